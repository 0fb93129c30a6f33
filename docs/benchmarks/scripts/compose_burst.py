"""N new 200-tool arrays registered at once through `maskd serve` on one CPU: how tool-call
composition queues when a vLLM API server admits N such requests together (issue 19). Each array
is 199 tools the server holds and one new, in an order of its own, so each register composes
(a router for its names, the new tool's piece); medians over the bursts after the first, ms.

    .venv/bin/python docs/benchmarks/scripts/compose_burst.py --data ../shared/maskbench-dev [--burst 8] [--rounds 12]
"""
from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--burst", type=int, default=8, help="arrays registered at once")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--cpu", type=int, default=1, help="the CPU `maskd serve` (and its compile workers) runs on")
    args = ap.parse_args()

    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd.tools.bench import common
    from maskd.tools.bench import tools as bench_tools
    from maskd_client import MaskClient

    pool = bench_tools.tool_pool(pathlib.Path(args.data), load_tokenizer("deepseek-v4"))
    base = [bench_tools._tool(s, p, "base") for s, p in pool[:200]]

    def array(tag: str, i: int):
        tools = base[:i % 200] + base[i % 200 + 1:]
        stem, schema = pool[200 + i % (len(pool) - 200)]
        tools.append(bench_tools._tool(stem, schema, f"{tag}-{i}"))
        random.Random(f"{tag}-{i}").shuffle(tools)
        return GrammarSpec.from_request(bench_tools.request(tools)).to_proto()

    srv = common.subprocess_server("deepseek-v4", 1, cpus=[args.cpu], json_schema_mode="complete")
    registers, bursts = [], []
    try:
        clients = [MaskClient(srv.address, want_forced_tokens=False, timeout_s=600) for _ in range(args.burst)]
        clients[0].register(GrammarSpec.from_request(bench_tools.request(base)).to_proto(), wait=True)
        with ThreadPoolExecutor(args.burst) as ex:
            for r in range(args.rounds):
                specs = [array(f"r{r}", i) for i in range(args.burst)]
                t0 = time.perf_counter()

                def register(k: int, specs=specs, t0=t0) -> float:
                    clients[k].register(specs[k], wait=True)
                    return time.perf_counter() - t0
                took = list(ex.map(register, range(args.burst)))
                if r:
                    registers += took
                    bursts.append(max(took))
                time.sleep(0.2)
    finally:
        srv.close()
    print(f"`maskd serve` on CPU {args.cpu}, {args.burst} new 200-tool arrays at once, {args.rounds - 1} bursts: "
          f"register median {statistics.median(registers) * 1e3:.1f} ms, "
          f"all {args.burst} ready median {statistics.median(bursts) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
