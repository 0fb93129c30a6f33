"""What a maskd request with N tools costs vLLM's engine core before its grammar is opened: the
request's SamplingParams decoded from vLLM's IPC (msgpack), vLLM's structured-output key
(``StructuredOutputRequest`` writes a dict schema as JSON), and maskd's spec. Before: the schema
as a dict and the spec built from it again (``spec_of``); after: what admission hands on since
this change, the schema as its text and the spec as plain data (``GrammarSpec.from_plain``).
Also the API server's side (admission's ``spec_of`` and the encode). Medians of 30, ms.

  .venv-vllm/bin/python docs/benchmarks/scripts/vllm_spec_handoff.py --data ../shared/maskbench-dev [--tools 200]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time


def ms(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--tools", type=int, default=200)
    args = ap.parse_args()

    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd.tool_specs import tool_call_schema
    from maskd.tools.bench import tools as bench_tools
    from maskd_client import vllm as plugin

    pool = bench_tools.tool_pool(pathlib.Path(args.data), load_tokenizer("deepseek-v4"))
    tools, _ = bench_tools.draw(pool, args.tools, "handoff", random.Random(5))
    schema = tool_call_schema(tools, "required")
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(SamplingParams)

    def params(json_value, extra=None):
        p = SamplingParams(structured_outputs=StructuredOutputsParams(json=json_value), extra_args=extra)
        p.structured_outputs._backend = plugin.BACKEND
        return p

    before = params(schema)
    spec = plugin.spec_of(before)
    after = params(spec.text, {plugin.SPEC_KEY: spec.to_plain()})
    wire_before, wire_after = encoder.encode(before), encoder.encode(after)

    def key(p):      # vLLM's structured-output key of a JSON request
        value = p.structured_outputs.json
        return value if isinstance(value, str) else json.dumps(value)

    rows = {
        "API server: admission's spec_of": ms(lambda: plugin.spec_of(params(schema))),
        "API server: encode, before (dict)": ms(lambda: encoder.encode(before)),
        "API server: encode, after (text + plain spec)": ms(lambda: encoder.encode(after)),
        "engine core, before: decode + key + spec_of":
            ms(lambda: plugin.spec_of(p) if key(p := decoder.decode(wire_before)) else None),
        "engine core, after: decode + key + from_plain":
            ms(lambda: GrammarSpec.from_plain(p.extra_args[plugin.SPEC_KEY]) if key(p := decoder.decode(wire_after))
               else None),
    }
    print(f"{args.tools} tools, schema {len(spec.text):,} chars")
    for name, value in rows.items():
        print(f"  {name}: {value:.2f} ms")


if __name__ == "__main__":
    main()
