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
import os
import pathlib
import random
import statistics
import time
import types


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MaskBench-dev (its BFCL / Glaive schemas give the tools)")
    ap.add_argument("--tools", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="sequences decoding beside the new request")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--tokenizer", default="deepseek-v4")
    args = ap.parse_args()

    import torch
    from sglang.srt.constrained.base_grammar_backend import GRAMMAR_BACKEND_REGISTRY
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    import maskd_client.sglang  # noqa: F401  (registers "maskd")
    from maskd.server.tokenizers import load_tokenizer
    from maskd.tool_specs import tool_call_schema
    from maskd.tools.bench import common
    from maskd.tools.bench import tools as bench_tools

    tok = load_tokenizer(args.tokenizer)
    pool = bench_tools.tool_pool(pathlib.Path(args.data), tok)
    tools = [bench_tools._tool(stem, schema, "open") for stem, schema in random.Random(0).sample(pool, args.tools)]
    handle = common.subprocess_server(args.tokenizer, 1)
    try:
        os.environ["MASKD_TARGET"] = handle.address
        server_args = types.SimpleNamespace(host="127.0.0.1", port=30000, nccl_port=0, dist_init_addr=None)
        backend = GRAMMAR_BACKEND_REGISTRY["maskd"](server_args, None, tok.ll.vocab_size, set(tok.eos_token_ids))

        def masks(grammars):
            batch = types.SimpleNamespace(grammars=list(grammars), temperatures=torch.ones(len(grammars)),
                                          vocab_size=tok.ll.vocab_size, device="cpu", grammar_mask=None)
            SamplingBatchInfo.update_regex_vocab_mask(batch)
            return batch.grammar_mask.vocab_mask

        text = backend.dispatch_json(json.dumps({"type": "object", "properties": {"text": {"type": "string"}},
                                                 "required": ["text"]}))
        array = backend.dispatch_json(json.dumps(tool_call_schema(tools, "required")))
        wire = len(array.spec.to_proto().SerializeToString())
        decoding = [text.copy() for _ in range(args.batch)]
        for t in tok.encode('{"text": "'):
            masks(decoding)
            for g in decoding:
                g.accept_token(t)
        letter = tok.encode("a")[0]
        times: dict[str, list[float]] = {"grammar_id": [], "spec": []}
        for r in range(2 * args.rounds + 2):
            how = "grammar_id" if r % 2 == 0 else "spec"
            base = array.copy()
            if how == "spec":
                base.grammar_id = ""            # the adapter before: every open carries the spec
            new = base.copy()
            masks(decoding)                     # a step without a new request, between
            for g in decoding:
                g.accept_token(letter)
            t0 = time.perf_counter()
            masks(decoding + [new])             # the step the new request joins
            elapsed = time.perf_counter() - t0
            for g in decoding:
                g.accept_token(letter)
            new.finished = True
            if r >= 2:                          # the first of each: warm-up
                times[how].append(elapsed)
        backend.shutdown()
    finally:
        handle.close()
    print(f"{args.tools} tools (spec {wire / 1024:.0f} KB on the wire), {args.batch} sequences decoding, "
          f"{args.rounds} rounds each, alternating; the step a new request joins, ms:")
    for how, ts in times.items():
        ts.sort()
        print(f"  open by {how:10s} p50 {statistics.median(ts) * 1e3:6.2f}  p90 {ts[int(0.9 * len(ts))] * 1e3:6.2f}")


if __name__ == "__main__":
    main()
