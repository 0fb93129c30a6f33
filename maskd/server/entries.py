"""A step's entries in the one form the step protocol runs, whatever their form on the wire.

A StepRequest carries entries two ways (contract revision 3): ``seqs``, SeqStep messages named by
id (opens, closes, restores, drafts, rollback: anything), and the columnar arrays (handles, steps,
token counts, tokens: the decode step's common case, named by the handle its open was answered
with). ``parse`` turns both into ``Entry`` objects, each with its ``Result`` (SeqStep entries first
in request order, then the columnar ones by index: the order of the rows too); the phases of the
step protocol (session.py, step_routing.py) read and write only these; ``answer`` writes each
result back in the form its entry came in. The decode step's common case skips the objects:
``plain_columns`` reads its columns as lists for a plain block (plain_block.py), and
``write_columnar`` writes the columnar answers of both forms. Besides two flags the session reads
(whether there are columns, want_forced_tokens), nothing else on the step path reads a StepRequest
or writes a StepResponse's answers.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import ACCEPTING_BIT, RESAMPLE_BIT, Code, SeqStatus

_NO_DRAFTS: tuple[int, ...] = ()


class Entry:
    """One entry of a step: what it asks of one sequence. ``seq`` is the sequence a columnar
    entry's handle names (a handle outlives a reuse of its id); None for entries named by id."""
    __slots__ = ("close", "drafts", "grammar_id", "history_offset", "opens", "propose", "rollback", "seq", "seq_id",
                 "spec", "step", "tokens", "unmasked")

    def __init__(self, seq_id: str, step: int, tokens: list[int], seq: Any = None) -> None:
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
    def of_message(cls, msg: pb.SeqStep) -> Entry:
        e = cls(msg.seq_id, msg.step, list(msg.tokens))
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


class Result:
    """One entry's answer. ``index``: the entry's place among those of its form; ``columnar``:
    which form it came in (and goes back in)."""
    __slots__ = ("accepting", "code", "columnar", "drafts_valid", "first_row", "forced_tokens", "handle", "index",
                 "num_rows", "proposed", "reason", "resample", "seq_id", "status", "step")

    def __init__(self, index: int, seq_id: str, step: int, columnar: bool) -> None:
        self.index, self.seq_id, self.step, self.columnar = index, seq_id, step, columnar
        self.status = SeqStatus.UNSPECIFIED
        self.code, self.reason = 0, ""
        self.first_row = self.num_rows = self.drafts_valid = self.handle = 0
        self.accepting = False
        self.forced_tokens: list[int] = []
        self.proposed: tuple[int, ...] = _NO_DRAFTS    # drafts the server proposes (propose_drafts)
        self.resample = False     # sampled_unmasked tokens refused: the row is for the position before them

    def copy_answer(self, src: Result) -> None:
        """A kept answer into this result (its own index, form and rows' place stay)."""
        self.status, self.code, self.reason = src.status, src.code, src.reason
        self.num_rows, self.accepting = src.num_rows, src.accepting
        self.drafts_valid, self.handle = src.drafts_valid, src.handle
        if src.forced_tokens:
            self.forced_tokens = list(src.forced_tokens)
        self.proposed = src.proposed
        self.resample = src.resample


def refuse(res: Result, refusals, code: Code, message: str, kind: str | None = None) -> None:
    """The entry is refused (nothing changed): ERROR with its code and reason, counted by kind."""
    res.status = SeqStatus.ERROR
    res.code = code
    res.reason = message
    refusals[kind or code.name.lower()] += 1


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


def refused_results(request: pb.StepRequest, refusals, reason: str) -> list[Result]:
    """Every entry of a request refused with INTERNAL (a step that failed in a way no phase caught)."""
    results = [Result(i, m.seq_id, m.step, False) for i, m in enumerate(request.seqs)]
    results += [Result(i, "", 0, True) for i in range(len(request.handles) // 4)]
    for res in results:
        refuse(res, refusals, Code.INTERNAL, reason, kind="internal")
    return results


def parse(request: pb.StepRequest, by_handle: dict[int, Any],
          columnar: bool = True) -> tuple[list[tuple[Entry, Result]], int, str]:
    """Every entry of a request with its result: (entries, columnar entries whose handle is
    unknown (answered NOT_FOUND already), why the columnar part is refused whole or "").
    ``columnar`` False: the SeqStep entries only (the columnar part is a plain block)."""
    pairs = [(Entry.of_message(m), Result(i, m.seq_id, m.step, False)) for i, m in enumerate(request.seqs)]
    raw = request.handles if columnar else b""
    if not raw:
        return pairs, 0, ""
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
        pairs += [(Entry("", 0, []), Result(i, "", 0, True)) for i in range(n)]
        return pairs, 0, problem
    if (counts == 1).all():
        token_lists = [[t] for t in tokens.tolist()]
    else:
        ends = np.cumsum(counts, dtype=np.int64).tolist()
        flat = tokens.tolist()
        token_lists = [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    unknown = 0
    unmasked = request.columnar_sampled_unmasked
    for i, (h, step, toks) in enumerate(zip(handles.tolist(), steps.tolist(), token_lists)):
        seq = by_handle.get(h)
        sid = seq.seq_id if seq is not None else ""
        res = Result(i, sid, step, True)
        if seq is None:
            unknown += 1
            res.status, res.code = SeqStatus.ERROR, Code.NOT_FOUND
            res.reason = (f"unknown sequence handle {h}: never given on this session, or its sequence was "
                          "closed or dropped with its stream; open it with a SeqStep")
        entry = Entry(sid, step, toks, seq)
        entry.unmasked = unmasked
        pairs.append((entry, res))
    return pairs, unknown, ""


def answer(results: list[Result], reply: pb.StepResponse, want_forced: bool, block: Any = None) -> None:
    """Each result into the reply in its entry's form: a SeqResult, or the columnar fields (from
    ``block``, a plain block (plain_block.py), when the columnar part was one)."""
    if block is not None:
        write_columnar(reply, block.status, block.problems, block.forced if want_forced else None)
    columnar = []
    add = reply.results.add
    for r in results:
        if r.columnar:
            columnar.append(r)
            continue
        out = add(seq_id=r.seq_id, step=r.step, status=r.status, code=r.code, reason=r.reason,
                  first_row=r.first_row, num_rows=r.num_rows, drafts_valid=r.drafts_valid, accepting=r.accepting,
                  handle=r.handle, resample=r.resample)
        if r.forced_tokens:
            out.forced_tokens.extend(r.forced_tokens)
        if r.proposed:
            out.proposed_drafts.extend(r.proposed)
    if not columnar:
        return
    status = bytes([int(r.status) | (ACCEPTING_BIT if r.accepting else 0) | (RESAMPLE_BIT if r.resample else 0)
                    for r in columnar])
    problems = {r.index: (r.code, r.reason) for r in columnar
                if r.status == SeqStatus.ERROR or r.status == SeqStatus.FAILED}
    forced = {r.index: r.forced_tokens for r in columnar if r.forced_tokens} if want_forced else None
    write_columnar(reply, status, problems, forced)


def write_columnar(reply: pb.StepResponse, status: bytes | bytearray, problems: Mapping[int, tuple[int, str]],
                   forced: Mapping[int, list[int]] | None) -> None:
    """The one writer of the columnar answers: a status byte per entry, the problems of ERROR and
    FAILED entries by index, and (``forced`` not None: want_forced_tokens) the forced tokens."""
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
