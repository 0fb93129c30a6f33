"""What the client API takes and returns: inputs, results, errors.

``SeqStatus`` and ``ServerInfo`` are the contract's (generated from the proto), re-exported.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from maskd.v1.contract import SeqStatus, ServerInfo

__all__ = ["MaskClientError", "SeqResult", "SeqStatus", "ServerInfo", "StepInput", "StepResult", "Unreachable",
           "describe", "grpc_code", "reply_within"]

_HAS_ROWS = frozenset((SeqStatus.READY, SeqStatus.FINISHED))
_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def grpc_code(value: int) -> grpc.StatusCode | None:
    """The grpc.StatusCode of a google.rpc.Code value (None for 0 / unknown)."""
    return _CODE_BY_VALUE.get(value) if value else None


class MaskClientError(RuntimeError):
    """A server or protocol problem the caller has to act on; ``code`` says which kind."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class Unreachable(MaskClientError):
    """Nothing at ``address`` answered (UNAVAILABLE); ``details`` says why: a health check's last
    reason, a connect or restore that found no server there."""

    def __init__(self, address: str, details: str) -> None:
        super().__init__(f"maskd at {address} is unreachable: {details}", grpc.StatusCode.UNAVAILABLE)
        self.address = address


def describe(exc: BaseException) -> str:
    """What happened, never empty: the status code's name (a MaskClientError that has one) or the
    exception's type, then its message: ``UNAVAILABLE: maskd at ... is unreachable: ...``,
    ``TimeoutError: no reply from maskd at ... within 35 s``. (An exception is always true and
    ``str(TimeoutError())`` is '': ``exc or type(exc).__name__`` names nothing.)"""
    code = getattr(exc, "code", None)
    name = code.name if isinstance(code, grpc.StatusCode) else type(exc).__name__
    text = str(exc)
    return f"{name}: {text}" if text else name


def reply_within(future: concurrent.futures.Future, timeout_s: float, target: str) -> Any:
    """``future.result(timeout_s)``, where running out of time raises a TimeoutError that says so
    (``no reply from maskd at TARGET within N s``) instead of one with no message."""
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        if future.done():
            raise     # the step itself failed with a TimeoutError: its own message
        # the class future.result raises (the builtin TimeoutError from Python 3.11 on)
        raise concurrent.futures.TimeoutError(f"no reply from maskd at {target} within {timeout_s:g} s") from None


@dataclasses.dataclass(frozen=True)
class StepInput:
    """What one sequence carries in a step (a plain token list is the common case)."""
    tokens: Sequence[int] = ()
    drafts: Sequence[int] = ()
    rollback: int = 0
    # Ask the server to propose up to this many draft tokens (grammar drafts; not with ``drafts``):
    # SeqResult.proposed_drafts has them, with a row for every draft position plus the bonus one.
    propose: int = 0
    # Opportunistic masking: ``tokens`` (one) were sampled without this sequence's row. The server
    # checks it: allowed, it is consumed and the answer has no row; refused, nothing is consumed
    # and SeqResult.resample is set with the row to sample again with (send that token next step).
    sampled_unmasked: bool = False


@dataclasses.dataclass
class SeqResult:
    """One sequence's answer in a step."""
    seq_id: str
    step: int
    status: SeqStatus
    row: int                  # index of this sequence's first row in StepResult.bitmask (-1: none)
    num_rows: int
    forced_tokens: list[int]
    reason: str = ""
    code: grpc.StatusCode | None = None
    accepting: bool = False
    drafts_valid: int = 0
    proposed_drafts: list[int] = dataclasses.field(default_factory=list)
    # sampled_unmasked: the token was refused (not consumed); the row is for the same position.
    resample: bool = False

    @property
    def has_rows(self) -> bool:
        return self.status in _HAS_ROWS


