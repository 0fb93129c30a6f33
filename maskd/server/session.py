"""The step protocol: one session's sequences and what a StepRequest does to them.

A session groups the sequences of one GPU worker; tensor-parallel ranks attach to the same
session so every rank may ask for a step and all get identical rows. ``Session.step`` applies
one StepRequest and returns a ``StepOutcome`` (the step's answers and its mask rows); it knows
nothing of gRPC, encoding or metrics (the service does those, in one place).

Every entry of a step, whichever form it came in (a SeqStep or a columnar one), is answered in
the step's one answer record (step_answers.py), by its index there. A step runs in phases:

1. admission and 2. routing (step_routing.py): the request's size, duplicate entries and token
   ids; closes, repeats (idempotency), opens and restores, step order. A columnar part that is
   the decode step's common case skips these as a plain block (plain_block.py).
3. ``_advance``: grammar readiness (tokens queue while it compiles), rollback; which sequences
   consume tokens, which only need rows, and which tokens were sampled without a row.
4. ``_check``: tokens sampled without a row (opportunistic masking, DOMINO §3.5) are checked
   against the row the sequence would have had: allowed ones go on to be consumed (and get no
   row), refused ones consume nothing and get that row to sample again with.
5. ``_consume``: every matcher's tokens in one batched engine call.
6. ``_fill``: every row of the reply in one batched engine call, in entry order; complete mode's
   checks (json_schema/step_checks.py) run beside it and their verdicts are applied here.

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
from maskd.server.engines.base import split_tokens
from maskd.server.grammar_cache import GrammarCache
from maskd.server.json_schema import DocumentChecks, Verdict
from maskd.server.plain_block import PlainBlock
from maskd.server.quotas import Quotas
from maskd.server.row_buffers import RowBuffers
from maskd.server.sequence import RECENT_STEPS, Kept, SequenceState, keep_answer, record_step
from maskd.server.step_answers import StepAnswers
from maskd.server.step_routing import AnswerReplay, Fill, StepRouter
from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import Code, GrammarState, SeqStatus

log = logging.getLogger("maskd.server.session")
READY, WAITING, FAILED, FINISHED = SeqStatus.READY, SeqStatus.WAITING, SeqStatus.FAILED, SeqStatus.FINISHED


@dataclasses.dataclass
class StepOutcome:
    """What one step produced: its answers (step_answers.py) and the rows they point into.
    ``release`` is called once the rows are encoded (they may sit in a buffer the session reuses)."""
    answers: StepAnswers
    rows: np.ndarray
    refusals: collections.Counter      # error kind -> entries refused or failed this step
    release: Callable[[], None] | None = None
    unmasked: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # allowed / resample
    marks: list[tuple[str, float]] = dataclasses.field(default_factory=list)   # (phase, clock at its end)

    @property
    def fill_seconds(self) -> float:
        """The fill phase's time (0 where the step filled nothing: a repeat answered whole, a refusal)."""
        ends = dict(self.marks)
        return ends["fill"] - ends["consume"] if "fill" in ends else 0.0

    @property
    def batch(self) -> int:
        return len(self.answers)


