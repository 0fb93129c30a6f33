"""maskd_client.apply: in-place bitmask application and the staging buffers.

The fast function is checked bit for bit against the slow reference on odd widths, all three
logits dtypes, with and without indices. The Triton kernel cannot run here without a GPU; it is
checked under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) and compiled for sm_90,
each in a subprocess, when Triton is installed. CUDA tests run where a GPU is present.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from maskd_client.apply import (
    BitmaskBuffers,
    apply_packed_token_bitmask_inplace,
    apply_token_bitmask_inplace,
    apply_token_bitmask_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HAS_CUDA = torch.cuda.is_available()


def _has_triton() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer view, so equality is bit for bit (and -inf == -inf, -0.0 != 0.0)."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    ra, rb = _raw(a), _raw(b)
    if not torch.equal(ra, rb):
        diff = (ra != rb).nonzero()[:5].tolist()
        raise AssertionError(f"tensors differ at {diff}")


def random_bitmask(gen: torch.Generator, rows: int, words: int) -> torch.Tensor:
    """Rows of mixed density, words spanning the whole signed range (negatives included)."""
    out = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int32, generator=gen)
    for r in range(rows):
        kind = r % 4
        if kind == 1:  # sparse: a few allowed tokens, the way most grammar steps look
            keep = torch.rand(words, generator=gen) < 0.05
            out[r] = torch.where(keep, out[r], torch.zeros_like(out[r]))
        elif kind == 2:  # nearly everything allowed, some words with only bit 31
            out[r] = -1
            out[r, ::3] = -(2**31)
        elif kind == 3 and words:  # nothing allowed but one token
            out[r] = 0
            out[r, words // 2] = 1 << (r % 31)
    return out


def random_logits(gen: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen) * 10
    if vocab > 2:
        x[:, 1] = -0.0  # signed zero must survive untouched
        x[:, 2] = float("inf")
    return x.to(dtype)


# (vocab, words): exact, logits wider than 32 * words (padding masked), narrower (bits ignored)
SHAPES = [
    (1, 1),
    (31, 1),
    (32, 1),
    (33, 2),
    (33, 1),
    (100, 4),
    (100, 2),
    (100, 7),
    (64, 0),
    (129280, 4040),
    (129280, 4000),
    (129280, 4050),
]


def _rows_for(vocab: int) -> int:
    return 2 if vocab > 10_000 else 6


# -------------------------------------------------------------------------------------------
# The reference itself, on hand-made rows
# -------------------------------------------------------------------------------------------


def test_reference_on_hand_made_rows():
    bm = torch.tensor(
        [[1, 0], [5, 0], [-(2**31), 0], [0, 1 << 3], [-1, -1]], dtype=torch.int32
    )
    logits = torch.zeros(5, 70)
    apply_token_bitmask_reference(logits, bm)
    allowed = [set((logits[r] == 0).nonzero().flatten().tolist()) for r in range(5)]
    assert allowed == [{0}, {0, 2}, {31}, {35}, set(range(64))]
    assert torch.isinf(logits[4, 64:]).all()


def test_fast_on_hand_made_rows():
    bm = torch.tensor([[-(2**31) | 1, 1 << 30]], dtype=torch.int32)
    logits = torch.arange(80, dtype=torch.float32)
    apply_token_bitmask_inplace(logits, bm[0])
    finite = torch.isfinite(logits).nonzero().flatten().tolist()
    assert finite == [0, 31, 62]
    assert logits[31].item() == 31.0


# -------------------------------------------------------------------------------------------
# Fast vs reference
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("vocab,words", SHAPES)
def test_matches_reference_without_indices(vocab, words, dtype):
    gen = torch.Generator().manual_seed(vocab * 7919 + words)
    rows = _rows_for(vocab)
    bm = random_bitmask(gen, rows, words)
    logits = random_logits(gen, rows, vocab, dtype)
    ref = apply_token_bitmask_reference(logits.clone(), bm)
    out = logits.clone()
    assert apply_token_bitmask_inplace(out, bm) is None
    assert_bit_equal(out, ref)
    if words * 32 < vocab:
        assert torch.isneginf(out[:, 32 * words :].float()).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("vocab,words", SHAPES)
@pytest.mark.parametrize("kind", ["list", "numpy", "tensor"])
def test_matches_reference_with_indices(vocab, words, dtype, kind):
    gen = torch.Generator().manual_seed(vocab * 104729 + words)
    batch = _rows_for(vocab) + 1
    n = batch - 2 if batch > 3 else 2
    idx = torch.randperm(batch, generator=gen)[:n]  # a random subset, in random order
    if kind == "list":
        indices = idx.tolist()
    elif kind == "numpy":
        indices = idx.numpy().astype(np.int32)
    else:
        indices = idx
    bm = random_bitmask(gen, n, words)
    logits = random_logits(gen, batch, vocab, dtype)
    ref = apply_token_bitmask_reference(logits.clone(), bm, idx.tolist())
    out = logits.clone()
    apply_packed_token_bitmask_inplace(out, bm, indices)
    assert_bit_equal(out, ref)
    untouched = sorted(set(range(batch)) - set(idx.tolist()))
    assert_bit_equal(out[untouched], logits[untouched])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("vocab,words", [(1, 1), (33, 2), (100, 3), (100, 5), (129280, 4040)])
def test_one_dimensional(vocab, words, dtype):
    gen = torch.Generator().manual_seed(vocab + words)
    bm = random_bitmask(gen, 1, words)[0]
    logits = random_logits(gen, 1, vocab, dtype)[0]
    ref = apply_token_bitmask_reference(logits.clone(), bm)
    out = logits.clone()
    apply_token_bitmask_inplace(out, bm)
    assert_bit_equal(out, ref)
    # 1-D logits with a (1, words) bitmask, and with indices=[0]
    out2 = logits.clone()
    apply_packed_token_bitmask_inplace(out2, bm.unsqueeze(0), [0])
    assert_bit_equal(out2, ref)


def test_mask_1d_onto_row_of_batch_with_indices():
    gen = torch.Generator().manual_seed(5)
    bm = random_bitmask(gen, 1, 4)[0]
    logits = random_logits(gen, 3, 100, torch.float32)
    out = logits.clone()
    apply_packed_token_bitmask_inplace(out, bm, [2])
    ref = apply_token_bitmask_reference(logits.clone(), bm, [2])
    assert_bit_equal(out, ref)
    assert_bit_equal(out[:2], logits[:2])


def test_noncontiguous_logits_are_masked_in_place():
    gen = torch.Generator().manual_seed(11)
    base = random_logits(gen, 4, 300, torch.float32)
    view = base[:, 50:150]  # row stride 300, a window of columns
    bm = random_bitmask(gen, 4, 4)
    expected = base.clone()
    apply_token_bitmask_reference(expected[:, 50:150], bm)
    apply_token_bitmask_inplace(view, bm)
    assert_bit_equal(base, expected)

    t = random_logits(gen, 100, 5, torch.float16).t()  # (5, 100) with column stride 5
    bm = random_bitmask(gen, 5, 4)
    ref = apply_token_bitmask_reference(t.clone(), bm)
    apply_token_bitmask_inplace(t, bm)
    assert_bit_equal(t, ref)


def test_noncontiguous_bitmask():
    gen = torch.Generator().manual_seed(12)
    wide = random_bitmask(gen, 8, 10)
    bm = wide[::2, 1:5]  # (4, 4), strided
    logits = random_logits(gen, 4, 128, torch.bfloat16)
    ref = apply_token_bitmask_reference(logits.clone(), bm.contiguous())
    apply_token_bitmask_inplace(logits, bm)
    assert_bit_equal(logits, ref)


def test_many_rows_cross_chunk_boundaries(monkeypatch):
    import maskd_client.apply as mod

    monkeypatch.setattr(mod, "_TORCH_CHUNK_ELEMS", 3 * 32 * 5)  # 3 rows per chunk
    gen = torch.Generator().manual_seed(13)
    bm = random_bitmask(gen, 10, 5)
    logits = random_logits(gen, 12, 170, torch.float32)
    idx = torch.randperm(12, generator=gen)[:10].tolist()
    ref = apply_token_bitmask_reference(logits.clone(), bm, idx)
    apply_packed_token_bitmask_inplace(logits, bm, idx)
    assert_bit_equal(logits, ref)


# -------------------------------------------------------------------------------------------
# The CPU path's row shapes: all-ones words skipped, few disallowed tokens written one by one,
# other rows expanded whole (every case against the reference, on both routes and the default)
# -------------------------------------------------------------------------------------------

ROW_KINDS = ["all_ones", "one_zero_bit", "few_zero_bits", "some_zero_words", "random", "sparse", "none", "tail_only"]


def shaped_bitmask(gen: torch.Generator, kinds: list[str], words: int, vocab: int) -> torch.Tensor:
    """One row per kind: all ones; one zero bit; 1-3 zero bits in ~3 % of the words (bit 31
    included); a few words of many zero bits among all-ones words; random; mostly 0; all 0; all
    ones but zero bits past ``vocab`` in the last word."""
    out = torch.full((len(kinds), words), -1, dtype=torch.int32)
    for r, kind in enumerate(kinds):
        if words == 0 or kind == "all_ones":
            continue
        if kind == "one_zero_bit":
            w = int(torch.randint(0, words, (1,), generator=gen))
            out[r, w] = ~(1 << int(torch.randint(0, 32, (1,), generator=gen)))
        elif kind == "few_zero_bits":
            pick = (torch.rand(words, generator=gen) < 0.03).nonzero().flatten().tolist() or [0]
            for w in pick:
                for b in torch.randint(0, 32, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen):
                    out[r, w] &= ~(1 << int(b)) if int(b) != 31 else 0x7FFFFFFF
        elif kind == "some_zero_words":
            pick = torch.randperm(words, generator=gen)[: max(1, words // 20)]
            out[r, pick] = torch.randint(-(2**31), 2**31, (pick.numel(),), dtype=torch.int32, generator=gen)
            out[r, pick[::2]] = 0
        elif kind == "random":
            out[r] = torch.randint(-(2**31), 2**31, (words,), dtype=torch.int32, generator=gen)
        elif kind == "sparse":
            out[r] = 0
            out[r, :: max(1, words // 3)] = 1 << 4
        elif kind == "none":
            out[r] = 0
        elif kind == "tail_only" and vocab % 32 and 32 * words >= vocab:
            out[r, (vocab - 1) // 32] = (1 << (vocab % 32)) - 1  # zero bits past vocab only
    return out


def special_logits(gen: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    x = random_logits(gen, rows, vocab, dtype)
    if vocab > 5:
        x[:, 3] = float("nan")  # values survive bit for bit where allowed
        x[:, 4] = float("-inf")
        x[:, 5] = 0.0
    return x


@pytest.fixture(params=["default", "all_expanded", "all_word_by_word"])
def cpu_route(request, monkeypatch):
    """The default routing, every row with a zero bit expanded whole, and every such row word by
    word."""
    import maskd_client.apply as mod

    if request.param == "all_expanded":
        monkeypatch.setattr(mod, "_SPARSE_LIMIT", 0.0)
    elif request.param == "all_word_by_word":
        monkeypatch.setattr(mod, "_SPARSE_LIMIT", 1e9)
        monkeypatch.setattr(mod, "_DENSE_WORDS", 2.0)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize(
    "vocab,words",
    [(1, 1), (31, 1), (64, 2), (100, 4), (100, 3), (100, 7), (1000, 32), (1000, 31), (995, 40), (4096, 128),
     (5000, 157)],
)
def test_row_shapes_match_reference(vocab, words, dtype, cpu_route):
    gen = torch.Generator().manual_seed(vocab * 31 + words)
    bm = shaped_bitmask(gen, ROW_KINDS, words, vocab)
    logits = special_logits(gen, len(ROW_KINDS), vocab, dtype)
    out = logits.clone()
    apply_token_bitmask_inplace(out, bm)
    assert_bit_equal(out, apply_token_bitmask_reference(logits.clone(), bm))
    # the all-ones row (and the row whose zero bits all lie past the vocabulary) is untouched
    # where the bitmask covers it
    covered = min(vocab, 32 * words)
    assert_bit_equal(out[0, :covered], logits[0, :covered])
    if vocab % 32 and 32 * words >= vocab:
        assert_bit_equal(out[-1], logits[-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("vocab,words", [(100, 4), (1000, 32), (995, 31), (995, 40), (5000, 157)])
def test_row_shapes_with_indices_match_reference(vocab, words, dtype, cpu_route):
    gen = torch.Generator().manual_seed(vocab + 7 * words)
    kinds = ROW_KINDS + ROW_KINDS[::-1]
    bm = shaped_bitmask(gen, kinds, words, vocab)
    batch = len(kinds) + 3
    logits = special_logits(gen, batch, vocab, dtype)
    for idx in (torch.randperm(batch, generator=gen)[: len(kinds)].tolist(), list(range(2, 2 + len(kinds)))):
        out = logits.clone()
        apply_packed_token_bitmask_inplace(out, bm, idx)
        assert_bit_equal(out, apply_token_bitmask_reference(logits.clone(), bm, idx))
        untouched = sorted(set(range(batch)) - set(idx))
        assert_bit_equal(out[untouched], logits[untouched])
    # xgrammar's meaning of indices: logits[i] with bitmask[i]
    sub = sorted(torch.randperm(len(kinds), generator=gen)[:5].tolist())
    out = logits[: len(kinds)].clone()
    apply_token_bitmask_inplace(out, bm, indices=sub)
    assert_bit_equal(out, apply_token_bitmask_reference(logits[: len(kinds)].clone(), bm[sub], sub))


def test_row_shapes_on_strided_logits(cpu_route):
    gen = torch.Generator().manual_seed(23)
    bm = shaped_bitmask(gen, ROW_KINDS, 8, 250)
    base = special_logits(gen, 2 * len(ROW_KINDS), 300, torch.float32)
    view = base[::2, 20:270]  # row stride 600, a window of 250 columns
    expected = base.clone()
    apply_token_bitmask_reference(expected[::2, 20:270], bm)
    apply_token_bitmask_inplace(view, bm)
    assert_bit_equal(base, expected)

    t = special_logits(gen, 250, len(ROW_KINDS), torch.bfloat16).t()  # column stride 8
    ref = apply_token_bitmask_reference(t.clone(), bm)
    apply_packed_token_bitmask_inplace(t, bm, list(range(len(ROW_KINDS))))
    assert_bit_equal(t, ref)


@pytest.mark.parametrize("vocab,words", [(100, 4), (995, 32), (1024, 32), (129280, 4040)])
def test_all_ones_rows_are_untouched(vocab, words):
    gen = torch.Generator().manual_seed(vocab)
    bm = torch.full((3, words), -1, dtype=torch.int32)
    logits = special_logits(gen, 4, vocab, torch.bfloat16)
    out = logits.clone()
    apply_packed_token_bitmask_inplace(out, bm, [3, 0, 1])
    assert_bit_equal(out, logits)
    out = logits[:3].clone()
    apply_token_bitmask_inplace(out, bm)
    assert_bit_equal(out, logits[:3])


def test_mixed_batch_across_chunks(monkeypatch):
    """Expanded rows come in runs of consecutive rows (in both tensors), cut into chunks."""
    import maskd_client.apply as mod

    monkeypatch.setattr(mod, "_TORCH_CHUNK_ELEMS", 2 * 32 * 40)  # 2 rows per chunk
    gen = torch.Generator().manual_seed(29)
    kinds = ["random", "random", "random", "all_ones", "sparse", "none", "one_zero_bit", "random", "none"]
    bm = shaped_bitmask(gen, kinds, 40, 1270)
    logits = special_logits(gen, 12, 1270, torch.float16)
    for idx in (None, [0, 1, 2, 3, 4, 5, 6, 7, 8], [3, 4, 5, 0, 1, 2, 9, 10, 11], [11, 10, 9, 8, 7, 6, 5, 4, 3]):
        lg = logits[: len(kinds)] if idx is None else logits
        out = lg.clone()
        if idx is None:
            apply_token_bitmask_inplace(out, bm)
        else:
            apply_packed_token_bitmask_inplace(out, bm, idx)
        assert_bit_equal(out, apply_token_bitmask_reference(lg.clone(), bm, idx))


def test_rows_over_the_limit_are_expanded(monkeypatch):
    """A row with few words that are not all ones but many disallowed tokens in them goes the
    other route; the result is the same either way."""
    import maskd_client.apply as mod

    calls = []
    monkeypatch.setattr(mod, "_mask_block", lambda t, b, c, f=mod._mask_block: (calls.append(t.shape[0]), f(t, b, c)))
    bm = torch.full((4, 100), -1, dtype=torch.int32)
    bm[0, :40] = 0  # 40 words, 1,280 disallowed tokens: over 2.5 x 100
    bm[1, 5] = ~(1 << 9)  # one token
    bm[2, :60] = 0x7FFFFFFF  # one token (bit 31) in each of 60 words: over half the words
    logits = torch.randn(4, 3200)
    out = logits.clone()
    apply_token_bitmask_inplace(out, bm)
    assert_bit_equal(out, apply_token_bitmask_reference(logits.clone(), bm))
    assert calls == [1, 1]  # rows 0 and 2 expanded; row 1 word by word; row 3 untouched


@pytest.mark.parametrize("seed", range(6))
def test_bit_offsets_enumerate_every_set_bit(seed):
    import maskd_client.apply as mod

    rng = np.random.default_rng(seed)
    n = 500
    pops = rng.integers(1, 33, n) if seed % 2 else rng.choice([1, 1, 1, 2, 3, 4, 32], n)
    inv = np.zeros(n, dtype=np.int64)
    for i, p in enumerate(pops):
        inv[i] = sum(1 << int(b) for b in rng.choice(32, int(p), replace=False))
    inv = ((inv + 2**31) % 2**32 - 2**31).astype(np.int32)  # bit 31 set: a negative word
    base = rng.integers(0, 10**9, n) * 64
    for step in (1, 5):
        got = np.sort(mod._bit_offsets(base, inv, False, step))
        want = np.sort([base[i] + j * step for i in range(n) for j in range(32) if (int(inv[i]) >> j) & 1])
        np.testing.assert_array_equal(got, want)
    shift = rng.integers(0, 32, n)
    single = (np.ones(n, dtype=np.uint32) << shift.astype(np.uint32)).view(np.int32)
    np.testing.assert_array_equal(mod._bit_offsets(base, single, True, 3), base + 3 * shift)
    np.testing.assert_array_equal(mod._bit_offsets(base, single, False, 3), base + 3 * shift)


def test_logits_that_require_grad_stay_visible_to_autograd():
    bm = torch.full((2, 4), -1, dtype=torch.int32)
    bm[0, 1] = ~(1 << 3)
    bm[1] = 0x0F0F0F0F
    x = torch.randn(3, 130, requires_grad=True)
    z = x * 2
    apply_packed_token_bitmask_inplace(z, bm, [2, 0])
    ref = apply_token_bitmask_reference((x * 2).detach(), bm, [2, 0])
    assert_bit_equal(z.detach(), ref)
    z[torch.isfinite(z)].sum().backward()
    assert torch.equal(x.grad, torch.where(torch.isfinite(ref), 2.0, 0.0))
    with pytest.raises(RuntimeError):  # in place on a leaf that requires grad, as torch says
        apply_token_bitmask_inplace(torch.randn(2, 130, requires_grad=True), bm)
    with torch.no_grad():  # no grad: the fast paths
        leaf = torch.randn(2, 130, requires_grad=True)
        expected = apply_token_bitmask_reference(leaf.detach().clone(), bm)
        apply_token_bitmask_inplace(leaf, bm)
        assert_bit_equal(leaf.detach(), expected)


def test_empty_inputs_are_no_ops():
    logits = torch.randn(3, 40)
    before = logits.clone()
    apply_packed_token_bitmask_inplace(logits, torch.zeros(0, 2, dtype=torch.int32), [])
    apply_packed_token_bitmask_inplace(logits, torch.zeros(0, 2, dtype=torch.int32), torch.empty(0, dtype=torch.long))
    assert_bit_equal(logits, before)
    apply_token_bitmask_inplace(torch.zeros(0, 40), torch.zeros(0, 2, dtype=torch.int32))
    apply_token_bitmask_inplace(torch.zeros(2, 0), torch.zeros(2, 2, dtype=torch.int32))


# -------------------------------------------------------------------------------------------
# Garbage in: ValueError
# -------------------------------------------------------------------------------------------

_L = torch.zeros(4, 100)
_B = torch.zeros(4, 4, dtype=torch.int32)

GARBAGE = {
    "logits not a tensor": (np.zeros((4, 100), np.float32), _B, None),
    "logits int": (torch.zeros(4, 100, dtype=torch.int32), _B, None),
    "logits float64": (torch.zeros(4, 100, dtype=torch.float64), _B, None),
    "logits 3-D": (torch.zeros(1, 4, 100), _B, None),
    "logits 0-D": (torch.tensor(1.0), _B, None),
    "logits expanded": (torch.zeros(1, 100).expand(4, 100), _B, None),
    "bitmask not a tensor": (_L, np.zeros((4, 4), np.int32), None),
    "bitmask int64": (_L, torch.zeros(4, 4, dtype=torch.int64), None),
    "bitmask uint8": (_L, torch.zeros(4, 16, dtype=torch.uint8), None),
    "bitmask bool": (_L, torch.zeros(4, 100, dtype=torch.bool), None),
    "bitmask float": (_L, torch.zeros(4, 4), None),
    "bitmask 3-D": (_L, torch.zeros(1, 4, 4, dtype=torch.int32), None),
    "bitmask 0-D": (_L, torch.tensor(1, dtype=torch.int32), None),
    "batch mismatch": (_L, torch.zeros(3, 4, dtype=torch.int32), None),
    "batch mismatch 1-D": (torch.zeros(100), _B, None),
    "indices too many": (_L, _B[:2], [0, 1, 2]),
    "indices too few": (_L, _B[:3], [0, 1]),
    "index too large": (_L, _B[:2], [0, 4]),
    "index negative": (_L, _B[:2], [-1, 0]),
    "index tensor too large": (_L, _B[:2], torch.tensor([1, 9])),
    "indices duplicate": (_L, _B[:2], [1, 1]),
    "indices float": (_L, _B[:2], [0.0, 1.0]),
    "indices float tensor": (_L, _B[:2], torch.tensor([0.0, 1.0])),
    "indices bool tensor": (_L, _B[:2], torch.tensor([True, False])),
    "indices 2-D": (_L, _B[:2], [[0, 1]]),
    "indices 2-D tensor": (_L, _B[:2], torch.tensor([[0], [1]])),
    "indices scalar": (_L, _B[:1], 0),
    "indices string": (_L, _B[:2], "01"),
    "indices ragged": (_L, _B[:2], [[0], [1, 2]]),
    "indices meta device": (_L, _B[:2], torch.tensor([0, 1], device="meta")),
    "devices differ": (_L, torch.zeros(4, 4, dtype=torch.int32, device="meta"), None),
    "devices differ (logits)": (torch.zeros(4, 100, device="meta"), _B, None),
}


@pytest.mark.parametrize("case", list(GARBAGE), ids=list(GARBAGE))
def test_garbage_raises_value_error(case):
    logits, bitmask, indices = GARBAGE[case]
    before = None
    if isinstance(logits, torch.Tensor) and logits.device.type == "cpu" and 0 not in logits.stride():
        logits = logits.clone()
        before = logits.clone()
    with pytest.raises(ValueError):
        apply_packed_token_bitmask_inplace(logits, bitmask, indices)
    if before is not None:
        assert_bit_equal(logits, before)  # nothing written before the error


# -------------------------------------------------------------------------------------------
# One meaning per name: xgrammar's and llguidance's apply_token_bitmask_inplace
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,words", [(100, 4), (129280, 4040), (96, 3), (70, 3)])
def test_same_as_xgrammar_and_llguidance(vocab, words):
    """Same arguments, same meaning: rows i with i, the indices keyword (xgrammar) and vocab_size."""
    xgr = pytest.importorskip("xgrammar")
    llg_torch = pytest.importorskip("llguidance.torch")
    gen = torch.Generator().manual_seed(vocab + words)
    bm = random_bitmask(gen, 5, words)
    logits = random_logits(gen, 5, vocab, torch.float32)
    ours, theirs, ll = logits.clone(), logits.clone(), logits.clone()
    apply_token_bitmask_inplace(ours, bm)
    xgr.apply_token_bitmask_inplace(theirs, bm)
    llg_torch.apply_token_bitmask_inplace(ll, bm)
    assert_bit_equal(ours, theirs)
    assert_bit_equal(ours, ll)
    for kw in ({"indices": [3, 0]}, {"vocab_size": vocab - 5}, {"indices": [4, 1], "vocab_size": vocab // 2}):
        ours, theirs = logits.clone(), logits.clone()
        apply_token_bitmask_inplace(ours, bm, **kw)
        xgr.apply_token_bitmask_inplace(theirs, bm, **kw)
        assert_bit_equal(ours, theirs)


def test_indices_name_rows_of_both_tensors():
    """xgrammar's meaning: logits[i] with bitmask[i]; the batch sizes may differ."""
    gen = torch.Generator().manual_seed(21)
    bm = random_bitmask(gen, 6, 4)
    logits = random_logits(gen, 4, 120, torch.float32)
    out = logits.clone()
    apply_token_bitmask_inplace(out, bm, indices=[3, 1])
    ref = apply_token_bitmask_reference(logits.clone(), bm[[3, 1]], [3, 1])
    assert_bit_equal(out, ref)
    assert_bit_equal(out[[0, 2]], logits[[0, 2]])
    out = logits.clone()
    apply_token_bitmask_inplace(out, bm, indices=torch.tensor([2]))
    assert_bit_equal(out, apply_token_bitmask_reference(logits.clone(), bm[[2]], [2]))


