"""A tool piece's check: its JSON-schema form against the Lark form the piece is built from.

    .venv/bin/python docs/benchmarks/scripts/tool_piece_check.py --data ../shared/maskbench-dev

1. Outcomes: every MaskBench-dev schema, in both JSON-schema modes and both whitespace options,
   checked by llguidance's ``validate_grammar`` in both forms (the piece's text as the server
   writes it): how many agree, and the mean time of each form per schema.
2. 200 pieces of ``maskd bench tools``' pool compiled as a server compiles them: in one compile
   worker (``CompilePool.compile_many``) and in process (``engine.compile``), per pass.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import llguidance


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()

    from maskd.server.compile_pool import CompilePool
    from maskd.server.engines.llguidance_engine import LLGuidanceEngine
    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd.tools.bench import tools as bench_tools

    tok = load_tokenizer("deepseek-v4")
    ll = tok.ll

    def check(grammar_of, text):
        t0 = time.perf_counter()
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar_of(text), ll)
        except ValueError as exc:
            error = str(exc)
        return bool(error), time.perf_counter() - t0

    def json_form(text):
        return llguidance.LLMatcher.grammar_from_json_schema(text)

    def lark_form(text):
        return llguidance.LLMatcher.grammar_from_lark(f"start: %json {text} /(?s:.*)/\n")

    files = sorted(pathlib.Path(args.data).glob("*.json"))
    agree = total = 0
    spent = {"json": 0.0, "lark": 0.0}
    for mode in ("strict", "complete"):
        engine = LLGuidanceEngine(tok, threads=1, json_schema_mode=mode)
        for whitespace in ("flexible", "compact"):
            for path in files:
                schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
                spec = GrammarSpec.from_dict({"json_schema": schema, "whitespace": whitespace})
                text = engine._json_text(spec, schema, lenient=False)
                (a, ta), (b, tb) = check(json_form, text), check(lark_form, text)
                spent["json"] += ta
                spent["lark"] += tb
                agree += a == b
                total += 1
    print(f"outcomes: {agree} of {total} agree; mean check per schema: JSON form "
          f"{spent['json'] / total * 1e3:.2f} ms, Lark form {spent['lark'] / total * 1e3:.2f} ms")

    engine = LLGuidanceEngine(tok, threads=1, json_schema_mode="complete")
    pool = bench_tools.tool_pool(pathlib.Path(args.data), tok)
    workers = CompilePool("llguidance", "deepseek-v4", None, 1, "complete")
    workers.wait_warm(120)
    try:
        for p in range(args.passes):
            tools = [bench_tools._tool(s, params, f"check{p}") for s, params in pool[:200]]
            spec = GrammarSpec.from_request(bench_tools.request(tools))
            parts = engine.composed_parts(spec)
            specs = [engine.piece_spec(spec, text) for text in parts.pieces]
            t0 = time.perf_counter()
            workers.compile_many(specs, 60)
            t1 = time.perf_counter()
            for s in specs:
                engine.compile(s)
            t2 = time.perf_counter()
            print(f"200 pieces, pass {p}: one compile worker {(t1 - t0) * 1e3:.0f} ms, in process {(t2 - t1) * 1e3:.0f} ms")
    finally:
        workers.close()


if __name__ == "__main__":
    main()
