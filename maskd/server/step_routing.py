"""The step protocol's first two phases: which entries are admitted and what each does to its sequence.

Phase 1, admission: the request's size, duplicate entries and token ids; refused entries change
nothing. Phase 2, routing: closes, repeats (idempotency: a tensor-parallel rank that lags, a
retry), opens and restores in parts, step order. What comes out is the entries that move their
sequence (for the engine phases in session.py), the repeats answered from the unchanged state
(``Fill`` with no tokens) and the repeats whose kept answer still has its rows (``AnswerReplay``).

``StepRouter`` is the session's (session.py) collaborator for these phases: it keeps the session's
table of sequences (``seqs``, ``by_handle``, ``closed``), opens and closes them, and knows nothing
of the engines' batching.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from maskd.server.config import Limits
from maskd.server.engines import Engine, Matcher
from maskd.server.entries import Entry
from maskd.server.grammar_cache import CacheEntry, GrammarCache, QueueFull
from maskd.server.quotas import Quotas
from maskd.server.row_buffers import RowBuffers
from maskd.server.sequence import CLOSED_KEPT, CLOSED_STEPS, RECENT_STEPS, Kept, SequenceState, digest
from maskd.server.step_answers import StepAnswers
from maskd.specs import GrammarSpec, SpecError
from maskd.v1.contract import Code, SeqStatus

READY, WAITING, FAILED, FINISHED, CLOSED = (
    SeqStatus.READY, SeqStatus.WAITING, SeqStatus.FAILED, SeqStatus.FINISHED, SeqStatus.CLOSED)


@dataclasses.dataclass(slots=True)
class Fill:
    """An entry (its index in the step) whose sequence moves (or repeats its last step) and whose
    matcher fills its rows."""
    i: int
    seq: SequenceState
    matcher: Matcher
    tokens: Sequence[int] = ()
    drafts: tuple = ()
    propose: int = 0        # drafts the server proposes (the fill phase sets ``drafts`` to them)
    unmasked: bool = False  # tokens sampled without a row: checked, and no row when they pass
    repeat_of: Kept | None = None   # a repeat filled again: the answer it repeats (whose inputs it keeps)


@dataclasses.dataclass(slots=True)
class AnswerReplay:
    """A repeat (entry ``i``) whose kept answer still has its rows: they are copied, not filled again."""
    i: int
    kept: Kept


class StepRouter:
    """Admission and routing of a session's steps, over the session's table of sequences, which it
    keeps: the open ones by id (``seqs``) and by handle (``by_handle``, closed ones too while their
    last answers are kept), and the closed ones with their last answers (``closed``)."""

    def __init__(self, engine: Engine, cache: GrammarCache, limits: Limits, buffers: RowBuffers, *, tenant: str = "",
                 quotas: Quotas | None = None) -> None:
        self.engine, self.cache, self.limits, self.buffers = engine, cache, limits, buffers
        self.tenant, self.quotas = tenant, quotas
        self.vocab_limit = engine.width
        self.seqs: dict[str, SequenceState] = {}
        self.by_handle: dict[int, SequenceState] = {}
        # Closed sequences whose last answers are kept (id -> state), oldest first.
        self.closed: collections.OrderedDict[str, SequenceState] = collections.OrderedDict()
        self._handles = 0

    # -- phase 1: admission -----------------------------------------------------------------------
    def admit(self, entries: list[Entry], answers: StepAnswers, refusals) -> list[Entry]:
        """The entries (SeqStep or columnar) that pass the request's and their own limits; the
        others are refused."""
        n = len(entries)
        total_rows = n
        if n * (1 + self.limits.max_draft_tokens) > self.limits.max_rows_per_step:
            total_rows += sum(len(m.drafts) + m.propose for m in entries)
        if total_rows > self.limits.max_rows_per_step:
            for m in entries:
                answers.refuse(m.index, refusals, Code.RESOURCE_EXHAUSTED,
                               f"step asks for {total_rows} rows; the limit is {self.limits.max_rows_per_step}")
            return []
        if n * (self.limits.max_tokens_per_step + self.limits.max_draft_tokens) > self.limits.max_tokens_per_request:
            tokens = sum(len(m.tokens) + len(m.drafts) for m in entries)
            if tokens > self.limits.max_tokens_per_request:
                for m in entries:
                    answers.refuse(m.index, refusals, Code.RESOURCE_EXHAUSTED,
                                   f"step carries {tokens} tokens; the limit is {self.limits.max_tokens_per_request} "
                                   "(--max-tokens-per-request)")
                return []
        admitted = []
        seen: set[str] = set()
        for msg in entries:
            sid = msg.seq_id
            if sid in seen:
                answers.refuse(msg.index, refusals, Code.INVALID_ARGUMENT,
                               f"sequence {sid!r} appears twice in one step")
                continue
            seen.add(sid)
            problem = self._check_tokens(msg)
            if problem:
                answers.refuse(msg.index, refusals, Code.INVALID_ARGUMENT, problem)
                continue
            admitted.append(msg)
        return admitted

    def _check_tokens(self, msg: Entry) -> str:
        tokens = msg.tokens
        n_drafts = len(msg.drafts)
        if msg.unmasked:
            if n_drafts or msg.propose:
                return "sampled_unmasked tokens are checked one step at a time: not with draft_tokens or propose_drafts"
            if len(tokens) > 1:
                return (f"{len(tokens)} sampled_unmasked tokens in one step; a step checks one (the token "
                        "sampled for the next position)")
        if msg.propose:
            if n_drafts:
                return "a step either carries draft tokens or asks for proposed ones (propose_drafts), not both"
            if msg.propose > self.limits.max_draft_tokens:
                return f"propose_drafts {msg.propose}; the limit is {self.limits.max_draft_tokens}"
        if not n_drafts:
            n = len(tokens)
            if n == 0 or (n == 1 and 0 <= tokens[0] < self.vocab_limit):  # the decode-step case
                return ""
        if n_drafts > self.limits.max_draft_tokens:
            return f"{n_drafts} draft tokens; the limit is {self.limits.max_draft_tokens}"
        if len(tokens) > self.limits.max_tokens_per_step:
            return (f"{len(tokens)} tokens in one step; the limit is {self.limits.max_tokens_per_step} "
                    "(a longer restore goes in parts: see history_offset)")
        lo = min(min(tokens, default=0), min(msg.drafts, default=0))
        hi = max(max(tokens, default=0), max(msg.drafts, default=0))
        if lo < 0 or hi >= self.vocab_limit:
            bad = [t for t in [*tokens, *msg.drafts] if t < 0 or t >= self.vocab_limit]
            return (f"token ids {bad[:8]} are outside the vocabulary of {self.vocab_limit} ids "
                    f"(tokenizer {self.engine.tokenizer.spec})")
        return ""

    # -- phase 2: routing -------------------------------------------------------------------------
    def route(self, admitted: list[Entry], answers: StepAnswers, refusals,
              replays: list[AnswerReplay]) -> tuple[list, list[Fill]]:
        """Closes, repeats, opens and order checks. Returns the entries that move their sequence
        ((entry, seq, tokens)) and the repeats that are answered from the unchanged state;
        repeats with a kept answer go to ``replays``."""
        moving: list = []
        repeats: list[Fill] = []
        refuse = answers.refuse
        for msg in admitted:
            sid, i = msg.seq_id, msg.index
            # A columnar entry names its sequence by handle (which outlives a reuse of the id).
            seq: SequenceState | None = msg.seq if msg.seq is not None else self.seqs.get(sid)
            opening = msg.opens is not None
            if seq is None and sid in self.closed:
                if opening:
                    self._drop_closed(sid)          # the id opens anew (a rank that lags re-derives the rows)
                else:
                    seq = self.closed[sid]
            if seq is not None and seq.closed:
                if msg.close:
                    answers.status[i] = CLOSED      # another rank closed it already
                elif not self._replay(msg, answers, seq, replays, refusals):
                    refuse(i, refusals, Code.NOT_FOUND,
                           f"sequence {sid!r} is closed; its step {msg.step} is not among its last "
                           f"{CLOSED_STEPS} steps, or their rows are gone (kept until the session's row "
                           "buffers come round)")
                continue
            if seq is not None and msg.step < seq.step and not msg.close and not msg.history_offset:
                if not self._replay(msg, answers, seq, replays, refusals):
                    if opening:
                        refuse(i, refusals, Code.ALREADY_EXISTS,
                               f"sequence {sid!r} is already open (at step {seq.step}); close it first")
                    else:
                        refuse(i, refusals, Code.FAILED_PRECONDITION,
                               f"step {msg.step} of sequence {sid!r} is out of order: the last applied step "
                               f"is {seq.step}, so the next is {seq.step + 1} (repeats are answered for the "
                               f"last {RECENT_STEPS} steps)")
                continue
            if msg.close:
                if seq is None:
                    refuse(i, refusals, Code.NOT_FOUND, f"cannot close unknown sequence {sid!r}")
                else:
                    self._forget(sid)
                    answers.status[i] = CLOSED
                continue
            if seq is not None and msg.step == seq.step:
                if opening:
                    self._route_reopen(msg, answers, seq, moving, repeats, replays, refusals)
                else:
                    last, k = seq.last_answer()
                    if last.same_inputs(k, msg):
                        self._answer_repeat(i, answers, seq, repeats, replays)
                    else:
                        self._divergence(msg, answers, seq, refusals)
                continue
            if opening:
                if seq is not None:
                    refuse(i, refusals, Code.ALREADY_EXISTS,
                           f"sequence {sid!r} is already open (at step {seq.step}); close it first")
                    continue
                seq = self._open(msg, answers, refusals)
                if seq is not None:
                    moving.append((msg, seq, msg.tokens))
                continue
            if seq is None:
                refuse(i, refusals, Code.NOT_FOUND,
                       f"unknown sequence {sid!r}: never opened on this session, closed, "
                       "or dropped with its stream; open it with a grammar at step 0")
            elif msg.step != seq.step + 1:
                refuse(i, refusals, Code.FAILED_PRECONDITION,
                       f"step {msg.step} of sequence {sid!r} is out of order: the last applied "
                       f"step is {seq.step}, so the next is {seq.step + 1}")
            else:
                moving.append((msg, seq, msg.tokens))
        return moving, repeats

    def _route_reopen(self, msg: Entry, answers: StepAnswers, seq: SequenceState, moving: list, repeats: list,
                      replays: list, refusals) -> None:
        """An opening entry at the step the sequence is at: a repeat of the open (another rank, a
        retry) or the next part of a restore (history_offset)."""
        i = msg.index
        if seq.entry.grammar_id != self._open_grammar_id(msg):
            answers.refuse(i, refusals, Code.ALREADY_EXISTS,
                           f"sequence {msg.seq_id!r} is already open with grammar {seq.entry.grammar_id}")
            return
        answers.handles[i] = seq.handle
        offset = msg.history_offset
        known = seq.parts.get(offset) if seq.parts is not None else None
        if known is not None:
            last, k = seq.last_answer()
            if known == digest(msg.tokens) and last.same_inputs(k, msg, tokens=False):
                self._answer_repeat(i, answers, seq, repeats, replays)
            else:
                self._divergence(msg, answers, seq, refusals)
        elif seq.parts is not None and offset == seq.history_length and offset > 0 and msg.tokens:
            seq.parts[offset] = digest(msg.tokens)
            moving.append((msg, seq, msg.tokens))
        else:
            answers.refuse(i, refusals, Code.FAILED_PRECONDITION,
                           f"restore part of sequence {msg.seq_id!r} at history offset {offset}, but the server "
                           f"holds {seq.history_length} tokens of it at step {seq.step}")

    def _open(self, msg: Entry, answers: StepAnswers, refusals) -> SequenceState | None:
        sid, i = msg.seq_id, msg.index
        if msg.history_offset:
            answers.refuse(i, refusals, Code.FAILED_PRECONDITION,
                           f"restore part of unknown sequence {sid!r} at history offset {msg.history_offset}: "
                           "the part at offset 0 opens it")
            return None
        if len(self.seqs) >= self.limits.max_sequences_per_session:
            answers.refuse(i, refusals, Code.RESOURCE_EXHAUSTED,
                           f"session holds {len(self.seqs)} sequences; the limit is "
                           f"{self.limits.max_sequences_per_session}")
            return None
        entry, code, problem = self._open_entry(msg)
        if entry is None:
            answers.refuse(i, refusals, code, problem)
            return None
        if self.quotas is not None:
            over = self.quotas.open_sequence(self.tenant)
            if over:
                answers.refuse(i, refusals, Code.RESOURCE_EXHAUSTED, over)
                return None
        self._handles += 1
        seq = SequenceState(sid, entry, msg.step, self._handles)
        seq.parts = {0: digest(msg.tokens)}
        self.seqs[sid] = seq
        self.by_handle[seq.handle] = seq
        answers.handles[i] = seq.handle
        return seq

    def _open_grammar_id(self, msg: Entry) -> str:
        if msg.opens == "grammar_id":
            return msg.grammar_id
        try:
            return self.cache.grammar_id(GrammarSpec.from_proto(msg.spec))
        except SpecError:
            return ""

    def _open_entry(self, msg: Entry) -> tuple[CacheEntry | None, Code, str]:
        if msg.opens == "grammar_id":
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

    def _replay(self, msg: Entry, answers: StepAnswers, seq: SequenceState, replays: list, refusals) -> bool:
        """A repeat of an older step (a rank that lags, a retry, a step of a closed sequence): the
        answer it had, or a divergence when its inputs differ. False when that answer is gone."""
        kept = seq.kept(msg.step)
        if kept is None or not self.buffers.holds(kept):
            return False
        if msg.opens is not None and seq.entry.grammar_id != self._open_grammar_id(msg):
            answers.refuse(msg.index, refusals, Code.ALREADY_EXISTS,
                           f"sequence {msg.seq_id!r} is already open with grammar {seq.entry.grammar_id}")
        elif not kept[0].same_inputs(kept[1], msg):
            self._divergence(msg, answers, seq, refusals)
        else:
            replays.append(AnswerReplay(msg.index, kept))
        return True

    def _answer_repeat(self, i: int, answers: StepAnswers, seq: SequenceState, repeats: list[Fill],
                       replays: list) -> None:
        """A repeat is answered from the unchanged state; readiness is the one decided before. The
        rows come from the kept answer when they are still there (no second fill)."""
        kept = seq.last_answer()
        last, k = kept
        status = last.status_of(k)
        drafts, _, propose, unmasked = last.inputs(k)
        if status in (READY, FINISHED) and (last.num_rows[k] or unmasked) and self.buffers.holds(kept):
            replays.append(AnswerReplay(i, kept))
        elif status == FAILED:
            answers.fail(i, seq, seq.dead_reason, seq.dead_code)
        elif status == WAITING or seq.matcher is None:
            answers.status[i] = WAITING
        else:   # filled again from the unchanged state (a refused sampled_unmasked token keeps its flag)
            resample = last.resample(k)
            if resample:
                answers.set_resample(i)
            repeats.append(Fill(i, seq, seq.matcher, (), drafts, propose, unmasked and not resample, kept))

    @staticmethod
    def _divergence(msg: Entry, answers: StepAnswers, seq: SequenceState, refusals) -> None:
        # Says where, never what: the tokens of a sequence are its owner's business.
        answers.refuse(msg.index, refusals, Code.ABORTED,
                       f"divergence: step {msg.step} of sequence {seq.seq_id!r} was already applied with other "
                       "inputs", kind="divergence")

    # -- closes --------------------------------------------------------------------------------------
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
