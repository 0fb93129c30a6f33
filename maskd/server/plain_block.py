"""The decode step's common case as arrays: a columnar part whose every entry is the next step of a
live, plain sequence, with one token.

Most steps of a running engine are exactly this: every sequence of the batch sampled one token from
the row it was given. ``entries.plain_columns`` reads such a columnar part off the wire and
``PlainBlock.of`` checks it against the session's sequences in one pass; the step protocol
(session.py) then consumes its tokens and fills its rows in the same engine calls as its other
entries, with no ``Entry``/``Result``/``Answer`` per sequence: statuses, problems and forced tokens
are arrays that ``entries.write_columnar`` (the one writer of columnar answers) puts in the reply.
Nothing here touches the protobuf types: entries.py is the step path's one module that does.

Plain means: its grammar compiled and its matcher made, no drafts learned or proposed, not failed,
not closed. A sequence's document (json_schema/step_checks.py: every JSON schema's finished
documents are validated, and a relaxed grammar's output is scanned as it grows) takes its token as
the per-entry path gives it; where it is checked this step (the grammar accepts, or its checker
scans), the check runs on a ``Fill`` made for that entry alone (``probes``) and its verdict comes
back into the block's arrays. A columnar part with any
entry out of the ordinary (an unknown handle, a repeat or a step out of order, a token outside the
vocabulary, a sampled_unmasked check, more than one token, a sequence also named by a SeqStep entry,
a request over the limits) goes through the per-entry phases instead: they are the exception path
of the same door, and answer every entry exactly as this one would.

Each sequence keeps ``(block, index)`` as its step's answer (``seq.recent[step]``); a repeat of that
step (a tensor-parallel rank that lags, a retry) or the ring of row buffers turns it into the
``Answer`` the per-entry path keeps (``SequenceState.kept``), so repeats are answered as before.
A repeat of the whole request (the same columnar bytes: what lockstep ranks send) is answered from
the block itself while every answer it gave is still kept (``Session._repeated_block``).
"""
from __future__ import annotations

import logging

import numpy as np

from maskd.server.entries import PlainColumns, Result
from maskd.server.json_schema import DocumentChecks
from maskd.server.sequence import Answer, SequenceState, internal_reason, keep_answer
from maskd.server.step_routing import Fill
from maskd.v1.contract import ACCEPTING_BIT, STATUS_MASK, Code, SeqStatus

log = logging.getLogger("maskd.server.session")
READY, WAITING, FAILED, FINISHED = SeqStatus.READY, SeqStatus.WAITING, SeqStatus.FAILED, SeqStatus.FINISHED
_NO_TOKENS: tuple[int, ...] = ()


