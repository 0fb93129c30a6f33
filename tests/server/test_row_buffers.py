"""The session's ring of row buffers: which buffer a step takes, and kept answers keep their
rows when the ring comes round (it grows, up to its cap; then they are packed by the row codec)."""
import numpy as np

from maskd.server.columns import PlainResult
from maskd.server.row_buffers import RowBuffers
from maskd.server.sequence import Answer, SequenceState


def Seq():
    """A sequence as the ring sees it (its kept answers, whether it is closed); no grammar needed."""
    return SequenceState("s", None, 0, 1)


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
    ring = RowBuffers(allocate, 96, count=2, max_count=2)
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


def test_the_ring_grows_while_buffers_come_round_with_kept_rows():
    ring = RowBuffers(allocate, 96, count=2, max_count=3)
    s = Seq()
    b, gen, rows = ring.take(1)
    rows[:] = 5
    kept = answer(s, 1, b, gen)
    ring.record(b, [(s, 1, kept)])
    ring.take(1)
    assert ring.take(1)[0] == 2 and ring.count == 3     # b still holds kept rows: a new buffer
    assert kept.packed is None and ring.holds(kept) and ring.rows_of(kept).tolist() == [[5, 5, 5]]
    assert ring.take(1)[0] == b and ring.count == 3      # b again, at the cap: packed, then reused
    assert kept.packed is not None and ring.rows_of(kept).tolist() == [[5, 5, 5]]
    again = answer(s, 2, b, gen + 1)
    ring.record(b, [(s, 2, again)])
    s.recent = {}                                        # not kept any more: no growth, no packing
    assert [ring.take(1)[0] for _ in range(3)] == [1, 2, 0] and ring.count == 3
    assert again.packed is None


def test_the_ring_grows_only_to_the_size_the_kept_answers_need():
    """A sequence keeps its last 4 answers and gets a step per take: 5 buffers, never packed."""
    ring = RowBuffers(allocate, 96, count=2, max_count=12)
    s = Seq()
    answers = []
    for t in range(40):
        b, gen, _ = ring.take(1)
        answers.append(answer(s, t, b, gen))
        ring.record(b, [(s, t, answers[-1])])
        s.recent.pop(t - 4, None)                       # it keeps steps t-3 .. t
    assert ring.count == 5
    assert all(a.packed is None for a in answers)


def test_a_closed_sequences_answers_last_while_the_ring_holds_them():
    ring = RowBuffers(allocate, 96, count=2, max_count=4)
    s = Seq()
    b, gen, _ = ring.take(1)
    last = answer(s, 5, b, gen)
    ring.record(b, [(s, 5, last)])
    s.closed = True
    ring.take(1)
    assert ring.take(1)[0] == b and ring.count == 2      # neither grown for nor packed
    assert last.packed is None and not ring.holds(last)
