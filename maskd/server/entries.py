"""A step's entries in the one form the step protocol runs, whatever their form on the wire, and
the one writer of their answers.

A StepRequest carries entries two ways (contract revision 3): ``seqs``, SeqStep messages named by
id (opens, closes, restores, drafts, rollback: anything), and the columnar arrays (handles, steps,
token counts, tokens: the decode step's common case, named by the handle its open was answered
with). Entry ``i`` of a step is SeqStep entry ``i``, then the columnar ones by index: the order of
the answers (step_answers.py) and of the rows. ``parse`` turns both forms into ``Entry`` objects;
the decode step's common case skips them: ``plain_columns`` reads its columns as lists for a plain
block (plain_block.py). ``write_answers`` writes every entry's answer back in the form it came in.
Besides two flags the session reads (whether there are columns, want_forced_tokens), nothing else
on the step path reads a StepRequest or writes a StepResponse's answers.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from maskd.server.step_answers import StepAnswers
from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import ACCEPTING_BIT, RESAMPLE_BIT, STATUS_MASK, Code, SeqStatus

_NO_DRAFTS: tuple[int, ...] = ()
_NO_PROBLEM = (0, "")


class Entry:
    """One entry of a step: what it asks of one sequence. ``seq`` is the sequence a columnar
    entry's handle names (a handle outlives a reuse of its id); None for entries named by id."""
    __slots__ = ("close", "drafts", "grammar_id", "history_offset", "index", "opens", "propose", "rollback", "seq",
                 "seq_id", "spec", "step", "tokens", "unmasked")

    def __init__(self, index: int, seq_id: str, step: int, tokens: list[int], seq: Any = None) -> None:
        self.index = index                # its place in the step (step_answers.py): its answer's
        self.seq_id, self.step, self.tokens, self.seq = seq_id, step, tokens, seq
        self.drafts = _NO_DRAFTS
        self.rollback = self.history_offset = 0
        self.propose = 0                  # draft tokens the server is asked to propose
        self.unmasked = False             # the tokens were sampled without a row: check them
        self.close = False
        self.opens: str | None = None     # None, "grammar_id" or "spec"
        self.grammar_id = ""
        self.spec: pb.GrammarSpec | None = None

    @classmethod
    def of_message(cls, index: int, msg: pb.SeqStep) -> Entry:
        e = cls(index, msg.seq_id, msg.step, list(msg.tokens))
        if msg.draft_tokens:
            e.drafts = tuple(msg.draft_tokens)
        e.rollback, e.history_offset, e.close = msg.rollback, msg.history_offset, msg.close
        e.propose = msg.propose_drafts
        e.unmasked = msg.sampled_unmasked
        e.opens = msg.WhichOneof("open")
        if e.opens == "grammar_id":
            e.grammar_id = msg.grammar_id
        elif e.opens == "spec":
            e.spec = msg.spec
        return e


def request_key(request: pb.StepRequest) -> tuple | None:
    """What a repeat of a request that is all columnar is recognised by (its columns and flags,
    byte for byte: what lockstep ranks send); None for any other request."""
    if not request.handles or request.seqs:
        return None
    return (request.handles, request.steps, request.token_counts, request.tokens, request.want_forced_tokens,
            request.columnar_sampled_unmasked)


@dataclasses.dataclass(slots=True)
class PlainColumns:
    """A request's columnar part when it has the decode step's shape (every entry one token, none
    sampled unmasked), as lists; with what its SeqStep entries add to the request's limits."""
    handles: list[int]
    steps: list[int]
    tokens: list[int]
    other_rows: int        # rows the SeqStep entries ask for
    other_tokens: int      # tokens they carry
    other_ids: list[str]   # the ids they name


_ONE = np.array([1], dtype="<u4").tobytes()


def plain_columns(request: pb.StepRequest) -> PlainColumns | None:
    """The columnar part in the decode step's shape, or None (the per-entry phases take it)."""
    raw = request.handles
    n = len(raw) // 4
    if (not n or request.columnar_sampled_unmasked or len(raw) != 4 * n or len(request.steps) != 4 * n
            or len(request.token_counts) != 4 * n or len(request.tokens) != 4 * n or request.token_counts != _ONE * n):
        return None
    seqs = request.seqs
    return PlainColumns(np.frombuffer(raw, dtype="<u4").tolist(), np.frombuffer(request.steps, dtype="<u4").tolist(),
                        np.frombuffer(request.tokens, dtype="<i4").tolist(),
                        sum(1 + len(m.draft_tokens) + m.propose_drafts for m in seqs) if seqs else 0,
                        sum(len(m.tokens) + len(m.draft_tokens) for m in seqs) if seqs else 0,
                        [m.seq_id for m in seqs])


def answers_for(request: pb.StepRequest) -> StepAnswers:
    """An empty answer record for every entry of a request (SeqStep entries first, then columnar)."""
    seqs = request.seqs
    return StepAnswers(len(seqs) + len(request.handles) // 4, len(seqs), [m.seq_id for m in seqs],
                       [m.step for m in seqs])


