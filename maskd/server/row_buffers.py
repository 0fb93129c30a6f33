"""A session's ring of row buffers: where each step's mask rows are filled.

A step that fills rows takes the next buffer that no reply is still encoding; the answers kept
for repeats (sequence.py) point into it with the buffer's generation, so a reused buffer never
answers for an older step. A repeat of a kept answer copies its rows instead of filling them
again: tensor-parallel ranks cost one fill per step, not one per rank.
"""
from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from maskd.server.sequence import RECENT_STEPS, Answer

# The steps whose rows kept answers can still point to, plus room for replies still being encoded.
ROW_BUFFERS = RECENT_STEPS + 2


class RowBuffers:
    def __init__(self, allocate: Callable[[int], np.ndarray], count: int = ROW_BUFFERS) -> None:
        self._allocate = allocate
        self._buffers: list[np.ndarray | None] = [None] * count
        self._generations = [0] * count
        self._encoding = [False] * count    # a reply is still encoding rows of this buffer
        self._next = 0

    def take(self, n_rows: int, reading: Collection[int] = ()) -> tuple[int, int, np.ndarray]:
        """(buffer, generation, rows) for a step: the next buffer that no reply is encoding and
        that the step does not copy kept rows from (``reading``), grown to ``n_rows``; its old
        answers stop counting. (-1, 0, a new array) when every buffer is taken that way."""
        count = len(self._buffers)
        for k in range(count):
            b = (self._next + k) % count
            if not self._encoding[b] and b not in reading:
                break
        else:
            return -1, 0, self._allocate(n_rows)
        self._next = (b + 1) % count
        self._generations[b] += 1
        buf = self._buffers[b]
        if buf is None or buf.shape[0] < n_rows:
            buf = self._buffers[b] = self._allocate(max(n_rows, 64, 2 * (0 if buf is None else buf.shape[0])))
        return b, self._generations[b], buf[:n_rows]

    def encoding(self, buffer: int) -> Callable[[], None]:
        """Marks ``buffer`` as read by a reply being encoded; the returned call ends that."""
        encoding = self._encoding
        encoding[buffer] = True

        def release() -> None:
            encoding[buffer] = False
        return release

    def holds(self, answer: Answer) -> bool:
        """Whether an answer's rows (if it has any) can still be given."""
        if answer.rows is not None or answer.result.num_rows == 0:
            return True
        b = answer.buffer
        return b >= 0 and self._generations[b] == answer.generation

    def rows_of(self, answer: Answer) -> np.ndarray:
        """The rows a kept answer points into (``holds`` said they are still there)."""
        if answer.rows is not None:
            return answer.rows
        buf = self._buffers[answer.buffer]
        assert buf is not None
        return buf
