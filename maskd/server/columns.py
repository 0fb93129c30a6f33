"""Columnar plain steps: a StepRequest's packed arrays as entries the step protocol runs, and their
answers as a StepResponse's packed arrays (contract revision 3).

A plain entry is a SeqStep with a handle instead of an id and no drafts, rollback, open or close.
``PlainStep`` and ``PlainResult`` have the attributes the protocol's phases read and write on
``pb.SeqStep`` / ``pb.SeqResult``, so both kinds of entry run through the same phases; only the
parsing and the answer differ, and both are a few numpy calls per step.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import Code, SeqStatus

ACCEPTING_BIT = 0x10


class PlainStep:
    """One columnar entry, as the phases read a SeqStep (and the sequence its handle names)."""
    __slots__ = ("seq", "seq_id", "step", "tokens")
    draft_tokens: tuple = ()
    rollback = 0
    close = False
    history_offset = 0

    def __init__(self, seq: Any, seq_id: str, step: int, tokens: list[int]) -> None:
        self.seq, self.seq_id, self.step, self.tokens = seq, seq_id, step, tokens

    def WhichOneof(self, name: str) -> None:
        return None


class PlainResult:
    """One columnar entry's answer, as the phases write a SeqResult."""
    __slots__ = ("accepting", "code", "drafts_valid", "first_row", "forced_tokens", "handle", "index", "num_rows",
                 "reason", "seq_id", "status", "step")

    def __init__(self, index: int, seq_id: str, step: int) -> None:
        self.index, self.seq_id, self.step = index, seq_id, step
        self.status = SeqStatus.UNSPECIFIED
        self.code, self.reason = 0, ""
        self.first_row = self.num_rows = self.drafts_valid = self.handle = 0
        self.accepting = False
        self.forced_tokens: list[int] = []

    def ClearField(self, name: str) -> None:
        if name == "forced_tokens":
            self.forced_tokens = []


def parse(request: pb.StepRequest, by_handle: dict[int, Any]) -> tuple[list[tuple[PlainStep, PlainResult]], str]:
    """The columnar entries of a request, each with the sequence its handle names (unknown handles
    and malformed arrays come back as problems: (entries, why the whole part is refused or ""))."""
    raw = request.handles
    if not raw:
        return [], ""
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
        return [(PlainStep(None, "", 0, []), PlainResult(i, "", 0)) for i in range(n)], problem
    step_list = steps.tolist()
    if (counts == 1).all():
        token_lists = [[t] for t in tokens.tolist()]
    else:
        ends = np.cumsum(counts, dtype=np.int64).tolist()
        flat = tokens.tolist()
        token_lists = [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    out = []
    for i, (h, step, toks) in enumerate(zip(handles.tolist(), step_list, token_lists)):
        seq = by_handle.get(h)
        sid = seq.seq_id if seq is not None else ""
        res = PlainResult(i, sid, step)
        if seq is None:
            res.status, res.code = SeqStatus.ERROR, Code.NOT_FOUND
            res.reason = (f"unknown sequence handle {h}: never given on this session, or its sequence was "
                          "closed or dropped with its stream; open it with a SeqStep")
        out.append((PlainStep(seq, sid, step, toks), res))
    return out, ""


def answer(results: list[PlainResult], reply: pb.StepResponse, want_forced: bool) -> None:
    """The columnar answers into the reply's packed fields."""
    if not results:
        return
    reply.statuses = bytes([int(r.status) | (ACCEPTING_BIT if r.accepting else 0) for r in results])
    for r in results:
        if r.status == SeqStatus.ERROR or r.status == SeqStatus.FAILED:
            reply.problems.add(index=r.index, code=int(r.code), reason=r.reason)
    if want_forced:
        reply.forced_counts = np.array([len(r.forced_tokens) for r in results], dtype="<u4").tobytes()
        forced = [t for r in results for t in r.forced_tokens]
        reply.forced_tokens = np.array(forced, dtype="<i4").tobytes()
