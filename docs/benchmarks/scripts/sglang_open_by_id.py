"""What an SGLang scheduler step costs when a new tool-calling request joins a decoding batch: the
new request's first fill opens its maskd sequence in that step, naming the grammar id its register
gave (now) or carrying its spec (before: a 200-tool array is ~110 KB the server reads on its step
path, while every other sequence of the batch waits for its row).

Through SGLang 0.5.23's own classes (the backend from its registry, ``SamplingBatchInfo
.update_regex_vocab_mask`` as its scheduler calls it once per step) against ``maskd serve`` in a
process of its own on 127.0.0.1. Per round: a batch of ``--batch`` sequences decoding a free-text
JSON string, plus one new copy of the registered tool array joining; the step that opens it is
timed, by id and by spec alternating (the same grammar object; ``grammar_id = ""`` is the adapter
before this change). Medians over ``--rounds``, ms.

  VLLM_TARGET_DEVICE=cpu .venv-engines/bin/python docs/benchmarks/scripts/sglang_open_by_id.py \
      --data ../shared/maskbench-dev [--tools 200] [--batch 32] [--rounds 40]
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
    ap.add_argument("--data", required=True, help="MaskBench-dev (its BFCL / Glaive schemas give the tools)")
    ap.add_argument("--tools", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="sequences decoding beside the new request")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--tokenizer", default="deepseek-v4")
    args = ap.parse_args()

    from sglang_batch import sglang_batch

    from maskd.tool_specs import tool_call_schema
    from maskd.tools.bench import tools as bench_tools

    with sglang_batch(args.tokenizer) as sg:
        pool = bench_tools.tool_pool(pathlib.Path(args.data), sg.tok)
        tools = [bench_tools._tool(stem, schema, "open") for stem, schema in random.Random(0).sample(pool, args.tools)]
        array = sg.backend.dispatch_json(json.dumps(tool_call_schema(tools, "required")))
        wire = len(array.spec.to_proto().SerializeToString())
        decoding = sg.decoding(args.batch)
        times: dict[str, list[float]] = {"grammar_id": [], "spec": []}
        for r in range(2 * args.rounds + 2):
            how = "grammar_id" if r % 2 == 0 else "spec"
            base = array.copy()
            if how == "spec":
                base.grammar_id = ""            # the adapter before: every open carries the spec
            new = base.copy()
            sg.masks(decoding)                  # a step without a new request, between
            sg.take_letter(decoding)
            t0 = time.perf_counter()
            sg.masks(decoding + [new])          # the step the new request joins
            elapsed = time.perf_counter() - t0
            sg.take_letter(decoding)
            new.finished = True
            if r >= 2:                          # the first of each: warm-up
                times[how].append(elapsed)
    print(f"{args.tools} tools (spec {wire / 1024:.0f} KB on the wire), {args.batch} sequences decoding, "
          f"{args.rounds} rounds each, alternating; the step a new request joins, ms:")
    for how, ts in times.items():
        ts.sort()
        print(f"  open by {how:10s} p50 {statistics.median(ts) * 1e3:6.2f}  p90 {ts[int(0.9 * len(ts))] * 1e3:6.2f}")


if __name__ == "__main__":
    main()
