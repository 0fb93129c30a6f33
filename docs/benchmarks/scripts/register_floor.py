"""What a request costs through `maskd serve` when the server holds its grammar: the register
(a cache hit) and open + the first step, for a regex, a one-tool call array and a 200-tool array
of MaskBench-dev BFCL / Glaive tools, alternating, steady state (medians, ms). The floor under
`maskd bench tools`' first row before anything is composed (issue 19).

    .venv/bin/python docs/benchmarks/scripts/register_floor.py --data ../shared/maskbench-dev [--rounds 60]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()

    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd.tools.bench import common
    from maskd.tools.bench import tools as bench_tools
    from maskd_client import MaskClient

    pool = bench_tools.tool_pool(pathlib.Path(args.data), load_tokenizer("deepseek-v4"))
    requests = {"regex": {"regex": "[a-z]+"},
                "1 tool": bench_tools.request([bench_tools._tool(s, p, "floor") for s, p in pool[:1]]),
                "200 tools": bench_tools.request([bench_tools._tool(s, p, "floor") for s, p in pool[:200]])}
    specs = {k: GrammarSpec.from_request(r).to_proto() for k, r in requests.items()}
    srv = common.subprocess_server("deepseek-v4", 2, json_schema_mode="complete")
    took: dict[str, dict[str, list[float]]] = {k: {"register": [], "open + first step": []} for k in specs}
    try:
        with MaskClient(srv.address, want_forced_tokens=False, timeout_s=600) as mc:
            for spec in specs.values():
                mc.register(spec, wait=True)      # compiled once: every register below is a cache hit
            for i in range(args.rounds):
                for name, spec in specs.items():
                    sid = f"{name}-{i}"
                    t0 = time.perf_counter()
                    grammar_id = mc.register(spec, wait=True)
                    t1 = time.perf_counter()
                    mc.open(sid, spec, grammar_id=grammar_id)
                    mc.step({sid: []})
                    t2 = time.perf_counter()
                    mc.close(sid)
                    took[name]["register"].append(t1 - t0)
                    took[name]["open + first step"].append(t2 - t1)
            mc.flush_closes()
    finally:
        srv.close()
    print(f"`maskd serve` in a process of its own, medians of {args.rounds}, ms")
    for name, phases in took.items():
        print(f"  {name}: " + ", ".join(f"{p} {statistics.median(x) * 1e3:.2f}" for p, x in phases.items()))


if __name__ == "__main__":
    main()
