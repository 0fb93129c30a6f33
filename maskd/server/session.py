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

The rules (idempotency, restores in parts, readiness once per step, answers kept for ranks that
lag) are the contract's: see proto/maskd/v1/maskd.proto.

Each sequence's state and the answers it keeps for repeats are in sequence.py; the rows live in
the session's ring of row buffers (row_buffers.py), and a repeat of a kept answer copies its rows
instead of filling them again.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from maskd.server import columns
from maskd.server.columns import PlainResult, PlainStep
from maskd.server.config import Limits
from maskd.server.engines import Engine, Matcher
from maskd.server.grammar_cache import CacheEntry, GrammarCache, QueueFull
from maskd.server.json_schema import DocumentChecks
from maskd.server.quotas import Quotas
from maskd.server.row_buffers import RowBuffers
from maskd.server.sequence import (
    CLOSED_KEPT,
    CLOSED_STEPS,
    RECENT_STEPS,
    Answer,
    SequenceState,
    digest,
    record_step,
)
from maskd.specs import GrammarSpec, SpecError
from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import Code, GrammarState, SeqStatus

log = logging.getLogger("maskd.server.session")
READY, WAITING, FAILED, FINISHED, CLOSED, ERROR = (
    SeqStatus.READY, SeqStatus.WAITING, SeqStatus.FAILED, SeqStatus.FINISHED, SeqStatus.CLOSED, SeqStatus.ERROR)

