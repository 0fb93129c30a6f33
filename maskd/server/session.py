"""The step protocol: one session's sequences and what a StepRequest does to them.

A session groups the sequences of one GPU worker; tensor-parallel ranks attach to the same
session so every rank may ask for a step and all get identical rows. ``Session.step`` applies
one StepRequest and returns a ``StepOutcome`` (a result per entry and the mask rows); it knows
nothing of gRPC, encoding or metrics (the service does those, in one place).

Every entry, whichever form it came in (a SeqStep or a columnar one), runs as an ``Entry`` with
a ``Result`` (entries.py). A step runs in phases:

1. admission and 2. routing (step_routing.py): the request's size, duplicate entries and token
   ids; closes, repeats (idempotency), opens and restores, step order.
3. ``_advance``: grammar readiness (tokens queue while it compiles), rollback; which sequences
   consume tokens, which only need rows, and which tokens were sampled without a row.
4. ``_check``: tokens sampled without a row (opportunistic masking, DOMINO §3.5) are checked
   against the row the sequence would have had: allowed ones go on to be consumed (and get no
   row), refused ones consume nothing and get that row to sample again with.
5. ``_consume``: every matcher's tokens in one batched engine call.
6. ``_fill``: every row of the reply in one batched engine call, in entry order.

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
from collections.abc import Callable

import numpy as np

from maskd.server import entries
from maskd.server.config import Limits
from maskd.server.drafts import CONTEXT, DraftModel
from maskd.server.engines import Engine
from maskd.server.entries import Result, refuse
from maskd.server.grammar_cache import GrammarCache
from maskd.server.json_schema import DocumentChecks, Verdict
from maskd.server.plain_block import PlainBlock
from maskd.server.quotas import Quotas
from maskd.server.row_buffers import RowBuffers
from maskd.server.sequence import RECENT_STEPS, Answer, SequenceState, fail, internal_reason, record_step
from maskd.server.step_routing import AnswerReplay, Fill, StepRouter
from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import Code, GrammarState, SeqStatus

log = logging.getLogger("maskd.server.session")
READY, WAITING, FAILED, FINISHED = SeqStatus.READY, SeqStatus.WAITING, SeqStatus.FAILED, SeqStatus.FINISHED


@dataclasses.dataclass
class StepOutcome:
    """What one step produced: a result per entry (SeqStep entries in request order, then the
    columnar ones: entries.parse's order) and the rows they point into, in the same order; where
    the columnar part was a plain block, ``block`` answers it (its rows come last).
    ``release`` is called once the rows are encoded (they may sit in a buffer the session reuses)."""
    results: list[Result]
    rows: np.ndarray
    refusals: collections.Counter      # error kind -> entries refused or failed this step
    release: Callable[[], None] | None = None
    unmasked: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # allowed / resample
    block: PlainBlock | None = None
    marks: list[tuple[str, float]] = dataclasses.field(default_factory=list)   # (phase, clock at its end)

    @property
    def fill_seconds(self) -> float:
        """The fill phase's time (0 where the step filled nothing: a repeat answered whole, a refusal)."""
        ends = dict(self.marks)
        return ends["fill"] - ends["consume"] if "fill" in ends else 0.0

    @property
    def batch(self) -> int:
        return len(self.results) + (len(self.block) if self.block is not None else 0)


class Session:
    def __init__(self, key: str, engine: Engine, cache: GrammarCache, limits: Limits, *, tenant: str = "",
                 quotas: Quotas | None = None, drafts: DraftModel | None = None) -> None:
        self.key = key
        self.tenant = tenant
        self.quotas = quotas
        self.engine = engine
        self.cache = cache
        self.limits = limits
        self.lock = threading.Lock()
        self.streams = 0
        self.vocab_limit = engine.width
        self.buffers = RowBuffers(engine.allocate, engine.width, self._kept_answer,
                                  max_count=limits.max_row_buffers_per_session)
        # Phases 1 and 2 (step_routing.py), and the table of sequences they open and close.
        self.router = StepRouter(engine, cache, limits, self.buffers, tenant=tenant, quotas=quotas)
        self.seqs, self.by_handle, self.closed = self.router.seqs, self.router.by_handle, self.router.closed
        self.checks = DocumentChecks(engine, cache.metrics)   # complete-mode hooks (doc_checks.py)
        # Grammar drafts: the server's drafter (one per server: every session's sequences teach it).
        self.drafts = drafts if drafts is not None else DraftModel()
        # The plain blocks of the last steps by their requests' bytes (plain_block.py): a rank
        # that repeats one whole gets its answer without a pass over its entries.
        self.blocks: collections.OrderedDict[tuple, PlainBlock] = collections.OrderedDict()

    # -- public -----------------------------------------------------------------------------------
    def step(self, request: pb.StepRequest) -> StepOutcome:
        """Applies one decode step for a batch. Never raises for bad input: refused entries come
        back as ERROR (the sequence unchanged), dead sequences as FAILED."""
        with self.lock:
            marks = [("lock", time.perf_counter())]     # the phases' ends, for a slow step's log line
            refusals: collections.Counter = collections.Counter()
            key = entries.request_key(request)
            if key is not None:
                repeated = self._repeated_block(key)
                if repeated is not None:
                    repeated.marks = marks
                    return repeated
            # The decode step's common case as arrays; anything else entry by entry (plain_block.py).
            columns = entries.plain_columns(request) if request.handles else None
            block = PlainBlock.of(columns, self) if columns is not None else None
            pairs, unknown, problem = entries.parse(request, self.by_handle, columnar=block is None)
            if problem:
                for _, res in pairs:
                    if res.columnar:
                        refuse(res, refusals, Code.INVALID_ARGUMENT, problem)
            elif unknown:
                refusals["not_found"] += unknown
            admitted = self.router.admit([pair for pair in pairs if not pair[1].status], refusals)
            replays: list[AnswerReplay] = []
            moving, repeats = self.router.route(admitted, refusals, replays)
            consume, fill, check = self._advance(moving, refusals)
            fill += repeats
            unmasked: collections.Counter = collections.Counter()
            if check:
                self._check(check, consume, fill, unmasked, refusals)
            marks.append(("route", time.perf_counter()))
            self._consume(consume, fill, refusals, block)
            marks.append(("consume", time.perf_counter()))
            rows, release = self._fill(fill, replays, request.want_forced_tokens, refusals, block)
            marks.append(("fill", time.perf_counter()))
            if block is not None:
                block.done()
                if key is not None:      # kept for a rank that repeats the whole request
                    self.blocks[key] = block
                    if len(self.blocks) > RECENT_STEPS:
                        self.blocks.popitem(last=False)
            return StepOutcome([res for _, res in pairs], rows, refusals, release, unmasked, block, marks)

    def _repeated_block(self, key: tuple) -> StepOutcome | None:
        """A repeat of a plain block's whole request, answered from the block (the rows it filled,
        while their buffer holds them); None where any of its answers is no longer kept."""
        block = self.blocks.get(key)
        if block is None or not block.still_kept(self.by_handle):
            return None
        n = block.rows_filled()
        if block.buffer < 0:
            assert block.rows is not None
            return StepOutcome([], block.rows[:n], collections.Counter(), block=block)
        rows = self.buffers.step_rows(block.buffer, block.generation, n)
        if rows is None:
            return None
        return StepOutcome([], rows, collections.Counter(), release=self.buffers.encoding(block.buffer), block=block)

    def refuse_all(self, request: pb.StepRequest, reason: str) -> StepOutcome:
        """Every entry refused with INTERNAL: the answer when a step failed in a way no phase caught."""
        refusals: collections.Counter = collections.Counter()
        return StepOutcome(entries.refused_results(request, refusals, reason), self.engine.allocate(0), refusals)

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

    # -- phase 3: advancing -----------------------------------------------------------------------
    def _advance(self, moving: list, refusals) -> tuple[list[Fill], list[Fill], list[Fill]]:
        """Readiness, rollback and the tokens each moving entry applies: (entries that consume
        tokens, entries that only need rows, entries whose tokens were sampled without a row)."""
        consume: list[Fill] = []
        fill: list[Fill] = []
        check: list[Fill] = []
        for msg, res, seq, tokens in moving:
            if seq.dead_reason:
                record_step(seq, msg, res)
                fail(res, seq, seq.dead_reason, seq.dead_code)
                continue
            entry = seq.entry
            if entry.state is GrammarState.COMPILING:
                self.cache.get(entry.grammar_id)  # applies the compile deadline
            if entry.state is GrammarState.COMPILING:
                # Tokens (a restored history) queue until the grammar is ready; no rows meanwhile.
                if msg.rollback > len(seq.pending):
                    refuse(res, refusals, Code.OUT_OF_RANGE,
                            f"cannot roll back {msg.rollback} tokens: sequence {seq.seq_id!r} has "
                            f"accepted {len(seq.pending)}")
                    continue
                if msg.unmasked and tokens:   # nothing to check them against yet: never queued unchecked
                    refuse(res, refusals, Code.FAILED_PRECONDITION,
                           f"sequence {seq.seq_id!r}: its grammar is still compiling, so a token sampled without "
                           "its row cannot be checked; step without tokens until the sequence is READY")
                    continue
                if msg.rollback:
                    del seq.pending[-msg.rollback:]
                seq.pending.extend(tokens)
                record_step(seq, msg, res)
                res.status = WAITING
                continue
            if entry.state is GrammarState.FAILED:
                record_step(seq, msg, res)
                fail(res, seq, f"grammar {entry.grammar_id} does not compile: {entry.error}", entry.error_code)
                refusals["grammar_failed"] += 1
                continue
            if msg.rollback and msg.rollback > seq.history_length:
                refuse(res, refusals, Code.OUT_OF_RANGE,
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
                    seq.tail = ()   # the tokens before are not known here: guesses start over
            except Exception as exc:   # an engine fault costs this sequence only
                record_step(seq, msg, res)
                self._internal(res, seq, "advancing", exc, refusals)
                continue
            record_step(seq, msg, res)
            job = Fill(res, seq, matcher, tokens, msg.drafts, msg.propose, msg.unmasked)
            (check if tokens and msg.unmasked else consume if tokens else fill).append(job)
        return consume, fill, check

    # -- phase 4: checking tokens sampled without a row ---------------------------------------------
    def _check(self, check: list[Fill], consume: list[Fill], fill: list[Fill], outcomes, refusals) -> None:
        """Opportunistic masking: each token is checked against the row its sequence would have had
        here. The grammar alone decides where the sequence has no document checks (one validate,
        no row filled); in the complete JSON-schema mode the row itself is filled with the
        document's checks (they take tokens the grammar allows out of it) and the token's bit read.
        Allowed: the entry consumes it and is answered without a row. Refused: nothing consumed,
        the entry gets the row for this position (``resample``); the sequence lives on."""
        plain = [job for job in check if job.seq.doc is None]
        checked = [job for job in check if job.seq.doc is not None]
        allowed: dict[int, bool] = {}
        eos = self.checks.eos
        for job in plain:
            m = job.matcher
            try:   # EOS is in a row where the grammar may end (a stopped matcher refuses to validate it)
                allowed[id(job)] = ((m.is_stopped() or m.is_accepting()) if job.tokens[0] in eos
                                    else m.validate(job.tokens) == 1)
            except Exception as exc:   # an engine fault costs this sequence only
                self._internal(job.res, job.seq, "checking a token sampled without its row", exc, refusals)
        if checked:
            allowed.update(self._check_with_rows(checked, refusals))
        for job in check:
            ok = allowed.get(id(job))
            if ok is None:             # failed while checking
                continue
            if ok:
                outcomes["allowed"] += 1
                consume.append(job)
            else:
                outcomes["resample"] += 1
                job.res.resample = True
                job.tokens, job.unmasked = (), False
                fill.append(job)

    def _check_with_rows(self, jobs: list[Fill], refusals) -> dict[int, bool]:
        """The rows of sequences with document checks at their current position, as the fill phase
        would write them, and whether each one's token is in its row. A sequence whose row is left
        empty fails here, as it would have when filled."""
        pairs: list[tuple[Fill, Fill]] = []      # (probe, job): the probe's result is scratch
        for job in jobs:
            probe = Fill(Result(len(pairs), job.res.seq_id, job.res.step, False), job.seq, job.matcher)
            try:
                probe.res.accepting = job.matcher.is_stopped() or job.matcher.is_accepting()
            except Exception as exc:   # an engine fault costs this sequence only
                self._internal(job.res, job.seq, "checking a token sampled without its row", exc, refusals)
                continue
            probe.res.first_row, probe.res.num_rows = len(pairs), 1
            pairs.append((probe, job))
        out = self.engine.allocate(len(pairs))
        try:
            self.engine.fill_batch([job.matcher for _, job in pairs], list(range(len(pairs))), None, out)
        except Exception:   # one by one: only the sequences the engine chokes on fail
            kept = []
            for probe, job in pairs:
                try:
                    self.engine.fill_batch([job.matcher], [probe.res.first_row], None, out)
                    kept.append((probe, job))
                except Exception as exc:
                    self._internal(job.res, job.seq, "checking a token sampled without its row", exc, refusals)
            pairs = kept
        checking = self.checks.start([probe for probe, _ in pairs])
        if checking is not None:
            self._apply_verdicts(self.checks.finish(checking, out), refusals)
        allowed: dict[int, bool] = {}
        for probe, job in pairs:
            if probe.res.status == FAILED:      # the document cannot pass from here: as in a fill
                fail(job.res, job.seq, probe.res.reason, Code(probe.res.code))
                continue
            t = int(job.tokens[0])
            row = out[probe.res.first_row]
            allowed[id(job)] = t < self.engine.width and bool((int(row[t >> 5]) >> (t & 31)) & 1)
        return allowed

    # -- phase 5: consuming -----------------------------------------------------------------------
    def _consume(self, consume: list[Fill], fill: list[Fill], refusals, block: PlainBlock | None = None) -> None:
        """Every entry's tokens in one engine call (a plain block's after the others')."""
        if not consume and block is None:
            return
        matchers = [a.matcher for a in consume]
        tokens = [a.tokens for a in consume]
        if block is not None:
            matchers += block.matchers
            tokens += [[t] for t in block.tokens]
        try:
            reasons: list = self.engine.consume_batch(matchers, tokens)
        except Exception:   # find the sequence the engine chokes on; the others carry on
            reasons = []
            for m, t in zip(matchers, tokens):
                try:
                    reasons.append(m.consume(t))
                except Exception as exc:
                    reasons.append(exc)
        if block is not None:
            block.consumed(reasons[len(consume):], refusals, self.checks)
            if not consume:
                return
            reasons = reasons[:len(consume)]
        if self.checks.live:
            reasons = self.checks.consumed(consume, reasons)
        for adv, reason in zip(consume, reasons):
            seq = adv.seq
            if isinstance(reason, Exception):
                self._internal(adv.res, seq, "consuming tokens", reason, refusals)
            elif reason is None:
                seq.accepted += len(adv.tokens)
                if seq.entry.drafting:
                    self._learn(seq, adv.tokens)
                fill.append(adv)
            else:
                refusals["token_rejected"] += 1
                fail(adv.res, seq, f"token rejected: {reason}")

    def _learn(self, seq: SequenceState, tokens) -> None:
        """Accepted tokens teach the grammar's drafter (a grammar for which drafts were asked: the
        others cost nothing); the drafts proposed at the step before are scored against them."""
        proposal = seq.proposal
        if proposal is not None:
            seq.proposal = None
            if seq.proposal_step == seq.step - 1:
                self.drafts.accepted(proposal, tokens)
        self.drafts.learn(self._drafts_key(seq), seq.tail, tokens)
        seq.tail = (*seq.tail, *tokens[-CONTEXT:])[-CONTEXT:]

    def _drafts_key(self, seq: SequenceState) -> str:
        """Whose counts a sequence learns from and is proposed from: its grammar's, within its tenant
        (one tenant's outputs never shape the drafts another tenant sees)."""
        return f"{self.tenant}\x00{seq.entry.grammar_id}" if self.tenant else seq.entry.grammar_id

    def _propose(self, fill: list[Fill], refusals) -> list[Fill]:
        """The drafts of entries that ask for them (a repeat of a step gets the same ones): set as
        the entry's drafts, so the fill writes their rows. Returns the entries still filling."""
        kept = []
        for job in fill:
            if job.propose and not job.drafts:
                seq = job.seq
                seq.entry.drafting = True
                try:
                    if seq.proposal is None or seq.proposal_step != seq.step:
                        seq.proposal = self.drafts.propose(self._drafts_key(seq), job.matcher, seq.tail, job.propose)
                        seq.proposal_step = seq.step
                except Exception as exc:   # an engine fault costs this sequence only
                    self._internal(job.res, seq, "proposing drafts", exc, refusals)
                    continue
                job.drafts = tuple(seq.proposal.drafts)
                job.res.proposed = job.drafts
            kept.append(job)
        return kept

    # -- phase 6: filling -------------------------------------------------------------------------
    def _fill(self, fill: list[Fill], replays: list[AnswerReplay], want_forced: bool, refusals,
              block: PlainBlock | None = None) -> tuple[np.ndarray, Callable[[], None] | None]:
        """Rows in entry order (SeqStep entries first, then columnar ones by index; a plain block's
        last): filled by the engine in one call, or copied from the kept answer of a repeat.
        Entries that ask for drafts get them proposed first (drafts.py)."""
        fill = self._propose(fill, refusals)
        jobs: list[Fill | AnswerReplay] = [*fill, *replays]
        jobs.sort(key=_row_order)
        n_rows = sum(j.answer.result.num_rows if isinstance(j, AnswerReplay) else (not j.unmasked) + len(j.drafts)
                     for j in jobs)
        if block is not None:
            n_rows += len(block)
        buffer, generation, out = (self.buffers.take(n_rows) if fill or block is not None
                                   else (-1, 0, self.engine.allocate(n_rows)))
        handles: list[int] = []                     # whose rows this step fills: (handle, step)
        steps: list[int] = []
        filled: list[Fill] = []
        first_rows, drafts = [], []
        row = 0
        any_drafts = False
        for job in jobs:
            if isinstance(job, AnswerReplay):            # a repeat whose kept answer has its rows
                res = job.res
                res.copy_answer(job.answer.result)
                n = res.num_rows
                if n:
                    res.first_row = row
                    out[row:row + n] = self.buffers.rows_of(job.answer)
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
            res.status = FINISHED if stopped else READY
            res.accepting = accepting
            if forced:
                res.forced_tokens.extend(forced)
            if job.unmasked:                        # its sampled token passed the check: no row
                answer = seq.kept(seq.step)
                if answer is not None:
                    answer.result, answer.buffer, answer.rows, answer.packed, answer.block = res, -1, None, None, None
                continue
            res.first_row = row
            res.num_rows = 1 + len(d)
            if d:
                any_drafts = True
                res.drafts_valid = drafts_valid
            answer = seq.kept(seq.step)
            if answer is not None:                  # its rows are these (a re-filled repeat too)
                answer.result, answer.buffer, answer.generation = res, buffer, generation
                answer.rows = answer.packed = answer.block = None
                if buffer < 0:
                    answer.rows = out
                else:
                    handles.append(seq.handle)
                    steps.append(seq.step)
            filled.append(job)
            first_rows.append(row)
            drafts.append(d)
            row += 1 + len(d)
        block_matchers: list = []
        if block is not None:
            block.buffer, block.generation = buffer, generation
            if buffer < 0:
                block.rows = out
            block_matchers, block_rows = block.read_states(row, want_forced, refusals)
            row += len(block_rows)
            first_rows += block_rows
            if any_drafts:
                drafts += [()] * len(block_rows)
        if filled or block_matchers:
            probes = block.probes() if block is not None else []
            checking = self.checks.start(filled + probes) if self.checks.live and (filled or probes) else None
            try:
                self.engine.fill_batch([a.matcher for a in filled] + block_matchers, first_rows,
                                       drafts if any_drafts else None, out)
            except Exception:   # fill them one by one: only the sequences the engine chokes on fail
                failed = np.zeros(row, dtype=bool)
                for adv, r, d in zip(filled, first_rows, drafts):
                    try:
                        self.engine.fill_batch([adv.matcher], [r], [d] if d else None, out)
                    except Exception as exc:
                        failed[r: r + 1 + len(d)] = True
                        adv.res.forced_tokens = []
                        adv.res.first_row = adv.res.num_rows = 0
                        self._internal(adv.res, adv.seq, "filling its mask", exc, refusals)
                if block is not None:
                    for i, r in enumerate(block.row):
                        if r >= 0:
                            try:
                                self.engine.fill_batch([block.matchers[i]], [r], None, out)
                            except Exception as exc:
                                failed[r] = True
                                block.fault(i, "filling its mask", exc, refusals)
                if failed.any():   # the failed entries' rows go: the columnar rows must stay dense
                    row = _drop_rows(out, failed, jobs, block)
            if checking is not None:
                had_rows = [(adv.res, adv.res.first_row, adv.res.num_rows) for adv in filled if adv.res.num_rows]
                self._apply_verdicts(self.checks.finish(checking, out), refusals)
                failed = np.zeros(row, dtype=bool)
                for res, r, n in had_rows:
                    if res.status == FAILED:         # the document cannot pass: its rows go too
                        failed[r: r + n] = True
                if block is not None and probes:
                    block.checked(failed)
                if failed.any():
                    row = _drop_rows(out, failed, jobs, block)
        out = out[:row]
        if buffer < 0:
            return out, None
        if block is not None:
            block_handles, block_steps = block.kept_rows()
            handles, steps = (handles + block_handles, steps + block_steps) if handles else (block_handles, block_steps)
        self.buffers.record(buffer, handles, steps)
        return out, self.buffers.encoding(buffer)

    @staticmethod
    def _apply_verdicts(verdicts: list[Verdict], refusals) -> None:
        """Complete mode's verdicts (json_schema/step_checks.py) into the checked entries' answers
        and sequences (a plain block's entries take theirs from their probes: PlainBlock.checked)."""
        for verdict in verdicts:
            res = verdict.job.res
            if verdict.failed:          # its rows are emptied already
                res.accepting = False
                res.num_rows = res.drafts_valid = 0
                del res.forced_tokens[:]
                fail(res, verdict.job.seq, verdict.failed)
                refusals["schema_invalid"] += 1
                continue
            if verdict.no_eos:
                res.accepting = False
            if verdict.drafts_valid is not None:
                res.drafts_valid = verdict.drafts_valid

    def _kept_answer(self, handle: int, step: int) -> Answer | None:
        """The answer a live sequence keeps for a step (the ring must not lose its rows)."""
        seq = self.by_handle.get(handle)
        return None if seq is None or seq.closed else seq.kept(step)

    @staticmethod
    def _internal(res: Result, seq: SequenceState, doing: str, exc: BaseException, refusals) -> None:
        """An engine fault on one sequence: it fails (with the reason) and nothing else does."""
        log.error("sequence %r: engine fault while %s", seq.seq_id, doing, exc_info=exc)
        refusals["internal"] += 1
        fail(res, seq, internal_reason(doing, exc), Code.INTERNAL)

# -- rows ----------------------------------------------------------------------------------------
def _drop_rows(out: np.ndarray, dropped: np.ndarray, jobs: list[Fill | AnswerReplay], block: PlainBlock | None) -> int:
    """Removes rows from the front of ``out`` (moving the others up, first_row fixed); returns how
    many rows are left."""
    before = np.cumsum(dropped) - dropped          # rows dropped before each row
    for job in jobs:
        res = job.res
        if res.num_rows:
            res.first_row -= int(before[res.first_row])
    if block is not None:
        block.drop_rows(before)
    kept = out[:len(dropped)][~dropped]
    out[:len(kept)] = kept
    return len(kept)


def _row_order(job: Fill | AnswerReplay) -> tuple[bool, int]:
    """SeqStep entries first, then columnar ones (each by index): the columnar rows stay dense."""
    return job.res.columnar, job.res.index