class StepResult:
    """One step's answer for the whole batch.

    Per sequence, in the order the step named them (``ids``), as arrays: ``status`` (SeqStatus
    values), ``row`` (its first row in ``bitmask``, -1 for none), ``num_rows``, ``accepting``; and
    ``bitmask``, the dense int32 rows (rows, words_per_row). ``seqs`` gives the same per sequence
    as SeqResult objects (built on first use; reasons, codes and forced tokens are there).
    """

    def __init__(self, seqs: dict[str, SeqResult] | None = None, bitmask: np.ndarray | None = None,
                 server_seconds: float = 0.0, round_trip_seconds: float = 0.0, *,
                 ids: list[str] | None = None, status: np.ndarray | None = None, row: np.ndarray | None = None,
                 num_rows: np.ndarray | None = None, accepting: np.ndarray | None = None,
                 steps: np.ndarray | None = None, details: dict[str, SeqResult] | None = None,
                 forced: dict[str, list[int]] | None = None) -> None:
        self.bitmask = bitmask if bitmask is not None else np.zeros((0, 0), dtype=np.int32)
        self.server_seconds = server_seconds
        self.round_trip_seconds = round_trip_seconds
        self._seqs: dict[str, SeqResult] | None = None
        if seqs is not None:   # from per-sequence results
            self.ids = list(seqs)
            self.status = np.array([int(r.status) for r in seqs.values()], dtype=np.uint8)
            self.row = np.array([r.row for r in seqs.values()], dtype=np.int32)
            self.num_rows = np.array([r.num_rows for r in seqs.values()], dtype=np.int32)
            self.accepting = np.array([r.accepting for r in seqs.values()], dtype=bool)
            self.steps = np.array([r.step for r in seqs.values()], dtype=np.int64)
            self._details: dict[str, SeqResult] = dict(seqs)
            self._forced: dict[str, list[int]] = {}
            self._seqs = dict(seqs)
            return
        self.ids = ids or []
        n = len(self.ids)
        self.status = status if status is not None else np.zeros(n, dtype=np.uint8)
        self.row = row if row is not None else np.full(n, -1, dtype=np.int32)
        self.num_rows = num_rows if num_rows is not None else np.zeros(n, dtype=np.int32)
        self.accepting = accepting if accepting is not None else np.zeros(n, dtype=bool)
        self.steps = steps if steps is not None else np.zeros(n, dtype=np.int64)
        self._details = details or {}
        self._forced = forced or {}

    @property
    def seqs(self) -> dict[str, SeqResult]:
        if self._seqs is None:
            out: dict[str, SeqResult] = {}
            statuses = self.status.tolist()
            rows, nums, acc, steps = self.row.tolist(), self.num_rows.tolist(), self.accepting.tolist(), \
                self.steps.tolist()
            for i, sid in enumerate(self.ids):
                d = self._details.get(sid)
                out[sid] = d if d is not None else SeqResult(sid, steps[i], SeqStatus(statuses[i]), rows[i], nums[i],
                                                              list(self._forced.get(sid, ())), accepting=acc[i])
            self._seqs = out
        return self._seqs

    def forced_tokens(self, seq_id: str) -> list[int]:
        """The forced tokens of one sequence (without building the batch's SeqResult objects)."""
        d = self._details.get(seq_id)
        return list(d.forced_tokens) if d is not None else list(self._forced.get(seq_id, ()))

    def with_rows(self) -> np.ndarray:
        """Positions (in ``ids``) of the sequences answered with rows (READY or FINISHED)."""
        ready = (self.status == int(SeqStatus.READY)) | (self.status == int(SeqStatus.FINISHED))
        return np.flatnonzero(ready & (self.row >= 0))

    def row_index(self, seq_id: str) -> int:
        return self.seqs[seq_id].row

    def tensor(self, device: Any = None, buffers: Any = None) -> Any:
        """The rows as an int32 torch tensor (through preallocated BitmaskBuffers if given)."""
        if buffers is not None:
            return buffers.upload(self.bitmask)
        import torch
        t = torch.from_numpy(self.bitmask)
        return t if device is None else t.to(device, non_blocking=True)

    def __repr__(self) -> str:
        return (f"StepResult({len(self.ids)} sequences, bitmask {self.bitmask.shape}, "
                f"server {self.server_seconds * 1e3:.3f} ms)")
