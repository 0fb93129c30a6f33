"""Hugging Face transformers integration: a ``LogitsProcessor`` backed by a maskd server.

    from maskd_client.hf import MaskdLogitsProcessor

    with MaskdLogitsProcessor("127.0.0.1:50051", [spec_row0, spec_row1]) as proc:
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=256,
                             **proc.generate_kwargs())

One maskd sequence per batch row. The grammar starts after the prompt: the prompt is never
sent; each step sends only the token generated last for each live row. Rows are masked in place
with :func:`maskd_client.apply.apply_token_bitmask_inplace` (mask row ``i`` on logits row ``i``,
as in xgrammar and llguidance).

* A row whose sequence is FINISHED has a mask that allows only EOS; once EOS is generated the row
  is done: it is closed on the server and never sent again (transformers keeps feeding pad tokens
  for it). Done rows are masked to EOS only, so they stay finished even when ``generate`` was not
  told the grammar's EOS id.
* A row whose grammar is still compiling (WAITING) is polled with empty steps until its mask
  arrives: a row never gets an all-allowed mask.
* A row whose sequence FAILED raises :class:`MaskdSequenceFailed` (the reason is the server's).
* Beam search, ``num_return_sequences`` with per-row specs, assisted generation and anything else
  that makes ``input_ids`` disagree with one sequence per row raise ``ValueError``.

Pipelining: ``generate_kwargs()`` also installs :attr:`MaskdLogitsProcessor.prefetcher`, a
``StoppingCriteria`` that transformers calls right after sampling and before the next forward
pass; it sends the step (``step_async``) at once, so the server computes the next masks while
the model runs and the processor only collects the reply. Without it the processor sends the
step itself when it is called (correct, just not overlapped).
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from maskd_client.apply import BitmaskBuffers, apply_token_bitmask_inplace
from maskd_client.client import MaskClient
from maskd_client.engine_env import deliver_answers, eos_row
from maskd_client.types import MaskClientError, SeqResult, SeqStatus, reply_within

__all__ = ["MaskdLogitsProcessor", "MaskdPrefetch", "MaskdSequenceFailed"]

log = logging.getLogger("maskd_client.hf")


class MaskdSequenceFailed(MaskClientError):
    """The maskd sequence of a batch row failed (token rejected, grammar does not compile)."""

    def __init__(self, row: int, seq_id: str, reason: str, code=None) -> None:
        super().__init__(f"maskd sequence {seq_id!r} of batch row {row} failed: {reason}", code)
        self.row = row
        self.seq_id = seq_id
        self.reason = reason


class MaskdPrefetch(StoppingCriteria):
    """Sends a step as soon as transformers has sampled (before the next forward pass).

    Never stops generation: it returns all False. Get it from ``processor.prefetcher``.
    """

    def __init__(self, processor: MaskdLogitsProcessor) -> None:
        self.processor = processor

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.processor._advance(input_ids)
        done: Any = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return done


class MaskdLogitsProcessor(LogitsProcessor):
    """Masks logits with rows from a maskd server, one maskd sequence per batch row.

    client: a :class:`MaskClient` (or a client with its API), or a target string such as
        ``HOST:PORT`` (the processor then owns a client and shuts it down on :meth:`close`).
    specs: one grammar spec for every row (a dict such as ``{"json_schema": {...}}``, a
        ``GrammarSpec`` or a proto), or a list with one spec per row.
    batch_size: the number of rows when one spec is given; inferred from the first call if None.
    tokenizer: the tokenizer fingerprint (or an object with ``.fingerprint``) to check against
        the server's, when the processor creates the client.
    eos_token_ids: the ids that end a row; the server's EOS ids when None.
    wait_timeout_s: how long to keep polling a row whose grammar is still compiling.
    close_finished: close a row's sequence on the server as soon as it generated EOS.
    """

    def __init__(self, client: MaskClient | str, specs: Any, *, batch_size: int | None = None,
                 tokenizer: Any = None, eos_token_ids: Sequence[int] | None = None,
                 wait_timeout_s: float = 60.0, poll_interval_s: float = 0.001,
                 close_finished: bool = True, seq_prefix: str | None = None) -> None:
        if isinstance(specs, (list, tuple)):
            if not specs:
                raise ValueError("specs is an empty list: give one spec per batch row, or one spec for all")
            if batch_size is not None and batch_size != len(specs):
                raise ValueError(f"batch_size={batch_size} but {len(specs)} specs were given")
            self._specs: list | None = list(specs)
            self._one_spec = None
            self.batch_size: int | None = len(specs)
        else:
            self._specs = None
            self._one_spec = specs
            self.batch_size = batch_size
        self.wait_timeout_s = float(wait_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self.close_finished = close_finished
        self._prefix = seq_prefix or f"hf-{uuid.uuid4().hex[:12]}"
        self._eos_override = tuple(int(t) for t in eos_token_ids) if eos_token_ids is not None else None
        self.prefetcher = MaskdPrefetch(self)

        if isinstance(client, str):
            self.client = MaskClient(client, tokenizer=tokenizer, want_forced_tokens=False)
            self._owns_client = True
        elif all(hasattr(client, a) for a in ("open", "step_async", "close", "info")):
            self.client = client  # a MaskClient, or a cluster client with the same API
            self._owns_client = False
        else:
            raise TypeError(f"client is a MaskClient or a 'HOST:PORT' target, not {type(client).__name__}")
        self._timeout_s = float(getattr(self.client, "timeout_s", 30.0))
        try:
            info = self.client.info()
            eos = self._eos_override or tuple(info.eos_token_ids)
            if not eos:
                raise ValueError("the server reports no EOS token ids; pass eos_token_ids=")
            bad = [t for t in eos if not 0 <= t < info.logits_width]
            if bad:
                raise ValueError(f"EOS ids {bad} are outside the server's {info.logits_width} ids")
        except BaseException:
            if self._owns_client:
                self.client.shutdown()
            raise
        self.info = info
        self.eos_token_ids: tuple[int, ...] = eos
        self.words = info.words_per_row
        self._eos_row = eos_row(self.eos_token_ids, self.words)
        self._eos_set = frozenset(self.eos_token_ids)

        # Per-generation state, set on the first call.
        self.seq_ids: list[str] = []
        self.prompt_length: int | None = None
        self.done: list[bool] = []          # EOS generated (or failed): never sent again
        self.eos_seen: list[bool] = []      # EOS generated
        self.statuses: list[SeqStatus | None] = []
        self.tokens: list[list[int]] = []   # tokens sent per row (the grammar's view)
        self._rows: Any = None               # (n, words) int32 array: the current mask of every row
        self._buffers: BitmaskBuffers | None = None
        self._last_ids: Any = None           # the input_ids tensor of the last step sent
        self._sent_length: int | None = None  # input_ids length whose step was sent
        self._pending: Any = None            # (future or None, [(row, seq_id)]) of the step in flight
        self._closed = False
        self._closed_rows: set[int] = set()
        self._warned_width = False
        # Measurements: seconds the processor waited for masks, one entry per call.
        self.wait_seconds: list[float] = []
        self.polls = 0                       # extra empty steps sent for WAITING rows

    # -- transformers entry points ---------------------------------------------------------------
    def generate_kwargs(self, *, set_eos: bool = True) -> dict:
        """Keyword arguments for ``model.generate``: this processor, its prefetcher and (with
        ``set_eos``) the grammar's EOS ids as ``eos_token_id`` and ``pad_token_id``."""
        kw: dict = {"logits_processor": LogitsProcessorList([self]),
                    "stopping_criteria": StoppingCriteriaList([self.prefetcher])}
        if set_eos:
            kw["eos_token_id"] = list(self.eos_token_ids)
            kw["pad_token_id"] = self.eos_token_ids[0]
        return kw

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.dim() != 2 or scores.shape[0] != input_ids.shape[0]:
            raise ValueError(f"scores of shape {tuple(scores.shape)} do not match input_ids of shape "
                             f"{tuple(input_ids.shape)}")
        t0 = time.perf_counter()
        self._advance(input_ids)
        self._collect()
        self.wait_seconds.append(time.perf_counter() - t0)
        if not self._warned_width and scores.shape[1] < self.info.vocab_size:
            self._warned_width = True
            log.warning("logits have %d columns but the maskd tokenizer has %d ids: tokens past the logits "
                        "can never be sampled", scores.shape[1], self.info.vocab_size)
        if self._buffers is None:
            self._buffers = BitmaskBuffers(len(self.seq_ids), self.words, device=scores.device)
        bitmask = self._buffers.upload(self._rows)
        apply_token_bitmask_inplace(scores, bitmask)
        return scores

    # -- the step ----------------------------------------------------------------------------------
    def _check_shape(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        b = input_ids.shape[0]
        if self.batch_size is None:
            self.batch_size = b
        if b != self.batch_size:
            raise ValueError(
                f"MaskdLogitsProcessor keeps one maskd sequence per batch row and has {self.batch_size}, "
                f"but input_ids has {b} rows: beam search (num_beams > 1), num_return_sequences > 1 "
                "with per-row specs, and other modes that expand or reorder the batch are not supported; "
                "use greedy or sampling decoding with one row per sequence")

    def _open(self, input_ids: torch.Tensor) -> None:
        if self._closed:
            raise ValueError("this MaskdLogitsProcessor is closed; make a new one for each generate call")
        n = self.batch_size
        assert n is not None   # set by _check_shape
        specs = self._specs if self._specs is not None else [self._one_spec] * n
        self.seq_ids = [f"{self._prefix}-{i}" for i in range(n)]
        for sid, spec in zip(self.seq_ids, specs):
            self.client.open(sid, spec)
        self.prompt_length = input_ids.shape[1]
        self.done = [False] * n
        self.eos_seen = [False] * n
        self.statuses = [None for _ in range(n)]
        self.tokens = [[] for _ in range(n)]
        self._rows = np.zeros((n, self.words), dtype=np.int32)

    def _advance(self, input_ids: torch.Tensor) -> None:
        """Sends the step for this ``input_ids`` once (from the prefetcher or from the processor)."""
        self._check_shape(input_ids)
        length = input_ids.shape[1]
        if self._sent_length is not None and length == self._sent_length:
            if not torch.equal(input_ids, self._last_ids):
                raise ValueError("input_ids changed without growing (beam search or assisted generation?): "
                                 "MaskdLogitsProcessor supports greedy and sampling decoding only")
            return  # already sent (by the prefetcher)
        if self._sent_length is None:
            self._open(input_ids)
            step: dict[str, list[int]] = {sid: [] for sid in self.seq_ids}
            rows = list(enumerate(self.seq_ids))
        else:
            if length != self._sent_length + 1:
                raise ValueError(
                    f"input_ids grew from {self._sent_length} to {length} tokens in one step: "
                    "MaskdLogitsProcessor takes one generated token per row per step (assisted or "
                    "speculative generation is not supported); use a new processor for each generate call")
            if not torch.equal(input_ids[:, :-1], self._last_ids):
                raise ValueError("the rows of input_ids were reordered or rewritten between steps (beam "
                                 "search?): MaskdLogitsProcessor supports greedy and sampling decoding only")
            if self._pending is not None:
                self._collect()  # a step whose reply nobody collected (the processor was not called)
            last = input_ids[:, -1].tolist()
            step, rows = {}, []
            for row, tok in enumerate(last):
                if self.done[row]:
                    continue
                if tok in self._eos_set:
                    self.eos_seen[row] = True
                    self._finish_row(row)
                    continue
                sid = self.seq_ids[row]
                step[sid] = [tok]
                rows.append((row, sid))
                self.tokens[row].append(tok)
        self._last_ids = input_ids
        self._sent_length = length
        fut = self.client.step_async(step) if step else None
        self._pending = (fut, rows)

    def _finish_row(self, row: int) -> None:
        self.done[row] = True
        self._rows[row] = self._eos_row
        if self.close_finished:
            self._closed_rows.add(row)
            try:
                self.client.close(self.seq_ids[row])
            except MaskClientError as exc:  # the stream is gone; close() at the end retries nothing
                log.debug("closing %s: %s", self.seq_ids[row], exc)

    def _collect(self) -> None:
        """Waits for the pending step's reply (polling rows still WAITING) and stores the rows."""
        if self._pending is None:
            return
        fut, rows = self._pending
        self._pending = None
        for row in range(len(self.seq_ids)):
            if self.done[row]:
                self._rows[row] = self._eos_row
        if fut is None:
            return
        target = getattr(self.client, "target", "its address")
        deadline = time.monotonic() + self.wait_timeout_s
        late: list[int] = []

        def step(entries: dict[str, Any]) -> Any:
            left = max(0.001, deadline - time.monotonic())
            return reply_within(self.client.step_async(entries), left + self._timeout_s, target)

        def ready(row: int, res: SeqResult, result: Any) -> None:
            self.statuses[row] = res.status
            self._rows[row] = result.bitmask[res.row]

        def give_up(row: int, reason: str, res: SeqResult | None) -> None:
            if res is None:              # still compiling when the wait ran out
                self.statuses[row] = SeqStatus.WAITING
                late.append(row)
                return
            self.statuses[row] = res.status
            sid = self.seq_ids[row]
            if res.status is SeqStatus.FAILED:
                self.done[row] = True
                raise MaskdSequenceFailed(row, sid, res.reason or "no reason given", res.code)
            raise MaskClientError(f"maskd refused step {res.step} of sequence {sid!r} (batch row {row}): "
                                  f"{res.status.name} {res.reason}", res.code)

        result = reply_within(fut, self.wait_timeout_s + self._timeout_s, target)
        self.polls += deliver_answers(result, {sid: row for row, sid in rows}, step, self.wait_timeout_s, ready,
                                      give_up, first_pause_s=self.poll_interval_s)
        if late:
            raise MaskClientError(f"grammar of batch rows {late} still compiling after {self.wait_timeout_s:.0f} s")

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Closes every sequence still open on the server (and the client if this owns it)."""
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is not None:
            try:  # a last prefetched step: let it land so that the close follows it
                pending[0].result(self._timeout_s)
            except Exception as exc:
                log.debug("last step before close: %s", exc)
        futures = []
        for row, sid in enumerate(self.seq_ids):
            if row not in self._closed_rows:
                try:
                    futures.append(self.client.close(sid))
                except MaskClientError as exc:
                    log.debug("closing %s: %s", sid, exc)
        try:   # no step follows: the closes (and those of rows that finished earlier) go now
            self.client.flush_closes()
        except MaskClientError as exc:
            log.debug("closing: %s", exc)
        for f in futures:
            try:
                f.result(self._timeout_s)
            except Exception as exc:
                log.debug("close: %s", exc)
        if self._owns_client:
            self.client.shutdown()

    def __enter__(self) -> MaskdLogitsProcessor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reporting ---------------------------------------------------------------------------------
    @property
    def finished(self) -> list[bool]:
        """Per row: EOS was generated (the row's output is complete)."""
        return list(self.eos_seen)