def test_columns_past_the_bitmask_are_masked_and_vocab_size_leaves_padding():
    gen = torch.Generator().manual_seed(22)
    bm = torch.full((2, 2), -1, dtype=torch.int32)            # 64 tokens, all allowed
    logits = random_logits(gen, 2, 80, torch.float32)
    out = logits.clone()
    apply_token_bitmask_inplace(out, bm)
    assert torch.isneginf(out[:, 64:]).all() and torch.equal(out[:, :64], logits[:, :64])
    out = logits.clone()
    apply_token_bitmask_inplace(out, torch.zeros(2, 2, dtype=torch.int32), vocab_size=60)
    assert torch.isneginf(out[:, :60]).all() and torch.equal(out[:, 60:], logits[:, 60:])


@pytest.mark.parametrize("kw", [{"vocab_size": 101}, {"vocab_size": -1}, {"vocab_size": 2.5}, {"vocab_size": True},
                                {"indices": [4]}, {"indices": [0, 0]}, {"indices": [-1]}, {"indices": "0"}])
def test_keyword_garbage(kw):
    logits = _L.clone()
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(logits, _B, **kw)
    assert_bit_equal(logits, _L)


def test_indices_are_keyword_only_and_packed_needs_rows():
    with pytest.raises(TypeError):
        apply_token_bitmask_inplace(_L.clone(), _B[:2], [0, 1])   # the old positional, packed meaning
    with pytest.raises(ValueError, match="logits_rows"):
        apply_packed_token_bitmask_inplace(_L.clone(), _B, None)


