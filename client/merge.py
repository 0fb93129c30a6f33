"""Per-server answers merged into one StepResult in batch order (a cluster step is split by owner)."""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import numpy as np

from maskd_client.types import StepResult


def merge_results(order: list[str], parts: list[StepResult]) -> StepResult:
    """One StepResult from per-server parts: every sequence of ``order``, rows in that order."""
    if len(parts) == 1 and list(parts[0].seqs) == order:
        return parts[0]
    words = next((p.bitmask.shape[1] for p in parts if p.bitmask.ndim == 2), 0)
    where: dict[str, tuple[int, Any]] = {}
    for i, part in enumerate(parts):
        for sid, r in part.seqs.items():
            where[sid] = (i, r)
    src: list[list[int]] = [[] for _ in parts]
    dst: list[list[int]] = [[] for _ in parts]
    seqs = {}
    row = 0
    for sid in order:
        i, r = where[sid]
        if r.row >= 0 and r.num_rows:
            n = r.num_rows
            src[i].extend(range(r.row, r.row + n))
            dst[i].extend(range(row, row + n))
            r.row = row
            row += n
        seqs[sid] = r
    bitmask = np.empty((row, words), dtype=np.int32)
    for i, part in enumerate(parts):
        if src[i]:
            bitmask[dst[i]] = part.bitmask[src[i]]
    return StepResult(seqs, bitmask, max((p.server_seconds for p in parts), default=0.0),
                      max((p.round_trip_seconds for p in parts), default=0.0))


def gather(order: list[str], futures: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """A future of the merged result of per-server futures."""
    if len(futures) == 1:
        return futures[0]
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
