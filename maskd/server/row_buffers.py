"""A session's ring of row buffers: where each step's mask rows are filled.

A step that fills rows takes the next buffer that no reply is still encoding. The answers kept
for repeats (sequence.py) point into it, so a repeat copies its rows instead of filling them
again: tensor-parallel ranks cost one fill per step, not one per rank. When the ring comes round
to a buffer, the rows of answers still kept there (a sequence stepped less often than its
session, a rank that lags) are packed out first with the row codec (its id lists: a few hundred
bytes a row where the row itself is 16 KB for a 129k vocabulary): a kept answer never loses its
rows, and a sequence that sits idle keeps little.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from maskd.rowcodec import ALLOWED_IDS, DENSE, REJECTED_IDS, RowBlockDecoder, RowBlockEncoder
from maskd.server.sequence import RECENT_STEPS, Answer, SequenceState

# In lockstep decoding (one request per step for every sequence) the answers of the last
# RECENT_STEPS steps stay in their buffers; the others are for replies still being encoded.
ROW_BUFFERS = RECENT_STEPS + 2


class RowBuffers:
    def __init__(self, allocate: Callable[[int], np.ndarray], width: int, count: int = ROW_BUFFERS) -> None:
        self._allocate = allocate
        self._width = width
        self._codec: tuple[RowBlockEncoder, RowBlockDecoder] | None = None   # stateless: no dictionary
        self._buffers: list[np.ndarray | None] = [None] * count
        self._generations = [0] * count
        self._encoding = [False] * count    # a reply is still encoding rows of this buffer
        # The answers each buffer's last step recorded: (sequence, step, answer).
        self._answers: list[list[tuple[SequenceState, int, Answer]]] = [[] for _ in range(count)]
        self._next = 0

    def take(self, n_rows: int) -> tuple[int, int, np.ndarray]:
        """(buffer, generation, rows) for a step: the next buffer no reply is encoding, grown to
        ``n_rows``, the rows of its answers still kept copied out first; (-1, 0, a new array)
        when every buffer is still being encoded."""
        count = len(self._buffers)
        for k in range(count):
            b = (self._next + k) % count
            if not self._encoding[b]:
                break
        else:
            return -1, 0, self._allocate(n_rows)
        self._next = (b + 1) % count
        buf = self._buffers[b]
        if self._answers[b]:
            self._copy_out(b, buf)
        self._generations[b] += 1
        if buf is None or buf.shape[0] < n_rows:
            buf = self._buffers[b] = self._allocate(max(n_rows, 64, 2 * (0 if buf is None else buf.shape[0])))
        return b, self._generations[b], buf[:n_rows]

    def record(self, buffer: int, answers: list[tuple[SequenceState, int, Answer]]) -> None:
        """The answers whose rows the step that took ``buffer`` filled there."""
        self._answers[buffer] = answers

    def encoding(self, buffer: int) -> Callable[[], None]:
        """Marks ``buffer`` as read by a reply being encoded; the returned call ends that."""
        encoding = self._encoding
        encoding[buffer] = True

        def release() -> None:
            encoding[buffer] = False
        return release

    def holds(self, answer: Answer) -> bool:
        """Whether an answer's rows (if it has any) can still be given."""
        if answer.rows is not None or answer.packed is not None or answer.result.num_rows == 0:
            return True
        b = answer.buffer
        return b >= 0 and self._generations[b] == answer.generation

    def rows_of(self, answer: Answer) -> np.ndarray:
        """A kept answer's rows (``holds`` said they are still there)."""
        res = answer.result
        if answer.packed is not None:
            assert self._codec is not None
            return self._codec[1].decode(answer.packed, res.num_rows)
        if answer.rows is not None:
            return answer.rows[res.first_row:res.first_row + res.num_rows]
        buf = self._buffers[answer.buffer]
        assert buf is not None
        return buf[res.first_row:res.first_row + res.num_rows]

    def _copy_out(self, b: int, buf: np.ndarray | None) -> None:
        generation = self._generations[b]
        for seq, step, answer in self._answers[b]:
            n = answer.result.num_rows
            if n and buf is not None and seq.recent.get(step) is answer and answer.buffer == b \
                    and answer.generation == generation and answer.rows is None:
                first = answer.result.first_row
                answer.packed = self._encoder(buf.shape[1]).encode(buf[first:first + n])
                answer.buffer = -1
        self._answers[b] = []

    def _encoder(self, words: int) -> RowBlockEncoder:
        if self._codec is None:
            kinds = (DENSE, ALLOWED_IDS, REJECTED_IDS)
            self._codec = (RowBlockEncoder(words, self._width, dict_size=0, encodings=kinds, compress=False),
                           RowBlockDecoder(words, self._width, dict_size=0, compression=""))
        return self._codec[0]
