"""The session's ring of row buffers: which buffer a step takes, and when a kept answer's rows
are still there."""
import numpy as np

from maskd.server.columns import PlainResult
from maskd.server.row_buffers import RowBuffers
from maskd.server.sequence import Answer


def allocate(n):
    return np.zeros((n, 3), np.int32)


def kept(buffer, generation, num_rows=1):
    res = PlainResult(0, "s", 0)
    res.num_rows = num_rows
    a = Answer((), (), 0, res)
    a.buffer, a.generation = buffer, generation
    return a


def test_the_ring_skips_buffers_being_encoded_or_read_and_grows():
    ring = RowBuffers(allocate, count=3)
    assert [ring.take(2)[0] for _ in range(4)] == [0, 1, 2, 0]
    release = ring.encoding(1)
    assert ring.take(2)[0] == 2                          # 1 is still encoding
    assert ring.take(2, reading={0})[0] == 2             # 0 is read by this step, 1 encoding
    release()
    b, gen, rows = ring.take(100, reading={0, 2})
    assert b == 1 and rows.shape == (100, 3)
    for k in range(3):
        ring.encoding(k)
    b, gen, rows = ring.take(5)
    assert (b, gen) == (-1, 0) and rows.shape == (5, 3)  # every buffer busy: a new array


def test_an_answer_holds_until_its_buffer_is_taken_again():
    ring = RowBuffers(allocate, count=2)
    b, gen, rows = ring.take(1)
    rows[0] = 7
    answer = kept(b, gen)
    assert ring.holds(answer) and ring.rows_of(answer)[0].tolist() == [7, 7, 7]
    ring.take(1)
    assert ring.holds(answer)
    ring.take(1)                                         # the ring came round to b
    assert not ring.holds(answer)
    assert ring.holds(kept(-1, 0, num_rows=0))           # no rows: nothing to lose
    copied = kept(-1, 0)
    copied.rows = np.ones((1, 3), np.int32)
    assert ring.holds(copied) and ring.rows_of(copied) is copied.rows
