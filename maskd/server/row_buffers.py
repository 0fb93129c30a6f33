"""A session's ring of row buffers: where each step's mask rows are filled.

A step that fills rows takes the next buffer that no reply is still encoding. The answers kept
for repeats (sequence.py) point into it, so a repeat copies its rows instead of filling them
again: tensor-parallel ranks cost one fill per step, not one per rank.

When the ring comes round to a buffer that still holds rows of kept answers (sequences that step
less often than their session fills: micro-batches stepped in turns, sequences left idle), the
ring grows by a buffer instead, up to ``--max-row-buffers-per-session`` (default: it does not
grow); past that, those rows are packed out with the row codec (its id lists: ~1.9 KB a row on
MaskBench-dev against 16 KB dense for a 129k vocabulary, ~21 µs a row) before the buffer is
reused. A kept answer never loses its rows; memory or CPU is the operator's choice.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from maskd.rowcodec import ALLOWED_IDS, DENSE, REJECTED_IDS, RowBlockDecoder, RowBlockEncoder
from maskd.server.sequence import RECENT_STEPS, Kept

# In lockstep decoding (one request per step for every sequence) the answers of the last
# RECENT_STEPS steps stay in their buffers; the others are for replies still being encoded.
ROW_BUFFERS = RECENT_STEPS + 2

# (handle, step) -> the answer a live sequence keeps for that step, or None.
FindAnswer = Callable[[int, int], "Kept | None"]


class RowBuffers:
    def __init__(self, allocate: Callable[[int], np.ndarray], width: int, find: FindAnswer,
                 count: int = ROW_BUFFERS, max_count: int = ROW_BUFFERS) -> None:
        self._allocate = allocate
        self._find = find
        self._max_count = max(count, max_count)
        self._width = width
        self._codec: tuple[RowBlockEncoder, RowBlockDecoder] | None = None   # stateless: no dictionary
        self._buffers: list[np.ndarray | None] = [None] * count
        self._generations = [0] * count
        self._encoding = [0] * count        # replies still encoding rows of this buffer
        self._encoding_lock = threading.Lock()
        # Whose rows each buffer's last step filled: (sequence handles, steps). Plain ints, not the
        # answers: holding those would keep them past their window and feed the garbage collector.
        self._answers: list[tuple[list[int], list[int]] | None] = [None] * count
        self._next = 0

    def take(self, n_rows: int) -> tuple[int, int, np.ndarray]:
        """(buffer, generation, rows) for a step: the next buffer no reply is encoding, grown to
        ``n_rows`` (a new one while that one still holds kept rows and the ring may grow; else its
        kept rows are packed out first); (-1, 0, a new array) when every buffer is being encoded."""
        count = len(self._buffers)
        for k in range(count):
            b = (self._next + k) % count
            if not self._encoding[b]:
                break
        else:
            return -1, 0, self._allocate(n_rows)
        self._next = (b + 1) % count
        if self._answers[b] is not None:
            kept = self._kept(b)
            if kept and count < self._max_count:
                self._next = b                  # b again next time, one step older: the ring grows
                b = self._grow()                # only until its oldest buffer is free to reuse
            else:
                self._pack(b, kept)
        buf = self._buffers[b]
        self._generations[b] += 1
        if buf is None or buf.shape[0] < n_rows:
            buf = self._buffers[b] = self._allocate(max(n_rows, 64, 2 * (0 if buf is None else buf.shape[0])))
        return b, self._generations[b], buf[:n_rows]

    def record(self, buffer: int, handles: list[int], steps: list[int]) -> None:
        """The (sequence handle, step) answers whose rows the step that took ``buffer`` filled."""
        self._answers[buffer] = (handles, steps)

    def encoding(self, buffer: int) -> Callable[[], None]:
        """Marks ``buffer`` as read by a reply being encoded (a repeat of a whole step may read it
        beside the step's own reply); the returned call ends that."""
        encoding, lock = self._encoding, self._encoding_lock
        with lock:
            encoding[buffer] += 1

        def release() -> None:     # on the reply's thread, outside the session's lock
            with lock:
                encoding[buffer] -= 1
        return release

    def holds(self, kept: Kept) -> bool:
        """Whether a kept answer's rows (if it has any) can still be given."""
        answers, i = kept
        if answers.rows is not None or answers.num_rows[i] == 0 or (answers.packed is not None and i in answers.packed):
            return True
        b = answers.buffer
        return b >= 0 and self._generations[b] == answers.generation

    def step_rows(self, buffer: int, generation: int, n_rows: int) -> np.ndarray | None:
        """The first rows a step filled into ``buffer`` at ``generation``, while the buffer still
        holds them (None once it was taken again)."""
        buf = self._buffers[buffer]
        if buf is None or self._generations[buffer] != generation:
            return None
        return buf[:n_rows]

    def rows_of(self, kept: Kept) -> np.ndarray:
        """A kept answer's rows (``holds`` said they are still there)."""
        answers, i = kept
        first, n = answers.first_row[i], answers.num_rows[i]
        packed = answers.packed.get(i) if answers.packed is not None else None
        if packed is not None:
            assert self._codec is not None
            return self._codec[1].decode(packed, n)
        if answers.rows is not None:
            return answers.rows[first:first + n]
        buf = self._buffers[answers.buffer]
        assert buf is not None
        return buf[first:first + n]

    @property
    def count(self) -> int:
        return len(self._buffers)

    def _kept(self, b: int) -> list[Kept]:
        """The answers recorded in buffer b that live sequences still keep, with rows there (a
        closed sequence's last answers last while the ring holds them: ranks lag by a step or
        two, and packing every finished sequence's rows would cost each one that CPU)."""
        recorded = self._answers[b]
        if recorded is None:
            return []
        generation, find, kept = self._generations[b], self._find, []
        for handle, step in zip(*recorded):
            found = find(handle, step)
            if found is None:
                continue
            answers, i = found
            if (answers.buffer == b and answers.generation == generation and answers.rows is None
                    and answers.num_rows[i] and (answers.packed is None or i not in answers.packed)):
                kept.append(found)
        return kept

    def _grow(self) -> int:
        self._buffers.append(None)
        self._generations.append(0)
        self._encoding.append(0)
        self._answers.append(None)
        return len(self._buffers) - 1

    def _pack(self, b: int, kept: list[Kept]) -> None:
        buf = self._buffers[b]
        if kept and buf is not None:
            encoder = self._encoder(buf.shape[1])
            for answers, i in kept:
                first = answers.first_row[i]
                answers.pack(i, encoder.encode(buf[first:first + answers.num_rows[i]]))
        self._answers[b] = None

    def _encoder(self, words: int) -> RowBlockEncoder:
        if self._codec is None:
            kinds = (DENSE, ALLOWED_IDS, REJECTED_IDS)
            self._codec = (RowBlockEncoder(words, self._width, dict_size=0, encodings=kinds, compress=False),
                           RowBlockDecoder(words, self._width, dict_size=0, compression=""))
        return self._codec[0]