class PlainBlock:
    """The columnar part of one step, every entry plain (see the module's docstring). Entry ``i`` is
    the request's columnar entry ``i``; ``status`` holds each one's packed status byte (the reply's
    ``statuses``), ``row`` its row in the step's rows (-1: none)."""
    __slots__ = ("buffer", "forced", "generation", "handles", "matchers", "probed", "problems", "row", "rows",
                 "seq_ids", "seqs", "status", "steps", "tokens")

    def __init__(self, seqs: list[SequenceState], matchers: list, handles: list[int], steps: list[int],
                 tokens: list[int]) -> None:
        self.seqs, self.matchers, self.handles, self.steps, self.tokens = seqs, matchers, handles, steps, tokens
        self.seq_ids: list[str] = []     # kept past the step, when ``seqs`` goes (see ``done``)
        n = len(seqs)
        self.status = bytearray(n)
        self.row = [-1] * n
        self.problems: dict[int, tuple[Code, str]] = {}
        self.forced: dict[int, list[int]] = {}
        self.buffer, self.generation = -1, 0
        self.rows: np.ndarray | None = None     # the step's rows when no ring buffer was free
        self.probed: list[tuple[int, Fill]] = []  # entries whose documents the fill phase checks

    def __len__(self) -> int:
        return len(self.handles)

    def done(self) -> None:
        """The step is over: the block keeps its answers, not its sequences or matchers (sequences
        keep it in their answers: holding them back would make cycles for the garbage collector)."""
        self.seq_ids = [seq.seq_id for seq in self.seqs]
        self.seqs, self.matchers, self.probed = [], [], []

    @classmethod
    def of(cls, columns: PlainColumns, session) -> PlainBlock | None:
        """The request's columnar part (read by entries.plain_columns) as a block, or None where any
        of it needs the per-entry phases."""
        handles, steps, tokens = columns.handles, columns.steps, columns.tokens
        n = len(handles)
        if min(tokens) < 0 or max(tokens) >= session.vocab_limit:
            return None
        limits = session.limits     # the request's limits, counted as the per-entry admission counts them
        if (n + columns.other_rows > limits.max_rows_per_step
                or n + columns.other_tokens > limits.max_tokens_per_request):
            return None
        named = set(handles)
        if len(named) != n:
            return None
        for sid in columns.other_ids:     # a sequence named twice goes where duplicates are refused
            other = session.seqs.get(sid)
            if other is not None and other.handle in named:
                return None
        seqs = list(map(session.by_handle.get, handles))
        for seq, step in zip(seqs, steps):
            if seq is None or seq.matcher is None or seq.step + 1 != step or seq.dead_reason or seq.entry.drafting:
                return None
        return cls(seqs, [seq.matcher for seq in seqs], handles, steps, tokens)

    # -- the engine phases (session.py calls these) ------------------------------------------------
    def consumed(self, reasons: list, refusals, checks: DocumentChecks) -> None:
        """The engine's answer to each entry's token: None (consumed), its reason, or an exception;
        documents take their tokens (an EOS ending one that does not pass is refused here)."""
        seqs, tokens, eos = self.seqs, self.tokens, checks.eos
        for i, reason in enumerate(reasons):
            if reason is None:
                doc = seqs[i].doc
                if doc is not None:
                    if tokens[i] in eos:
                        reason = checks.take(seqs[i], (tokens[i],))
                    else:
                        doc.append(tokens[i])
            if reason is None:
                seqs[i].accepted += 1
            elif isinstance(reason, Exception):
                self.fault(i, "consuming tokens", reason, refusals)
            else:
                self.fail(i, f"token rejected: {reason}", Code.INVALID_ARGUMENT)
                refusals["token_rejected"] += 1

    def read_states(self, first_row: int, want_forced: bool, refusals) -> tuple[list, list[int]]:
        """Each live entry's grammar state (finished, accepting, forced tokens) and its row from
        ``first_row`` on; every entry's answer kept for repeats. Returns the matchers and rows to fill."""
        matchers, rows = [], []
        status, row, problems = self.status, self.row, self.problems
        r = first_row
        for i, (seq, m, step) in enumerate(zip(self.seqs, self.matchers, self.steps)):
            if i not in problems:
                try:
                    stopped = m.is_stopped()
                    accepting = stopped or m.is_accepting()
                    forced = m.forced_tokens() if want_forced and not stopped else None
                except Exception as exc:   # an engine fault costs this sequence only (and gets no rows)
                    self.fault(i, "reading the grammar state", exc, refusals)
                else:
                    seq.finished = stopped
                    status[i] = (FINISHED if stopped else READY) | (ACCEPTING_BIT if accepting else 0)
                    if forced:
                        self.forced[i] = forced
                    doc = seq.doc
                    if doc is not None and (accepting or doc.scans):     # its document is checked
                        probe = Fill(Result(i, seq.seq_id, step, True), seq, m)
                        probe.res.status = FINISHED if stopped else READY
                        probe.res.accepting, probe.res.first_row, probe.res.num_rows = accepting, r, 1
                        self.probed.append((i, probe))
                    row[i] = r
                    r += 1
                    matchers.append(m)
                    rows.append(row[i])
            # The sequence's step (record_step's part for a plain one), its answer kept as (block, i).
            if seq.step + 1 != step:
                continue   # a fault above already ended it (fault records the step)
            keep_answer(seq, step, (self, i))
        return matchers, rows

    def rows_filled(self) -> int:
        """How many rows the block's entries have (an entry without one has a problem)."""
        return len(self.handles) - len(self.problems)

    def still_kept(self, by_handle: dict) -> bool:
        """Whether every entry's answer is still what its sequence keeps for that step (the
        sequence, closed or not, still reached by its handle, the step within its window)."""
        get = by_handle.get
        for h, step in zip(self.handles, self.steps):
            seq = get(h)
            kept = seq.recent.get(step) if seq is not None else None
            if kept is None or (kept[0] if isinstance(kept, tuple) else kept.block) is not self:
                return False
        return True

    def kept_rows(self) -> tuple[list[int], list[int]]:
        """(handles, steps) of the entries whose rows this step filled: the ring's record of them."""
        if len(self.problems) == 0:
            return self.handles, self.steps
        keep = [i for i, r in enumerate(self.row) if r >= 0]
        return [self.handles[i] for i in keep], [self.steps[i] for i in keep]

    def drop_rows(self, before: np.ndarray) -> None:
        """Rows were taken out of the step's rows (``before[r]``: how many before row r): the
        entries' rows move up; entries that lost theirs were failed already."""
        row = self.row
        for i, r in enumerate(row):
            if r >= 0:
                row[i] = r - int(before[r])
        for i, probe in self.probed:
            probe.res.first_row, probe.res.num_rows = max(row[i], 0), int(row[i] >= 0)

    def probes(self) -> list[Fill]:
        """The entries whose documents the fill phase checks (json_schema/step_checks.py)."""
        return [probe for _, probe in self.probed]

    def checked(self, failed_rows: np.ndarray) -> None:
        """The checks' verdicts into the entries' answers: a document that does not pass cleared
        the accepting bit, or failed its sequence (whose row is marked in ``failed_rows``)."""
        for i, probe in self.probed:
            res = probe.res
            if self.row[i] < 0:
                continue
            if res.status == FAILED:
                failed_rows[self.row[i]] = True
                self.status[i] = FAILED
                self.row[i] = -1
                self.problems[i] = (Code(res.code), res.reason)
                self.forced.pop(i, None)
            elif not res.accepting:
                self.status[i] &= ~ACCEPTING_BIT & 0xFF

    # -- failures --------------------------------------------------------------------------------
    def fail(self, i: int, reason: str, code: Code) -> None:
        """Entry i's sequence fails (it stays failed): FAILED with the reason, no row."""
        seq = self.seqs[i]
        seq.fail(reason, code)
        self.status[i] = FAILED
        self.row[i] = -1
        self.problems[i] = (code, reason)
        self.forced.pop(i, None)
        if seq.step + 1 == self.steps[i]:
            keep_answer(seq, self.steps[i], (self, i))

    def fault(self, i: int, doing: str, exc: BaseException, refusals) -> None:
        """An engine fault on entry i: its sequence fails (with the reason) and nothing else does."""
        seq = self.seqs[i]
        log.error("sequence %r: engine fault while %s", seq.seq_id, doing, exc_info=exc)
        refusals["internal"] += 1
        self.fail(i, internal_reason(doing, exc), Code.INTERNAL)

    # -- answers -----------------------------------------------------------------------------------
    def answer(self, i: int) -> Answer:
        """Entry i's answer as the per-entry path keeps it (for a repeat of its step)."""
        res = Result(i, self.seq_ids[i], self.steps[i], True)
        packed = self.status[i]
        res.status = SeqStatus(packed & STATUS_MASK)
        res.accepting = bool(packed & ACCEPTING_BIT)
        problem = self.problems.get(i)
        if problem is not None:
            res.code, res.reason = problem
        res.forced_tokens = list(self.forced.get(i, ()))
        answer = Answer((self.tokens[i],), _NO_TOKENS, 0, res)
        answer.block = self
        if self.row[i] >= 0:
            res.first_row, res.num_rows = self.row[i], 1
            answer.buffer, answer.generation = self.buffer, self.generation
            if self.buffer < 0:
                answer.rows = self.rows
        return answer
