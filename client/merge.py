"""Per-server answers merged into one StepResult in batch order (a cluster step is split by owner)."""
from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

from maskd_client.types import SeqResult, StepResult


def merge_results(order: list[str], parts: list[StepResult]) -> StepResult:
    """One StepResult from per-server parts: every sequence of ``order``, rows in that order."""
    if len(parts) == 1 and parts[0].ids == order:
        return parts[0]
    if len(parts) == 1:
        return _reordered(order, parts[0])
    words = next((p.bitmask.shape[1] for p in parts if p.bitmask.ndim == 2 and p.bitmask.shape[1]), 0)
    loc: dict[str, tuple[int, int]] = {}
    for pi, part in enumerate(parts):
        for j, sid in enumerate(part.ids):
            loc[sid] = (pi, j)
    where = np.array([loc[sid] for sid in order], dtype=np.int64).reshape(len(order), 2)
    n = len(order)
    status = np.empty(n, dtype=np.uint8)
    old_row = np.empty(n, dtype=np.int64)
    num_rows = np.empty(n, dtype=np.int32)
    accepting = np.empty(n, dtype=bool)
    steps = np.empty(n, dtype=np.int64)
    for pi, part in enumerate(parts):
        mine = where[:, 0] == pi
        j = where[mine, 1]
        status[mine], old_row[mine], num_rows[mine] = part.status[j], part.row[j], part.num_rows[j]
        accepting[mine], steps[mine] = part.accepting[j], part.steps[j]
    counts = np.where(old_row >= 0, num_rows, 0)
    new_row = np.where(old_row >= 0, np.cumsum(counts) - counts, -1).astype(np.int32)
    bitmask = np.empty((int(counts.sum()), words), dtype=np.int32)
    for pi, part in enumerate(parts):   # every row of a part to its place, in one copy per part
        mine = (where[:, 0] == pi) & (counts > 0)
        if mine.any():
            reps = counts[mine]
            offset = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
            bitmask[np.repeat(new_row[mine], reps) + offset] = part.bitmask[np.repeat(old_row[mine], reps) + offset]
    details: dict[str, SeqResult] = {}
    forced: dict[str, list[int]] = {}
    position = {sid: i for i, sid in enumerate(order)}
    for part in parts:
        for sid, d in part._details.items():
            if sid in position:
                d.row = int(new_row[position[sid]])
                details[sid] = d
        forced.update(part._forced)
    return StepResult(None, bitmask, max((p.server_seconds for p in parts), default=0.0),
                      max((p.round_trip_seconds for p in parts), default=0.0), ids=list(order), status=status,
                      row=new_row, num_rows=num_rows, accepting=accepting, steps=steps, details=details,
                      forced=forced)


def _reordered(order: list[str], part: StepResult) -> StepResult:
    """One server's answer in the caller's order (it answers SeqStep entries before columnar
    ones): a permutation of its arrays and one gather of its rows."""
    position = {sid: j for j, sid in enumerate(part.ids)}
    perm = np.fromiter((position[sid] for sid in order), dtype=np.int64, count=len(order))
    old_row = part.row[perm].astype(np.int64)
    num_rows = part.num_rows[perm]
    counts = np.where(old_row >= 0, num_rows, 0).astype(np.int64)
    starts = np.cumsum(counts) - counts
    new_row = np.where(old_row >= 0, starts, -1).astype(np.int32)
    has = counts > 0
    if (counts <= 1).all():
        src = old_row[has]
    else:
        reps = counts[has]
        src = np.repeat(old_row[has], reps) + (np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps))
    bitmask = part.bitmask[src] if len(src) else part.bitmask[:0]
    inverse = np.empty(len(perm), dtype=np.int64)
    inverse[perm] = np.arange(len(perm))
    details: dict[str, SeqResult] = {}
    for sid, d in part._details.items():   # the few sequences with a detailed answer
        j = position.get(sid)
        if j is not None:
            d.row = int(new_row[inverse[j]])
            details[sid] = d
    return StepResult(None, bitmask, part.server_seconds, part.round_trip_seconds, ids=list(order),
                      status=part.status[perm], row=new_row, num_rows=num_rows, accepting=part.accepting[perm],
                      steps=part.steps[perm], details=details, forced=part._forced)


def gather(order: list[str], futures: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """A future of the merged result of per-server futures, in ``order`` (a server answers its
    SeqStep entries before its columnar ones; the caller gets the order it asked in)."""
    outer: concurrent.futures.Future = concurrent.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(_):
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            outer.set_result(merge_results(order, [f.result() for f in futures]))
        except BaseException as exc:
            outer.set_exception(exc)

    for f in futures:
        f.add_done_callback(done)
    return outer


def chain(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    def copy(f):
        if target.done():
            return
        exc = f.exception()
        if exc is not None:
            target.set_exception(exc)
        else:
            target.set_result(f.result())
    source.add_done_callback(copy)
