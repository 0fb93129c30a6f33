"""The session's ring of row buffers: which buffer a step takes, and kept answers keep their
rows (packed by the row codec) when the ring comes round."""
import numpy as np

from maskd.server.columns import PlainResult
from maskd.server.row_buffers import RowBuffers
from maskd.server.sequence import Answer


class Seq:
    """What the ring reads of a sequence: the answers it still keeps."""

    def __init__(self):
        self.recent = {}


def allocate(n):
    return np.zeros((n, 3), np.int32)


def answer(seq, step, buffer, generation, first_row=0, num_rows=1):
    res = PlainResult(0, "s", 0)
    res.first_row, res.num_rows = first_row, num_rows
    a = Answer((), (), 0, res)
    a.buffer, a.generation = buffer, generation
    seq.recent[step] = a
    return a


def test_the_ring_skips_buffers_being_encoded_and_grows():
    ring = RowBuffers(allocate, 96, count=3)
    assert [ring.take(2)[0] for _ in range(4)] == [0, 1, 2, 0]
    release = ring.encoding(1)
    assert ring.take(2)[0] == 2                          # 1 is still encoding
    release()
    b, gen, rows = ring.take(100)
    assert b == 0 and rows.shape == (100, 3)
    for k in range(3):
        ring.encoding(k)
    b, gen, rows = ring.take(5)
    assert (b, gen) == (-1, 0) and rows.shape == (5, 3)  # every buffer busy: a new array


def test_kept_answers_keep_their_rows_when_the_ring_comes_round():
    ring = RowBuffers(allocate, 96, count=2)
    s, gone = Seq(), Seq()
    b, gen, rows = ring.take(4)
    rows[:] = np.arange(12).reshape(4, 3)
    kept = answer(s, 7, b, gen, first_row=1, num_rows=2)
    dropped = answer(gone, 3, b, gen, first_row=3)
    ring.record(b, [(s, 7, kept), (gone, 3, dropped)])
    gone.recent = {}                                     # no longer kept: not copied
    assert ring.holds(kept) and ring.rows_of(kept).tolist() == [[3, 4, 5], [6, 7, 8]]
    ring.take(1)
    b2, _, rows2 = ring.take(4)                          # the ring came round to b
    assert b2 == b
    rows2[:] = -1
    assert ring.holds(kept) and ring.rows_of(kept).tolist() == [[3, 4, 5], [6, 7, 8]]
    assert kept.packed is not None and len(kept.packed) < 2 * 12           # packed, not copied
    assert dropped.packed is None and not ring.holds(dropped)
    assert ring.holds(answer(s, 8, -1, 0, num_rows=0))   # no rows: nothing to lose
