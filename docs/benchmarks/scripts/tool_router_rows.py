"""Groundwork for per-tool pieces (issue 19, item 2): does a router give the whole grammar's rows
until a call's parameters start, how fast is it ready, and does llguidance's state depend only on
the bytes written (so a piece can be positioned by re-tokenizing them)?

    .venv/bin/python docs/benchmarks/scripts/tool_router_rows.py [--tools 200] [--calls 40]

Tools: MaskBench-dev's BFCL / Glaive parameter schemas (``maskd bench tools``' pool), named
uniquely per run; the request is ``tool_choice: "required"``; grammars are llguidance's for the
plain json_schema spec (strict form), deepseek-v4. The router is the same call array with one
item schema: the names as an enum, parameters any object. Calls: a random tool of the set with one of
its valid instances, written ``json.dumps`` style. Prints:

1. compile + first row: the whole set, and the router;
2. router rows against the whole grammar's at every position before the parameters' first byte
   (positions compared, rows that differ);
3. the whole grammar's row after the same bytes fed as the canonical tokens and as one token per
   character (``LLTokenizer.tokenize_bytes`` of each character): rows that differ.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time

import llguidance

from maskd.server.tokenizers import load_tokenizer
from maskd.tool_specs import tool_call_schema
from maskd.tools.bench.common import llguidance_grammar
from maskd.tools.bench.tools import _tool, tool_pool

REPO = pathlib.Path(__file__).resolve().parents[3]


def compiled(tok, schema: dict) -> tuple[llguidance.LLMatcher, float]:
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(tok.ll, llguidance_grammar(json.dumps(schema)), log_level=0)
    m.compute_bitmask()
    seconds = time.perf_counter() - t0
    if m.is_error():
        raise RuntimeError(m.get_error())
    return m, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(REPO / ".." / "shared" / "maskbench-dev"))
    ap.add_argument("--tools", type=int, default=200)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    data = pathlib.Path(args.data).resolve()
    tok = load_tokenizer("deepseek-v4")
    rng = random.Random(args.seed)
    pool = tool_pool(data, tok)
    instances = {}
    for stem, _ in pool:
        tests = json.loads((data / f"{stem}.json").read_text(encoding="utf-8")).get("tests", [])
        instances[stem] = [t["data"] for t in tests if t.get("valid")]
    whole_s, router_s = [], []
    compared = differ = positions_bytes = differ_bytes = 0
    where: dict[int, int] = {}     # bytes before the parameters' first byte -> rows that differ there
    for r in range(args.rounds):
        picked = rng.sample([p for p in pool if instances[p[0]]], args.tools)
        tools = [_tool(stem, schema, f"r{r}") for stem, schema in picked]
        whole_schema = tool_call_schema(tools, "required")
        names = [t["function"]["name"] for t in tools]
        router_schema = {**whole_schema, "items": {
            "type": "object", "properties": {"name": {"type": "string", "enum": names},
                                             "parameters": {"type": "object"}},
            "required": ["name", "parameters"]}}
        router_schema.pop("$defs", None)
        _, s1 = compiled(tok, whole_schema)
        _, s2 = compiled(tok, router_schema)
        whole_s.append(s1)
        router_s.append(s2)
        for _ in range(args.calls // args.rounds):
            k = rng.randrange(len(tools))
            name = tools[k]["function"]["name"]
            params = rng.choice(instances[picked[k][0]])
            text = json.dumps([{"name": name, "parameters": params}], ensure_ascii=False)
            start = text.index('"parameters": ') + len('"parameters": ')
            tokens = tok.encode(text)
            w = llguidance.LLMatcher(tok.ll, llguidance_grammar(json.dumps(whole_schema)), log_level=0)
            rt = llguidance.LLMatcher(tok.ll, llguidance_grammar(json.dumps(router_schema)), log_level=0)
            written = b""
            for t in tokens:
                if len(written) >= start:            # the parameters began: the pieces' part
                    break
                compared += 1
                if w.compute_bitmask() != rt.compute_bitmask():
                    differ += 1
                    where[start - len(written)] = where.get(start - len(written), 0) + 1
                if not (w.consume_token(t) and rt.consume_token(t)):
                    raise RuntimeError(f"a valid call was refused: {text[:80]}")
                written += tok.ll.decode_bytes([t])
            # The same bytes, another tokenization: one character at a time.
            for cut in sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1))):
                canon = llguidance.LLMatcher(tok.ll, llguidance_grammar(json.dumps(whole_schema)), log_level=0)
                chars = llguidance.LLMatcher(tok.ll, llguidance_grammar(json.dumps(whole_schema)), log_level=0)
                prefix = text[:cut].encode()
                a = tok.ll.tokenize_bytes(prefix)
                b = [t for ch in text[:cut] for t in tok.ll.tokenize_bytes(ch.encode())]
                if canon.try_consume_tokens(a) != len(a) or chars.try_consume_tokens(b) != len(b):
                    continue                          # a tokenization that ends inside a lexeme it cannot take
                positions_bytes += 1
                differ_bytes += canon.compute_bitmask() != chars.compute_bitmask()
    print(f"| {args.tools} tools, {args.rounds} sets | whole compile + first row ms (median) | "
          f"router compile + first row ms (median) |")
    print("|---|---|---|")
    print(f"| | {statistics.median(whole_s) * 1e3:.1f} | {statistics.median(router_s) * 1e3:.2f} |")
    print()
    print(f"router rows vs the whole grammar's before the parameters: {compared} positions, {differ} differ "
          f"(by bytes left before the parameters: {dict(sorted(where.items()))})")
    print(f"the same bytes as canonical tokens and one token per character: {positions_bytes} prefixes, "
          f"{differ_bytes} rows differ")


if __name__ == "__main__":
    main()
