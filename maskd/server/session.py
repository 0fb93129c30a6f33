"""The step protocol: one session's sequences and what a StepRequest does to them.

A session groups the sequences of one GPU worker; tensor-parallel ranks attach to the same
session so every rank may ask for a step and all get identical rows. ``Session.step`` applies
one StepRequest and returns a ``StepOutcome`` (a result per entry and the mask rows); it knows
nothing of gRPC, encoding or metrics (the service does those, in one place).

A step runs in phases, each a method below:

1. ``_admit``: the request's size, duplicate entries and token ids; refused entries change nothing.
2. ``_route``: closes, repeats (idempotency), opens and restores, step order: what each
   remaining entry does to its sequence.
3. ``_advance``: grammar readiness (tokens queue while it compiles), rollback; which sequences
   consume tokens and which only need rows.
4. ``_consume``: every matcher's tokens in one batched engine call.
5. ``_fill``: every row of the reply in one batched engine call.

The rules (idempotency, restores in parts, readiness once per step) are the contract's: see
proto/maskd/v1/maskd.proto.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence

import numpy as np

from maskd.server.config import Limits
from maskd.server.doc_checks import DocumentChecks
from maskd.server.engines import Engine, Matcher
from maskd.server.grammar_cache import CacheEntry, GrammarCache
from maskd.specs import GrammarSpec, SpecError
from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import Code, GrammarState, SeqStatus

READY, WAITING, FAILED, FINISHED, CLOSED, ERROR = (
    SeqStatus.READY, SeqStatus.WAITING, SeqStatus.FAILED, SeqStatus.FINISHED, SeqStatus.CLOSED, SeqStatus.ERROR)


class SequenceState:
    """Server-side state of one sequence; a pure function of (grammar, accepted tokens)."""
    __slots__ = (
        "accepted",
        "dead_reason",
        "doc",
        "entry",
        "finished",
        "last_drafts",
        "last_rollback",
        "last_status",
        "last_tokens",
        "matcher",
        "parts",
        "pending",
        "seq_id",
        "step",
    )

    def __init__(self, seq_id: str, entry: CacheEntry, step: int) -> None:
        self.seq_id = seq_id
        self.entry = entry
        self.matcher: Matcher | None = None
        self.doc = None                # complete JSON-schema mode: the output the validator checks
        self.step = step               # last step applied
        self.accepted = 0              # tokens the matcher consumed (bounds rollback)
        self.pending: list[int] = []   # tokens received while the grammar compiled
        self.dead_reason = ""          # set once the sequence failed
        self.last_tokens: tuple = ()
        self.last_drafts: tuple = ()
        self.last_rollback = 0
        self.last_status = WAITING     # readiness decided for the last step
        self.finished = False
        # Opening parts received at the current step: history offset -> hash of their tokens.
        self.parts: dict[int, int] | None = None

    @property
    def history_length(self) -> int:
        return self.accepted + len(self.pending)

    @property
    def waiting(self) -> bool:
        return self.entry.state is GrammarState.COMPILING


@dataclasses.dataclass
class StepOutcome:
    """What one step produced: a result per entry (request order) and the rows they point into."""
    results: list[pb.SeqResult]
    rows: np.ndarray
    refusals: collections.Counter      # error kind -> entries refused or failed this step
    fill_seconds: float = 0.0


@dataclasses.dataclass(slots=True)
class _Advance:
    """An entry that moves its sequence (or repeats its last step) and gets rows."""
    res: pb.SeqResult
    seq: SequenceState
    matcher: Matcher
    tokens: Sequence[int] = ()
    drafts: tuple = ()


class Session:
    def __init__(self, key: str, engine: Engine, cache: GrammarCache, limits: Limits) -> None:
        self.key = key
        self.engine = engine
        self.cache = cache
        self.limits = limits
        self.seqs: dict[str, SequenceState] = {}
        self.lock = threading.Lock()
        self.streams = 0
        self.vocab_limit = engine.width
        self._rows = engine.allocate(64)
        self.checks = DocumentChecks(engine, cache.metrics)   # complete-mode hooks (doc_checks.py)

    # -- public -----------------------------------------------------------------------------------
    def step(self, request: pb.StepRequest) -> StepOutcome:
        """Applies one decode step for a batch. Never raises for bad input: refused entries come
        back as ERROR (the sequence unchanged), dead sequences as FAILED."""
        with self.lock:
            refusals: collections.Counter = collections.Counter()
            results = [pb.SeqResult(seq_id=m.seq_id, step=m.step) for m in request.seqs]
            admitted = self._admit(request, results, refusals)
            moving, repeats = self._route(admitted, refusals)
            consume, fill = self._advance(moving, refusals)
            fill += repeats
            self._consume(consume, fill, refusals)
            t0 = time.perf_counter()
            rows = self._fill(fill, request.want_forced_tokens, refusals)
            return StepOutcome(results, rows, refusals, time.perf_counter() - t0)

    def close_all(self) -> int:
        with self.lock:
            n = len(self.seqs)
            for seq in self.seqs.values():
                seq.matcher = None
            self.seqs.clear()
            return n

    def waiting_count(self) -> int:
        return sum(1 for s in self.seqs.values() if s.waiting)

    # -- phase 1: admission -----------------------------------------------------------------------
    def _admit(self, request: pb.StepRequest, results: list[pb.SeqResult], refusals) -> list:
        entries = request.seqs
        n = len(entries)
        total_rows = n
        if n * (1 + self.limits.max_draft_tokens) > self.limits.max_rows_per_step:
            total_rows += sum(len(m.draft_tokens) for m in entries)
        if total_rows > self.limits.max_rows_per_step:
            for res in results:
                _refuse(res, refusals, Code.RESOURCE_EXHAUSTED,
                        f"step asks for {total_rows} rows; the limit is {self.limits.max_rows_per_step}")
            return []
        admitted = []
        seen: set[str] = set()
        for msg, res in zip(entries, results):
            sid = msg.seq_id
            if sid in seen:
                _refuse(res, refusals, Code.INVALID_ARGUMENT, f"sequence {sid!r} appears twice in one step")
                continue
            seen.add(sid)
            problem = self._check_tokens(msg)
            if problem:
                _refuse(res, refusals, Code.INVALID_ARGUMENT, problem)
                continue
            admitted.append((msg, res))
        return admitted

    def _check_tokens(self, msg: pb.SeqStep) -> str:
        tokens = msg.tokens
        n_drafts = len(msg.draft_tokens)
        if not n_drafts:
            n = len(tokens)
            if n == 0 or (n == 1 and 0 <= tokens[0] < self.vocab_limit):  # the decode-step case
                return ""
        if n_drafts > self.limits.max_draft_tokens:
            return f"{n_drafts} draft tokens; the limit is {self.limits.max_draft_tokens}"
        if len(tokens) > self.limits.max_tokens_per_step:
            return (f"{len(tokens)} tokens in one step; the limit is {self.limits.max_tokens_per_step} "
                    "(a longer restore goes in parts: see history_offset)")
        lo = min(min(tokens, default=0), min(msg.draft_tokens, default=0))
        hi = max(max(tokens, default=0), max(msg.draft_tokens, default=0))
        if lo < 0 or hi >= self.vocab_limit:
            bad = [t for t in list(tokens) + list(msg.draft_tokens) if t < 0 or t >= self.vocab_limit]
            return (f"token ids {bad[:8]} are outside the vocabulary of {self.vocab_limit} ids "
                    f"(tokenizer {self.engine.tokenizer.spec})")
        return ""

    # -- phase 2: routing -------------------------------------------------------------------------
    def _route(self, admitted: list, refusals) -> tuple[list, list[_Advance]]:
        """Closes, repeats, opens and order checks. Returns the entries that move their sequence
        ((msg, res, seq, tokens)) and the repeats that are answered from the unchanged state."""
        moving: list = []
        repeats: list[_Advance] = []
        for msg, res in admitted:
            sid = msg.seq_id
            seq = self.seqs.get(sid)
            opening = msg.WhichOneof("open") is not None
            if msg.close:
                if seq is None:
                    _refuse(res, refusals, Code.NOT_FOUND, f"cannot close unknown sequence {sid!r}")
                else:
                    self._forget(sid)
                    res.status = CLOSED
                continue
            if seq is not None and msg.step == seq.step:
                if opening:
                    self._route_reopen(msg, res, seq, moving, repeats, refusals)
                elif self._same_inputs(msg, seq):
                    self._answer_repeat(res, seq, repeats)
                else:
                    self._divergence(res, seq, refusals)
                continue
            if opening:
                if seq is not None:
                    _refuse(res, refusals, Code.ALREADY_EXISTS,
                            f"sequence {sid!r} is already open (at step {seq.step}); close it first")
                    continue
                seq = self._open(msg, res, refusals)
                if seq is not None:
                    moving.append((msg, res, seq, msg.tokens))
                continue
            if seq is None:
                _refuse(res, refusals, Code.NOT_FOUND,
                        f"unknown sequence {sid!r}: never opened on this session, closed, "
                        "or dropped with its stream; open it with a grammar at step 0")
            elif msg.step != seq.step + 1:
                _refuse(res, refusals, Code.FAILED_PRECONDITION,
                        f"step {msg.step} of sequence {sid!r} is out of order: the last applied "
                        f"step is {seq.step}, so the next is {seq.step + 1}")
            else:
                moving.append((msg, res, seq, msg.tokens))
        return moving, repeats

    def _route_reopen(self, msg, res, seq: SequenceState, moving: list, repeats: list, refusals) -> None:
        """An opening entry at the step the sequence is at: a repeat of the open (another rank, a
        retry) or the next part of a restore (history_offset)."""
        if seq.entry.grammar_id != self._open_grammar_id(msg):
            _refuse(res, refusals, Code.ALREADY_EXISTS,
                    f"sequence {msg.seq_id!r} is already open with grammar {seq.entry.grammar_id}")
            return
        offset = msg.history_offset
        known = seq.parts.get(offset) if seq.parts is not None else None
        if known is not None:
            if known == _digest(msg.tokens) and tuple(msg.draft_tokens) == seq.last_drafts:
                self._answer_repeat(res, seq, repeats)
            else:
                self._divergence(res, seq, refusals)
        elif seq.parts is not None and offset == seq.history_length and offset > 0 and msg.tokens:
            seq.parts[offset] = _digest(msg.tokens)
            moving.append((msg, res, seq, msg.tokens))
        else:
            _refuse(res, refusals, Code.FAILED_PRECONDITION,
                    f"restore part of sequence {msg.seq_id!r} at history offset {offset}, but the server "
                    f"holds {seq.history_length} tokens of it at step {seq.step}")

    def _open(self, msg: pb.SeqStep, res: pb.SeqResult, refusals) -> SequenceState | None:
        sid = msg.seq_id
        if msg.history_offset:
            _refuse(res, refusals, Code.FAILED_PRECONDITION,
                    f"restore part of unknown sequence {sid!r} at history offset {msg.history_offset}: "
                    "the part at offset 0 opens it")
            return None
        if len(self.seqs) >= self.limits.max_sequences_per_session:
            _refuse(res, refusals, Code.RESOURCE_EXHAUSTED,
                    f"session holds {len(self.seqs)} sequences; the limit is {self.limits.max_sequences_per_session}")
            return None
        entry, code, problem = self._open_entry(msg)
        if entry is None:
            _refuse(res, refusals, code, problem)
            return None
        seq = SequenceState(sid, entry, msg.step)
        seq.parts = {0: _digest(msg.tokens)}
        self.seqs[sid] = seq
        return seq

    def _open_grammar_id(self, msg: pb.SeqStep) -> str:
        if msg.WhichOneof("open") == "grammar_id":
            return msg.grammar_id
        try:
            return self.cache.grammar_id(GrammarSpec.from_proto(msg.spec))
        except SpecError:
            return ""

    def _open_entry(self, msg: pb.SeqStep) -> tuple[CacheEntry | None, Code, str]:
        if msg.WhichOneof("open") == "grammar_id":
            entry = self.cache.get(msg.grammar_id)
            if entry is None:
                return None, Code.NOT_FOUND, (f"unknown grammar id {msg.grammar_id!r}: register it first "
                                              "(it may also have been evicted from the cache)")
            return entry, Code.OK, ""
        try:
            spec = GrammarSpec.from_proto(msg.spec)
        except SpecError as exc:
            return None, Code.INVALID_ARGUMENT, str(exc)
        if spec.size > self.limits.max_grammar_bytes:
            return None, Code.RESOURCE_EXHAUSTED, (f"grammar is {spec.size} bytes; the limit is "
                                                   f"{self.limits.max_grammar_bytes}")
        return self.cache.lookup(spec), Code.OK, ""

    @staticmethod
    def _same_inputs(msg: pb.SeqStep, seq: SequenceState) -> bool:
        return (tuple(msg.tokens) == seq.last_tokens and tuple(msg.draft_tokens) == seq.last_drafts
                and msg.rollback == seq.last_rollback)

    @staticmethod
    def _answer_repeat(res: pb.SeqResult, seq: SequenceState, repeats: list[_Advance]) -> None:
        """A repeat is answered from the unchanged state; readiness is the one decided before."""
        status = seq.last_status
        if status == FAILED:
            _fail(res, seq, seq.dead_reason)
        elif status == WAITING or seq.matcher is None:
            res.status = WAITING
        else:
            repeats.append(_Advance(res, seq, seq.matcher, (), seq.last_drafts))

    @staticmethod
    def _divergence(res: pb.SeqResult, seq: SequenceState, refusals) -> None:
        # Says where, never what: the tokens of a sequence are its owner's business.
        _refuse(res, refusals, Code.ABORTED,
                f"divergence: step {res.step} of sequence {seq.seq_id!r} was already applied with other inputs",
                kind="divergence")

    # -- phase 3: advancing -----------------------------------------------------------------------
    def _advance(self, moving: list, refusals) -> tuple[list[_Advance], list[_Advance]]:
        """Readiness, rollback and the tokens each moving entry applies."""
        consume: list[_Advance] = []
        fill: list[_Advance] = []
        for msg, res, seq, tokens in moving:
            if seq.dead_reason:
                _record(seq, msg)
                _fail(res, seq, seq.dead_reason)
                continue
            entry = seq.entry
            if entry.state is GrammarState.COMPILING:
                self.cache.get(entry.grammar_id)  # applies the compile deadline
            if entry.state is GrammarState.COMPILING:
                # Tokens (a restored history) queue until the grammar is ready; no rows meanwhile.
                if msg.rollback > len(seq.pending):
                    _refuse(res, refusals, Code.OUT_OF_RANGE,
                            f"cannot roll back {msg.rollback} tokens: sequence {seq.seq_id!r} has "
                            f"accepted {len(seq.pending)}")
                    continue
                if msg.rollback:
                    del seq.pending[-msg.rollback:]
                seq.pending.extend(tokens)
                _record(seq, msg)
                seq.last_status = res.status = WAITING
                continue
            if entry.state is GrammarState.FAILED:
                _record(seq, msg)
                seq.dead_reason = f"grammar {entry.grammar_id} does not compile: {entry.error}"
                _fail(res, seq, seq.dead_reason)
                refusals["grammar_failed"] += 1
                continue
            if msg.rollback and msg.rollback > seq.history_length:
                _refuse(res, refusals, Code.OUT_OF_RANGE,
                        f"cannot roll back {msg.rollback} tokens: sequence {seq.seq_id!r} has accepted "
                        f"{seq.history_length}")
                continue
            matcher = seq.matcher
            if matcher is None:
                matcher = seq.matcher = self.engine.new_matcher(entry.compiled)
                seq.doc = self.checks.open_document(entry.compiled)
                if seq.pending:  # tokens queued while the grammar compiled come first
                    tokens = seq.pending + list(tokens)
                    seq.pending = []
            if msg.rollback:
                matcher.rollback(msg.rollback)
                if seq.doc is not None:
                    seq.doc.rollback(msg.rollback)
                seq.accepted -= msg.rollback
                seq.finished = False
            _record(seq, msg)
            (consume if tokens else fill).append(_Advance(res, seq, matcher, tokens, seq.last_drafts))
        return consume, fill

    # -- phase 4: consuming -----------------------------------------------------------------------
    def _consume(self, consume: list[_Advance], fill: list[_Advance], refusals) -> None:
        if not consume:
            return
        reasons = self.engine.consume_batch([a.matcher for a in consume], [a.tokens for a in consume])
        if self.checks.live:
            reasons = self.checks.consumed(consume, reasons)
        for adv, reason in zip(consume, reasons):
            seq = adv.seq
            if reason is None:
                seq.accepted += len(adv.tokens)
                fill.append(adv)
            else:
                seq.dead_reason = f"token rejected: {reason}"
                seq.matcher = seq.doc = None
                refusals["token_rejected"] += 1
                _fail(adv.res, seq, seq.dead_reason)

    # -- phase 5: filling -------------------------------------------------------------------------
    def _fill(self, fill: list[_Advance], want_forced: bool, refusals) -> np.ndarray:
        n_rows = sum(1 + len(a.drafts) for a in fill)
        if n_rows > self._rows.shape[0]:
            self._rows = self.engine.allocate(max(n_rows, 2 * self._rows.shape[0]))
        out = self._rows[:n_rows]
        if not fill:
            return out
        matchers, first_rows, drafts = [], [], []
        row = 0
        any_drafts = False
        for adv in fill:
            res, seq, d, m = adv.res, adv.seq, adv.drafts, adv.matcher
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
        pending = self.checks.start(fill) if self.checks.live else None
        self.engine.fill_batch(matchers, first_rows, drafts if any_drafts else None, out)
        if pending is not None:
            self.checks.finish(pending, out, refusals)
        return out

    def _forget(self, sid: str) -> None:
        seq = self.seqs.pop(sid, None)
        if seq is not None:
            seq.matcher = None


# -- per-entry results ---------------------------------------------------------------------------
def _digest(tokens) -> int:
    return hash(tuple(tokens))


def _record(seq: SequenceState, msg: pb.SeqStep) -> None:
    if msg.step != seq.step:
        seq.parts = None          # restore parts are remembered only at the step they restored
    seq.step = msg.step
    seq.last_tokens = tuple(msg.tokens)
    seq.last_drafts = tuple(msg.draft_tokens)
    seq.last_rollback = msg.rollback


def _refuse(res: pb.SeqResult, refusals, code: Code, message: str, kind: str | None = None) -> None:
    res.status = ERROR
    res.code = code
    res.reason = message
    refusals[kind or code.name.lower()] += 1


def _fail(res: pb.SeqResult, seq: SequenceState, reason: str) -> None:
    seq.last_status = res.status = FAILED
    res.code = Code.INVALID_ARGUMENT
    res.reason = reason