def test_error_messages_say_what_is_wrong():
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_inplace(_L.clone(), _B.long())
    with pytest.raises(ValueError, match="out of range"):
        apply_packed_token_bitmask_inplace(_L.clone(), _B[:1], [7])
    with pytest.raises(ValueError, match="3 rows but logits have 4"):
        apply_token_bitmask_inplace(_L.clone(), _B[:3])
    with pytest.raises(ValueError, match="meta"):
        apply_token_bitmask_inplace(_L.clone(), _B.to("meta"))


# -------------------------------------------------------------------------------------------
# BitmaskBuffers (CPU)
# -------------------------------------------------------------------------------------------


def _rows(n: int, words: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-(2**31), 2**31, size=(n, words), dtype=np.int64).astype(np.int32)


def test_buffers_upload_returns_the_rows():
    buf = BitmaskBuffers(8, 5, device="cpu")
    assert buf.max_rows == 8 and buf.words == 5
    rows = _rows(3, 5, 0)
    out = buf.upload(rows)
    assert out.dtype == torch.int32 and out.shape == (3, 5) and out.device.type == "cpu"
    np.testing.assert_array_equal(out.numpy(), rows)
    rows[0, 0] ^= 1  # a copy, not a view of the caller's array
    assert out[0, 0].item() != rows[0, 0]
    assert buf.ready_event() is None  # nothing to wait for on CPU
    buf.wait()
    buf.synchronize()
    buf.mark_consumed()


