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
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np

from maskd.server import columns
from maskd.server.columns import PlainResult
from maskd.server.config import Limits
from maskd.server.engines import Engine, Matcher
from maskd.server.grammar_cache import CacheEntry, GrammarCache, QueueFull
from maskd.server.quotas import Quotas
from maskd.specs import GrammarSpec, SpecError
from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import Code, GrammarState, SeqStatus

log = logging.getLogger("maskd.server.session")
READY, WAITING, FAILED, FINISHED, CLOSED, ERROR = (
    SeqStatus.READY, SeqStatus.WAITING, SeqStatus.FAILED, SeqStatus.FINISHED, SeqStatus.CLOSED, SeqStatus.ERROR)


class SequenceState:
    """Server-side state of one sequence; a pure function of (grammar, accepted tokens)."""
    __slots__ = (
        "accepted",
        "dead_code",
        "dead_reason",
        "entry",
        "finished",
        "handle",
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

    def __init__(self, seq_id: str, entry: CacheEntry, step: int, handle: int) -> None:
        self.seq_id = seq_id
        self.handle = handle           # names it in columnar steps of its session
        self.entry = entry
        self.matcher: Matcher | None = None
        self.step = step               # last step applied
        self.accepted = 0              # tokens the matcher consumed (bounds rollback)
        self.pending: list[int] = []   # tokens received while the grammar compiled
        self.dead_reason = ""          # set once the sequence failed
        self.dead_code = Code.INVALID_ARGUMENT
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
    """What one step produced: a result per entry (SeqStep entries in request order, then the
    columnar ones) and the rows they point into (those of SeqStep entries first)."""
    results: list[pb.SeqResult]
    rows: np.ndarray
    refusals: collections.Counter      # error kind -> entries refused or failed this step
    fill_seconds: float = 0.0
    plain: list[PlainResult] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class _Advance:
    """An entry that moves its sequence (or repeats its last step) and gets rows."""
    res: pb.SeqResult | PlainResult
    seq: SequenceState
    matcher: Matcher
    tokens: Sequence[int] = ()
    drafts: tuple = ()


class Session:
    def __init__(self, key: str, engine: Engine, cache: GrammarCache, limits: Limits, *, tenant: str = "",
                 quotas: Quotas | None = None) -> None:
        self.key = key
        self.tenant = tenant
        self.quotas = quotas
        self.engine = engine
        self.cache = cache
        self.limits = limits
        self.seqs: dict[str, SequenceState] = {}
        self.by_handle: dict[int, SequenceState] = {}
        self._handles = 0
        self.lock = threading.Lock()
        self.streams = 0
        self.vocab_limit = engine.width
        self._rows = engine.allocate(64)

    # -- public -----------------------------------------------------------------------------------
    def step(self, request: pb.StepRequest) -> StepOutcome:
        """Applies one decode step for a batch. Never raises for bad input: refused entries come
        back as ERROR (the sequence unchanged), dead sequences as FAILED."""
        with self.lock:
            refusals: collections.Counter = collections.Counter()
            rich = [(m, pb.SeqResult(seq_id=m.seq_id, step=m.step)) for m in request.seqs]
            plain, problem = columns.parse(request, self.by_handle)
            if problem:
                for _, res in plain:
                    _refuse(res, refusals, Code.INVALID_ARGUMENT, problem)
            else:
                refusals["not_found"] += sum(1 for _, res in plain if res.status == ERROR)
            admitted = self._admit(rich + [e for e in plain if not e[1].status], refusals)
            moving, repeats = self._route(admitted, refusals)
            consume, fill = self._advance(moving, refusals)
            fill += repeats
            self._consume(consume, fill, refusals)
            t0 = time.perf_counter()
            rows = self._fill(fill, request.want_forced_tokens, refusals)
            return StepOutcome([res for _, res in rich], rows, refusals, time.perf_counter() - t0,
                               [res for _, res in plain])

    def refuse_all(self, request: pb.StepRequest, reason: str) -> StepOutcome:
        """Every entry refused with INTERNAL: the answer when a step failed in a way no phase caught."""
        refusals: collections.Counter = collections.Counter()
        results = [pb.SeqResult(seq_id=m.seq_id, step=m.step) for m in request.seqs]
        plain = [PlainResult(i, "", 0) for i in range(len(request.handles) // 4)]
        for res in [*results, *plain]:
            _refuse(res, refusals, Code.INTERNAL, reason, kind="internal")
        return StepOutcome(results, self.engine.allocate(0), refusals, plain=plain)

    def close_all(self) -> int:
        with self.lock:
            n = len(self.seqs)
            for seq in self.seqs.values():
                seq.matcher = None
            self.seqs.clear()
            self.by_handle.clear()
            if self.quotas is not None:
                self.quotas.close_sequences(self.tenant, n)
            return n

    def waiting_count(self) -> int:
        return sum(1 for s in self.seqs.values() if s.waiting)

    # -- phase 1: admission -----------------------------------------------------------------------
    def _admit(self, pairs: list, refusals) -> list:
        """The entries (SeqStep or columnar, with their results) that pass the request's and their
        own limits; the others are refused."""
        entries = [m for m, _ in pairs]
        results = [r for _, r in pairs]
        n = len(entries)
        total_rows = n
        if n * (1 + self.limits.max_draft_tokens) > self.limits.max_rows_per_step:
            total_rows += sum(len(m.draft_tokens) for m in entries)
        if total_rows > self.limits.max_rows_per_step:
            for res in results:
                _refuse(res, refusals, Code.RESOURCE_EXHAUSTED,
                        f"step asks for {total_rows} rows; the limit is {self.limits.max_rows_per_step}")
            return []
        if n * (self.limits.max_tokens_per_step + self.limits.max_draft_tokens) > self.limits.max_tokens_per_request:
            tokens = sum(len(m.tokens) + len(m.draft_tokens) for m in entries)
            if tokens > self.limits.max_tokens_per_request:
                for res in results:
                    _refuse(res, refusals, Code.RESOURCE_EXHAUSTED,
                            f"step carries {tokens} tokens; the limit is {self.limits.max_tokens_per_request} "
                            "(--max-tokens-per-request)")
                return []
        admitted = []
        seen: set[str] = set()
        for msg, res in pairs:
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
        res.handle = seq.handle
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
        if self.quotas is not None:
            over = self.quotas.open_sequence(self.tenant)
            if over:
                _refuse(res, refusals, Code.RESOURCE_EXHAUSTED, over)
                return None
        self._handles += 1
        seq = SequenceState(sid, entry, msg.step, self._handles)
        seq.parts = {0: _digest(msg.tokens)}
        self.seqs[sid] = seq
        self.by_handle[seq.handle] = seq
        res.handle = seq.handle
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
        problem = spec_problem(spec, self.limits)
        if problem:
            return None, Code.RESOURCE_EXHAUSTED, problem
        try:
            return self.cache.lookup(spec, self.tenant), Code.OK, ""
        except QueueFull as exc:
            return None, Code.RESOURCE_EXHAUSTED, str(exc)

    @staticmethod
    def _same_inputs(msg: pb.SeqStep, seq: SequenceState) -> bool:
        return (tuple(msg.tokens) == seq.last_tokens and tuple(msg.draft_tokens) == seq.last_drafts
                and msg.rollback == seq.last_rollback)

    @staticmethod
    def _answer_repeat(res: pb.SeqResult, seq: SequenceState, repeats: list[_Advance]) -> None:
        """A repeat is answered from the unchanged state; readiness is the one decided before."""
        status = seq.last_status
        if status == FAILED:
            _fail(res, seq, seq.dead_reason, seq.dead_code)
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
                _fail(res, seq, seq.dead_reason, seq.dead_code)
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
                _fail(res, seq, seq.dead_reason, entry.error_code)
                refusals["grammar_failed"] += 1
                continue
            if msg.rollback and msg.rollback > seq.history_length:
                _refuse(res, refusals, Code.OUT_OF_RANGE,
                        f"cannot roll back {msg.rollback} tokens: sequence {seq.seq_id!r} has accepted "
                        f"{seq.history_length}")
                continue
            try:
                matcher = seq.matcher
                if matcher is None:
                    matcher = seq.matcher = self.engine.new_matcher(entry.compiled)
                    if seq.pending:  # tokens queued while the grammar compiled come first
                        tokens = seq.pending + list(tokens)
                        seq.pending = []
                if msg.rollback:
                    matcher.rollback(msg.rollback)
                    seq.accepted -= msg.rollback
                    seq.finished = False
            except Exception as exc:   # an engine fault costs this sequence only
                _record(seq, msg)
                self._internal(res, seq, "advancing", exc, refusals)
                continue
            _record(seq, msg)
            (consume if tokens else fill).append(_Advance(res, seq, matcher, tokens, seq.last_drafts))
        return consume, fill

    # -- phase 4: consuming -----------------------------------------------------------------------
    def _consume(self, consume: list[_Advance], fill: list[_Advance], refusals) -> None:
        if not consume:
            return
        try:
            reasons: list = self.engine.consume_batch([a.matcher for a in consume], [a.tokens for a in consume])
        except Exception:   # find the sequence the engine chokes on; the others carry on
            reasons = []
            for adv in consume:
                try:
                    reasons.append(adv.matcher.consume(adv.tokens))
                except Exception as exc:
                    reasons.append(exc)
        for adv, reason in zip(consume, reasons):
            seq = adv.seq
            if isinstance(reason, Exception):
                self._internal(adv.res, seq, "consuming tokens", reason, refusals)
            elif reason is None:
                seq.accepted += len(adv.tokens)
                fill.append(adv)
            else:
                seq.dead_reason = f"token rejected: {reason}"
                seq.matcher = None
                refusals["token_rejected"] += 1
                _fail(adv.res, seq, seq.dead_reason)

    # -- phase 5: filling -------------------------------------------------------------------------
    def _fill(self, fill: list[_Advance], want_forced: bool, refusals) -> np.ndarray:
        """Rows of SeqStep entries first, then those of columnar entries in entry order."""
        plain = [a for a in fill if type(a.res) is PlainResult]
        if plain:
            plain.sort(key=lambda a: a.res.index)
            fill = [a for a in fill if type(a.res) is not PlainResult] + plain
        n_rows = sum(1 + len(a.drafts) for a in fill)
        if n_rows > self._rows.shape[0]:
            self._rows = self.engine.allocate(max(n_rows, 2 * self._rows.shape[0]))
        out = self._rows[:n_rows]
        if not fill:
            return out
        filled: list[_Advance] = []
        first_rows, drafts = [], []
        row = 0
        any_drafts = False
        for adv in fill:
            res, seq, d, m = adv.res, adv.seq, adv.drafts, adv.matcher
            try:
                stopped = m.is_stopped()
                accepting = stopped or m.is_accepting()
                drafts_valid = m.validate(d) if d else 0
                forced = m.forced_tokens() if want_forced and not stopped else ()
            except Exception as exc:   # an engine fault costs this sequence only
                self._internal(res, seq, "reading the grammar state", exc, refusals)
                continue
            seq.finished = stopped
            seq.last_status = res.status = FINISHED if stopped else READY
            res.first_row = row
            res.num_rows = 1 + len(d)
            res.accepting = accepting
            if d:
                any_drafts = True
                res.drafts_valid = drafts_valid
            if forced:
                res.forced_tokens.extend(forced)
            filled.append(adv)
            first_rows.append(row)
            drafts.append(d)
            row += 1 + len(d)
        try:
            self.engine.fill_batch([a.matcher for a in filled], first_rows, drafts if any_drafts else None, out)
        except Exception:   # fill them one by one: only the sequences the engine chokes on fail
            for adv, r, d in zip(filled, first_rows, drafts):
                try:
                    self.engine.fill_batch([adv.matcher], [r], [d] if d else None, out)
                except Exception as exc:
                    out[r: r + 1 + len(d)] = 0
                    adv.res.ClearField("forced_tokens")
                    adv.res.first_row = adv.res.num_rows = 0
                    self._internal(adv.res, adv.seq, "filling its mask", exc, refusals)
        return out

    @staticmethod
    def _internal(res: pb.SeqResult, seq: SequenceState, doing: str, exc: BaseException, refusals) -> None:
        """An engine fault on one sequence: it fails (with the reason) and nothing else does."""
        log.error("sequence %r: engine fault while %s", seq.seq_id, doing, exc_info=exc)
        seq.dead_reason = f"internal error while {doing}: {type(exc).__name__}: {str(exc)[:200]}"
        seq.matcher = None
        refusals["internal"] += 1
        _fail(res, seq, seq.dead_reason, Code.INTERNAL)

    def _forget(self, sid: str) -> None:
        seq = self.seqs.pop(sid, None)
        if seq is not None:
            seq.matcher = None
            self.by_handle.pop(seq.handle, None)
            if self.quotas is not None:
                self.quotas.close_sequences(self.tenant)


def spec_problem(spec: GrammarSpec, limits: Limits) -> str:
    """Why a well-formed spec is over the server's limits ("" when it is not)."""
    if spec.size > limits.max_grammar_bytes:
        return f"grammar is {spec.size} bytes; the limit is {limits.max_grammar_bytes}"
    depth = spec.depth
    if depth > limits.max_grammar_depth:
        return (f"grammar nests {depth} levels deep; the limit is {limits.max_grammar_depth} "
                "(--max-grammar-depth)")
    return ""


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


def _fail(res: pb.SeqResult, seq: SequenceState, reason: str, code: Code = Code.INVALID_ARGUMENT) -> None:
    seq.last_status = res.status = FAILED
    seq.dead_code = code
    res.code = code
    res.reason = reason
