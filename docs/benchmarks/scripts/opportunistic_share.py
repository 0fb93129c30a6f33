"""Opportunistic masking with a model that means something: how many steps need a row?

    .venv/bin/python docs/benchmarks/scripts/opportunistic_share.py [--schemas 24] [--batch 4]

The tiny Llama trained on the JSON of MaskBench-dev's train half (maskd.tools.json_training; built
once, ~4 minutes) writes documents for schemas of the held-out half and for the schema-driven
ACCOUNT schema of tests/vllm_engine, sampling first from its unmasked logits
(``maskd.tools.demo.sample_first``: every token checked by an embedded maskd server with
``StepInput(sampled_unmasked=True)``, a row sent and the token sampled again only where the
server refuses it). Greedy and sampled (temperature 1). Prints a markdown table: tokens checked,
refused, the share of steps that needed a row, and valid outputs (every finished document is
checked by the server's complete mode and again here with jsonschema).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

from maskd.server import MaskServer, ServerConfig
from maskd.tools.bench.vllm_workloads import ACCOUNT
from maskd.tools.demo import sample_first, validate
from maskd.tools.json_training import held_out_schemas
from maskd.tools.vllm_serve import json_model_dir

REPO = pathlib.Path(__file__).resolve().parents[3]

MASKBENCH = (REPO / ".." / "shared" / "maskbench-dev").resolve()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=24)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(json_model_dir(MASKBENCH))).eval()
    server = MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=1)).start()
    eos_ids = set(server.engine.tokenizer.eos_token_ids)
    start = torch.full((args.batch, 1), min(eos_ids), dtype=torch.long)   # a document starts after EOS
    enc = {"input_ids": start, "attention_mask": torch.ones_like(start)}
    workloads = {"account (schema-driven)": [ACCOUNT] * max(1, args.schemas // 4),
                 "MaskBench-dev held out": held_out_schemas(MASKBENCH, args.schemas)}
    rows = []
    try:
        for greedy in (True, False):
            for name, schemas in workloads.items():
                checked = resampled = valid = finished = outputs = 0
                t0 = time.perf_counter()
                for k, schema in enumerate(schemas):
                    torch.manual_seed(k)
                    spec = {"json_schema": schema, "whitespace": "compact"}
                    try:
                        out, _, c, r = sample_first(model, enc, server.address, spec, args.max_new_tokens, greedy,
                                                    eos_ids, server.engine.width, f"{name[:4]}-{greedy}-{k}")
                    except Exception as exc:   # a schema the server refuses, a sequence that failed
                        print(f"  {name} #{k}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                        continue
                    checked, resampled = checked + c, resampled + r
                    for row in out[:, 1:].tolist():
                        outputs += 1
                        end = next((j for j, t in enumerate(row) if t in eos_ids), None)
                        if end is None:
                            continue
                        finished += 1
                        text = server.engine.tokenizer.ll.decode_bytes(row[:end]).decode("utf-8", "replace")
                        valid += validate(text, schema)[0]
                rows.append((("greedy" if greedy else "sampled, T=1"), name, len(schemas), checked, resampled,
                             resampled / max(1, checked), f"{valid}/{finished}/{outputs}", time.perf_counter() - t0))
    finally:
        server.stop(grace=1.0)
    print("| decoding | workload | schemas | tokens checked | refused (a row sent) | share of steps needing a row "
          "| valid / ended / outputs | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:,} | {r[4]:,} | {r[5]:.1%} | {r[6]} | {r[7]:.1f} |")


if __name__ == "__main__":
    main()
