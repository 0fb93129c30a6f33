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
           "bitmask_row_stride": "i32", "HAS_INDICES": "constexpr", "BLOCK_WORDS": "constexpr"}
    src = ASTSource(fn=m._triton_kernel, signature=sig,
                    constexprs={"HAS_INDICES": has_idx, "BLOCK_WORDS": m._BLOCK_WORDS})
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
