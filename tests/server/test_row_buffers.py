"""The session's ring of row buffers: which buffer a step takes, and kept answers keep their
rows when the ring comes round (it grows, up to its cap; then they are packed by the row codec)."""
import numpy as np

from maskd.server.row_buffers import RowBuffers
from maskd.server.step_answers import StepAnswers


class Kept(dict):
    """(handle, step) -> answer: what the session's live sequences keep (the ring asks it)."""

    def find(self, handle, step):
        return self.get((handle, step))


def allocate(n):
    return np.zeros((n, 3), np.int32)


def answer(buffer, generation, first_row=0, num_rows=1):
    """A kept answer: (a step's answers, the entry's index there) whose rows are in ``buffer``."""
    answers = StepAnswers(1)
    answers.first_row[0], answers.num_rows[0] = first_row, num_rows
    answers.buffer, answers.generation = buffer, generation
    return answers, 0


def packed(kept):
    """The kept answer's rows as the ring packed them out, or None."""
    answers, i = kept
    return None if answers.packed is None else answers.packed.get(i)


def test_the_ring_skips_buffers_being_encoded_and_grows_them():
    ring = RowBuffers(allocate, 96, Kept().find, count=3)
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
    kept = Kept()
    ring = RowBuffers(allocate, 96, kept.find, count=2, max_count=2)
    b, gen, rows = ring.take(4)
    rows[:] = np.arange(12).reshape(4, 3)
    a, gone = answer(b, gen, first_row=1, num_rows=2), answer(b, gen, first_row=3)
    kept[1, 7] = a                                       # sequence 1 keeps its step 7; 2 no longer step 3
    ring.record(b, [1, 2], [7, 3])
    assert ring.holds(a) and ring.rows_of(a).tolist() == [[3, 4, 5], [6, 7, 8]]
    ring.take(1)
    b2, _, rows2 = ring.take(4)                          # the ring came round to b
    assert b2 == b
    rows2[:] = -1
    assert ring.holds(a) and ring.rows_of(a).tolist() == [[3, 4, 5], [6, 7, 8]]
    assert packed(a) is not None and len(packed(a)) < 2 * 12                 # packed, not copied
    assert packed(gone) is None and not ring.holds(gone)
    assert ring.holds(answer(-1, 0, num_rows=0))         # no rows: nothing to lose


def test_the_ring_grows_while_buffers_come_round_with_kept_rows():
    kept = Kept()
    ring = RowBuffers(allocate, 96, kept.find, count=2, max_count=3)
    b, gen, rows = ring.take(1)
    rows[:] = 5
    kept[1, 1] = a = answer(b, gen)
    ring.record(b, [1], [1])
    ring.take(1)
    assert ring.take(1)[0] == 2 and ring.count == 3     # b still holds kept rows: a new buffer
    assert packed(a) is None and ring.holds(a) and ring.rows_of(a).tolist() == [[5, 5, 5]]
    assert ring.take(1)[0] == b and ring.count == 3      # b again, at the cap: packed, then reused
    assert packed(a) is not None and ring.rows_of(a).tolist() == [[5, 5, 5]]
    again = answer(b, gen + 1)
    ring.record(b, [1], [2])                             # step 2 is not kept: no growth, no packing
    assert [ring.take(1)[0] for _ in range(3)] == [1, 2, 0] and ring.count == 3
    assert packed(again) is None


def test_the_ring_grows_only_to_the_size_the_kept_answers_need():
    """A sequence keeps its last 4 answers and gets a step per take: 5 buffers, never packed."""
    kept = Kept()
    ring = RowBuffers(allocate, 96, kept.find, count=2, max_count=12)
    answers = []
    for t in range(40):
        b, gen, _ = ring.take(1)
        kept[1, t] = a = answer(b, gen)
        answers.append(a)
        ring.record(b, [1], [t])
        kept.pop((1, t - 4), None)                       # it keeps steps t-3 .. t
    assert ring.count == 5
    assert all(packed(a) is None for a in answers)
