"""One step's answers as columns: the one record of what each entry of a step was answered.

Entry ``i`` of a step is the request's SeqStep entry ``i`` for ``i < named``, else its columnar
entry ``i - named``; that is the order of the step's rows too. Every phase of the step protocol
(step_routing.py, session.py, plain_block.py) answers through this record: one ``refuse`` (the
entry is refused, its sequence unchanged), one ``fail`` (its sequence fails and stays failed) and
plain writes to the columns; the reply is written from it by entries.write_answers, the one
writer of answers.

A sequence keeps ``(answers, i)`` as the answer of each recent step (sequence.py ``keep_answer``),
so a repeat of that step (a tensor-parallel rank that lags, a retry) reads this same record: the
inputs the step asked with (a repeat with other inputs is a divergence), the answer, and the
rows while the session's ring of row buffers holds them (row_buffers.py), or packed out of it.
Nothing here holds a sequence or a matcher: a kept answer never makes a cycle for the collector.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from maskd.v1.contract import ACCEPTING_BIT, RESAMPLE_BIT, STATUS_MASK, Code, SeqStatus

log = logging.getLogger("maskd.server.session")
_NO_INPUTS: tuple = ((), 0, 0, False)        # drafts, rollback, propose, unmasked


class StepAnswers:
    """Every entry's answer to one step (see the module's docstring). Columns: ``status`` (the
    packed status byte of the wire's ``statuses``: SeqStatus | accepting | resample),
    ``first_row``/``num_rows`` (its rows in the step's rows), and by index where an entry has one:
    ``problems`` (code, reason of an ERROR or FAILED entry), ``forced``, ``drafts_valid``,
    ``proposed``, ``handles`` (the handle an open was answered with). The inputs: ``tokens`` (a
    tuple, or one int for a decode step's one token) and ``extras`` ((drafts, rollback, propose,
    unmasked) where any is set). The rows: a ring buffer and its generation, ``rows`` (the step's
    own array when no buffer was free), ``packed`` (entries whose rows the ring packed out)."""
    __slots__ = ("buffer", "drafts_valid", "extras", "first_row", "forced", "generation", "handles", "named",
                 "num_rows", "packed", "problems", "proposed", "rows", "seq_ids", "status", "steps", "tokens")

    def __init__(self, n: int, named: int = 0, seq_ids: list[str] | None = None,
                 steps: list[int] | None = None) -> None:
        self.named = named
        self.seq_ids = seq_ids if seq_ids is not None else []   # the SeqStep entries' (columnar ones go by handle)
        self.steps = steps if steps is not None else []         # the SeqStep entries'
        self.status = bytearray(n)
        self.first_row = [0] * n
        self.num_rows = [0] * n
        self.problems: dict[int, tuple[int, str]] = {}
        self.forced: dict[int, list[int]] = {}
        self.drafts_valid: dict[int, int] = {}
        self.proposed: dict[int, tuple[int, ...]] = {}
        self.handles: dict[int, int] = {}
        self.tokens: list[Any] = [()] * n
        self.extras: dict[int, tuple] = {}
        self.buffer = -1
        self.generation = 0
        self.rows: np.ndarray | None = None
        self.packed: dict[int, bytes] | None = None

    def __len__(self) -> int:
        return len(self.status)

    # -- the answer ---------------------------------------------------------------------------------
    def status_of(self, i: int) -> SeqStatus:
        return SeqStatus(self.status[i] & STATUS_MASK)

    def set_status(self, i: int, status: int, accepting: bool = False) -> None:
        self.status[i] = status | (ACCEPTING_BIT if accepting else 0) | (self.status[i] & RESAMPLE_BIT)

    def accepting(self, i: int) -> bool:
        return bool(self.status[i] & ACCEPTING_BIT)

    def clear_accepting(self, i: int) -> None:
        self.status[i] &= ~ACCEPTING_BIT & 0xFF

    def resample(self, i: int) -> bool:
        return bool(self.status[i] & RESAMPLE_BIT)

    def set_resample(self, i: int) -> None:
        self.status[i] |= RESAMPLE_BIT

    def refuse(self, i: int, refusals, code: Code, message: str, kind: str | None = None) -> None:
        """Entry i is refused (its sequence unchanged): ERROR with the code and reason, counted by kind."""
        self.status[i] = SeqStatus.ERROR
        self.problems[i] = (code, message)
        refusals[kind or code.name.lower()] += 1

    def fail(self, i: int, seq: Any, reason: str, code: Code = Code.INVALID_ARGUMENT) -> None:
        """Entry i's sequence fails (``SequenceState.fail``: it answers so from now on) and the
        entry says so: FAILED with the reason, no rows, no forced tokens."""
        seq.fail(reason, code)
        self.status[i] = SeqStatus.FAILED
        self.problems[i] = (code, reason)
        self.num_rows[i] = 0
        self.forced.pop(i, None)
        self.drafts_valid.pop(i, None)

    def fault(self, i: int, seq: Any, doing: str, exc: BaseException, refusals) -> None:
        """An engine fault on entry i's sequence: logged and counted, and that sequence fails
        (INTERNAL, with the reason); nothing else does."""
        log.error("sequence %r: engine fault while %s", seq.seq_id, doing, exc_info=exc)
        refusals["internal"] += 1
        self.fail(i, seq, internal_reason(doing, exc), Code.INTERNAL)

    def copy_answer(self, i: int, src: StepAnswers, k: int) -> None:
        """``src``'s answer k (a kept one) as entry i's answer; its rows' place is the caller's."""
        self.status[i] = src.status[k]
        problem = src.problems.get(k)
        if problem is not None:
            self.problems[i] = problem
        self.num_rows[i] = src.num_rows[k]
        forced = src.forced.get(k)
        if forced is not None:
            self.forced[i] = list(forced)
        for mine, theirs in ((self.drafts_valid, src.drafts_valid), (self.handles, src.handles)):
            if k in theirs:
                mine[i] = theirs[k]
        if k in src.proposed:
            self.proposed[i] = src.proposed[k]

    # -- the inputs ---------------------------------------------------------------------------------
    def set_inputs(self, i: int, tokens: Any, drafts: tuple = (), rollback: int = 0, propose: int = 0,
                   unmasked: bool = False) -> None:
        self.tokens[i] = tokens if type(tokens) is int else tuple(tokens)
        if drafts or rollback or propose or unmasked:
            self.extras[i] = (tuple(drafts), rollback, propose, unmasked)

    def copy_inputs(self, i: int, src: StepAnswers, k: int) -> None:
        self.tokens[i] = src.tokens[k]
        extras = src.extras.get(k)
        if extras is not None:
            self.extras[i] = extras
        else:
            self.extras.pop(i, None)

    def inputs(self, i: int) -> tuple:
        """(drafts, rollback, propose, unmasked) that entry i asked with."""
        return self.extras.get(i, _NO_INPUTS)

    def same_inputs(self, i: int, entry: Any, *, tokens: bool = True) -> bool:
        """Whether ``entry`` asks what entry i asked (``tokens`` False: its drafts and flags only,
        for a restore part, whose tokens are compared by their digest)."""
        drafts, rollback, propose, unmasked = self.extras.get(i, _NO_INPUTS)
        if entry.drafts != drafts or entry.propose != propose or entry.unmasked != unmasked:
            return False
        if not tokens:
            return True
        mine = self.tokens[i]
        asked = entry.tokens
        if type(mine) is int:
            return len(asked) == 1 and asked[0] == mine and entry.rollback == rollback
        return tuple(asked) == mine and entry.rollback == rollback

    def detached(self, i: int) -> StepAnswers:
        """Entry i alone (its inputs and answer, no rows): what a sequence polling a compiling
        grammar keeps for each of its many WAITING steps, without holding those steps' records."""
        one = StepAnswers(1)
        one.copy_inputs(0, self, i)
        one.copy_answer(0, self, i)
        one.num_rows[0] = 0
        return one

    # -- the rows -------------------------------------------------------------------------------------
    def pack(self, i: int, packed: bytes) -> None:
        """Entry i's rows, packed by the row codec (the ring took their buffer back)."""
        if self.packed is None:
            self.packed = {}
        self.packed[i] = packed

    def rows_filled(self) -> int:
        return sum(self.num_rows)


def internal_reason(doing: str, exc: BaseException) -> str:
    """What a sequence that an engine fault ended answers (the fault itself goes to the log)."""
    return f"internal error while {doing}: {type(exc).__name__}: {str(exc)[:200]}"


def unanswered() -> StepAnswers:
    """What a sequence whose open was refused before its step applied answers (nothing was asked)."""
    answers = StepAnswers(1)
    answers.status[0] = SeqStatus.WAITING
    return answers
