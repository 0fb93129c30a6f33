"""The decode step's common case as arrays: the entries of a columnar part that are each the next
step of a live, plain sequence, with one token.

Most steps of a running engine are exactly this: every sequence of the batch sampled one token from
the row it was given. ``entries.plain_columns`` reads a columnar part of one-token entries off the
wire and ``PlainBlock.of`` checks it against the session's sequences in one pass, with no ``Entry``
per sequence; the step protocol (session.py) then consumes its tokens and fills its rows in the
same engine calls as its other entries, and every entry is answered in the step's one answer
record (step_answers.py), as any other entry is: the block is the input side of its entries, not a
second door for their answers.

Plain means: its grammar compiled and its matcher made, no drafts learned or proposed, not failed,
not closed. A sequence's document (json_schema/step_checks.py: every JSON schema's finished
documents are validated, and a relaxed grammar's output is scanned as it grows) takes its token as
the per-entry path gives it; where it is checked this step (the grammar accepts, or its checker
scans), the check runs on a ``Fill`` of that entry (``probes``) and its verdict is applied as any
other entry's. The entries out of the ordinary (an unknown handle, a repeat or a step out of
order, a token outside the vocabulary, a handle named twice, a sequence also named by a SeqStep
entry) are an index subset (``others``) that the per-entry phases take, and the rows of both are
put in entry order at the end of the fill. A whole columnar part goes entry by entry where it is
over the request's limits (admission refuses it whole), sampled unmasked, or has an entry of other
than one token (``plain_columns``).
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import cast

from maskd.server.engines import Matcher
from maskd.server.entries import PlainColumns
from maskd.server.json_schema import DocumentChecks
from maskd.server.sequence import SequenceState, keep_answer
from maskd.server.step_answers import StepAnswers
from maskd.server.step_routing import Fill
from maskd.v1.contract import ACCEPTING_BIT, Code, SeqStatus

log = logging.getLogger("maskd.server.session")
READY, FAILED, FINISHED = SeqStatus.READY, SeqStatus.FAILED, SeqStatus.FINISHED


class PlainBlock:
    """The plain entries of one step's columnar part (see the module's docstring): block entry ``j``
    is the step's entry ``index[j]`` in ``answers``; ``others`` are the columnar entries (by their
    place in the columnar part) that the per-entry phases take."""
    __slots__ = ("answers", "handles", "index", "matchers", "others", "probed", "seqs", "steps", "tokens")

    def __init__(self, seqs: list[SequenceState], handles: list[int], steps: list[int], tokens: list[int],
                 answers: StepAnswers, index: Sequence[int] | None = None, others: Sequence[int] = ()) -> None:
        self.seqs, self.handles, self.steps, self.tokens = seqs, handles, steps, tokens
        self.matchers = cast(list[Matcher], [seq.matcher for seq in seqs])   # ``of`` checked each has one
        self.answers = answers
        self.others = others
        self.probed: list[Fill] = []             # entries whose documents the fill phase checks
        if index is None:                        # the whole columnar part
            self.index: Sequence[int] = range(answers.named, answers.named + len(seqs))
            answers.tokens[answers.named:] = tokens      # the inputs its answers are kept with
        else:
            self.index = index
            for i, t in zip(index, tokens):
                answers.tokens[i] = t
        for i, seq, step in zip(self.index, seqs, steps):
            keep_answer(seq, step, (answers, i))  # routed: the step is each sequence's last, its answer kept

    def __len__(self) -> int:
        return len(self.handles)

    @classmethod
    def of(cls, columns: PlainColumns, session, answers: StepAnswers) -> PlainBlock | None:
        """The plain entries of the request's columnar part (read by entries.plain_columns) as a
        block, the others left to the per-entry phases; None where none is plain, or where the
        request is over its limits (the per-entry admission refuses it whole)."""
        handles, steps, tokens = columns.handles, columns.steps, columns.tokens
        n = len(handles)
        limits = session.limits     # the request's limits, counted as the per-entry admission counts them
        if (n + columns.other_rows > limits.max_rows_per_step
                or n + columns.other_tokens > limits.max_tokens_per_request):
            return None
        seqs = list(map(session.by_handle.get, handles))
        odd = [j for j, (seq, step) in enumerate(zip(seqs, steps))
               if seq is None or seq.matcher is None or seq.step + 1 != step or seq.dead_reason or seq.entry.drafting]
        vocab = session.vocab_limit
        if min(tokens) < 0 or max(tokens) >= vocab:
            odd += [j for j, t in enumerate(tokens) if t < 0 or t >= vocab]
        named = set(handles)
        if len(named) != n:       # a handle named twice: both where duplicates are refused
            seen = collections.Counter(handles)
            odd += [j for j, h in enumerate(handles) if seen[h] > 1]
        for sid in columns.other_ids:     # a sequence a SeqStep entry names too: there as well
            other = session.seqs.get(sid)
            if other is not None and other.handle in named:
                odd += [j for j, h in enumerate(handles) if h == other.handle]
        if not odd:
            return cls(seqs, handles, steps, tokens, answers)
        others = sorted(set(odd))
        if len(others) == n:
            return None
        plain = sorted(set(range(n)).difference(others))
        odd_ids = {seqs[j].seq_id for j in others if seqs[j] is not None}
        if any(seqs[j].seq_id in odd_ids for j in plain):
            return None    # one id under two handles (reopened): every entry where duplicates are refused
        base = answers.named
        return cls([seqs[j] for j in plain], [handles[j] for j in plain], [steps[j] for j in plain],
                   [tokens[j] for j in plain], answers, [base + j for j in plain], others)

    # -- the engine phases (session.py calls these) ------------------------------------------------
    def consumed(self, reasons: list, refusals, checks: DocumentChecks) -> None:
        """The engine's answer to each entry's token: None (consumed), its reason, or an exception;
        documents take their tokens (an EOS ending one that does not pass is refused here)."""
        seqs, tokens, eos, answers, index = self.seqs, self.tokens, checks.eos, self.answers, self.index
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
                answers.fault(index[i], seqs[i], "consuming tokens", reason, refusals)
            else:
                answers.fail(index[i], seqs[i], f"token rejected: {reason}", Code.INVALID_ARGUMENT)
                refusals["token_rejected"] += 1

    def read_states(self, first_row: int, want_forced: bool, refusals) -> tuple[list, list[int]]:
        """Each live entry's grammar state (finished, accepting, forced tokens) and its row from
        ``first_row`` on. Returns the matchers and rows to fill."""
        matchers, rows = [], []
        answers = self.answers
        status, first, num_rows, forced = answers.status, answers.first_row, answers.num_rows, answers.forced
        r = first_row
        for i, seq, m in zip(self.index, self.seqs, self.matchers):
            if status[i] == FAILED:
                continue     # failed in the consume phase
            try:
                stopped = m.is_stopped()
                accepting = stopped or m.is_accepting()
                forced_here = m.forced_tokens() if want_forced and not stopped else None
            except Exception as exc:   # an engine fault costs this sequence only (and gets no rows)
                answers.fault(i, seq, "reading the grammar state", exc, refusals)
                continue
            seq.finished = stopped
            status[i] = (FINISHED if stopped else READY) | (ACCEPTING_BIT if accepting else 0)
            if forced_here:
                forced[i] = forced_here
            doc = seq.doc
            if doc is not None and (accepting or doc.scans):     # its document is checked
                self.probed.append(Fill(i, seq, m))
            first[i] = r
            num_rows[i] = 1
            r += 1
            matchers.append(m)
            rows.append(first[i])
        return matchers, rows

    def kept_rows(self) -> tuple[list[int], list[int]]:
        """(handles, steps) of the entries whose rows this step filled: the ring's record of them."""
        answers = self.answers
        if not answers.problems:       # no entry of the step refused or failed: every block entry has its row
            return self.handles, self.steps
        num_rows = answers.num_rows
        keep = [j for j, i in enumerate(self.index) if num_rows[i]]
        return [self.handles[j] for j in keep], [self.steps[j] for j in keep]