def parse(request: pb.StepRequest, by_handle: dict[int, Any], answers: StepAnswers,
          columnar: Sequence[int] | None = None) -> tuple[list[Entry], int, str]:
    """The entries of a request that the per-entry phases take: (entries, columnar entries whose
    handle is unknown (refused NOT_FOUND in ``answers`` already), why the columnar part is refused
    whole or ""). Every SeqStep entry, and the columnar ones at the places ``columnar`` lists
    (None: all of them; the others are a plain block's)."""
    found = [Entry.of_message(i, m) for i, m in enumerate(request.seqs)]
    raw = request.handles if columnar is None or columnar else b""
    if not raw:
        return found, 0, ""
    named = len(found)
    n = len(raw) // 4
    problem = ""
    try:
        handles = np.frombuffer(raw, dtype="<u4")
        steps = np.frombuffer(request.steps, dtype="<u4")
        counts = np.frombuffer(request.token_counts, dtype="<u4")
        tokens = np.frombuffer(request.tokens, dtype="<i4")
        if not (len(steps) == len(counts) == n) or int(counts.sum(dtype=np.int64)) != len(tokens):
            problem = (f"columnar arrays disagree: {n} handles, {len(steps)} steps, {len(counts)} token counts "
                       f"summing to {int(counts.sum(dtype=np.int64))}, {len(tokens)} tokens")
    except ValueError as exc:   # a byte length that is not a multiple of 4
        problem = f"columnar arrays are not packed 32-bit values: {exc}"
    if problem:
        found += [Entry(named + i, "", 0, []) for i in range(n)]
        return found, 0, problem
    if (counts == 1).all():
        token_lists = [[t] for t in tokens.tolist()]
    else:
        ends = np.cumsum(counts, dtype=np.int64).tolist()
        flat = tokens.tolist()
        token_lists = [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    unknown = 0
    unmasked = request.columnar_sampled_unmasked
    hs, ss = handles.tolist(), steps.tolist()
    for j in range(n) if columnar is None else columnar:
        i, h = named + j, hs[j]
        seq = by_handle.get(h)
        if seq is None:
            unknown += 1
            answers.status[i] = SeqStatus.ERROR
            answers.problems[i] = (Code.NOT_FOUND, f"unknown sequence handle {h}: never given on this session, or its "
                                   "sequence was closed or dropped with its stream; open it with a SeqStep")
        entry = Entry(i, seq.seq_id if seq is not None else "", ss[j], token_lists[j], seq)
        entry.unmasked = unmasked
        found.append(entry)
    return found, unknown, ""


def write_answers(answers: StepAnswers, reply: pb.StepResponse, want_forced: bool) -> None:
    """The one writer of a step's answers into its reply: a SeqResult per SeqStep entry, the
    columnar fields for the columnar ones."""
    status, problems, forced = answers.status, answers.problems, answers.forced
    named = answers.named
    if named:
        add = reply.results.add
        first_row, num_rows = answers.first_row, answers.num_rows
        drafts_valid, handles, proposed = answers.drafts_valid, answers.handles, answers.proposed
        for i, (seq_id, step) in enumerate(zip(answers.seq_ids, answers.steps)):
            packed = status[i]
            code, reason = problems.get(i, _NO_PROBLEM)
            n = num_rows[i]
            out = add(seq_id=seq_id, step=step, status=packed & STATUS_MASK, code=int(code), reason=reason,
                      first_row=first_row[i] if n else 0, num_rows=n, drafts_valid=drafts_valid.get(i, 0),
                      accepting=bool(packed & ACCEPTING_BIT), handle=handles.get(i, 0),
                      resample=bool(packed & RESAMPLE_BIT))
            if i in forced:
                out.forced_tokens.extend(forced[i])
            if i in proposed:
                out.proposed_drafts.extend(proposed[i])
    if len(status) == named:
        return
    if named:
        status = status[named:]
        problems = {i - named: p for i, p in problems.items() if i >= named}
        forced = {i - named: f for i, f in forced.items() if i >= named}
    _write_columnar(reply, status, problems, forced if want_forced else None)


def _write_columnar(reply: pb.StepResponse, status: bytes | bytearray, problems: Mapping[int, tuple[int, str]],
                   forced: Mapping[int, list[int]] | None) -> None:
    """The columnar answers: a status byte per entry, the problems of ERROR and FAILED entries by
    index, and (``forced`` not None: want_forced_tokens) the forced tokens."""
    reply.statuses = bytes(status)
    for i in sorted(problems):
        code, reason = problems[i]
        reply.problems.add(index=i, code=int(code), reason=reason)
    if forced is not None:
        counts = np.zeros(len(status), dtype="<u4")
        flat: list[int] = []
        for i in sorted(forced):
            counts[i] = len(forced[i])
            flat += forced[i]
        reply.forced_counts = counts.tobytes()
        reply.forced_tokens = np.array(flat, dtype="<i4").tobytes()
