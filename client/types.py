"""What the client API takes and returns: inputs, results, errors.

``SeqStatus`` and ``ServerInfo`` are the contract's (generated from the proto), re-exported.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from maskd.v1.contract import SeqStatus, ServerInfo

__all__ = ["MaskClientError", "SeqResult", "SeqStatus", "ServerInfo", "StepInput", "StepResult", "grpc_code"]

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


@dataclasses.dataclass(frozen=True)
class StepInput:
    """What one sequence carries in a step (a plain token list is the common case)."""
    tokens: Sequence[int] = ()
    drafts: Sequence[int] = ()
    rollback: int = 0


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

    @property
    def has_rows(self) -> bool:
        return self.status in _HAS_ROWS


@dataclasses.dataclass
class StepResult:
    """One step's answer for the whole batch: per-sequence results and the dense rows."""
    seqs: dict[str, SeqResult]
    bitmask: np.ndarray       # int32 (rows, words_per_row)
    server_seconds: float
    round_trip_seconds: float

    def row_index(self, seq_id: str) -> int:
        return self.seqs[seq_id].row

    def tensor(self, device: Any = None, buffers: Any = None) -> Any:
        """The rows as an int32 torch tensor (through preallocated BitmaskBuffers if given)."""
        if buffers is not None:
            return buffers.upload(self.bitmask)
        import torch
        t = torch.from_numpy(self.bitmask)
        return t if device is None else t.to(device, non_blocking=True)
