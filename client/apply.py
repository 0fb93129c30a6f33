"""Apply packed token bitmasks to logits in place, and stage bitmask rows on the device.

Layout (the one of vLLM, xgrammar and llguidance): a row is ``words`` int32 words; bit ``i % 32``
of word ``i // 32`` set means token ``i`` is allowed. Words are signed int32, so a word whose
bit 31 is set is negative; every shift below is an arithmetic shift followed by ``& 1``, which is
exact for negative words too.

Two functions, one meaning per name:

* :func:`apply_token_bitmask_inplace` ``(logits, bitmask, *, vocab_size=None, indices=None)`` has
  the arguments and the meaning of xgrammar's and llguidance's function of that name: bitmask row
  ``i`` masks logits row ``i``; with ``indices``, only the listed rows of both are used
  (``logits[i]`` with ``bitmask[i]`` for ``i`` in indices); with ``vocab_size``, only
  ``logits[:, :vocab_size]`` is touched. One choice where the two libraries differ: logits columns
  past ``32 * words`` are set to ``-inf`` (llguidance's behaviour; xgrammar leaves them and warns
  that out-of-grammar tokens can then be sampled).
* :func:`apply_packed_token_bitmask_inplace` ``(logits, bitmask, logits_rows)``: maskd's packed
  mapping, for a bitmask that holds only the rows of the sequences that have a grammar: bitmask
  row ``k`` masks logits row ``logits_rows[k]``.

On CUDA the work is one Triton kernel when ``triton`` can be imported; elsewhere (CPU, or CUDA
without Triton) it is a few vectorized torch ops. On CPU, words of all ones (-1, 32 allowed
tokens) are skipped first: rows of them only are not touched, and rows with few disallowed tokens
get only those written; the rest are expanded whole. Triton is imported lazily, only on the first
CUDA call, so a CPU-only worker never imports it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "BitmaskBuffers",
    "apply_packed_token_bitmask_inplace",
    "apply_token_bitmask_inplace",
    "apply_token_bitmask_reference",
    "triton_available",
]

_LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The Triton kernel's tile: BLOCK_WORDS words (a (BLOCK_WORDS, 32) tile of 512 logits), TILES of them one after
# the other per program (4,096 logits), NUM_WARPS warps. Chosen on an H100 among tiles of 8-32 words, 1-16 tiles
# and 2-8 warps and against xgrammar's kernel (docs/decisions/0009-cuda-apply-kernel.md): small tiles over few
# warps keep rows that disallow most tokens (most grammar steps) fast, several tiles per program keep the
# program count low for rows that allow all.
_BLOCK_WORDS = 16
_TILES = 8
_NUM_WARPS = 4

# The torch path expands bits into an int32 (or int16) temporary of (rows, 32 * words); process
# rows in chunks so that temporary stays near this many elements (16 MiB) whatever the batch.
_TORCH_CHUNK_ELEMS = 1 << 22

IndicesLike = Any  # None, a sequence of ints, a numpy integer array or an integer torch tensor


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _as_2d_logits(logits: Any) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in _LOGITS_DTYPES:
        raise ValueError(
            f"logits dtype must be float32, float16 or bfloat16, got {logits.dtype}"
        )
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    elif logits.dim() != 2:
        raise ValueError(
            f"logits must be 1-D (vocab,) or 2-D (batch, vocab), got shape {tuple(logits.shape)}"
        )
    for size, stride in zip(logits.shape, logits.stride()):
        if stride == 0 and size > 1:
            raise ValueError(
                "logits has overlapping memory (an expanded/broadcast view); "
                "it cannot be masked in place"
            )
    return logits


def _as_2d_bitmask(bitmask: Any) -> torch.Tensor:
    if not isinstance(bitmask, torch.Tensor):
        raise ValueError(f"bitmask must be a torch.Tensor, got {type(bitmask).__name__}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask dtype must be torch.int32, got {bitmask.dtype}")
    if bitmask.dim() == 1:
        bitmask = bitmask.unsqueeze(0)
    elif bitmask.dim() != 2:
        raise ValueError(
            "bitmask must be 1-D (words,) or 2-D (rows, words), "
            f"got shape {tuple(bitmask.shape)}"
        )
    return bitmask


def _indices_to_numpy(indices: IndicesLike, logits_device: torch.device) -> np.ndarray:
    """Host copy of ``indices`` as int64, after checking type, dtype, rank and device."""
    if isinstance(indices, torch.Tensor):
        if indices.device.type != "cpu" and indices.device != logits_device:
            raise ValueError(
                f"indices are on {indices.device} but logits are on {logits_device}"
            )
        if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
            raise ValueError(f"indices must hold integers, got dtype {indices.dtype}")
        if indices.dim() != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
        # A device tensor costs one synchronizing copy here; pass a list or a CPU tensor on the
        # hot path.
        return indices.detach().to("cpu", torch.int64).numpy()
    if isinstance(indices, (str, bytes)):
        raise ValueError(f"indices must be a sequence of ints, got {type(indices).__name__}")
    try:
        arr = np.asarray(indices)
    except Exception as exc:  # ragged lists and the like
        raise ValueError(f"indices must be a 1-D sequence of ints: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"indices must hold integers, got {arr.dtype} ({arr[:4].tolist()}...)")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise ValueError("indices out of range")
    return arr.astype(np.int64, copy=False)


def _validate(
    logits: Any, bitmask: Any, indices: IndicesLike
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
    logits2d = _as_2d_logits(logits)
    bitmask2d = _as_2d_bitmask(bitmask)
    if logits2d.device != bitmask2d.device:
        raise ValueError(
            f"logits are on {logits2d.device} but bitmask is on {bitmask2d.device}; "
            "copy the bitmask to the logits' device first"
        )
    n_logit_rows = logits2d.shape[0]
    n_mask_rows = bitmask2d.shape[0]
    if indices is None:
        if n_mask_rows != n_logit_rows:
            raise ValueError(
                f"bitmask has {n_mask_rows} rows but logits have {n_logit_rows}; "
                "pass indices (or use apply_packed_token_bitmask_inplace) to mask a subset of the logits rows"
            )
        return logits2d, bitmask2d, None
    idx = _indices_to_numpy(indices, logits2d.device)
    if idx.shape[0] != n_mask_rows:
        raise ValueError(
            f"{idx.shape[0]} indices for {n_mask_rows} bitmask rows; "
            "logits_rows[k] names the logits row masked by bitmask row k"
        )
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n_logit_rows:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"index {bad} out of range for logits with {n_logit_rows} rows"
            )
        if np.unique(idx).size != idx.size:
            raise ValueError("indices must be unique (each logits row gets at most one bitmask row)")
    return logits2d, bitmask2d, idx


# --------------------------------------------------------------------------------------------
# Torch path (CPU; CUDA without Triton)
# --------------------------------------------------------------------------------------------


# Rows are expanded whole with integer ops on the logits' own bits: x ^= bits(-inf); x &= keep
# (all ones where the token is allowed, 0 where not); x ^= bits(-inf). That is masked_fill(-inf)
# bit for bit, whatever the value (NaN, +inf and -0.0 included), and several times faster on CPU,
# where masked_fill_ with a bool mask runs at ~1.7 ns per element.
_NEG_INF_BITS = {torch.float32: -8388608, torch.float16: -1024, torch.bfloat16: -128}  # ff800000, fc00, ff80

# On CPU, words that are all ones (-1) allow all 32 of their tokens and are skipped: a row of them
# only is not touched. A row whose other words plus their disallowed tokens number at most
# _SPARSE_LIMIT x its words is masked word by word: only its disallowed tokens are written, in one
# scattered store. Other rows, and rows where over _DENSE_WORDS of the words hold a disallowed
# token, are expanded whole, which costs about the same per row whatever its bits. On the 2-core AMD EPYC of
# docs/decisions/0008-cpu-apply-kernel.md the two routes cost the same near 4 x the row's words with one torch thread;
# the whole-row route gains from more threads and the word-by-word one does not, hence 2.5.
_SPARSE_LIMIT = 2.5
_DENSE_WORDS = 0.5

_LITTLE_ENDIAN = sys.byteorder == "little"

_keep_luts: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _keep_lut(device: torch.device, int_dtype: torch.dtype) -> torch.Tensor:
    """(256, 8) ``int_dtype``: ``[b, j]`` is -1 where bit j of byte b is set, else 0."""
    key = (device, int_dtype)
    lut = _keep_luts.get(key)
    if lut is None:
        b = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        lut = (-((b >> torch.arange(8, dtype=torch.int32)) & 1)).to(device, int_dtype)
        _keep_luts[key] = lut  # a race computes the same table twice, harmlessly
    return lut


def _token_bytes(bm: torch.Tensor) -> torch.Tensor:
    """(c, words) int32 -> (c * words * 4,) int32: the bytes of the words in token order."""
    if _LITTLE_ENDIAN:
        return bm.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=bm.device)
    return ((bm.unsqueeze(-1) >> shifts) & 255).reshape(-1)


def _mask_block(target: torch.Tensor, bm: torch.Tensor, covered: int) -> None:
    """Mask ``target[:, :covered]`` (c rows) with ``bm`` (c, ceil(covered / 32)) in place."""
    c, words = bm.shape
    int_dtype = torch.int32 if target.element_size() == 4 else torch.int16
    keep = _keep_lut(bm.device, int_dtype).index_select(0, _token_bytes(bm))  # (c * words * 4, 8)
    keep = keep.view(c, 32 * words)[:, :covered]
    neg_inf = _NEG_INF_BITS[target.dtype]
    raw = target[:, :covered].view(int_dtype)  # same element size: a view for any strides
    raw.bitwise_xor_(neg_inf).bitwise_and_(keep).bitwise_xor_(neg_inf)


_POP8 = np.array([bin(b).count("1") for b in range(256)], dtype=np.uint8)
_bitwise_count = getattr(np, "bitwise_count", None)  # numpy >= 2.0


def _popcount(words: np.ndarray) -> np.ndarray:
    """Set bits of each int32 word."""
    as_unsigned = words.view(np.uint32)  # bitwise_count counts the bits of |x| for signed types
    if _bitwise_count is not None:
        return _bitwise_count(as_unsigned)
    return _POP8[as_unsigned.view(np.uint8)].reshape(-1, 4).sum(1, dtype=np.uint8)


def _lone_bit(x: np.ndarray) -> np.ndarray:
    """The index of the one set bit of each int32 word: its exponent as a float32 (exact)."""
    return (x.view(np.uint32).astype(np.float32).view(np.int32) >> 23) - 127


def _bit_offsets(base: np.ndarray, inv: np.ndarray, single: bool, step: int) -> np.ndarray:
    """``base[i] + j * step`` for every set bit j of ``inv[i]`` (int32 words, none 0; ``single``:
    none has more than one set bit)."""
    if single:  # one disallowed token per word: typical of mostly-allowed rows
        return base + (_lone_bit(inv) if step == 1 else _lone_bit(inv) * step)
    found = []
    for _ in range(3):  # peel the lowest set bit off, three times at most
        low = inv & -inv  # int32 wraps: the lowest bit of INT_MIN is INT_MIN
        found.append(base + (_lone_bit(low) if step == 1 else _lone_bit(low) * step))
        inv = inv ^ low
        more = np.flatnonzero(inv != 0)  # a bool array: several times faster than on int32
        if more.size == 0:
            return np.concatenate(found)
        base, inv = base[more], inv[more]
    # Words with more bits left are unpacked whole (token order on any host).
    bits = np.unpackbits(inv.astype("<i4").view(np.uint8), bitorder="little")
    hit = np.flatnonzero(bits.view(np.bool_))  # 32 * word + bit
    found.append(base[hit >> 5] + (hit & 31) * step)
    return np.concatenate(found)


_NO_ROWS = np.empty(0, dtype=np.int64)


def _mask_sparse_cpu(
    logits2d: torch.Tensor, words: np.ndarray, idx: np.ndarray | None, covered: int
) -> np.ndarray:
    """Write -inf to the disallowed tokens of the rows that have few; return the other rows.

    words: (n, ceil(covered / 32)) int32, C-contiguous. Returns the bitmask rows (each with a
    word that is not all ones) to expand whole.
    """
    n, cw = words.shape
    partial = words != -1  # words that are not all ones
    if not partial.any():
        return _NO_ROWS
    flat = np.flatnonzero(partial)  # row-major word numbers
    limit = _SPARSE_LIMIT * cw
    dense = None
    starts = counts = None
    if flat.size > _DENSE_WORDS * cw:
        # Rows where over half the words hold a disallowed token (random rows, rows that allow
        # few tokens) are expanded whole without looking at their bits.
        starts = np.searchsorted(flat, np.arange(n + 1) * cw)
        counts = np.diff(starts)
        over = counts > _DENSE_WORDS * cw
        if over.all():
            return np.arange(n)
        if over.any():
            dense = over
            flat = flat[np.repeat(~over, counts)]
            if flat.size == 0:
                return np.flatnonzero(dense)
            counts[over] = 0
            starts[1:] = np.cumsum(counts)
    inv = words.reshape(-1)[flat]  # a copy
    np.invert(inv, out=inv)  # set bits: disallowed tokens
    if covered % 32:  # bits past the logits width, in each row's last word, are ignored
        inv[flat % cw == cw - 1] &= (1 << (covered % 32)) - 1
    pop = _popcount(inv)
    most = int(pop.max())
    if flat.size * (1 + most) > limit:  # some row may be over the limit: count its tokens
        if starts is None or counts is None:
            starts = np.searchsorted(flat, np.arange(n + 1) * cw)
            counts = np.diff(starts)
        rows = np.flatnonzero(counts)  # reduceat's segments: these rows' words
        over = counts[rows] + np.add.reduceat(pop, starts[rows], dtype=np.int64) > limit
        if over.any():
            if dense is None:
                dense = np.zeros(n, dtype=bool)
            dense[rows[over]] = True
            keep = np.repeat(~over, counts[rows])
            flat, inv, pop = flat[keep], inv[keep], pop[keep]
    if covered % 32:
        keep = pop != 0  # a last word with no disallowed token inside the width
        flat, inv = flat[keep], inv[keep]
    if flat.size:
        s0, s1 = logits2d.stride()
        if idx is None and s0 == 32 * cw * s1:
            base = flat * (32 * s1)  # word (r, w) starts at r * s0 + 32 * w * s1
        else:
            r = flat // cw
            base = (r if idx is None else idx[r]) * s0 + (flat - r * cw) * (32 * s1)
        offsets = _bit_offsets(base, inv, most == 1, s1)
        # One scattered write through numpy (a few thousand stores gain nothing from torch's
        # thread pool); bfloat16, which numpy lacks, as its bits.
        value: float
        if logits2d.dtype == torch.bfloat16:
            raw, value = logits2d.detach().view(torch.int16).numpy(), _NEG_INF_BITS[torch.bfloat16]
        else:
            raw, value = logits2d.detach().numpy(), -np.inf
        if raw.flags.c_contiguous:
            raw_flat = raw.reshape(-1)
        else:
            span = (raw.shape[0] - 1) * s0 + (raw.shape[1] - 1) * s1 + 1
            raw_flat = np.lib.stride_tricks.as_strided(raw, shape=(span,), strides=(raw.itemsize,))
        raw_flat[offsets] = value
    return _NO_ROWS if dense is None else np.flatnonzero(dense)


def _apply_autograd(logits2d: torch.Tensor, bitmask2d: torch.Tensor, idx: np.ndarray | None) -> None:
    """masked_fill_, which autograd sees, for logits that require grad while grad is enabled
    (the fast paths write the logits' bits behind autograd's back)."""
    n, words = bitmask2d.shape
    vocab = logits2d.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits2d.device)
    bits = (bitmask2d.unsqueeze(-1) >> shifts) & 1  # (n, words, 32)
    disallowed = torch.ones(n, vocab, dtype=torch.bool, device=logits2d.device)
    covered = min(vocab, 32 * words)
    disallowed[:, :covered] = bits.reshape(n, 32 * words)[:, :covered] == 0
    if idx is None:
        logits2d.masked_fill_(disallowed, float("-inf"))
    else:
        rows = torch.from_numpy(idx).to(logits2d.device)
        logits2d[rows] = logits2d[rows].masked_fill(disallowed, float("-inf"))


def _apply_torch(logits2d: torch.Tensor, bitmask2d: torch.Tensor, idx: np.ndarray | None) -> None:
    if logits2d.requires_grad and torch.is_grad_enabled():
        _apply_autograd(logits2d, bitmask2d, idx)
        return
    n, words = bitmask2d.shape
    vocab = logits2d.shape[1]
    device = logits2d.device
    covered = min(vocab, 32 * words)
    if vocab > covered:  # logits columns past the bitmask's bits
        if idx is None:
            logits2d[:, covered:].fill_(float("-inf"))
        else:
            rows_t = torch.from_numpy(idx).to(device, non_blocking=True)
            logits2d[:, covered:].index_fill_(0, rows_t, float("-inf"))
    if covered == 0:
        return
    cw = (covered + 31) // 32
    bm = bitmask2d if cw == words else bitmask2d[:, :cw]  # words past the logits are not read
    if device.type == "cpu":
        words_np = bm.numpy()
        if not words_np.flags.c_contiguous:
            words_np = np.ascontiguousarray(words_np)
        dense_k = _mask_sparse_cpu(logits2d, words_np, idx, covered)
    else:  # CUDA without Triton: every row expanded, no host synchronization
        dense_k = np.arange(n)
    if dense_k.size == 0:
        return
    # Runs of rows consecutive in both the bitmask and the logits, in chunks that keep the
    # (rows, 32 * words) temporary near _TORCH_CHUNK_ELEMS elements.
    dense_l = dense_k if idx is None else idx[dense_k]
    breaks = np.flatnonzero((np.diff(dense_k) != 1) | (np.diff(dense_l) != 1)) + 1
    chunk = max(1, _TORCH_CHUNK_ELEMS // (32 * cw))
    for run_k, run_l in zip(np.split(dense_k, breaks), np.split(dense_l, breaks)):
        k0, l0 = int(run_k[0]), int(run_l[0])
        for s in range(0, run_k.size, chunk):
            e = min(run_k.size, s + chunk)
            _mask_block(logits2d[l0 + s : l0 + e], bm[k0 + s : k0 + e], covered)


# --------------------------------------------------------------------------------------------
# Triton path (CUDA)
# --------------------------------------------------------------------------------------------

# Bound by _load_triton(); the kernel below resolves ``tl`` from these module globals when Triton
# compiles it, never at import time (annotations are strings under ``from __future__``).
triton: Any = None
tl: Any = None
_triton_kernel: Any = None
_triton_state = "unknown"  # "unknown" | "ok" | "missing"
_triton_lock = threading.Lock()


def _bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    indices_ptr,
    vocab,
    words,
    logits_row_stride,
    logits_col_stride,
    bitmask_row_stride,
    HAS_INDICES: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    TILES: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    # One program per (bitmask row, TILES tiles of BLOCK_WORDS words); the grid covers
    # ceil(vocab / 32) words, so columns past 32 * words are reached and masked too.
    mask_row = tl.program_id(0)
    if HAS_INDICES:
        logits_row = tl.load(indices_ptr + mask_row).to(tl.int64)
    else:
        logits_row = mask_row.to(tl.int64)
    row_ptr = logits_ptr + logits_row * logits_row_stride
    bitmask_row_ptr = bitmask_ptr + mask_row.to(tl.int64) * bitmask_row_stride
    bit = tl.arange(0, 32)
    for tile in tl.static_range(TILES):
        word = (tl.program_id(1) * TILES + tile) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
        packed = tl.load(
            bitmask_row_ptr + word,
            mask=word < words,
            other=0,  # words past the row: no bit set, token disallowed
        )
        # No test for tiles of all-ones words: the store is masked off for them anyway, and on an
        # H100 the test (a reduction across the program's warps before the store) saved nothing on
        # all-allowed rows and cost up to a third on rows that disallow most tokens.
        allowed = (packed[:, None] >> bit[None, :]) & 1  # (BLOCK_WORDS, 32)
        token = word[:, None] * 32 + bit[None, :]
        if WIDE_OFFSETS:  # a column stride that takes offsets past int32
            token = token.to(tl.int64)
        disallowed = (allowed == 0) & (token < vocab)
        # -inf is cast to the logits' dtype by the store
        tl.store(row_ptr + token * logits_col_stride, float("-inf"), mask=disallowed)


def _load_triton() -> bool:
    """Import Triton and JIT the kernel once; False when Triton cannot be imported."""
    global triton, tl, _triton_kernel, _triton_state
    if _triton_state != "unknown":
        return _triton_state == "ok"
    with _triton_lock:
        if _triton_state != "unknown":
            return _triton_state == "ok"
        try:
            import triton as _triton
            import triton.language as _tl
        except Exception:  # ImportError, or a broken install failing on import
            _triton_state = "missing"
            return False
        triton, tl = _triton, _tl
        _triton_kernel = _triton.jit(_bitmask_kernel)
        _triton_state = "ok"
        return True


def triton_available() -> bool:
    """Whether the CUDA path uses Triton (imports Triton on the first call)."""
    return _load_triton()


def _apply_triton(
    logits2d: torch.Tensor, bitmask2d: torch.Tensor, idx: np.ndarray | torch.Tensor | None
) -> None:
    if not _load_triton():
        raise RuntimeError("triton is not importable")
    n = bitmask2d.shape[0]
    vocab = logits2d.shape[1]
    if n == 0 or vocab == 0:
        return
    bm = bitmask2d if bitmask2d.stride(1) == 1 else bitmask2d.contiguous()
    device = logits2d.device
    if idx is None:
        idx_t = bm  # placeholder pointer; never read when HAS_INDICES is False
    elif isinstance(idx, torch.Tensor):
        idx_t = idx.to(device, torch.int64).contiguous()
    else:
        idx_t = torch.from_numpy(idx).to(device, non_blocking=True)
    grid = (n, triton.cdiv(triton.cdiv(vocab, 32), _BLOCK_WORDS * _TILES))
    wide = (vocab + 32) * max(1, abs(logits2d.stride(1))) >= 2**31
    ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        _triton_kernel[grid](
            logits2d,
            bm,
            idx_t,
            vocab,
            bm.shape[1],
            logits2d.stride(0),
            logits2d.stride(1),
            bm.stride(0),
            HAS_INDICES=idx is not None,
            BLOCK_WORDS=_BLOCK_WORDS,
            TILES=_TILES,
            WIDE_OFFSETS=wide,
            num_warps=_NUM_WARPS,
        )


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    vocab_size: int | None = None,
    indices: Sequence[int] | np.ndarray | torch.Tensor | None = None,
) -> None:
    """Set disallowed logits to ``-inf`` in place (xgrammar's and llguidance's arguments).

    logits: (batch, vocab) or (vocab,), float32/float16/bfloat16, on any device.
    bitmask: (batch, words) or (words,), int32, on the logits' device; bit ``i % 32`` of word
        ``i // 32`` set means token ``i`` is allowed. Row ``i`` masks logits row ``i``.
    vocab_size: only ``logits[:, :vocab_size]`` is masked (padding past it is left as it is);
        None: the whole logits width. Logits columns below ``vocab_size`` and past
        ``32 * words`` are masked.
    indices: optional 1-D ints, unique: only logits row ``i`` with bitmask row ``i`` for each
        listed ``i`` (the batch sizes may then differ); other rows are left untouched. A list or a
        CPU tensor costs no device synchronization; a device tensor is copied to the host once for
        the range check.

    Raises ValueError on inputs of the wrong type, dtype, rank, device or row count, and on
    indices out of range or repeated.
    """
    logits2d = _as_2d_logits(logits)
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
            raise ValueError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
        if not 0 <= int(vocab_size) <= logits2d.shape[1]:
            raise ValueError(f"vocab_size {vocab_size} is outside the logits width {logits2d.shape[1]}")
        logits2d = logits2d[:, : int(vocab_size)]
    if indices is None:
        _apply(logits2d, bitmask, None, None)
        return
    bitmask2d = _as_2d_bitmask(bitmask)
    idx = _indices_to_numpy(indices, logits2d.device)
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        limit = min(logits2d.shape[0], bitmask2d.shape[0])
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise ValueError(f"index {bad} out of range for logits with {logits2d.shape[0]} rows and a bitmask "
                             f"with {bitmask2d.shape[0]} rows")
        if np.unique(idx).size != idx.size:
            raise ValueError("indices must be unique")
    if bitmask2d.device != logits2d.device:
        raise ValueError(f"logits are on {logits2d.device} but bitmask is on {bitmask2d.device}; "
                         "copy the bitmask to the logits' device first")
    rows = torch.from_numpy(idx).to(bitmask2d.device, non_blocking=True)
    _apply(logits2d, bitmask2d.index_select(0, rows), idx, indices)


def apply_packed_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    logits_rows: Sequence[int] | np.ndarray | torch.Tensor,
) -> None:
    """Set disallowed logits to ``-inf`` in place, with maskd's packed row mapping.

    bitmask: (rows, words) int32, only the rows of the sequences that have a grammar: bitmask row
        ``k`` masks logits row ``logits_rows[k]``; logits rows not listed are left untouched.
    logits_rows: 1-D ints, unique, one per bitmask row. A list or CPU tensor costs no device
        synchronization; a device tensor is copied to the host once for the range check.

    Logits columns past ``32 * words`` are set to ``-inf``; bits past the logits width are ignored.
    Raises ValueError as :func:`apply_token_bitmask_inplace` does.
    """
    if logits_rows is None:
        raise ValueError("logits_rows names the logits row of every bitmask row; use "
                         "apply_token_bitmask_inplace for a bitmask with one row per logits row")
    _apply(_as_2d_logits(logits), bitmask, _MISSING, logits_rows)


_MISSING = object()


def _apply(logits2d: torch.Tensor, bitmask: Any, idx: Any, indices: Any) -> None:
    """Masks ``logits2d`` rows: all of them (idx None), or row ``idx[k]`` with bitmask row ``k``
    (idx an int64 array; ``_MISSING``: validate ``indices`` first)."""
    if idx is _MISSING:
        logits2d, bitmask2d, idx = _validate(logits2d, bitmask, indices)
    elif idx is None:
        logits2d, bitmask2d, _ = _validate(logits2d, bitmask, None)
    else:
        bitmask2d = bitmask
    if bitmask2d.shape[0] == 0 or logits2d.shape[1] == 0:
        return
    if logits2d.device.type == "cuda" and _load_triton():
        if isinstance(indices, torch.Tensor) and indices.device == logits2d.device and idx is not None:
            _apply_triton(logits2d, bitmask2d, indices)  # already on the device: no copy
        else:
            _apply_triton(logits2d, bitmask2d, idx)
        return
    _apply_torch(logits2d, bitmask2d, idx)


def apply_token_bitmask_reference(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    logits_rows: Sequence[int] | np.ndarray | torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow, obviously correct version of :func:`apply_packed_token_bitmask_inplace` (bitmask row
    ``k`` on logits row ``logits_rows[k]``; one row per logits row when None), for tests.

    Masks ``logits`` in place and returns it. Does no validation beyond what it needs.
    """
    indices = logits_rows
    one_d = logits.dim() == 1
    rows = logits.unsqueeze(0) if one_d else logits
    masks = bitmask.detach().cpu().numpy()
    if masks.ndim == 1:
        masks = masks[None, :]
    if indices is None:
        targets = list(range(masks.shape[0]))
    else:
        targets = [int(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)]
    vocab = rows.shape[1]
    words = masks.shape[1]
    token = np.arange(vocab)
    inside = token < 32 * words  # tokens past the row's bits are disallowed
    for k, r in enumerate(targets):
        # The words as unsigned 64-bit values: no sign-extension games.
        row_words = masks[k].astype(np.int64) & 0xFFFFFFFF
        allowed = np.zeros(vocab, dtype=bool)
        t = token[inside]
        allowed[inside] = (row_words[t // 32] >> (t % 32)) & 1 == 1
        disallowed = torch.from_numpy(~allowed).to(rows.device)
        rows[r][disallowed] = float("-inf")
    return logits


# --------------------------------------------------------------------------------------------
# Staging buffers
# --------------------------------------------------------------------------------------------


class _StagingSlot:
    __slots__ = ("consumed", "copied", "device", "host", "host_np")

    def __init__(self) -> None:
        self.host: Any = None       # torch.Tensor (pinned on CUDA machines)
        self.host_np: Any = None    # numpy view of host
        self.device: Any = None     # torch.Tensor on the device
        self.copied: Any = None  # torch.cuda.Event recorded after the H2D copy
        self.consumed: Any = None  # torch.cuda.Event recorded by mark_consumed()


class BitmaskBuffers:
    """Preallocated host (pinned on CUDA machines) and device buffers for bitmask rows.

    ``upload(rows)`` copies (n, words) int32 rows into the host buffer, then non-blocking onto
    the device buffer, and returns the (n, words) device view to pass to
    :func:`apply_token_bitmask_inplace`. On a CPU device it returns the host view.
    ``host_rows(n)`` gives the next slot's host buffer to decode a step's rows into (the ``out``
    of ``MaskClient.step_async``); uploading rows that already lie there skips the host copy.

    Buffers are used round robin over ``num_slots`` slots (default 2), so the rows of step t+1
    can be uploaded while step t's rows are still being read. A returned view stays valid until
    ``num_slots`` further uploads. Reusing a slot is made safe by construction:

    * before the host buffer of a slot is overwritten, the host waits for that slot's previous
      copy to finish (normally long done);
    * before the device buffer of a slot is overwritten, the copy stream waits (on the GPU, not
      the host) for the event recorded by :meth:`mark_consumed`, when the consumer recorded one.
      Copies on the consumer's own stream (``stream=None``, the default) are ordered anyway.

    With ``stream=`` a side stream, the consumer must wait for the copy before reading: call
    :meth:`wait` (makes the current stream wait, without blocking the host) or use
    :meth:`ready_event`; then call :meth:`mark_consumed` after the kernel that reads the rows.
    """

    def __init__(
        self,
        max_rows: int,
        words: int,
        device: torch.device | str | None = None,
        *,
        pin_memory: bool | None = None,
        num_slots: int = 2,
    ) -> None:
        if int(max_rows) < 0:
            raise ValueError(f"max_rows must be >= 0, got {max_rows}")
        if int(words) < 0:
            raise ValueError(f"words must be >= 0, got {words}")
        if int(num_slots) < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.words = int(words)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._on_device = self.device.type != "cpu"
        self._slots = [_StagingSlot() for _ in range(int(num_slots))]
        self._next = 0
        self._last: _StagingSlot | None = None
        self._reserved: _StagingSlot | None = None     # the slot host_rows handed out for the next upload
        self._capacity = max(1, int(max_rows))
        for slot in self._slots:
            self._allocate(slot, self._capacity)

    # -- allocation --------------------------------------------------------------------------

    @property
    def max_rows(self) -> int:
        """Rows every slot can take without growing."""
        return self._capacity

    def _allocate(self, slot: _StagingSlot, rows: int) -> None:
        # Old buffers may still be read or written by queued copies: let those finish first.
        if slot.copied is not None:
            slot.copied.synchronize()
        if slot.consumed is not None:
            slot.consumed.synchronize()
        slot.copied = slot.consumed = None
        slot.host = torch.empty((rows, self.words), dtype=torch.int32, pin_memory=self.pin_memory)
        slot.host_np = slot.host.numpy()
        slot.device = (
            torch.empty((rows, self.words), dtype=torch.int32, device=self.device)
            if self._on_device
            else None
        )

    def _grow(self, n: int) -> None:
        self._capacity = max(n, 2 * self._capacity)
        for slot in self._slots:
            self._allocate(slot, self._capacity)

    # -- the hot path ------------------------------------------------------------------------

    def host_rows(self, max_rows: int) -> np.ndarray:
        """The host buffer of the slot the next upload uses, (>= max_rows, words) int32: a step's
        rows decoded into it need no host copy when uploaded. Its previous copy is waited for first."""
        if max_rows > self._capacity:
            self._grow(max_rows)
        slot = self._slots[self._next]
        if slot.copied is not None:
            slot.copied.synchronize()
            slot.copied = None
        self._reserved = slot
        return slot.host_np

    def upload(self, rows_np: np.ndarray, stream: Any = None) -> torch.Tensor:
        """Copy ``rows_np`` ((n, words) int32; uint32 is taken bit for bit) onto the device.

        Returns the (n, words) int32 view of the device buffer (of the host buffer on a CPU
        device). ``stream``: the CUDA stream to copy on; the current stream when None.
        """
        if not isinstance(rows_np, np.ndarray):
            raise ValueError(f"rows must be a numpy array, got {type(rows_np).__name__}")
        if rows_np.ndim != 2:
            raise ValueError(f"rows must be 2-D (n, words), got shape {rows_np.shape}")
        if rows_np.dtype == np.uint32:
            rows_np = rows_np.view(np.int32)
        elif rows_np.dtype != np.int32:
            raise ValueError(f"rows must be int32, got {rows_np.dtype}")
        n, words = rows_np.shape
        if words != self.words:
            raise ValueError(f"rows have {words} words but the buffers were made for {self.words}")
        reserved, self._reserved = self._reserved, None
        in_place = (reserved is not None and reserved is self._slots[self._next] and n <= len(reserved.host_np)
                    and rows_np.ctypes.data == reserved.host_np.ctypes.data and rows_np.flags["C_CONTIGUOUS"])
        if n > self._capacity:
            self._grow(n)

        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        self._last = slot

        # The previous copy out of this host buffer must be done before we overwrite it.
        if slot.copied is not None:
            slot.copied.synchronize()
            slot.copied = None
        if not in_place:     # rows decoded into host_rows() are there already
            np.copyto(slot.host_np[:n], rows_np, casting="no")
        if not self._on_device:
            return slot.host[:n]

        if self.device.type != "cuda":  # another accelerator: plain ordered copy
            slot.device[:n].copy_(slot.host[:n], non_blocking=True)
            return slot.device[:n]

        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        with torch.cuda.stream(s):
            if slot.consumed is not None:
                s.wait_event(slot.consumed)  # GPU-side: the last reader of this slot is done
                slot.consumed = None
            slot.device[:n].copy_(slot.host[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(s)
        slot.copied = event
        return slot.device[:n]

    def ready_event(self) -> Any:
        """The CUDA event recorded after the last upload's copy (None on CPU or before any)."""
        return None if self._last is None else self._last.copied

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (the current stream when None) wait for the last upload, on the GPU."""
        event = self.ready_event()
        if event is None:
            return
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        s.wait_event(event)

    def synchronize(self) -> None:
        """Block the host until the last upload's copy is done."""
        event = self.ready_event()
        if event is not None:
            event.synchronize()

    def mark_consumed(self, stream: Any = None) -> None:
        """Record that the last uploaded rows have been read by work queued on ``stream``.

        Needed only when uploads run on a side stream: the next upload into the same slot waits
        for this event on the GPU before overwriting the device buffer.
        """
        if self._last is None or not self._on_device or self.device.type != "cuda":
            return
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(s)
        self._last.consumed = event
