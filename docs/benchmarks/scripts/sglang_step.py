"""An SGLang scheduler step of a decoding batch with maskd: ``SamplingBatchInfo
.update_regex_vocab_mask`` as the scheduler calls it once per step (SGLang 0.5.23's own classes,
the backend from its registry), then each request's ``accept_token``, against ``maskd serve`` in a
process of its own on 127.0.0.1. Every sequence decodes a free-text JSON string (rows nearly all
allowed, one new token per step).

Two ways the adapter puts the step's rows into SGLang's mask, alternating step by step on the same
batch: ``columns`` (now: one gather from the step's rows and one scatter into the mask, for every
sequence answered with a row) and ``per sequence`` (before: a SeqResult per sequence and its row
copied on its own, which is what the adapter still does for a sequence that waits or fails).
Medians over ``--steps`` steps per way, ms.

  VLLM_TARGET_DEVICE=cpu .venv-engines/bin/python docs/benchmarks/scripts/sglang_step.py [--batch 32,128]
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="32,128", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per way and batch size")
    ap.add_argument("--tokenizer", default="deepseek-v4")
    args = ap.parse_args()

    from sglang_batch import sglang_batch

    from maskd_client import sglang as adapter

    columns = adapter.MaskdGrammarBackend._take_rows

    def per_sequence(self, vocab_mask, rows, result):
        return dict(rows)           # every sequence through settle, one SeqResult and one copy each

    try:
        with sglang_batch(args.tokenizer) as sg:
            print(f"{args.tokenizer} ({sg.tok.ll.vocab_size} ids), free-text JSON string, one server thread; "
                  "the step: update_regex_vocab_mask + accept_token, ms")
            for size in [int(b) for b in args.batch.split(",")]:
                decoding = sg.decoding(size)
                times: dict[str, list[float]] = {"columns": [], "per sequence": []}
                for step in range(2 * args.steps + 4):
                    way = "columns" if step % 2 == 0 else "per sequence"
                    adapter.MaskdGrammarBackend._take_rows = columns if way == "columns" else per_sequence
                    t0 = time.perf_counter()
                    mask = sg.masks(decoding)
                    sg.take_letter(decoding)
                    elapsed = time.perf_counter() - t0
                    assert int(mask[0][sg.letter >> 5]) >> (sg.letter & 31) & 1
                    if step >= 4:
                        times[way].append(elapsed)
                adapter.MaskdGrammarBackend._take_rows = columns
                for g in decoding:
                    g.finished = True
                cells = "  ".join(f"{way} {statistics.median(ts) * 1e3:6.2f}" for way, ts in times.items())
                print(f"  batch {size:4d}: {cells}")
    finally:
        adapter.MaskdGrammarBackend._take_rows = columns

if __name__ == "__main__":
    main()