@dataclasses.dataclass(slots=True)
class _KeptStep:
    """A plain block's step, kept by its request's bytes: a rank that repeats the whole request
    gets these answers while every one of them is still what its sequence keeps."""
    answers: StepAnswers
    handles: list[int]
    steps: list[int]


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
        # The plain blocks' steps of the last steps by their requests' bytes: a rank that repeats
        # one whole gets its answers without a pass over its entries.
        self.blocks: collections.OrderedDict[tuple, _KeptStep] = collections.OrderedDict()

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
            answers = entries.answers_for(request)
            # The decode step's common case as arrays; anything else entry by entry (plain_block.py).
            columns = entries.plain_columns(request) if request.handles else None
            block = PlainBlock.of(columns, self, answers) if columns is not None else None
            found, unknown, problem = entries.parse(request, self.by_handle, answers,
                                                    columnar=None if block is None else block.others)
            if problem:
                for msg in found[answers.named:]:
                    answers.refuse(msg.index, refusals, Code.INVALID_ARGUMENT, problem)
            elif unknown:
                refusals["not_found"] += unknown
            admitted = self.router.admit([msg for msg in found if not answers.status[msg.index]], answers, refusals)
            replays: list[AnswerReplay] = []
            moving, repeats = self.router.route(admitted, answers, refusals, replays)
            consume, fill, check = self._advance(moving, answers, refusals)
            fill += repeats
            unmasked: collections.Counter = collections.Counter()
            if check:
                self._check(check, consume, fill, answers, unmasked, refusals)
            marks.append(("route", time.perf_counter()))
            self._consume(consume, fill, answers, refusals, block)
            marks.append(("consume", time.perf_counter()))
            rows, release = self._fill(fill, replays, answers, request.want_forced_tokens, refusals, block)
            marks.append(("fill", time.perf_counter()))
            if block is not None and key is not None and not block.others:   # for a rank that repeats it whole
                self.blocks[key] = _KeptStep(answers, block.handles, block.steps)
                if len(self.blocks) > RECENT_STEPS:
                    self.blocks.popitem(last=False)
            return StepOutcome(answers, rows, refusals, release, unmasked, marks)

    def _repeated_block(self, key: tuple) -> StepOutcome | None:
        """A repeat of a plain block's whole request, answered from that step's answers (the rows
        it filled, while their buffer holds them); None where any of them is no longer kept."""
        kept = self.blocks.get(key)
        if kept is None:
            return None
        answers, get = kept.answers, self.by_handle.get
        for h, step in zip(kept.handles, kept.steps):
            seq = get(h)
            mine = seq.recent.get(step) if seq is not None else None
            if mine is None or mine[0] is not answers:
                return None
        n = answers.rows_filled()
        if answers.buffer < 0:
            assert answers.rows is not None
            return StepOutcome(answers, answers.rows[:n], collections.Counter())
        rows = self.buffers.step_rows(answers.buffer, answers.generation, n)
        if rows is None:
            return None
        return StepOutcome(answers, rows, collections.Counter(), release=self.buffers.encoding(answers.buffer))

    def refuse_all(self, request: pb.StepRequest, reason: str) -> StepOutcome:
        """Every entry refused with INTERNAL: the answer when a step failed in a way no phase caught."""
        refusals: collections.Counter = collections.Counter()
        answers = entries.answers_for(request)
        for i in range(len(answers)):
            answers.refuse(i, refusals, Code.INTERNAL, reason, kind="internal")
        return StepOutcome(answers, self.engine.allocate(0), refusals)

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
    def _advance(self, moving: list, answers: StepAnswers, refusals) -> tuple[list[Fill], list[Fill], list[Fill]]:
        """Readiness, rollback and the tokens each moving entry applies: (entries that consume
        tokens, entries that only need rows, entries whose tokens were sampled without a row)."""
        consume: list[Fill] = []
        fill: list[Fill] = []
        check: list[Fill] = []
        for msg, seq, tokens in moving:
            i = msg.index
            if seq.dead_reason:
                record_step(seq, msg, answers)
                answers.fail(i, seq, seq.dead_reason, seq.dead_code)
                continue
            entry = seq.entry
            if entry.state is GrammarState.COMPILING:
                self.cache.get(entry.grammar_id)  # applies the compile deadline
            if entry.state is GrammarState.COMPILING:
                # Tokens (a restored history) queue until the grammar is ready; no rows meanwhile.
                if msg.rollback > len(seq.pending):
                    answers.refuse(i, refusals, Code.OUT_OF_RANGE,
                                   f"cannot roll back {msg.rollback} tokens: sequence {seq.seq_id!r} has "
                                   f"accepted {len(seq.pending)}")
                    continue
                if msg.unmasked and tokens:   # nothing to check them against yet: never queued unchecked
                    answers.refuse(i, refusals, Code.FAILED_PRECONDITION,
                                   f"sequence {seq.seq_id!r}: its grammar is still compiling, so a token sampled "
                                   "without its row cannot be checked; step without tokens until the sequence "
                                   "is READY")
                    continue
                if msg.rollback:
                    del seq.pending[-msg.rollback:]
                seq.pending.extend(tokens)
                answers.status[i] = WAITING
                answers.set_inputs(i, msg.tokens, msg.drafts, msg.rollback, msg.propose, msg.unmasked)
                # Kept alone: a sequence polls a compiling grammar as fast as its rank steps.
                keep_answer(seq, msg.step, (answers.detached(i), 0))
                continue
            if entry.state is GrammarState.FAILED:
                record_step(seq, msg, answers)
                answers.fail(i, seq, f"grammar {entry.grammar_id} does not compile: {entry.error}", entry.error_code)
                refusals["grammar_failed"] += 1
                continue
            if msg.rollback and msg.rollback > seq.history_length:
                answers.refuse(i, refusals, Code.OUT_OF_RANGE,
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
                record_step(seq, msg, answers)
                answers.fault(i, seq, "advancing", exc, refusals)
                continue
            record_step(seq, msg, answers)
            job = Fill(i, seq, matcher, tokens, msg.drafts, msg.propose, msg.unmasked)
            (check if tokens and msg.unmasked else consume if tokens else fill).append(job)
        return consume, fill, check

    # -- phase 4: checking tokens sampled without a row ---------------------------------------------
    def _check(self, check: list[Fill], consume: list[Fill], fill: list[Fill], answers: StepAnswers, outcomes,
               refusals) -> None:
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
                allowed[job.i] = ((m.is_stopped() or m.is_accepting()) if job.tokens[0] in eos
                                  else m.validate(job.tokens) == 1)
            except Exception as exc:   # an engine fault costs this sequence only
                answers.fault(job.i, job.seq, "checking a token sampled without its row", exc, refusals)
        if checked:
            allowed.update(self._check_with_rows(checked, answers, refusals))
        for job in check:
            ok = allowed.get(job.i)
            if ok is None:             # failed while checking
                continue
            if ok:
                outcomes["allowed"] += 1
                consume.append(job)
            else:
                outcomes["resample"] += 1
                answers.set_resample(job.i)
                job.tokens, job.unmasked = (), False
                fill.append(job)

    def _check_with_rows(self, jobs: list[Fill], answers: StepAnswers, refusals) -> dict[int, bool]:
        """The rows of sequences with document checks at their current position, as the fill phase
        would write them, and whether each one's token is in its row. A sequence whose row is left
        empty fails here, as it would have when filled."""
        probes = StepAnswers(len(jobs))          # scratch: probe k is the row the job would have had
        pairs: list[tuple[Fill, Fill]] = []
        for job in jobs:
            k = len(pairs)
            try:
                accepting = job.matcher.is_stopped() or job.matcher.is_accepting()
            except Exception as exc:   # an engine fault costs this sequence only
                answers.fault(job.i, job.seq, "checking a token sampled without its row", exc, refusals)
                continue
            probes.set_status(k, READY, accepting)
            probes.first_row[k], probes.num_rows[k] = k, 1
            pairs.append((Fill(k, job.seq, job.matcher), job))
        out = self.engine.allocate(len(pairs))
        try:
            self.engine.fill_batch([job.matcher for _, job in pairs], list(range(len(pairs))), None, out)
        except Exception:   # one by one: only the sequences the engine chokes on fail
            kept = []
            for probe, job in pairs:
                try:
                    self.engine.fill_batch([job.matcher], [probe.i], None, out)
                    kept.append((probe, job))
                except Exception as exc:
                    answers.fault(job.i, job.seq, "checking a token sampled without its row", exc,
                                   refusals)
            pairs = kept
        checking = self.checks.start(probes, [probe for probe, _ in pairs])
        failed: dict[int, str] = {}
        if checking is not None:
            for verdict in self.checks.finish(checking, out):
                if verdict.failed:       # the document cannot pass from here: as in a fill
                    failed[verdict.job.i] = verdict.failed
        allowed: dict[int, bool] = {}
        for probe, job in pairs:
            reason = failed.get(probe.i)
            if reason is not None:
                answers.fail(job.i, job.seq, reason)
                refusals["schema_invalid"] += 1
                continue
            t = int(job.tokens[0])
            row = out[probe.i]
            allowed[job.i] = t < self.engine.width and bool((int(row[t >> 5]) >> (t & 31)) & 1)
        return allowed

    # -- phase 5: consuming -----------------------------------------------------------------------
    def _consume(self, consume: list[Fill], fill: list[Fill], answers: StepAnswers, refusals,
                 block: PlainBlock | None = None) -> None:
        """Every entry's tokens in one engine call, one flat array (a plain block's after the others')."""
        if not consume and block is None:
            return
        matchers = [a.matcher for a in consume]
        tokens = [t for a in consume for t in a.tokens]
        counts: list[int] | None = None
        if any(len(a.tokens) != 1 for a in consume):     # not the decode step's one token each
            counts = [len(a.tokens) for a in consume]
        if block is not None:
            matchers += block.matchers
            tokens += block.tokens
            if counts is not None:
                counts += [1] * len(block)
        try:
            reasons: list = self.engine.consume_batch(matchers, tokens, counts)
        except Exception:   # find the sequence the engine chokes on; the others carry on
            reasons = []
            for m, t in zip(matchers, split_tokens(tokens, counts)):
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
                answers.fault(adv.i, seq, "consuming tokens", reason, refusals)
            elif reason is None:
                seq.accepted += len(adv.tokens)
                if seq.entry.drafting:
                    self._learn(seq, adv.tokens)
                fill.append(adv)
            else:
                refusals["token_rejected"] += 1
                answers.fail(adv.i, seq, f"token rejected: {reason}")

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

    def _propose(self, fill: list[Fill], answers: StepAnswers, refusals) -> list[Fill]:
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
                    answers.fault(job.i, seq, "proposing drafts", exc, refusals)
                    continue
                job.drafts = tuple(seq.proposal.drafts)
                answers.proposed[job.i] = job.drafts
            kept.append(job)
        return kept

    # -- phase 6: filling -------------------------------------------------------------------------
    def _fill(self, fill: list[Fill], replays: list[AnswerReplay], answers: StepAnswers, want_forced: bool, refusals,
              block: PlainBlock | None = None) -> tuple[np.ndarray, Callable[[], None] | None]:
        """Rows in entry order (SeqStep entries first, then columnar ones by index): filled by the
        engine in one call (a plain block's after the others', then put in entry order where they
        interleave), or copied from the kept answer of a repeat. Entries that ask for drafts get
        them proposed first (drafts.py)."""
        fill = self._propose(fill, answers, refusals)
        jobs: list[Fill | AnswerReplay] = [*fill, *replays]
        jobs.sort(key=_entry_index)
        n_rows = sum(job.kept[0].num_rows[job.kept[1]] if isinstance(job, AnswerReplay)
                     else (not job.unmasked) + len(job.drafts) for job in jobs)
        if block is not None:
            n_rows += len(block)
        buffer, generation, out = (self.buffers.take(n_rows) if fill or block is not None
                                   else (-1, 0, self.engine.allocate(n_rows)))
        answers.buffer, answers.generation = buffer, generation
        if buffer < 0:
            answers.rows = out
        first_row, num_rows = answers.first_row, answers.num_rows
        handles: list[int] = []                     # whose rows this step fills: (handle, step)
        steps: list[int] = []
        filled: list[Fill] = []
        first_rows, drafts = [], []
        row = 0
        any_drafts = False
        for job in jobs:
            i = job.i
            if isinstance(job, AnswerReplay):            # a repeat whose kept answer has its rows
                answers.copy_answer(i, *job.kept)
                n = num_rows[i]
                if n:
                    first_row[i] = row
                    out[row:row + n] = self.buffers.rows_of(job.kept)
                    row += n
                continue
            seq, d, m = job.seq, job.drafts, job.matcher
            try:
                stopped = m.is_stopped()
                accepting = stopped or m.is_accepting()
                drafts_valid = m.validate(d) if d else 0
                forced = m.forced_tokens() if want_forced and not stopped else ()
            except Exception as exc:   # an engine fault costs this sequence only (and gets no rows)
                answers.fault(i, seq, "reading the grammar state", exc, refusals)
                continue
            seq.finished = stopped
            answers.set_status(i, FINISHED if stopped else READY, accepting)
            if forced:
                answers.forced[i] = list(forced)
            if job.repeat_of is not None:           # a repeat filled again: its answer is this one now
                answers.copy_inputs(i, *job.repeat_of)
                keep_answer(seq, seq.step, (answers, i))
            if job.unmasked:                        # its sampled token passed the check: no row
                continue
            first_row[i] = row
            num_rows[i] = 1 + len(d)
            if d:
                any_drafts = True
                answers.drafts_valid[i] = drafts_valid
            if buffer >= 0:                         # the ring keeps a record of whose rows it holds
                handles.append(seq.handle)
                steps.append(seq.step)
            filled.append(job)
            first_rows.append(row)
            drafts.append(d)
            row += 1 + len(d)
        block_matchers: list = []
        if block is not None:
            block_matchers, block_rows = block.read_states(row, want_forced, refusals)
            row += len(block_rows)
            first_rows += block_rows
            if any_drafts:
                drafts += [()] * len(block_rows)
        if filled or block_matchers:
            probes = filled + block.probed if block is not None else filled
            checking = self.checks.start(answers, probes) if self.checks.live and probes else None
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
                        answers.fault(adv.i, adv.seq, "filling its mask", exc, refusals)
                if block is not None:
                    for i, m, seq in zip(block.index, block.matchers, block.seqs):
                        if num_rows[i]:
                            r = first_row[i]
                            try:
                                self.engine.fill_batch([m], [r], None, out)
                            except Exception as exc:
                                failed[r] = True
                                answers.fault(i, seq, "filling its mask", exc, refusals)
                if failed.any():   # the failed entries' rows go: the columnar rows must stay dense
                    row = _drop_rows(out, failed, answers)
            if checking is not None:
                failed = np.zeros(row, dtype=bool)
                for verdict in self.checks.finish(checking, out):
                    i = verdict.job.i
                    if verdict.failed and num_rows[i]:      # the document cannot pass: its rows go too
                        failed[first_row[i]: first_row[i] + num_rows[i]] = True
                    self._apply_verdict(verdict, answers, refusals)
                if failed.any():
                    row = _drop_rows(out, failed, answers)
        if block is not None and block.others:   # a block's rows and other columnar entries' interleave
            _entry_order(out, answers)
        out = out[:row]
        if buffer < 0:
            return out, None
        if block is not None:
            block_handles, block_steps = block.kept_rows()
            handles, steps = (handles + block_handles, steps + block_steps) if handles else (block_handles, block_steps)
        self.buffers.record(buffer, handles, steps)
        return out, self.buffers.encoding(buffer)

    @staticmethod
    def _apply_verdict(verdict: Verdict, answers: StepAnswers, refusals) -> None:
        """Complete mode's verdict on one checked entry (json_schema/step_checks.py) into its answer
        and sequence (its rows are edited already)."""
        i = verdict.job.i
        if verdict.failed:
            answers.fail(i, verdict.job.seq, verdict.failed)
            refusals["schema_invalid"] += 1
            return
        if verdict.no_eos:
            answers.clear_accepting(i)
        if verdict.drafts_valid is not None:
            answers.drafts_valid[i] = verdict.drafts_valid

    def _kept_answer(self, handle: int, step: int) -> Kept | None:
        """The answer a live sequence keeps for a step (the ring must not lose its rows)."""
        seq = self.by_handle.get(handle)
        return None if seq is None or seq.closed else seq.kept(step)


# -- rows ----------------------------------------------------------------------------------------
def _drop_rows(out: np.ndarray, dropped: np.ndarray, answers: StepAnswers) -> int:
    """Removes rows from the front of ``out`` (moving the others up, each entry's first row fixed);
    returns how many rows are left. The entries whose rows were dropped have none any more."""
    before = np.cumsum(dropped) - dropped          # rows dropped before each row
    first_row, num_rows = answers.first_row, answers.num_rows
    for i, n in enumerate(num_rows):
        if n:
            first_row[i] -= int(before[first_row[i]])
    kept = out[:len(dropped)][~dropped]
    out[:len(kept)] = kept
    return len(kept)


def _entry_order(out: np.ndarray, answers: StepAnswers) -> None:
    """Puts the step's rows in entry order (the wire's order): a plain block's rows were filled
    after the other entries', and some of those are columnar entries among the block's."""
    first_row, num_rows = answers.first_row, answers.num_rows
    source: list[int] = []
    for i, n in enumerate(num_rows):
        if n:
            first = first_row[i]
            first_row[i] = len(source)
            source.extend(range(first, first + n))
    if source != list(range(len(source))):
        out[:len(source)] = out[source]


def _entry_index(job: Fill | AnswerReplay) -> int:
    """Rows go in entry order: SeqStep entries first, then columnar ones (the columnar rows stay dense)."""
    return job.i
