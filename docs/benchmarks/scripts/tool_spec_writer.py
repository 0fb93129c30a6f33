"""What building a request's spec costs an engine's admission (vLLM's API server) for N tools:
``GrammarSpec.from_request`` on a ``tools`` + ``tool_choice: "required"`` request as parsed from
HTTP (fresh objects each time), with each tool's parameters written by ``json.dumps``, by json's
own C writer built once (maskd's writer before orjson; the same text), or by maskd's compact writer
(orjson, json's writer where orjson would write otherwise), in turns in one process. Medians, ms.

  .venv/bin/python docs/benchmarks/scripts/tool_spec_writer.py --data ../shared/maskbench-dev [--tools 200]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--tools", type=int, default=200)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()

    from maskd import tool_specs
    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd.tools.bench import tools as bench_tools

    pool = bench_tools.tool_pool(pathlib.Path(args.data), load_tokenizer("deepseek-v4"))
    rng = random.Random(0)
    requests = []
    for i in range(args.requests):
        tools = [bench_tools._tool(stem, schema, f"r{i}") for stem, schema in rng.sample(pool, args.tools)]
        requests.append(json.loads(json.dumps(bench_tools.request(tools))))

    def dumps(value):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    writers = {"json.dumps": dumps, "json's C writer": tool_specs._json_writer(), "compact writer": tool_specs._compact}
    differ = 0
    for r in requests:
        texts = set()
        for writer in writers.values():
            tool_specs._compact = writer
            texts.add(GrammarSpec.from_request(r).text)
        differ += len(texts) > 1
    tool_specs._compact = writers["compact writer"]
    print(f"{differ} of {len(requests)} requests' texts differ between the writers")
    try:
        for _ in range(args.passes):
            cells = []
            for k, (name, writer) in enumerate(writers.items()):
                tool_specs._compact = writer
                times = []
                for r in requests[k::len(writers)]:
                    t0 = time.perf_counter()
                    GrammarSpec.from_request(r)
                    times.append(time.perf_counter() - t0)
                cells.append(f"{name} {statistics.median(times) * 1e3:.2f}")
            print(f"{args.tools} tools, spec from the request, ms: " + ", ".join(cells))
    finally:
        tool_specs._compact = writers["compact writer"]


if __name__ == "__main__":
    main()