@dataclasses.dataclass
class StepOutcome:
    """What one step produced: a result per entry (SeqStep entries in request order, then the
    columnar ones) and the rows they point into (those of SeqStep entries first). ``release`` is
    called once the rows are encoded (they may sit in a buffer the session reuses)."""
    results: list[pb.SeqResult]
    rows: np.ndarray
    refusals: collections.Counter      # error kind -> entries refused or failed this step
    fill_seconds: float = 0.0
    plain: list[PlainResult] = dataclasses.field(default_factory=list)
    release: Callable[[], None] | None = None


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
        # Closed sequences whose last answers are kept (id -> state), oldest first.
        self.closed: collections.OrderedDict[str, SequenceState] = collections.OrderedDict()
        self.buffers = RowBuffers(engine.allocate, engine.width, self._kept_answer,
                                  max_count=limits.max_row_buffers_per_session)
        self.checks = DocumentChecks(engine, cache.metrics)   # complete-mode hooks (doc_checks.py)

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
            replays: list[tuple[pb.SeqResult | PlainResult, Answer]] = []
            moving, repeats = self._route(admitted, refusals, replays)
            consume, fill = self._advance(moving, refusals)
            fill += repeats
            self._consume(consume, fill, refusals)
            t0 = time.perf_counter()
            rows, release = self._fill(fill, replays, request.want_forced_tokens, refusals)
            return StepOutcome([res for _, res in rich], rows, refusals, time.perf_counter() - t0,
                               [res for _, res in plain], release)

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
            self.closed.clear()
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
    def _route(self, admitted: list, refusals, replays: list) -> tuple[list, list[_Advance]]:
        """Closes, repeats, opens and order checks. Returns the entries that move their sequence
        ((msg, res, seq, tokens)) and the repeats that are answered from the unchanged state;
        repeats with a kept answer go to ``replays``."""
        moving: list = []
        repeats: list[_Advance] = []
        for msg, res in admitted:
            sid = msg.seq_id
            # A columnar entry names its sequence by handle (which outlives a reuse of the id).
            seq: SequenceState | None = msg.seq if type(msg) is PlainStep else self.seqs.get(sid)
            opening = msg.WhichOneof("open") is not None
            if seq is None and sid in self.closed:
                if opening:
                    self._drop_closed(sid)          # the id opens anew (a rank that lags re-derives the rows)
                else:
                    seq = self.closed[sid]
            if seq is not None and seq.closed:
                if msg.close:
                    res.status = CLOSED             # another rank closed it already
                elif not self._replay(msg, res, seq, replays, refusals):
                    _refuse(res, refusals, Code.NOT_FOUND,
                            f"sequence {sid!r} is closed; its step {msg.step} is not among its last "
                            f"{CLOSED_STEPS} steps, or their rows are gone (kept until the session's row "
                            "buffers come round)")
                continue
            if seq is not None and msg.step < seq.step and not msg.close and not msg.history_offset:
                if not self._replay(msg, res, seq, replays, refusals):
                    if opening:
                        _refuse(res, refusals, Code.ALREADY_EXISTS,
                                f"sequence {sid!r} is already open (at step {seq.step}); close it first")
                    else:
                        _refuse(res, refusals, Code.FAILED_PRECONDITION,
                                f"step {msg.step} of sequence {sid!r} is out of order: the last applied step "
                                f"is {seq.step}, so the next is {seq.step + 1} (repeats are answered for the "
                                f"last {RECENT_STEPS} steps)")
                continue
            if msg.close:
                if seq is None:
                    _refuse(res, refusals, Code.NOT_FOUND, f"cannot close unknown sequence {sid!r}")
                else:
                    self._forget(sid)
                    res.status = CLOSED
                continue
            if seq is not None and msg.step == seq.step:
                if opening:
                    self._route_reopen(msg, res, seq, moving, repeats, replays, refusals)
                elif self._same_inputs(msg, seq):
                    self._answer_repeat(res, seq, repeats, replays)
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

    def _route_reopen(self, msg, res, seq: SequenceState, moving: list, repeats: list, replays: list,
                      refusals) -> None:
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
            if known == digest(msg.tokens) and tuple(msg.draft_tokens) == seq.last_drafts:
                self._answer_repeat(res, seq, repeats, replays)
            else:
                self._divergence(res, seq, refusals)
        elif seq.parts is not None and offset == seq.history_length and offset > 0 and msg.tokens:
            seq.parts[offset] = digest(msg.tokens)
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
        seq.parts = {0: digest(msg.tokens)}
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

    def _replay(self, msg, res, seq: SequenceState, replays: list, refusals) -> bool:
        """A repeat of an older step (a rank that lags, a retry, a step of a closed sequence): the
        answer it had, or a divergence when its inputs differ. False when that answer is gone."""
        answer = seq.recent.get(msg.step)
        if answer is None or not self.buffers.holds(answer):
            return False
        if msg.WhichOneof("open") is not None and seq.entry.grammar_id != self._open_grammar_id(msg):
            _refuse(res, refusals, Code.ALREADY_EXISTS,
                    f"sequence {msg.seq_id!r} is already open with grammar {seq.entry.grammar_id}")
        elif (tuple(msg.tokens) != answer.tokens or tuple(msg.draft_tokens) != answer.drafts
              or msg.rollback != answer.rollback):
            self._divergence(res, seq, refusals)
        else:
            replays.append((res, answer))
        return True

    def _answer_repeat(self, res, seq: SequenceState, repeats: list[_Advance], replays: list) -> None:
        """A repeat is answered from the unchanged state; readiness is the one decided before. The
        rows come from the kept answer when they are still there (no second fill)."""
        status = seq.last_status
        answer = seq.recent.get(seq.step)
        if status in (READY, FINISHED) and answer is not None and answer.result.num_rows \
                and self.buffers.holds(answer):
            replays.append((res, answer))
        elif status == FAILED:
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
                record_step(seq, msg, res)
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
                record_step(seq, msg, res)
                seq.last_status = res.status = WAITING
                continue
            if entry.state is GrammarState.FAILED:
                record_step(seq, msg, res)
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
            except Exception as exc:   # an engine fault costs this sequence only
                record_step(seq, msg, res)
                self._internal(res, seq, "advancing", exc, refusals)
                continue
            record_step(seq, msg, res)
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
        if self.checks.live:
            reasons = self.checks.consumed(consume, reasons)
        for adv, reason in zip(consume, reasons):
            seq = adv.seq
            if isinstance(reason, Exception):
                self._internal(adv.res, seq, "consuming tokens", reason, refusals)
            elif reason is None:
                seq.accepted += len(adv.tokens)
                fill.append(adv)
            else:
                seq.dead_reason = f"token rejected: {reason}"
                seq.matcher = seq.doc = None
                refusals["token_rejected"] += 1
                _fail(adv.res, seq, seq.dead_reason)

    # -- phase 5: filling -------------------------------------------------------------------------
    def _fill(self, fill: list[_Advance], replays: list, want_forced: bool,
              refusals) -> tuple[np.ndarray, Callable[[], None] | None]:
        """Rows of SeqStep entries first, then those of columnar entries in entry order: filled by
        the engine, or copied from the kept answer of a repeat."""
        jobs: list = [*fill, *replays]
        if any(type(j[0] if type(j) is tuple else j.res) is PlainResult for j in jobs):
            jobs.sort(key=_row_order)
        n_rows = sum(1 + len(j.drafts) if type(j) is _Advance else j[1].result.num_rows for j in jobs)
        buffer, generation, out = self.buffers.take(n_rows) if fill else (-1, 0, self.engine.allocate(n_rows))
        handles: list[int] = []                     # whose rows this step fills: (handle, step)
        steps: list[int] = []
        filled: list[_Advance] = []
        first_rows, drafts = [], []
        row = 0
        any_drafts = False
        for job in jobs:
            if type(job) is tuple:                  # a repeat with a kept answer
                res, answer = job
                src = answer.result
                _copy_result(res, src)
                n = src.num_rows
                if n:
                    res.first_row = row
                    out[row:row + n] = self.buffers.rows_of(answer)
                    row += n
                continue
            res, seq, d, m = job.res, job.seq, job.drafts, job.matcher
            try:
                stopped = m.is_stopped()
                accepting = stopped or m.is_accepting()
                drafts_valid = m.validate(d) if d else 0
                forced = m.forced_tokens() if want_forced and not stopped else ()
            except Exception as exc:   # an engine fault costs this sequence only (and gets no rows)
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
            answer = seq.recent.get(seq.step)
            if answer is not None:                  # its rows are these (a re-filled repeat too)
                answer.result, answer.buffer, answer.generation = res, buffer, generation
                answer.rows = answer.packed = None
                if buffer < 0:
                    answer.rows = out
                else:
                    handles.append(seq.handle)
                    steps.append(seq.step)
            filled.append(job)
            first_rows.append(row)
            drafts.append(d)
            row += 1 + len(d)
        if filled:
            checking = self.checks.start(filled) if self.checks.live else None
            try:
                self.engine.fill_batch([a.matcher for a in filled], first_rows, drafts if any_drafts else None, out)
            except Exception:   # fill them one by one: only the sequences the engine chokes on fail
                failed = np.zeros(row, dtype=bool)
                for adv, r, d in zip(filled, first_rows, drafts):
                    try:
                        self.engine.fill_batch([adv.matcher], [r], [d] if d else None, out)
                    except Exception as exc:
                        failed[r: r + 1 + len(d)] = True
                        adv.res.ClearField("forced_tokens")
                        adv.res.first_row = adv.res.num_rows = 0
                        self._internal(adv.res, adv.seq, "filling its mask", exc, refusals)
                if failed.any():   # the failed entries' rows go: the columnar rows must stay dense
                    row = _drop_rows(out, failed, jobs)
            if checking is not None:
                had_rows = [(adv.res, adv.res.first_row, adv.res.num_rows) for adv in filled if adv.res.num_rows]
                self.checks.finish(checking, out, refusals)
                failed = np.zeros(row, dtype=bool)
                for res, r, n in had_rows:
                    if res.status == FAILED:         # the document cannot pass: its rows go too
                        failed[r: r + n] = True
                if failed.any():
                    row = _drop_rows(out, failed, jobs)
        out = out[:row]
        if buffer < 0:
            return out, None
        self.buffers.record(buffer, handles, steps)
        return out, self.buffers.encoding(buffer)

    def _kept_answer(self, handle: int, step: int) -> Answer | None:
        """The answer a live sequence keeps for a step (the ring must not lose its rows)."""
        seq = self.by_handle.get(handle)
        return None if seq is None or seq.closed else seq.recent.get(step)

    @staticmethod
    def _internal(res: pb.SeqResult, seq: SequenceState, doing: str, exc: BaseException, refusals) -> None:
        """An engine fault on one sequence: it fails (with the reason) and nothing else does."""
        log.error("sequence %r: engine fault while %s", seq.seq_id, doing, exc_info=exc)
        seq.dead_reason = f"internal error while {doing}: {type(exc).__name__}: {str(exc)[:200]}"
        seq.matcher = None
        refusals["internal"] += 1
        _fail(res, seq, seq.dead_reason, Code.INTERNAL)

    def _forget(self, sid: str) -> None:
        """Closes a sequence. Its last answers stay (their rows while the buffers hold them) for
        ranks whose last steps come after this close."""
        seq = self.seqs.pop(sid, None)
        if seq is None:
            return
        seq.matcher = None
        seq.pending = []
        seq.closed = True
        seq.recent = {step: seq.recent[step] for step in sorted(seq.recent)[-CLOSED_STEPS:]}
        self._drop_closed(sid)
        self.closed[sid] = seq
        while len(self.closed) > CLOSED_KEPT:
            self._drop_closed(next(iter(self.closed)))
        if self.quotas is not None:
            self.quotas.close_sequences(self.tenant)

    def _drop_closed(self, sid: str) -> None:
        seq = self.closed.pop(sid, None)
        if seq is not None and self.by_handle.get(seq.handle) is seq:
            del self.by_handle[seq.handle]


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
def _drop_rows(out: np.ndarray, dropped: np.ndarray, jobs: list) -> int:
    """Removes rows from the front of ``out`` (moving the others up, first_row fixed); returns how
    many rows are left."""
    before = np.cumsum(dropped) - dropped          # rows dropped before each row
    for job in jobs:
        res = job[0] if type(job) is tuple else job.res
        if res.num_rows:
            res.first_row -= int(before[res.first_row])
    kept = out[:len(dropped)][~dropped]
    out[:len(kept)] = kept
    return len(kept)


def _row_order(job) -> int:
    """SeqStep entries first (in their order: a stable sort), then columnar ones by index."""
    res = job[0] if type(job) is tuple else job.res
    return res.index if type(res) is PlainResult else -1


def _copy_result(dst, src) -> None:
    """A kept answer into this entry's result (either kind; the entry's own index and row stay)."""
    dst.status, dst.code, dst.reason = src.status, src.code, src.reason
    dst.num_rows, dst.accepting = src.num_rows, src.accepting
    dst.drafts_valid, dst.handle = src.drafts_valid, src.handle
    if src.forced_tokens:
        dst.forced_tokens.extend(src.forced_tokens)


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
