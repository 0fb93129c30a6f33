"""vLLM's CPU sampler (``torch.ops._C.fused_gumbel_argmax``, what ``TopKTopPSampler.forward_cpu``
runs) on logits rows with more and fewer ``-inf`` entries: what a grammar's mask saves it.

    LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so OMP_NUM_THREADS=1 taskset -c 0 \
        .venv-vllm/bin/python docs/benchmarks/scripts/vllm_cpu_sampler.py
"""
import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm._C  # noqa: E402,F401  (registers torch.ops._C)

BATCH, VOCAB, REPEATS = 128, 129_280, 10


def main() -> None:
    torch.manual_seed(0)
    dense = torch.randn(BATCH, VOCAB)
    half = dense.clone()
    half[:, ::2] = float("-inf")
    few = dense.clone()
    few[:, 20:] = float("-inf")
    seeds = torch.randint(0, 2**31, (BATCH,), dtype=torch.long)
    for name, logits in (("every token allowed", dense), ("half the tokens -inf", half),
                         ("all but 20 tokens -inf", few)):
        torch.ops._C.fused_gumbel_argmax(logits, seeds)
        t0 = time.perf_counter()
        for _ in range(REPEATS):
            torch.ops._C.fused_gumbel_argmax(logits, seeds)
        print(f"{name}: {(time.perf_counter() - t0) / REPEATS * 1e3:.1f} ms per call ({BATCH} x {VOCAB})")


if __name__ == "__main__":
    main()
