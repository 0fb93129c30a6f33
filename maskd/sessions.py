"""Sessions and sequences: the per-step protocol logic, independent of gRPC.

A session groups the sequences of one GPU worker. Tensor-parallel ranks attach to the
same session (same key) so every rank may ask for a step and all get identical rows.

Per sequence the server keeps the matcher, the step number and what that step carried.
A sequence opens at step 0, or at any later step when a client restores it (after a
lost stream or worker) with its whole token history. A step is applied at most once: repeating (seq, step) with the same tokens recomputes
the rows from the unchanged matcher; with other tokens it is a divergence error. Every
refusal leaves the sequence as it was.
"""
from __future__ import annotations

import threading
import time
from typing import Sequence

import grpc
import numpy as np

from maskd.engines import Engine, Matcher
from maskd.grammar_cache import CacheEntry, GrammarCache, GrammarState
from maskd.metrics import Metrics
from maskd.specs import GrammarSpec, SpecError
from maskd.v1 import maskd_pb2 as pb

READY, WAITING, FAILED, FINISHED, CLOSED, ERROR = (
    pb.SEQ_STATUS_READY, pb.SEQ_STATUS_WAITING, pb.SEQ_STATUS_FAILED,
    pb.SEQ_STATUS_FINISHED, pb.SEQ_STATUS_CLOSED, pb.SEQ_STATUS_ERROR)
_C = grpc.StatusCode


def _code(status: grpc.StatusCode) -> int:
    return status.value[0]


class Limits:
    def __init__(self, *, max_grammar_bytes: int = 1 << 20, max_draft_tokens: int = 16,
                 max_tokens_per_step: int = 4096, max_rows_per_step: int = 8192,
                 max_sequences_per_session: int = 65536) -> None:
        self.max_grammar_bytes = max_grammar_bytes
        self.max_draft_tokens = max_draft_tokens
        self.max_tokens_per_step = max_tokens_per_step
        self.max_rows_per_step = max_rows_per_step
        self.max_sequences_per_session = max_sequences_per_session


class Sequence_:
    """Server-side state of one sequence."""
    __slots__ = ("seq_id", "entry", "matcher", "step", "accepted", "dead_reason", "pending",
                 "last_tokens", "last_drafts", "last_rollback", "last_status", "finished")

    def __init__(self, seq_id: str, entry: CacheEntry) -> None:
        self.seq_id = seq_id
        self.entry = entry
        self.matcher: Matcher | None = None
        self.step = -1              # last step applied
        self.accepted = 0           # tokens accepted so far (bounds rollback)
        self.pending: list = []     # tokens received while the grammar compiled
        self.dead_reason = ""       # set once the sequence failed
        self.last_tokens: tuple = ()
        self.last_drafts: tuple = ()
        self.last_rollback = 0
        self.last_status = WAITING  # status decided for the last step
        self.finished = False


