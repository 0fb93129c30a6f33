"""The CUDA apply kernels on a GPU: maskd's Triton kernel as shipped, its tile / tiles-per-program
/ warp choices, maskd's kernel before (one program per 32 words, 4 warps, a tile of all-ones words
skipped), xgrammar's Triton kernel (the one vLLM applies for every structured-output backend on
CUDA), and with --candidates the other layouts tried (a flat 1-D tile as xgrammar's, a persistent
grid). Every output is checked bit-equal to maskd's torch route (CUDA without Triton) first.

Rows of 129,280 tokens (deepseek-v4, 4,040 words), 32/128/256 rows, float32 and bfloat16, five
kinds of rows. GPU time: triton.testing.do_bench (L2 flushed before each call), the median of three
medians. Host time: the Python call alone, no synchronization, median of 200 calls (what the
engine's CPU thread pays to launch it). Upload: BitmaskBuffers.upload of random rows, synchronized.

Run where a GPU is: python3 docs/benchmarks/scripts/gpu_apply_kernels.py --out DIR
  (--xgrammar-kernel PATH: xgrammar's kernels/apply_token_bitmask_inplace_triton.py, read from
  an unpacked xgrammar wheel; the xgrammar package itself is not imported.)
Here without a GPU: TRITON_INTERPRET=1 ... --smoke checks the variants' outputs on small shapes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import maskd_client.apply as m  # noqa: E402

WORDS = 4040
VOCAB = 32 * WORDS


def row_kinds(rows: int, words: int, gen: np.random.Generator) -> dict[str, np.ndarray]:
    """The five kinds of rows of docs/benchmarks.md's CPU table."""
    allowed = np.full((rows, words), -1, dtype=np.int32)
    random = gen.integers(-(2**31), 2**31, (rows, words), dtype=np.int64).astype(np.int32)
    bits = gen.random((rows, words * 32)) >= 0.01  # 99 % of tokens allowed
    p99 = np.packbits(bits, axis=-1, bitorder="little").view("<i4").astype(np.int32)
    one_zero = np.full((rows, words), -1, dtype=np.int32)
    hit = gen.random((rows, words)) < 0.01
    one_zero[hit] = ~(np.int32(1) << gen.integers(0, 31, hit.sum()).astype(np.int32))
    few = np.where(gen.random((rows, words)) < 0.05, random, 0).astype(np.int32)
    return {"all allowed": allowed, "random": random, "99% of tokens allowed": p99,
            "1% of words with one 0 bit": one_zero, "few allowed": few}


def launch_previous(kernel, logits, bm):
    grid = (bm.shape[0], m.triton.cdiv(m.triton.cdiv(logits.shape[1], 32), 32))
    kernel[grid](logits, bm, bm, logits.shape[1], bm.shape[1], logits.stride(0), logits.stride(1),
                 bm.stride(0), HAS_INDICES=False, BLOCK_WORDS=32)


