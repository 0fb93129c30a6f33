"""Tool calls in a model's own tags, in the real engine: vLLM 0.32 CPU with ``--tool-call-parser
qwen3_coder`` builds a structural tag in the ``qwen_xml`` argument style for ``tool_choice:
"required"``; served by maskd (its default backend, llguidance, compiles that style with xgrammar:
maskd/server/engines/fallback.py) and, in another engine started after it, by vLLM's own
xgrammar backend in process. In each engine the same chat requests with ``tool_choice: "none"``
(no constraint) are the baseline, interleaved with the constrained ones. Streaming chat requests,
8 tools each, temperature 0.8, medians over rounds. Placement: the maskd server (``--threads 1``)
on CPU 1, vLLM's worker OMP threads on CPU 0, vLLM's API server, engine core and these clients
unpinned.

  .venv/bin/python docs/benchmarks/scripts/vllm_tool_call_tags.py [--concurrency 8,32] [--rounds 2]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import statistics
import tempfile
import time

from maskd.tools.bench.vllm import _stream

PARSER = ("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")
XGRAMMAR = ("--structured-outputs-config", '{"backend": "xgrammar"}')
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"tool {i}", "parameters": {
    "type": "object", "properties": {f"city_{i}": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": [f"city_{i}"]}}} for i in range(8)]


def drive(port: int, choice: str, concurrency: int, n: int, max_tokens: int, tag: str) -> dict:
    def body(i: int) -> dict:
        return {"model": "tiny", "messages": [{"role": "user", "content": f"Request {tag}-{i}: call a tool."}],
                "tools": TOOLS, "tool_choice": choice, "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
                "stream": True, "stream_options": {"include_usage": True}}

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: _stream("127.0.0.1", port, body(i)), range(n)))
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    finish: dict = {}
    for r in results:
        finish[r["finish"]] = finish.get(r["finish"], 0) + 1
    return {"tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else None,
            "ttft_p90_ms": 1e3 * ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
            "finish": finish, "errors": [r["error"] for r in results if r["error"]]}


def main() -> None:
    from maskd.tools.bench import common
    from maskd.tools.vllm_serve import vllm_engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    logs = pathlib.Path(tempfile.mkdtemp(prefix="tool-tags-"))
    server = common.subprocess_server("deepseek-v4", 1, log_path=logs / "maskd-serve.log", cpus=[1])
    omp = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    results: dict = {}
    try:
        for backend, env in (("maskd", {"MASKD_TARGET": server.address, **omp}), ("xgrammar", omp)):
            with vllm_engine(logs, *XGRAMMAR, *PARSER, "--max-num-seqs", str(max(levels)), env=env,
                             name=f"tags-{backend}") as engine:
                port = int(engine.url.rsplit(":", 1)[1])
                for c in levels:    # warm-up: the grammar, and every batch shape
                    for choice in ("none", "required"):
                        drive(port, choice, c, c, args.max_tokens, "warm")
                for r in range(args.rounds):
                    for c in levels:
                        for choice in (("none", "required") if r % 2 == 0 else ("required", "none")):
                            res = drive(port, choice, c, 2 * c, args.max_tokens, f"{backend}-{r}-{c}")
                            results.setdefault((backend, c, choice), []).append(res)
                            print(f"{backend} c={c} round {r} {choice}: {res['tok_s']:.0f} tok/s, TTFT p50 "
                                  f"{res['ttft_p50_ms']:.0f} ms, finish {res['finish']}, errors {len(res['errors'])}",
                                  flush=True)
    finally:
        server.close()
    print(f"\nmedians of {args.rounds} rounds (logs: {logs})")
    print("| engine | in flight | unconstrained tok/s | required tok/s (ratio) | TTFT p50 ms none / required |")
    print("|---|---|---|---|---|")
    for backend in ("maskd", "xgrammar"):
        for c in levels:
            none, req = results[(backend, c, "none")], results[(backend, c, "required")]
            base = statistics.median(x["tok_s"] for x in none)
            got = statistics.median(x["tok_s"] for x in req)
            print(f"| {backend} | {c} | {base:.0f} | {got:.0f} ({got / base:.2f}) | "
                  f"{statistics.median(x['ttft_p50_ms'] for x in none):.0f} / "
                  f"{statistics.median(x['ttft_p50_ms'] for x in req):.0f} |")


if __name__ == "__main__":
    main()