class Session:
    def __init__(self, key: str, engine: Engine, cache: GrammarCache, limits: Limits,
                 metrics: Metrics | None) -> None:
        self.key = key
        self.engine = engine
        self.cache = cache
        self.limits = limits
        self.metrics = metrics
        self.seqs: dict[str, Sequence_] = {}
        self.lock = threading.Lock()
        self.streams = 0
        self._rows = engine.allocate(64)
        self.vocab_limit = engine.width

    # -- public ---------------------------------------------------------------------------------
    def step(self, request: pb.StepRequest) -> tuple[pb.StepResponse, np.ndarray]:
        """Applies one decode step; returns the reply (rows not yet encoded) and the rows."""
        with self.lock:
            return self._step(request)

    def close_all(self) -> int:
        with self.lock:
            n = len(self.seqs)
            self._forget(list(self.seqs))
            return n

    # -- the step -------------------------------------------------------------------------------
    def _step(self, request: pb.StepRequest):
        t0 = time.perf_counter()
        reply = pb.StepResponse(words_per_row=self.engine.words_per_row)
        results = reply.results
        seen: set[str] = set()
        # Sequences that get rows this step: (result, seq, drafts)
        fill: list[tuple[pb.SeqResult, Sequence_, tuple]] = []
        consume_seqs: list[Sequence_] = []
        consume_tokens: list[Sequence[int]] = []
        consume_results: list[pb.SeqResult] = []
        n_seqs = len(request.seqs)
        total_rows = n_seqs
        if n_seqs * (1 + self.limits.max_draft_tokens) > self.limits.max_rows_per_step:
            total_rows += sum(len(s.draft_tokens) for s in request.seqs)
        too_many = total_rows > self.limits.max_rows_per_step

        for msg in request.seqs:
            res = results.add(seq_id=msg.seq_id, step=msg.step)
            if too_many:
                self._refuse(res, _C.RESOURCE_EXHAUSTED,
                             f"step asks for {total_rows} rows; the limit is {self.limits.max_rows_per_step}")
                continue
            sid = msg.seq_id
            if sid in seen:
                self._refuse(res, _C.INVALID_ARGUMENT, f"sequence {sid!r} appears twice in one step")
                continue
            seen.add(sid)
            problem = self._check_tokens(msg)
            if problem:
                self._refuse(res, _C.INVALID_ARGUMENT, problem)
                continue
            opening = msg.WhichOneof("open") is not None
            seq = self.seqs.get(sid)

            if msg.close:
                if seq is None:
                    self._refuse(res, _C.NOT_FOUND, f"cannot close unknown sequence {sid!r}")
                else:
                    self._forget([sid])
                    res.status = CLOSED
                continue

            if seq is not None and msg.step == seq.step:
                # A repeat (another TP rank, or a retry): same inputs, same answer, no advance.
                if opening and seq.entry.grammar_id != self._open_grammar_id(msg):
                    self._refuse(res, _C.ALREADY_EXISTS,
                                 f"sequence {sid!r} is already open with grammar {seq.entry.grammar_id}")
                    continue
                if (tuple(msg.tokens) != seq.last_tokens or tuple(msg.draft_tokens) != seq.last_drafts
                        or msg.rollback != seq.last_rollback):
                    if self.metrics is not None:
                        self.metrics.errors.labels("divergence").inc()
                    self._refuse(res, _C.ABORTED,
                                 f"divergence: step {msg.step} of sequence {sid!r} was already applied with "
                                 f"other tokens {list(seq.last_tokens)}; got {list(msg.tokens)}")
                    continue
                self._answer_repeat(res, seq, fill)
                continue

            if opening:
                if seq is not None:
                    self._refuse(res, _C.ALREADY_EXISTS,
                                 f"sequence {sid!r} is already open (at step {seq.step}); close it first")
                    continue
                if len(self.seqs) >= self.limits.max_sequences_per_session:
                    self._refuse(res, _C.RESOURCE_EXHAUSTED,
                                 f"session holds {len(self.seqs)} sequences; the limit is "
                                 f"{self.limits.max_sequences_per_session}")
                    continue
                entry, problem_code, problem = self._open_entry(msg)
                if entry is None:
                    self._refuse(res, problem_code, problem)
                    continue
                seq = Sequence_(sid, entry)
                self.seqs[sid] = seq
            elif seq is None:
                self._refuse(res, _C.NOT_FOUND,
                             f"unknown sequence {sid!r}: never opened on this session, closed, "
                             "or dropped with its stream; open it with a grammar at step 0")
                continue
            elif msg.step != seq.step + 1:
                self._refuse(res, _C.FAILED_PRECONDITION,
                             f"step {msg.step} of sequence {sid!r} is out of order: the last applied "
                             f"step is {seq.step}, so the next is {seq.step + 1}")
                continue

            # Advance to msg.step.
            if seq.dead_reason:
                self._record(seq, msg)
                self._fail(res, seq, seq.dead_reason)
                continue
            entry = seq.entry
            if entry.state is GrammarState.COMPILING:
                self.cache.get(entry.grammar_id)  # applies the compile deadline
            if entry.state is GrammarState.COMPILING:
                # Tokens (a restored history) queue until the grammar is ready; no rows meanwhile.
                if msg.rollback > len(seq.pending):
                    self._refuse(res, _C.OUT_OF_RANGE,
                                 f"cannot roll back {msg.rollback} tokens: sequence {sid!r} has accepted "
                                 f"{len(seq.pending)}")
                    continue
                if msg.rollback:
                    del seq.pending[-msg.rollback:]
                seq.pending.extend(msg.tokens)
                self._record(seq, msg)
                seq.last_status = res.status = WAITING
                continue
            if entry.state is GrammarState.FAILED:
                self._record(seq, msg)
                seq.dead_reason = f"grammar {entry.grammar_id} does not compile: {entry.error}"
                self._fail(res, seq, seq.dead_reason)
                continue
            tokens = msg.tokens
            if seq.matcher is None:
                seq.matcher = self.engine.new_matcher(entry.compiled)
                if seq.pending:  # tokens queued while the grammar compiled come first
                    tokens = seq.pending + list(msg.tokens)
                    seq.pending = []
            if msg.rollback:
                if msg.rollback > seq.accepted:
                    self._refuse(res, _C.OUT_OF_RANGE,
                                 f"cannot roll back {msg.rollback} tokens: sequence {sid!r} has accepted "
                                 f"{seq.accepted}")
                    continue
                seq.matcher.rollback(msg.rollback)
                seq.accepted -= msg.rollback
                seq.finished = False
            self._record(seq, msg)
            if tokens:
                consume_seqs.append(seq)
                consume_tokens.append(tokens)
                consume_results.append(res)
            else:
                fill.append((res, seq, tuple(msg.draft_tokens)))

        if consume_seqs:
            reasons = self.engine.consume_batch([s.matcher for s in consume_seqs], consume_tokens)
            for seq, tokens, res, reason in zip(consume_seqs, consume_tokens, consume_results, reasons):
                if reason is None:
                    seq.accepted += len(tokens)
                    fill.append((res, seq, seq.last_drafts))
                else:
                    seq.dead_reason = f"token rejected: {reason}"
                    seq.matcher = None
                    if self.metrics is not None:
                        self.metrics.errors.labels("token_rejected").inc()
                    self._fail(res, seq, seq.dead_reason)

        rows = self._fill(fill, request.want_forced_tokens)
        if self.metrics is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - t0)
            self.metrics.step_batch.observe(len(request.seqs))
        reply.server_seconds = time.perf_counter() - t0
        return reply, rows

    def _fill(self, fill, want_forced: bool) -> np.ndarray:
        n_rows = sum(1 + len(d) for _, _, d in fill)
        if n_rows > self._rows.shape[0]:
            self._rows = self.engine.allocate(max(n_rows, 2 * self._rows.shape[0]))
        out = self._rows[:n_rows] if n_rows else self._rows[:0]
        if not fill:
            return out
        matchers, first_rows, drafts = [], [], []
        row = 0
        any_drafts = False
        for res, seq, d in fill:
            m = seq.matcher
            stopped = m.is_stopped()
            seq.finished = stopped
            seq.last_status = res.status = FINISHED if stopped else READY
            res.first_row = row
            res.num_rows = 1 + len(d)
            res.accepting = stopped or m.is_accepting()
            if d:
                any_drafts = True
                res.drafts_valid = m.validate(d)
            if want_forced and not stopped:
                res.forced_tokens.extend(m.forced_tokens())
            matchers.append(m)
            first_rows.append(row)
            drafts.append(d)
            row += 1 + len(d)
        t0 = time.perf_counter()
        self.engine.fill_batch(matchers, first_rows, drafts if any_drafts else None, out)
        if self.metrics is not None:
            self.metrics.fill_seconds.observe(time.perf_counter() - t0)
        return out

    # -- helpers --------------------------------------------------------------------------------
    def _answer_repeat(self, res: pb.SeqResult, seq: Sequence_, fill: list) -> None:
        status = seq.last_status
        if status == FAILED:
            self._fail(res, seq, seq.dead_reason)
        elif status == WAITING:
            res.status = WAITING  # readiness is decided once per (sequence, step)
        else:
            fill.append((res, seq, seq.last_drafts))

    @staticmethod
    def _record(seq: Sequence_, msg: pb.SeqStep) -> None:
        seq.step = msg.step
        seq.last_tokens = tuple(msg.tokens)
        seq.last_drafts = tuple(msg.draft_tokens)
        seq.last_rollback = msg.rollback

    def _refuse(self, res: pb.SeqResult, code: grpc.StatusCode, message: str) -> None:
        res.status = ERROR
        res.code = _code(code)
        res.reason = message
        if self.metrics is not None:
            self.metrics.errors.labels(code.name.lower()).inc()

    @staticmethod
    def _fail(res: pb.SeqResult, seq: Sequence_, reason: str) -> None:
        seq.last_status = res.status = FAILED
        res.code = _code(_C.INVALID_ARGUMENT)
        res.reason = reason

    def _check_tokens(self, msg: pb.SeqStep) -> str:
        tokens = msg.tokens
        n_drafts = len(msg.draft_tokens)
        if not n_drafts:
            n = len(tokens)
            if n == 0 or (n == 1 and 0 <= tokens[0] < self.vocab_limit):  # the decode-step case
                return ""
        if len(msg.draft_tokens) > self.limits.max_draft_tokens:
            return f"{len(msg.draft_tokens)} draft tokens; the limit is {self.limits.max_draft_tokens}"
        if len(msg.tokens) > self.limits.max_tokens_per_step:
            return f"{len(msg.tokens)} tokens in one step; the limit is {self.limits.max_tokens_per_step}"
        lo = min(min(msg.tokens, default=0), min(msg.draft_tokens, default=0))
        hi = max(max(msg.tokens, default=0), max(msg.draft_tokens, default=0))
        if lo < 0 or hi >= self.vocab_limit:
            bad = [t for t in list(msg.tokens) + list(msg.draft_tokens) if t < 0 or t >= self.vocab_limit]
            return (f"token ids {bad[:8]} are outside the vocabulary of {self.vocab_limit} ids "
                    f"(tokenizer {self.engine.tokenizer.spec})")
        return ""

    def _open_grammar_id(self, msg: pb.SeqStep) -> str:
        if msg.WhichOneof("open") == "grammar_id":
            return msg.grammar_id
        try:
            return self.cache.grammar_id(GrammarSpec.from_proto(msg.spec))
        except SpecError:
            return ""

    def _open_entry(self, msg: pb.SeqStep):
        if msg.WhichOneof("open") == "grammar_id":
            entry = self.cache.get(msg.grammar_id)
            if entry is None:
                return None, _C.NOT_FOUND, (f"unknown grammar id {msg.grammar_id!r}: register it first "
                                            "(it may also have been evicted from the cache)")
            return entry, None, ""
        try:
            spec = GrammarSpec.from_proto(msg.spec)
        except SpecError as exc:
            return None, _C.INVALID_ARGUMENT, str(exc)
        if spec.size > self.limits.max_grammar_bytes:
            return None, _C.RESOURCE_EXHAUSTED, (f"grammar is {spec.size} bytes; the limit is "
                                                 f"{self.limits.max_grammar_bytes}")
        return self.cache.lookup(spec), None, ""

    def _forget(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            seq = self.seqs.pop(sid, None)
            if seq is not None:
                seq.matcher = None

    def waiting_count(self) -> int:
        return sum(1 for s in self.seqs.values() if s.entry.state is GrammarState.COMPILING)
