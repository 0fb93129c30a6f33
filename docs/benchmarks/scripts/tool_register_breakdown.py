"""Where a 200-tool request's register goes on the server: ``maskd bench tools``' three requests
(cold, the same set again, all but one known and shuffled) through a server embedded in this
process, with the server's register phases timed by wrapping them (time inside each, ms, summed per
request; the router and the pieces run on two threads at once inside ``_composed``). Medians over
``--rounds`` rounds.

  .venv/bin/python docs/benchmarks/scripts/tool_register_breakdown.py --data ../shared/maskbench-dev
"""
from __future__ import annotations

import argparse
import collections
import functools
import pathlib
import random
import statistics
import time

PHASES = (
    ("GrammarSpec.from_proto", "maskd.specs", "GrammarSpec", "from_proto"),
    ("cache lookup", "maskd.server.grammar_cache", "GrammarCache", "lookup"),
    ("cache wait", "maskd.server.grammar_cache", "GrammarCache", "wait"),
    ("composed", "maskd.server.grammar_cache", "GrammarCache", "_composed"),
    ("router (thread)", "maskd.server.grammar_cache", "GrammarCache", "_route"),
    ("pieces", "maskd.server.grammar_cache", "GrammarCache", "_pieces"),
    ("new pieces compiled", "maskd.server.grammar_cache", "GrammarCache", "_compile_pieces"),
    ("compose", "maskd.server.engines.llguidance_engine", "LLGuidanceEngine", "compose"),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--tools", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()

    import importlib

    from maskd.server import MaskServer, ServerConfig
    from maskd.server.tokenizers import load_tokenizer
    from maskd.tools.bench import tools as bench_tools
    from maskd_client import MaskClient

    spent: dict[str, list[float]] = collections.defaultdict(list)
    for label, module, cls, name in PHASES:
        owner = getattr(importlib.import_module(module), cls)
        original = getattr(owner, name)

        def timed(*a, _original=original, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                spent[_label].append(time.perf_counter() - t0)
        setattr(owner, name, functools.wraps(original)(timed))

    pool = bench_tools.tool_pool(pathlib.Path(args.data), load_tokenizer("deepseek-v4"))
    server = MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=2)).start()
    rows: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    try:
        with MaskClient(server.address, want_forced_tokens=False, timeout_s=600) as mc:
            bench_tools.first_row(mc, bench_tools.request([bench_tools._tool(s, p, "warm") for s, p in pool[:3]]),
                                  "warm")
            for r in range(args.rounds):
                cold, shuffled = bench_tools.draw(pool, args.tools, f"breakdown{r}", random.Random(r))
                for scenario, tools in (("cold", cold), ("same", cold), ("shuffled", shuffled)):
                    spent.clear()
                    took = bench_tools.first_row(mc, bench_tools.request(tools), f"{r}-{scenario}")
                    rows[scenario].append({**{f"client: {k}": v for k, v in took.items()},
                                           **{f"server: {k}": sum(v) for k, v in spent.items()}})
    finally:
        server.stop(grace=0.5)
    print(f"{args.tools} tools, medians of {args.rounds} rounds, ms (embedded server, 2 fill threads)")
    for scenario, samples in rows.items():
        keys = [k for k in samples[-1]]
        print(f"  {scenario}: " + ", ".join(
            f"{k} {statistics.median(s.get(k, 0.0) for s in samples) * 1e3:.2f}" for k in keys))


if __name__ == "__main__":
    main()