def load_xgrammar(path: str | None):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("xgr_triton_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.apply_token_bitmask_inplace_triton


def launch(kernel, logits, bm, block_words, tiles, num_warps):
    n, vocab = bm.shape[0], logits.shape[1]
    grid = (n, m.triton.cdiv(m.triton.cdiv(vocab, 32), block_words * tiles))
    kernel[grid](logits, bm, bm, vocab, bm.shape[1], logits.stride(0), logits.stride(1),
                 bm.stride(0), HAS_INDICES=False, BLOCK_WORDS=block_words, TILES=tiles,
                 WIDE_OFFSETS=False, num_warps=num_warps)


def torch_route(logits, bm):
    state = m._triton_state
    m._triton_state = "missing"
    try:
        m.apply_token_bitmask_inplace(logits, bm)
    finally:
        m._triton_state = state


def gpu_ms(fn, device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench
        return statistics.median(float(do_bench(fn, warmup=5, rep=30, return_mode="median"))
                                 for _ in range(3))
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def host_us(fn, device, calls=200) -> float:
    times = []
    for i in range(calls):
        if device.type == "cuda" and i % 50 == 0:
            torch.cuda.synchronize()  # keep the launch queue short
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


# --------------------------------------------------------------------------------------------
# Candidates: a flat tile (BLOCK tokens in one row, xgrammar's layout) with the all-ones skip;
# grid (rows, blocks) or persistent (one program per SM looping over the work).
# --------------------------------------------------------------------------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


# maskd's kernel up to 7359878: one program per 32 words, 4 warps, a tile of all-ones words skipped
# after a reduction across the program.
@triton.jit
def previous_kernel(
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
):
    # One program per (bitmask row, block of BLOCK_WORDS words); the grid covers
    # ceil(vocab / 32) words, so columns past 32 * words are reached and masked too.
    mask_row = tl.program_id(0)
    block = tl.program_id(1)
    word = block * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    packed = tl.load(
        bitmask_ptr + mask_row.to(tl.int64) * bitmask_row_stride + word,
        mask=word < words,
        other=0,  # words past the row: no bit set, token disallowed
    )
    # The logits are only ever stored to, under a mask of the disallowed tokens, so a word of
    # all ones (-1) touches none of them; a block of such words (nearly-all-allowed rows) skips
    # the rest outright: no index load, no (BLOCK_WORDS, 32) expansion, no store.
    if tl.sum((packed != -1).to(tl.int32), axis=0) > 0:
        if HAS_INDICES:
            logits_row = tl.load(indices_ptr + mask_row).to(tl.int64)
        else:
            logits_row = mask_row.to(tl.int64)
        bit = tl.arange(0, 32)
        allowed = (packed[:, None] >> bit[None, :]) & 1  # (BLOCK_WORDS, 32)
        token = word[:, None].to(tl.int64) * 32 + bit[None, :]
        disallowed = (allowed == 0) & (token < vocab)
        ptrs = logits_ptr + logits_row * logits_row_stride + token * logits_col_stride
        neg_inf = tl.full([BLOCK_WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
        tl.store(ptrs, neg_inf, mask=disallowed)


@triton.jit
def flat_kernel(logits_ptr, bitmask_ptr, vocab, words, logits_row_stride, bitmask_row_stride,
                BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    word = block * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(bitmask_ptr + row.to(tl.int64) * bitmask_row_stride + word, mask=word < words, other=0)
    if tl.sum((packed != -1).to(tl.int32), axis=0) > 0:
        token = block * BLOCK + tl.arange(0, BLOCK)
        disallowed = (((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0).reshape(BLOCK)
        tl.store(logits_ptr + row.to(tl.int64) * logits_row_stride + token, float("-inf"),
                 mask=disallowed & (token < vocab))


@triton.jit
def looped_kernel(logits_ptr, bitmask_ptr, vocab, words, logits_row_stride, bitmask_row_stride,
                  BLOCK: tl.constexpr, SUB: tl.constexpr):
    row = tl.program_id(0)
    for s in tl.static_range(BLOCK // SUB):
        start = tl.program_id(1) * BLOCK + s * SUB
        word = start // 32 + tl.arange(0, SUB // 32)
        packed = tl.load(bitmask_ptr + row.to(tl.int64) * bitmask_row_stride + word, mask=word < words, other=0)
        if tl.sum((packed != -1).to(tl.int32), axis=0) > 0:
            token = start + tl.arange(0, SUB)
            disallowed = (((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0).reshape(SUB)
            tl.store(logits_ptr + row.to(tl.int64) * logits_row_stride + token, float("-inf"),
                     mask=disallowed & (token < vocab))


@triton.jit
def persistent_kernel(logits_ptr, bitmask_ptr, rows, vocab, words, logits_row_stride, bitmask_row_stride,
                      PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    blocks = tl.cdiv(vocab, BLOCK)
    for work in tl.range(pid, rows * blocks, PROGRAMS):
        row = work // blocks
        block = work % blocks
        word = block * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        packed = tl.load(bitmask_ptr + row.to(tl.int64) * bitmask_row_stride + word, mask=word < words, other=0)
        if tl.sum((packed != -1).to(tl.int32), axis=0) > 0:
            token = block * BLOCK + tl.arange(0, BLOCK)
            disallowed = (((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0).reshape(BLOCK)
            tl.store(logits_ptr + row.to(tl.int64) * logits_row_stride + token, float("-inf"),
                     mask=disallowed & (token < vocab))


def launch_flat(logits, bm, block, num_warps):
    grid = (bm.shape[0], triton.cdiv(logits.shape[1], block))
    flat_kernel[grid](logits, bm, logits.shape[1], bm.shape[1], logits.stride(0), bm.stride(0),
                      BLOCK=block, num_warps=num_warps)


def launch_looped(logits, bm, block, num_warps, sub):
    grid = (bm.shape[0], triton.cdiv(logits.shape[1], block))
    looped_kernel[grid](logits, bm, logits.shape[1], bm.shape[1], logits.stride(0), bm.stride(0),
                        BLOCK=block, SUB=sub, num_warps=num_warps)


def launch_persistent(logits, bm, block, num_warps, programs):
    persistent_kernel[(programs,)](logits, bm, bm.shape[0], logits.shape[1], bm.shape[1], logits.stride(0),
                                   bm.stride(0), PROGRAMS=programs, BLOCK=block, num_warps=num_warps)


def candidates(base_logits, words, gen, device, smoke, xgr=None):
    """Every candidate's output checked against the torch route, then timed (256 and 32 rows)."""
    out = []
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    configs = [("shipped", 1024, 4), ("xgrammar", 4096, 0)]
    configs += [("flat", b, w) for b, ws in ((1024, (8, 16)), (2048, (8, 16)), (4096, (4, 8, 16))) for w in ws]
    configs += [("looped 1024", 4096, 4), ("looped 1024", 4096, 8), ("looped 2048", 8192, 8),
                ("persistent x4", 2048, 4), ("persistent x8", 1024, 4), ("persistent x4", 4096, 16)]
    if smoke:
        configs = [("shipped", 0, 0), ("flat", 256, 4), ("looped 128", 256, 4), ("persistent", 256, 4)]
    for rows in ([3] if smoke else [256, 128]):
        kinds = row_kinds(rows, words, gen)
        for dtype in ([torch.float32] if smoke else [torch.float32, torch.bfloat16]):
            logits0 = base_logits[:rows].to(dtype).to(device)
            for kind in ("all allowed", "99% of tokens allowed", "few allowed", "random"):
                bm = torch.from_numpy(kinds[kind]).to(device)
                expect = logits0.clone()
                torch_route(expect, bm)
                for name, block, nw in configs:
                    if name == "shipped":
                        fn = (lambda lg: m.apply_token_bitmask_inplace(lg, bm))
                    elif name == "xgrammar":
                        if xgr is None:
                            continue
                        fn = (lambda lg: xgr(lg, bm))
                    elif name.startswith("looped"):
                        fn = (lambda lg, b=block, w=nw, sub=int(name.split()[1]): launch_looped(lg, bm, b, w, sub))
                    elif name.startswith("persistent"):
                        progs = sms * int(name.split("x")[-1]) if " x" in name else sms
                        fn = (lambda lg, b=block, w=nw, p=progs: launch_persistent(lg, bm, b, w, p))
                    else:
                        fn = (lambda lg, b=block, w=nw: launch_flat(lg, bm, b, w))
                    o = logits0.clone()
                    fn(o)
                    ints = torch.int32 if dtype == torch.float32 else torch.int16
                    assert torch.equal(o.view(ints), expect.view(ints)), (name, block, nw, kind, dtype)
                    if smoke:
                        continue
                    work = logits0.clone()
                    row = {"rows": rows, "dtype": str(dtype).split(".")[-1], "kind": kind, "kernel": name,
                           "block": block, "num_warps": nw, "gpu_ms": gpu_ms(lambda: fn(work), device)}
                    out.append(row)
                    print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/gpu-apply")
    ap.add_argument("--xgrammar-kernel", default=None)
    ap.add_argument("--candidates", action="store_true", help="time the candidate kernels first")
    ap.add_argument("--smoke", action="store_true", help="small shapes, outputs checked only")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert m.triton_available(), "triton is not importable"
    xgr = load_xgrammar(args.xgrammar_kernel)
    previous = previous_kernel
    words = 8 if args.smoke else WORDS
    vocab = 32 * words
    batch_sizes = [3] if args.smoke else [32, 128, 256]
    dtypes = [torch.float32] if args.smoke else [torch.float32, torch.bfloat16]
    gen = np.random.default_rng(0)
    base_logits = torch.randn(max(batch_sizes), vocab, generator=torch.Generator().manual_seed(1))
    results = []
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": m.triton.__version__, "words": words}
    print(json.dumps(info), flush=True)

    def variants(bm, with_xgr):
        v = {
            "maskd": lambda lg: m.apply_token_bitmask_inplace(lg, bm),
            "maskd before (7359878)": lambda lg: launch_previous(previous, lg, bm),
        }
        if with_xgr and xgr is not None:
            v["xgrammar triton"] = lambda lg: xgr(lg, bm)
        return v

    cands = candidates(base_logits, words, gen, device, args.smoke, xgr) if args.candidates or args.smoke else []
    for rows in batch_sizes:
        kinds = row_kinds(rows, words, gen)
        for dtype in dtypes:
            logits0 = base_logits[:rows].to(dtype).to(device)
            for kind, rows_np in kinds.items():
                bm = torch.from_numpy(rows_np).to(device)
                expect = logits0.clone()
                torch_route(expect, bm)
                for name, fn in variants(bm, device.type == "cuda").items():
                    out = logits0.clone()
                    fn(out)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    same = torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                       expect.view(torch.int16 if dtype != torch.float32 else torch.int32))
                    assert same, (name, rows, dtype, kind)
                    if args.smoke:
                        continue
                    work = logits0.clone()
                    row = {"rows": rows, "dtype": str(dtype).split(".")[-1], "kind": kind, "variant": name,
                           "gpu_ms": gpu_ms(lambda: fn(work), device),
                           "host_us": host_us(lambda: fn(work), device)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
    # Tile, tiles per program and warp choices of the shipped kernel, on 256 rows.
    sweep = []
    if not args.smoke:
        kinds = row_kinds(256, words, gen)
        for dtype in (torch.float32, torch.bfloat16):
            logits = base_logits[:256].to(dtype).to(device)
            for kind in ("all allowed", "99% of tokens allowed", "few allowed", "random"):
                bm = torch.from_numpy(kinds[kind]).to(device)
                for bw, tiles, nw in ((16, 8, 4), (16, 8, 8), (16, 4, 4), (16, 16, 4), (8, 16, 2), (8, 16, 4),
                                      (32, 4, 8), (32, 4, 4), (32, 2, 8)):
                    row = {"dtype": str(dtype).split(".")[-1], "kind": kind, "block_words": bw, "tiles": tiles,
                           "num_warps": nw,
                           "gpu_ms": gpu_ms(lambda: launch(m._triton_kernel, logits, bm, bw, tiles, nw), device)}
                    sweep.append(row)
                    print(json.dumps(row), flush=True)
    # Staging: pinned host rows to the device (BitmaskBuffers.upload), 256 rows.
    upload = []
    if device.type == "cuda" and not args.smoke:
        for rows in batch_sizes:
            buf = m.BitmaskBuffers(rows, words)
            rows_np = row_kinds(rows, words, gen)["random"]
            t = []
            for _ in range(50):
                s = time.perf_counter()
                buf.upload(rows_np)
                buf.synchronize()
                t.append(time.perf_counter() - s)
            upload.append({"rows": rows, "upload_ms": statistics.median(t) * 1e3})
            print(json.dumps(upload[-1]), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_apply.json").write_text(json.dumps(
        {"info": info, "candidates": cands, "results": results, "sweep": sweep, "upload": upload}, indent=1))
    print("ok", flush=True)


if __name__ == "__main__":
    main()
