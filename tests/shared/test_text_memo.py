"""maskd.text_memo.TextMemo: what a wire text was read into, kept by the text, bounded by characters."""
import pytest

from maskd.text_memo import TextMemo


def test_bounded_by_characters_the_least_recently_used_out_first():
    texts = ["a" * 10, "b" * 10, "c" * 10]
    memo: TextMemo[str] = TextMemo(max_chars=25)                 # room for two
    made = [memo.get_or_make(t, str.upper) for t in texts[:2]]
    assert memo.chars == 20 and memo.get_or_make(texts[0], lambda t: "again") is made[0]   # used: b is oldest
    memo.get_or_make(texts[2], str.upper)
    assert texts[0] in memo and texts[2] in memo and texts[1] not in memo and memo.chars == 20
    assert memo.get_many(texts) == ["A" * 10, None, "C" * 10]


def test_a_value_counts_the_characters_it_holds_and_a_text_larger_than_the_bound_is_not_kept():
    memo: TextMemo[str] = TextMemo(max_chars=30)
    memo.get_or_make("x" * 10, lambda t: t * 2, extra_chars=len)    # 10 + 20
    assert memo.chars == 30 and "x" * 10 in memo
    memo.put("y" * 40, "too large")                                # not kept, and pushes nothing out
    assert "y" * 40 not in memo and "x" * 10 in memo and memo.chars == 30


def test_what_make_raises_is_raised_and_nothing_is_kept():
    memo: TextMemo[int] = TextMemo(max_chars=100)
    for _ in range(2):                                              # raised every time, not a kept failure
        with pytest.raises(ValueError, match="bad"):
            memo.get_or_make("bad", lambda t: int(t))
    assert "bad" not in memo and memo.chars == 0
    memo.put("1", 1)
    memo.put("1", 2)                                                # a text kept keeps its value
    assert memo.get("1") == 1 and memo.chars == 1