def test_buffers_feed_apply():
    gen = torch.Generator().manual_seed(3)
    buf = BitmaskBuffers(4, 4, device="cpu")
    rows = random_bitmask(gen, 3, 4).numpy()
    logits = random_logits(gen, 5, 100, torch.float32)
    ref = apply_token_bitmask_reference(logits.clone(), torch.from_numpy(rows), [4, 0, 2])
    apply_packed_token_bitmask_inplace(logits, buf.upload(rows), [4, 0, 2])
    assert_bit_equal(logits, ref)


def test_buffers_slots_keep_previous_rows():
    buf = BitmaskBuffers(4, 3, device="cpu", num_slots=2)
    a, b, c = _rows(2, 3, 1), _rows(4, 3, 2), _rows(1, 3, 3)
    ta = buf.upload(a)
    tb = buf.upload(b)
    np.testing.assert_array_equal(ta.numpy(), a)  # step t's rows survive step t+1's upload
    np.testing.assert_array_equal(tb.numpy(), b)
    tc = buf.upload(c)
    np.testing.assert_array_equal(tc.numpy(), c)
    np.testing.assert_array_equal(tb.numpy(), b)


def test_buffers_grow():
    buf = BitmaskBuffers(2, 4, device="cpu")
    small = _rows(2, 4, 4)
    np.testing.assert_array_equal(buf.upload(small).numpy(), small)
    big = _rows(9, 4, 5)
    out = buf.upload(big)
    assert buf.max_rows >= 9
    np.testing.assert_array_equal(out.numpy(), big)
    for seed in range(4):  # every slot has grown
        again = _rows(9, 4, 10 + seed)
        np.testing.assert_array_equal(buf.upload(again).numpy(), again)
    np.testing.assert_array_equal(buf.upload(small).numpy(), small)
    assert buf.upload(np.zeros((0, 4), np.int32)).shape == (0, 4)


