"""What each remaining lead on issue 19's 5 ms target is worth: a 200-tool request's first row
through a server embedded in this process, for five requests of the same size, each sent the way
``maskd bench tools`` sends ``shuffled`` (the set's pieces compiled first; a collection and 50 ms
idle before each request, as between an agent's turns):

* ``same``: the very same request again (a cache hit: nothing compiled or composed);
* ``known``: a new array of 199 known tools in another order (composed: a router compiled for the
  new name set, every piece cached);
* ``known, router kept``: the same, with the server's router taken from its cache whatever the
  names (timing only: the rows are wrong; what a router not compiled per name set would give);
* ``shuffled``: 199 known tools and one new one in another order (bench tools' target request);
* ``shuffled, router kept``: the same with the router kept as above.

Printed: medians over ``--requests`` requests of the first row and its three parts (the spec built
from the request, register, open + the first step), and of the server's register handler.

  .venv/bin/python docs/benchmarks/scripts/tool_request_floors.py --data ../shared/maskbench-dev
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import random
import statistics
import time

KINDS = ("same", "known", "known, router kept", "shuffled", "shuffled, router kept")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--tools", type=int, default=200)
    ap.add_argument("--requests", type=int, default=30, help="requests of each kind, interleaved")
    args = ap.parse_args()

    from maskd.server import MaskServer, ServerConfig
    from maskd.server import service as service_module
    from maskd.server.engines import llguidance_engine
    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd.tools.bench import tools as bench_tools
    from maskd_client import MaskClient

    handler: list[float] = []
    original_register = service_module.MaskService.RegisterGrammar

    def timed_register(self, request, context):
        t0 = time.perf_counter()
        try:
            return original_register(self, request, context)
        finally:
            handler.append(time.perf_counter() - t0)
    service_module.MaskService.RegisterGrammar = timed_register

    keep_router = [False]
    kept: dict[tuple, object] = {}
    original_router = llguidance_engine.LLGuidanceEngine.router

    def router(self, spec, parts):
        if not keep_router[0]:
            return original_router(self, spec, parts)
        key = (parts.single, spec.whitespace, spec.max_whitespace)
        if key not in kept:
            kept[key] = original_router(self, spec, parts)
        return kept[key]
    llguidance_engine.LLGuidanceEngine.router = router

    pool = bench_tools.tool_pool(pathlib.Path(args.data), load_tokenizer("deepseek-v4"))
    rng = random.Random(0)
    picked = rng.sample(pool, args.tools + 1)
    cold = [bench_tools._tool(s, p, "floors") for s, p in picked[:args.tools]]
    server = MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=2)).start()
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    try:
        with MaskClient(server.address, want_forced_tokens=False, timeout_s=600) as mc:
            mc.register(GrammarSpec.from_request(bench_tools.request(cold)).to_proto(), wait=True)
            keep_router[0] = True          # the kept router compiled once, before any timing
            mc.register(GrammarSpec.from_request(bench_tools.request(cold[1:])).to_proto(), wait=True)
            for i in range(args.requests):
                for kind in KINDS:
                    keep_router[0] = kind.endswith("router kept")
                    if kind == "same":
                        tools = cold
                    else:
                        tools = cold[:]
                        del tools[rng.randrange(len(tools))]
                        if kind.startswith("shuffled"):
                            tools.append(bench_tools._tool(*picked[-1], f"floors-{i}-{len(kind)}"))
                        rng.shuffle(tools)
                    request = bench_tools.request(tools)
                    gc.collect()
                    time.sleep(0.05)
                    handler.clear()
                    took = bench_tools.first_row(mc, request, f"{i}-{kind}")   # the bench's own timing
                    samples[kind].append({"first row": took["first_row"], "spec": took["spec"],
                                          "register": took["register"], "register handler": sum(handler),
                                          "open + first step": took["first_step"]})
            mc.flush_closes()
    finally:
        server.stop(grace=0.5)
    print(f"{args.tools} tools, medians of {args.requests} requests each, ms (embedded server, 2 fill threads)")
    for kind, rows in samples.items():
        print(f"  {kind:22s} " + ", ".join(f"{k} {statistics.median(r[k] for r in rows) * 1e3:.2f}" for k in rows[0]))


if __name__ == "__main__":
    main()
