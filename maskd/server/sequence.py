"""One sequence's server-side state and the answers it keeps for repeats.

A sequence is a pure function of (grammar, accepted tokens); besides its matcher it remembers
what its recent steps were answered (step_answers.py), so that a tensor-parallel rank that lags behind
the others, or retries, gets the answer every rank got. The step protocol (session.py) changes
these; nothing here knows of requests or engines' batching.
"""
from __future__ import annotations

from maskd.server.drafts import Proposal
from maskd.server.engines import Matcher
from maskd.server.entries import Entry
from maskd.server.grammar_cache import CacheEntry
from maskd.server.step_answers import StepAnswers, unanswered
from maskd.v1.contract import STATUS_MASK, Code, GrammarState, SeqStatus

# A kept answer: (the answers of the step it was given in, the entry's index there).
Kept = tuple[StepAnswers, int]

# Answers kept per sequence for repeats of older steps (a tensor-parallel rank that lags behind
# the others by a step or two, or retries one), and closed sequences kept with their last answers
# so that a rank whose last steps arrive after another rank's close still gets them.
RECENT_STEPS = 4
CLOSED_KEPT = 1024
CLOSED_STEPS = 2
# WAITING answers are kept while a grammar compiles; this bounds them per sequence.
MAX_KEPT_ANSWERS = 4096


class SequenceState:
    """Server-side state of one sequence; a pure function of (grammar, accepted tokens)."""
    __slots__ = (
        "accepted",
        "closed",
        "dead_code",
        "dead_reason",
        "doc",
        "entry",
        "finished",
        "handle",
        "matcher",
        "parts",
        "pending",
        "proposal",
        "proposal_step",
        "recent",
        "seq_id",
        "step",
        "tail",
    )

    def __init__(self, seq_id: str, entry: CacheEntry, step: int, handle: int) -> None:
        self.seq_id = seq_id
        self.handle = handle           # names it in columnar steps of its session
        self.entry = entry
        self.matcher: Matcher | None = None
        self.doc = None                # complete JSON-schema mode: the output the validator checks
        self.step = step               # last step applied
        self.accepted = 0              # tokens the matcher consumed (bounds rollback)
        self.pending: list[int] = []   # tokens received while the grammar compiled
        self.dead_reason = ""          # set once the sequence failed
        self.dead_code = Code.INVALID_ARGUMENT
        self.finished = False
        # Opening parts received at the current step: history offset -> hash of their tokens.
        self.parts: dict[int, int] | None = None
        # The answers of the last RECENT_STEPS steps and of every step answered WAITING, so that a
        # rank that lags behind the others, or retries, gets the answer every rank got: each one
        # (that step's answers, the entry's index there): step_answers.py.
        self.recent: dict[int, Kept] = {}
        self.closed = False
        # Grammar drafts (drafts.py): the last tokens accepted (what a guess is conditioned on), and
        # the drafts proposed at step ``proposal_step`` (a repeat of that step gets them again).
        self.tail: tuple[int, ...] = ()
        self.proposal: Proposal | None = None
        self.proposal_step = -1

    @property
    def history_length(self) -> int:
        return self.accepted + len(self.pending)

    @property
    def waiting(self) -> bool:
        return self.entry.state is GrammarState.COMPILING

    def last_answer(self) -> Kept:
        """The answer of the step the sequence is at: that step's inputs and the readiness decided
        for it (``UNANSWERED`` while its open's step was refused before it applied)."""
        kept = self.recent.get(self.step)
        return UNANSWERED if kept is None else kept

    def fail(self, reason: str, code: Code) -> None:
        """The one way a sequence fails (it stays failed): the reason it answers from now on, and no
        matcher or document any more."""
        self.dead_reason = reason
        self.dead_code = code
        self.matcher = self.doc = None

    def kept(self, step: int) -> Kept | None:
        """The answer kept for a step: (that step's answers, the entry's index there)."""
        return self.recent.get(step)


#: What a sequence whose open was refused before its step applied answers (nothing was asked).
UNANSWERED: Kept = (unanswered(), 0)


def record_step(seq: SequenceState, msg: Entry, answers: StepAnswers) -> None:
    """Makes entry ``msg`` the sequence's last step: its inputs go into its answer, which the
    sequence keeps."""
    i = msg.index
    answers.set_inputs(i, msg.tokens, msg.drafts, msg.rollback, msg.propose, msg.unmasked)
    keep_answer(seq, msg.step, (answers, i))


def keep_answer(seq: SequenceState, step: int, answer: Kept) -> None:
    """The one record of a step: ``step`` becomes the sequence's last and ``answer`` (a step's
    answers and the entry's index there) its answer, which also holds the step's inputs."""
    if step != seq.step:
        seq.parts = None          # restore parts are remembered only at the step they restored
    seq.step = step
    # Older answers beyond the window go, except WAITING ones: steps that poll a compiling grammar
    # come as fast as a rank sends them, so the ranks' lag in steps is not bounded there (those
    # answers are small, and end with the compile).
    recent = seq.recent
    recent[step] = answer
    old = recent.get(step - RECENT_STEPS)
    if old is not None and old[0].status[old[1]] & STATUS_MASK != SeqStatus.WAITING:
        del recent[step - RECENT_STEPS]
    if len(recent) > MAX_KEPT_ANSWERS:
        del recent[next(iter(recent))]


def digest(tokens) -> int:
    """What a restore part is remembered by: the hash of its tokens."""
    return hash(tuple(tokens))