def test_buffers_accept_uint32_readonly_and_strided():
    buf = BitmaskBuffers(4, 2, device="cpu")
    u = np.array([[0xFFFFFFFF, 0x80000000]], dtype=np.uint32)
    np.testing.assert_array_equal(buf.upload(u).numpy(), [[-1, -(2**31)]])
    ro = np.frombuffer(np.arange(4, dtype=np.int32).tobytes(), dtype=np.int32).reshape(2, 2)
    assert not ro.flags.writeable
    np.testing.assert_array_equal(buf.upload(ro).numpy(), ro)
    strided = _rows(6, 4, 6)[::2, ::2]
    np.testing.assert_array_equal(buf.upload(strided).numpy(), strided)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 5), np.int32),  # wrong words
        np.zeros((2, 3), np.int32),
        np.zeros((2, 4), np.int64),
        np.zeros((2, 4), np.float32),
        np.zeros(4, np.int32),
        np.zeros((1, 2, 4), np.int32),
        [[0, 0, 0, 0]],
        torch.zeros(2, 4, dtype=torch.int32),
    ],
    ids=["words5", "words3", "int64", "float32", "1-D", "3-D", "list", "tensor"],
)
def test_buffers_reject_bad_rows(bad):
    buf = BitmaskBuffers(4, 4, device="cpu")
    with pytest.raises(ValueError):
        buf.upload(bad)


