"""The vLLM worker's apply of a step's rows on CUDA: vLLM 0.32's route against maskd's.

vLLM's route (``vllm/v1/structured_output/utils.py::apply_grammar_bitmask`` on CUDA, written out
here since vLLM is not installed on the GPU machine): a pinned (batch rows, words) bitmask filled
with -1, each request's rows copied to its logits row, the whole of it copied to the device, the
logits row indices copied (pinned) unless every row is structured, xgrammar's Triton kernel
(what ``xgr.apply_token_bitmask_inplace`` runs on CUDA). maskd's route: ``maskd_client.vllm_apply
.apply_rows`` (only the structured rows, pinned, maskd's Triton kernel). Both get the same
GrammarOutput-like inputs (one row per request, no drafts) and their outputs are checked equal
before timing.

Per shape: the whole route per step on the GPU (``triton.testing.do_bench``: events around the
call, L2 flushed, median of three medians; the host's own time shows here when it is longer than
the GPU's) and the host time of one call (median of 200, the queue drained every 50).

  python3 docs/benchmarks/scripts/gpu_vllm_apply_routes.py --xgrammar-kernel PATH [--out DIR]

(PATH: ``xgrammar/kernels/apply_token_bitmask_inplace_triton.py`` from an unpacked xgrammar
wheel; the xgrammar package is not imported.)
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

ROOT = pathlib.Path(__file__).resolve().parents[3]
VOCAB = 129_280            # deepseek-v4
WORDS = (VOCAB + 31) // 32


def load_xgrammar(path: str):
    spec = importlib.util.spec_from_file_location("xgr_triton_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.apply_token_bitmask_inplace_triton


def vllm_route(xgr_kernel, bitmask: np.ndarray, ids, batch_req_ids, logits: torch.Tensor) -> None:
    """vLLM 0.32's CUDA route, no drafts."""
    where = {req_id: i for i, req_id in enumerate(batch_req_ids)}
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, pin_memory=True)
    full_np = full.numpy()
    out_indices = []
    for k, req_id in enumerate(ids):
        i = where.get(req_id)
        if i is not None:
            full_np[i] = bitmask[k]
            out_indices.append(i)
    on_device = full.to(logits.device, non_blocking=True)
    index = None
    if len(out_indices) != logits.shape[0]:
        index = torch.tensor(out_indices, dtype=torch.int32, pin_memory=True).to(logits.device, non_blocking=True)
    xgr_kernel(logits, on_device, indices=index)


def rows_of(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "all allowed":
        return np.full((n, WORDS), -1, dtype=np.int32)
    if kind == "few allowed":
        rows = np.zeros((n, WORDS), dtype=np.int32)
        for r in range(n):
            rows[r, rng.integers(0, WORDS, 4)] = rng.integers(1, 2**31, 4, dtype=np.int64).astype(np.int32)
        return rows
    return rng.integers(-2**31, 2**31, size=(n, WORDS), dtype=np.int64).astype(np.int32)


def gpu_ms(fn) -> float:
    from triton.testing import do_bench
    return statistics.median(float(do_bench(fn, warmup=5, rep=40, return_mode="median")) for _ in range(3))


def host_us(fn, calls: int = 200) -> float:
    times = []
    for i in range(calls):
        if i % 50 == 0:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def measure(xgr, bitmask, ids, batch_ids, lg) -> dict[str, float]:
    from maskd_client.vllm_apply import apply_rows

    def vllm():
        vllm_route(xgr, bitmask, ids, batch_ids, lg)

    def maskd():
        apply_rows(bitmask, ids, {}, batch_ids, lg)

    return {"vllm_gpu_us": 1e3 * gpu_ms(vllm), "maskd_gpu_us": 1e3 * gpu_ms(maskd),
            "vllm_host_us": host_us(vllm), "maskd_host_us": host_us(maskd)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--xgrammar-kernel", required=True)
    ap.add_argument("--out", default="out/gpu-vllm-apply")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from maskd_client.vllm_apply import apply_rows

    xgr = load_xgrammar(args.xgrammar_kernel)
    rng = np.random.default_rng(3)
    device = torch.device("cuda")
    results = []
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        for batch, structured in ((32, 32), (128, 128), (256, 256), (256, 128)):
            batch_ids = [f"r{i}" for i in range(batch)]
            ids = batch_ids[::-1][:structured] if structured == batch else batch_ids[::2][:structured]
            for kind in ("all allowed", "few allowed", "random"):
                bitmask = rows_of(kind, structured, rng)
                base = torch.randn(batch, VOCAB, device=device, dtype=torch.float32).to(dtype)
                a, b = base.clone(), base.clone()
                vllm_route(xgr, bitmask, ids, batch_ids, a)
                apply_rows(bitmask, ids, {}, batch_ids, b)
                torch.cuda.synchronize()
                assert torch.equal(a, b), (dtype, batch, structured, kind)
                row = {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "structured": structured,
                       "rows": kind, **measure(xgr, bitmask, ids, batch_ids, base.clone())}
                results.append(row)
                print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_vllm_apply_routes.json").write_text(json.dumps(results, indent=1))
    lines = ["| dtype | batch | structured | rows | vLLM route µs (GPU / host) | maskd route µs (GPU / host) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['structured']} | {r['rows']} | "
                     f"{r['vllm_gpu_us']:.1f} / {r['vllm_host_us']:.1f} | "
                     f"{r['maskd_gpu_us']:.1f} / {r['maskd_host_us']:.1f} |")
    (out / "gpu_vllm_apply_routes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
