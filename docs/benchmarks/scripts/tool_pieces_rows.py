"""Per-tool pieces (issue 19, item 2) against the whole grammar on MaskBench-dev's tools: the rows of
a composed tool-call array and of the same array compiled whole, at every position of valid calls
(canonical tokens and a character a token) and of random walks that favour the tokens at the
boundaries of the parameters; and what a row costs each way in the fill (one sequence).

    .venv/bin/python docs/benchmarks/scripts/tool_pieces_rows.py [--tools 200] [--calls 20] [--walks 20]
        [--whitespace compact] [--single] [--show 10]

Tools: ``maskd bench tools``' pool (BFCL / Glaive parameter schemas), named for this run; grammars:
llguidance's for the plain spec (flexible JSON unless ``--whitespace compact``), ``--mode``
complete or strict, ``--single`` for ``parallel_tool_calls: false``; deepseek-v4.

The server compiles compact arrays whole (``LLGuidanceEngine.composed_parts``); with
``--whitespace compact`` this script composes them anyway, to show where the rows part: each of the
first ``--show`` differing positions is printed with the forced bytes of the whole grammar, the
router and the named tool's piece (llguidance's ``compute_ff_bytes``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import time

import numpy as np

from maskd.server.engines.llguidance_engine import LLGuidanceEngine
from maskd.server.tokenizers import load_tokenizer
from maskd.specs import GrammarSpec
from maskd.tools.bench.tools import _tool, tool_pool

REPO = pathlib.Path(__file__).resolve().parents[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(REPO / ".." / "shared" / "maskbench-dev"))
    ap.add_argument("--tools", type=int, default=200)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--walks", type=int, default=20)
    ap.add_argument("--mode", default="complete", choices=("complete", "strict"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--whitespace", default="flexible", choices=("flexible", "compact"))
    ap.add_argument("--single", action="store_true", help="parallel_tool_calls false: at most one call")
    ap.add_argument("--show", type=int, default=10, help="differing positions printed")
    args = ap.parse_args()
    data = pathlib.Path(args.data).resolve()
    tok = load_tokenizer("deepseek-v4")
    engine = LLGuidanceEngine(tok, threads=1, json_schema_mode=args.mode)
    engine.prepare()
    pool = tool_pool(data, tok)
    instances = {stem: [t["data"] for t in json.loads((data / f"{stem}.json").read_text()).get("tests", [])
                        if t.get("valid")] for stem, _ in pool}
    rng = random.Random(args.seed)
    picked = rng.sample([p for p in pool if instances[p[0]]], args.tools)
    tools = [_tool(stem, schema, "run") for stem, schema in picked]
    spec = GrammarSpec.from_request({"tools": tools, "tool_choice": "required",
                                     "disable_any_whitespace": args.whitespace == "compact",
                                     "parallel_tool_calls": not args.single})
    parts = spec.parts    # (composed_parts: None for compact arrays, which the server compiles whole)
    separators = (",", ":") if args.whitespace == "compact" else None
    whole = engine.compile(dataclasses.replace(spec, parts=None))
    composed = engine.compose(spec, parts, [engine.compile(engine.piece_spec(spec, t)) for t in parts.pieces])
    seconds = {"whole": 0.0, "composed": 0.0}
    positions = differ = 0

    shown = 0

    def show(w, c, rows, written: bytes) -> None:
        nonlocal shown
        shown += 1
        if shown > args.show:
            return

        def listed(row):
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:tok.ll.vocab_size])
            return f"{len(allowed)} tokens {[tok.ll.decode_bytes([int(t)]) for t in allowed[:4]]}"
        print(f"differ after ...{written[-40:]!r}: whole {listed(rows[0])}, composed {listed(rows[1])}")
        if hasattr(c, "router"):
            piece = c.g.pieces.get(c.scan.name)
            print(f"    forced bytes: whole {w.m.compute_ff_bytes()!r}, router {c.router.compute_ff_bytes()!r}, "
                  f"piece of {c.scan.name!r} at its start "
                  f"{piece.matcher().compute_ff_bytes() if piece is not None else None!r}")

    def compare(w, c, written: bytes = b"") -> np.ndarray:
        nonlocal positions, differ
        rows = []
        for name, m in (("whole", w), ("composed", c)):
            out = engine.allocate(1)
            t0 = time.perf_counter()
            engine.fill_batch([m], [0], None, out)
            seconds[name] += time.perf_counter() - t0
            rows.append(out[0])
        positions += 1
        if not np.array_equal(rows[0], rows[1]) or w.is_accepting() != c.is_accepting():
            differ += 1
            show(w, c, rows, written)
        return rows[0]

    for k in range(args.calls):
        i = rng.randrange(len(tools))
        calls = [{"name": tools[i]["function"]["name"], "parameters": rng.choice(instances[picked[i][0]])}]
        text = json.dumps(calls, ensure_ascii=False, separators=separators)
        tokens = tok.ll.tokenize_bytes(text.encode()) if k % 2 == 0 else \
            [t for ch in text for t in tok.ll.tokenize_bytes(ch.encode())]
        w, c = engine.new_matcher(whole), engine.new_matcher(composed)
        written = b""
        for t in tokens:
            compare(w, c, written)
            if (w.consume([t]) is None) != (c.consume([t]) is None):
                differ += 1
                break
            written += tok.ll.decode_bytes([t])
        compare(w, c, written)
    timed = positions
    structural = np.array([any(ch in (tok.ll.decode_bytes([t]) or b"") for ch in b'{}[]",:')
                           for t in range(tok.ll.vocab_size)])
    for _ in range(args.walks):
        w, c = engine.new_matcher(whole), engine.new_matcher(composed)
        written = b""
        for _ in range(120):
            row = compare(w, c, written)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:tok.ll.vocab_size])
            if not len(allowed):
                break
            pick = allowed[structural[allowed]]
            t = int(rng.choice(pick if len(pick) and rng.random() < 0.6 else allowed))
            if (w.consume([t]) is None) != (c.consume([t]) is None):
                differ += 1
                break
            written += tok.ll.decode_bytes([t])
            if w.is_stopped():
                break
    kind = f"{args.mode} mode, {args.whitespace} JSON" + (", single" if args.single else "")
    print(f"{args.tools} tools ({kind}): {positions} positions compared ({timed} on valid calls, the rest "
          f"on walks), {differ} differ")
    print(f"fill of one row, us (all positions): whole {seconds['whole'] / positions * 1e6:.1f}, "
          f"composed {seconds['composed'] / positions * 1e6:.1f}")


if __name__ == "__main__":
    main()