def test_buffers_reject_bad_construction():
    with pytest.raises(ValueError):
        BitmaskBuffers(-1, 4, device="cpu")
    with pytest.raises(ValueError):
        BitmaskBuffers(4, -1, device="cpu")
    with pytest.raises(ValueError):
        BitmaskBuffers(4, 4, device="cpu", num_slots=0)


# -------------------------------------------------------------------------------------------
# Triton stays out of the CPU path
# -------------------------------------------------------------------------------------------

_CPU_SMOKE = """
import torch
from maskd_client.apply import apply_packed_token_bitmask_inplace, apply_token_bitmask_reference, BitmaskBuffers
g = torch.Generator().manual_seed(0)
bm = torch.randint(-2**31, 2**31, (3, 4), dtype=torch.int32, generator=g)
lg = torch.randn(5, 120, generator=g)
ref = apply_token_bitmask_reference(lg.clone(), bm, [4, 1, 0])
apply_packed_token_bitmask_inplace(lg, BitmaskBuffers(3, 4, device="cpu").upload(bm.numpy()), [4, 1, 0])
assert torch.equal(lg, ref)
"""


_TRITON_INTERPRETER_CHECK = """
import torch
import maskd_client.apply as m
assert m.triton_available()
g = torch.Generator().manual_seed(1)
cases = [(1, 1, None), (33, 1, None), (100, 4, [3, 0]), (100, 7, None), (70, 2, [1]),
         (5000, 150, [2, 4, 0]), (5000, 200, None)]
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for vocab, words, idx in cases:
        n = len(idx) if idx else 5
        bm = torch.randint(-2**31, 2**31, (n, words), dtype=torch.int32, generator=g)
        bm[0, ::2] = -2**31
        lg = (torch.randn(5, vocab, generator=g) * 10).to(dtype)
        ref = m.apply_token_bitmask_reference(lg.clone(), bm, idx)
        out = lg.clone()
        l2, b2, i2 = m._validate(out, bm, idx)
        m._apply_triton(l2, b2, i2)
        assert torch.equal(out, ref), (dtype, vocab, words, idx)
        if idx:  # indices already a tensor
            out = lg.clone()
            m._apply_triton(out, bm, torch.tensor(idx))
            assert torch.equal(out, ref), (dtype, vocab, words, idx, "tensor")
base = torch.randn(4, 300, generator=g)
bm = torch.randint(-2**31, 2**31, (4, 4), dtype=torch.int32, generator=g)
exp = base.clone()
m.apply_token_bitmask_reference(exp[:, 50:150], bm)
m._apply_triton(base[:, 50:150], bm, None)
assert torch.equal(base, exp)
cols = torch.randn(3000, 3, generator=g).t()  # a column stride of 3
bm = torch.randint(-2**31, 2**31, (3, 94), dtype=torch.int32, generator=g)
exp = m.apply_token_bitmask_reference(cols.clone(), bm)
m._apply_triton(cols, bm, None)
assert torch.equal(cols, exp)

# Row shapes: all ones (no store), one zero bit, a few zero bits, random, none allowed, and
# all ones but for zero bits past the vocabulary; vocab not a multiple of 32, a bitmask wider and
# narrower than the logits, with and without indices.
def shaped(n, words, vocab):
    bm = torch.full((n, words), -1, dtype=torch.int32)
    for r in range(n):
        kind = r % 6
        if kind == 1:
            bm[r, (7 * r) % words] = ~(1 << (r % 32))
        elif kind == 2:
            bm[r, ::5] = 0x7FFFFFFF  # bit 31 off
            bm[r, 3 % words] &= ~(1 << 9)
        elif kind == 3:
            bm[r] = torch.randint(-2**31, 2**31, (words,), dtype=torch.int32, generator=g)
        elif kind == 4:
            bm[r] = 0
        elif kind == 5 and vocab % 32 and 32 * words >= vocab:
            bm[r, (vocab - 1) // 32] = (1 << (vocab % 32)) - 1
    return bm
shape_cases = [(1024, 32, None), (1000, 32, None), (1000, 40, [6, 0, 3, 1, 5, 2]), (995, 31, [1, 3, 7]),
               (2080, 65, list(range(8))), (70, 3, [0]), (33, 2, None)]
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for vocab, words, idx in shape_cases:
        n = len(idx) if idx else 6
        bm = shaped(n, words, vocab)
        lg = (torch.randn(8, vocab, generator=g) * 10).to(dtype)
        lg[:, 1] = float("nan")
        lg[:, 2] = -0.0
        ref = m.apply_token_bitmask_reference((lg if idx else lg[:n]).clone(), bm, idx)
        out = (lg if idx else lg[:n]).clone()
        l2, b2, i2 = m._validate(out, bm, idx)
        m._apply_triton(l2, b2, i2)
        assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           ref.view(torch.int16 if dtype != torch.float32 else torch.int32)), (dtype, vocab, words, idx)
    ones = torch.full((3, 40), -1, dtype=torch.int32)  # every block skipped: nothing touched
    lg = (torch.randn(5, 1000, generator=g) * 10).to(dtype)
    out = lg.clone()
    m._apply_triton(out, ones, torch.tensor([4, 0, 2]))
    assert torch.equal(out, lg), dtype
print("ok")
"""

