"""Grammar drafts in a real vLLM CPU engine: tokens/s and vLLM's spec-decode counters, side by side.

    .venv-vllm/bin/python docs/benchmarks/scripts/vllm_grammar_drafts.py [--requests 16] [--concurrency 4]

One engine at a time (the machine has 2 cores), all on the tiny Llama trained on the JSON of
MaskBench-dev's train half (maskd.tools.json_training), greedy, compact JSON:

* unconstrained: the same prompts with no constraint (the ceiling the issue compares with);
* guidance: vLLM's own backend, no drafts;
* guidance + ngram: vLLM's own backend with its n-gram drafter (4 drafts, lookup 2-4);
* maskd: no drafts;
* maskd + grammar drafts: ``GrammarDrafts``, 4 drafts per step.

Workloads: ``account``, schema-driven JSON (six required keys, enums, a boolean, an integer: the
test's ACCOUNT schema), and ``maskbench``: schemas of MaskBench-dev's held-out half (not trained on)
that vLLM's guidance backend compiles. A warm-up round teaches nothing that is measured: maskd's
server is fresh per engine, and the warm-up uses other prompts of the same schemas (what a server
in service would have seen). Prints a markdown table; the maskd server runs in this process
(1 fill thread) beside the engine's processes on the same 2 cores.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "tests" / "vllm_engine")]
from harness import ENGINE_OPTIONS, vllm_engine  # noqa: E402
from test_grammar_drafts import ACCOUNT, GRAMMAR_DRAFTS  # noqa: E402

from maskd.server import MaskServer, ServerConfig  # noqa: E402
from maskd.tools.json_training import held_out_schemas  # noqa: E402
from maskd.tools.vllm_serve import json_model_dir  # noqa: E402

MASKBENCH = (REPO / ".." / "shared" / "maskbench-dev").resolve()
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")


def maskbench_schemas(n: int) -> list[dict]:
    return held_out_schemas(MASKBENCH, n)


def requests(workload: str, n: int, offset: int, constrained: bool) -> list[dict]:
    out = []
    schemas = [ACCOUNT] * n if workload == "account" else maskbench_schemas(n)
    for i, schema in enumerate(schemas):
        body = {"prompt": f"JSON for request #{i + offset}:", "max_tokens": 96, "temperature": 0}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        out.append(body)
    return out


def run(engine, bodies: list[dict], concurrency: int) -> dict:
    before = [engine.metric(c) for c in COUNTERS]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(engine.post, bodies))
    seconds = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for status, r in replies if status == 200)
    failed = sum(1 for status, _ in replies if status != 200)
    drafts, drafted, accepted = (engine.metric(c) - b for c, b in zip(COUNTERS, before))
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "failed": failed,
            "per_step": 1 + accepted / drafts if drafts else None, "drafts": drafted, "accepted": accepted}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    model = json_model_dir(MASKBENCH)
    setups = [("unconstrained", ENGINE_OPTIONS, False, False), ("guidance", ENGINE_OPTIONS, False, True),
              ("guidance + ngram", (*ENGINE_OPTIONS, "--speculative-config", NGRAM), False, True),
              ("maskd", ENGINE_OPTIONS, True, True),
              ("maskd + grammar drafts", (*ENGINE_OPTIONS, "--speculative-config", GRAMMAR_DRAFTS), True, True)]
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for name, options, maskd, constrained in setups:
            server = MaskServer(ServerConfig(host="127.0.0.1", port=0, tokenizer="deepseek-v4", threads=1,
                                             compile_threads=1)).start() if maskd else None
            env = {"MASKD_TARGET": server.address} if server else {}
            try:
                with vllm_engine(pathlib.Path(logs), *options, env=env, name=name.replace(" ", ""),
                                 model=model) as engine:
                    for workload in ("account", "maskbench"):
                        run(engine, requests(workload, args.requests, 1000, constrained), args.concurrency)
                        r = run(engine, requests(workload, args.requests, 0, constrained), args.concurrency)
                        rows.append((workload, name, r))
                        print(workload, name, r, flush=True)
            finally:
                if server is not None:
                    server.stop(grace=1.0)
    print("\n| workload | engine | tokens/s | vs unconstrained | tokens per verification step | drafts | "
          "accepted | failed |\n|---|---|---|---|---|---|---|---|")
    for workload in ("account", "maskbench"):
        base = next(r["tok_s"] for w, n, r in rows if w == workload and n == "unconstrained")
        for w, name, r in rows:
            if w == workload:
                per_step = f"{r['per_step']:.2f}" if r["per_step"] else "-"
                print(f"| {workload} | {name} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {per_step} | "
                      f"{r['drafts']:.0f} | {r['accepted']:.0f} | {r['failed']} |")


if __name__ == "__main__":
    main()