_TRITON_SM90_COMPILE = """
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print("skip", e); raise SystemExit(0)
import maskd_client.apply as m
assert m.triton_available()
for ptr, has_idx in (("*fp32", False), ("*bf16", True), ("*fp16", True)):
    sig = {"logits_ptr": ptr, "bitmask_ptr": "*i32", "indices_ptr": "*i64", "vocab": "i32",
           "words": "i32", "logits_row_stride": "i64", "logits_col_stride": "i32",
           "bitmask_row_stride": "i32", "HAS_INDICES": "constexpr", "BLOCK_WORDS": "constexpr",
           "TILES": "constexpr", "WIDE_OFFSETS": "constexpr"}
    src = ASTSource(fn=m._triton_kernel, signature=sig,
                    constexprs={"HAS_INDICES": has_idx, "BLOCK_WORDS": m._BLOCK_WORDS,
                                "TILES": m._TILES, "WIDE_OFFSETS": False})
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # no NVIDIA backend / ptxas in this Triton build
        if "ptxas" in str(e) or "backend" in str(e).lower():
            print("skip", e); raise SystemExit(0)
        raise
    assert k.asm.get("cubin"), ptr
print("ok")
"""


@pytest.fixture(scope="module")
def subprocs(tmp_path_factory):
    """Start every subprocess check at once (each pays a torch import), collect them by name."""
    cache = tmp_path_factory.mktemp("triton-cache")
    jobs = {
        "blocked": (
            "import sys\nsys.modules['triton'] = None\n"
            + _CPU_SMOKE
            + "import maskd_client.apply as m\n"
            "assert m.triton_available() is False\n"
            "assert sys.modules['triton'] is None\n"
            "print('ok')\n",
            {},
        ),
        "no_import": ("import sys\n" + _CPU_SMOKE + "print('triton' in sys.modules)\n", {}),
    }
    if _has_triton():
        jobs["interpreter"] = (_TRITON_INTERPRETER_CHECK, {"TRITON_INTERPRET": "1"})
        jobs["sm90"] = (
            _TRITON_SM90_COMPILE,
            {"TRITON_CACHE_DIR": str(cache), "TRITON_DEFAULT_FP_FUSION": "1"},
        )
    procs = {}
    for name, (code, extra) in jobs.items():
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        env.update(extra)
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def result(name: str) -> str:
        proc = procs[name]
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        return out.strip()

    yield result
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_works_with_triton_blocked(subprocs):
    assert subprocs("blocked") == "ok"


def test_cpu_path_never_imports_triton(subprocs):
    assert subprocs("no_import") == "False"


# -------------------------------------------------------------------------------------------
# The Triton kernel without a GPU: interpreter and sm_90 compile
# -------------------------------------------------------------------------------------------


@pytest.mark.skipif(not _has_triton(), reason="triton not installed")
def test_triton_kernel_under_interpreter(subprocs):
    assert subprocs("interpreter") == "ok"


@pytest.mark.skipif(not _has_triton(), reason="triton not installed")
def test_triton_kernel_compiles_for_sm90(subprocs):
    out = subprocs("sm90")
    if out.startswith("skip"):
        pytest.skip(out)
    assert out == "ok"


# -------------------------------------------------------------------------------------------
# CUDA (runs only where a GPU is present)
# -------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")


@cuda
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("vocab,words", [(1, 1), (33, 1), (100, 7), (129280, 4040), (129280, 4000)])
def test_cuda_matches_reference(vocab, words, dtype, use_triton, monkeypatch):
    import maskd_client.apply as mod

    if use_triton and not mod.triton_available():
        pytest.skip("triton not importable")
    if not use_triton:
        monkeypatch.setattr(mod, "_triton_state", "missing")
    gen = torch.Generator().manual_seed(vocab + words)
    bm = random_bitmask(gen, 4, words)
    logits = random_logits(gen, 6, vocab, dtype)
    for indices in (None, [5, 0, 3, 2], torch.tensor([1, 4, 0, 3], device="cuda")):
        lg = logits[:4] if indices is None else logits
        ref = apply_token_bitmask_reference(lg.clone(), bm, None if indices is None else list(map(int, indices)))
        out = lg.cuda()
        if indices is None:
            apply_token_bitmask_inplace(out, bm.cuda())
        else:
            apply_packed_token_bitmask_inplace(out, bm.cuda(), indices)
        assert_bit_equal(out, ref)


@cuda
def test_cuda_buffers_side_stream():
    gen = torch.Generator().manual_seed(9)
    words = 4040
    buf = BitmaskBuffers(2, words)
    assert buf.device.type == "cuda"
    side = torch.cuda.Stream()
    logits = random_logits(gen, 3, 129280, torch.float32)
    for step in range(5):
        rows = random_bitmask(gen, 3 if step == 3 else 2, words).numpy()  # step 3 grows
        idx = [2, 0, 1][: rows.shape[0]]
        ref = apply_token_bitmask_reference(logits.clone(), torch.from_numpy(rows), idx)
        dev_rows = buf.upload(rows, stream=side)
        assert buf.ready_event() is not None
        buf.wait()
        out = logits.cuda()
        apply_packed_token_bitmask_inplace(out, dev_rows, idx)
        buf.mark_consumed()
        assert_bit_equal(out, ref)
    assert buf.max_rows >= 3


@cuda
def test_cuda_apply_with_host_indices_never_waits_for_the_gpu(monkeypatch):
    """Indices given as a list or a CPU tensor: no call synchronizes with the device (the engine's
    CPU thread must not wait for the forward pass that wrote the logits). torch's sync debug mode
    raises on any synchronizing copy or call."""
    import maskd_client.apply as mod

    gen = torch.Generator().manual_seed(11)
    bm = random_bitmask(gen, 4, 4040)
    logits = random_logits(gen, 6, 129280, torch.bfloat16)
    ref = apply_token_bitmask_reference(logits.clone(), bm, [5, 0, 3, 2])
    full = torch.full((6, 4040), -1, dtype=torch.int32)
    full[[5, 0, 3, 2]] = bm
    for use_triton in ([True] if mod.triton_available() else []) + [False]:
        if not use_triton:
            monkeypatch.setattr(mod, "_triton_state", "missing")
        apply_packed_token_bitmask_inplace(logits.cuda(), bm.cuda(), [5, 0, 3, 2])   # first-call tables
        for indices in ([5, 0, 3, 2], torch.tensor([5, 0, 3, 2])):
            packed, whole = logits.cuda(), logits.cuda()
            dev_bm, dev_full = bm.cuda(), full.cuda()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                apply_packed_token_bitmask_inplace(packed, dev_bm, indices)
                apply_token_bitmask_inplace(whole, dev_full, indices=indices)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert_bit_equal(packed.cpu(), ref)
            assert_bit_equal(whole.cpu(), ref)


def test_buffers_take_rows_decoded_into_their_host_buffer_without_a_copy():
    """``host_rows`` hands out the next slot's host buffer; rows written there are uploaded in
    place (the same memory), and the slots go round as before."""
    buf = BitmaskBuffers(2, 3, device="cpu", num_slots=2)
    first = _rows(2, 3, 7)
    host = buf.host_rows(2)
    host[:2] = first
    out = buf.upload(host[:2])
    assert out.data_ptr() == torch.from_numpy(host).data_ptr()
    np.testing.assert_array_equal(out.numpy(), first)
    other = _rows(2, 3, 8)                      # an upload from elsewhere copies into the next slot
    second = buf.upload(other)
    np.testing.assert_array_equal(second.numpy(), other)
    np.testing.assert_array_equal(out.numpy(), first)
    grown = buf.host_rows(5)                    # grows every slot
    assert grown.shape[0] >= 5 and buf.max_rows >= 5
    big = _rows(5, 3, 9)
    grown[:5] = big
    np.testing.assert_array_equal(buf.upload(grown[:5]).numpy(), big)
