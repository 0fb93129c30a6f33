"""A cache of mask rows across requests: would it pay? (issue 19, item 3: measure before building)

    .venv/bin/python docs/benchmarks/scripts/mask_cache_hits.py [--data ../shared/maskbench-dev] [--calls 2000]

A row is a function of (grammar, the tokens written so far), so a cache keyed on (grammar or
piece, prefix) would give exact rows without a fill. Replays with llguidance in process (the
grammar a server builds for a plain json_schema spec, the deepseek-v4 tokenizer):

1. **MaskBench-dev**: every valid instance of every schema that compiles, in a shuffled order; at
   every position, whether an earlier instance of the same schema wrote the same prefix (a hit of
   a prefix-keyed cache of that grammar) and, as an upper bound for any cache keyed on the
   grammar's state, whether an equal row already came up for that schema at any position.
2. **Tool calls**: calls of tools drawn from MaskBench-dev's BFCL / Glaive parameter schemas
   (the pool ``maskd bench tools`` uses), uniformly and Zipf-like (weight 1/rank), each writing
   one valid instance of its tool's parameters (and every distinct call of the pool once, without
   the repeats a small pool makes); at every position inside the parameters, whether
   the same tool's piece saw that prefix before (a cache of the piece's rows shared by requests
   with different tool sets). A whole-grammar key would hit only for a repeated tool set.

Prints hit rates, the fill time a hit would save (llguidance's mask per row, timed here) and the
rows a cache would hold. One process, one core.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import pathlib
import random
import time

import llguidance

from maskd.server.tokenizers import load_tokenizer
from maskd.tools.bench.common import llguidance_grammar
from maskd.tools.bench.tools import tool_pool
from maskd.tools.conformance import load_suite

REPO = pathlib.Path(__file__).resolve().parents[3]


class Tally:
    def __init__(self) -> None:
        self.positions = self.prefix_hits = self.row_hits = 0
        self.fill_s = 0.0
        self.cached_rows = 0

    def line(self, name: str) -> str:
        n = max(1, self.positions)
        per_row_us = self.fill_s / n * 1e6
        return (f"| {name} | {self.positions:,} | {self.prefix_hits / n:.1%} | {self.row_hits / n:.1%} | "
                f"{per_row_us:.1f} | {self.prefix_hits * per_row_us / 1e3:,.1f} | {self.cached_rows:,} |")


def replay(matcher: llguidance.LLMatcher, tokens: list[int], key: tuple, prefixes: set, rows: set,
           tally: Tally) -> None:
    """Walks ``tokens`` through ``matcher``: at each position a row, and whether its key was seen."""
    h = hashlib.blake2b(repr(key).encode(), digest_size=16)
    for t in tokens:
        prefix = h.digest()
        t0 = time.perf_counter()
        row = matcher.compute_bitmask()
        tally.fill_s += time.perf_counter() - t0
        tally.positions += 1
        if prefix in prefixes:
            tally.prefix_hits += 1
        else:
            prefixes.add(prefix)
            tally.cached_rows += 1
        digest = hashlib.blake2b(row, digest_size=16).digest()
        if digest in rows:
            tally.row_hits += 1
        rows.add(digest)
        if not matcher.consume_token(t):
            raise RuntimeError(f"the grammar refused a valid instance's token {t}: {matcher.get_error()}")
        h.update(t.to_bytes(4, "little"))


def maskbench(data: pathlib.Path, tok, rng: random.Random) -> Tally:
    tally = Tally()
    for name, schema, tests in load_suite(data):
        docs = [tok.encode(json.dumps(t["data"], ensure_ascii=False)) for t in tests if t.get("valid")]
        if not docs:
            continue
        try:
            grammar = llguidance_grammar(json.dumps(schema))
        except Exception:   # llguidance refuses the schema in strict form: not replayed
            continue
        first = llguidance.LLMatcher(tok.ll, grammar, log_level=0)
        if first.is_error():
            continue
        rng.shuffle(docs)
        prefixes: set = set()
        rows: set = set()
        for doc in docs:
            try:
                replay(llguidance.LLMatcher(tok.ll, grammar, log_level=0), doc, (name,), prefixes, rows, tally)
            except RuntimeError:   # an instance llguidance's strict grammar refuses (key order, formats)
                continue
    return tally


def tool_calls(data: pathlib.Path, tok, calls: int, zipf: bool | None, rng: random.Random) -> Tally:
    """``zipf`` None: every distinct (tool, instance) call once, in a shuffled order (what prefixes
    different calls of a tool share, without the pool's repeats)."""
    pool = tool_pool(data, tok)
    instances = {}
    for stem, _ in pool:
        tests = json.loads((data / f"{stem}.json").read_text(encoding="utf-8")).get("tests", [])
        docs = [tok.encode(json.dumps(t["data"], ensure_ascii=False)) for t in tests if t.get("valid")]
        if docs:
            instances[stem] = docs
    tools = [(stem, schema) for stem, schema in pool if stem in instances]
    rng.shuffle(tools)
    weights = [1.0 / (k + 1) for k in range(len(tools))] if zipf else None
    grammars = {stem: llguidance_grammar(json.dumps(schema)) for stem, schema in tools}
    tally = Tally()
    prefixes: set = set()
    rows: collections.defaultdict = collections.defaultdict(set)
    if zipf is None:
        picks = [(stem, doc) for stem, _ in tools for doc in {tuple(d): d for d in instances[stem]}.values()]
        rng.shuffle(picks)
    else:
        picks = []
        for _ in range(calls):
            stem, _ = rng.choices(tools, weights=weights)[0]
            picks.append((stem, rng.choice(instances[stem])))
    for stem, doc in picks:
        try:
            replay(llguidance.LLMatcher(tok.ll, grammars[stem], log_level=0), doc, (stem,), prefixes, rows[stem],
                   tally)
        except RuntimeError:
            continue
    return tally


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(REPO / ".." / "shared" / "maskbench-dev"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    data = pathlib.Path(args.data).resolve()
    tok = load_tokenizer("deepseek-v4")
    rows = [("MaskBench-dev replay (each schema's valid instances)", maskbench(data, tok, random.Random(args.seed)))]
    rows.append(("tool calls: every distinct call of the pool once", tool_calls(data, tok, 0, None,
                                                                                random.Random(args.seed))))
    for zipf in (False, True):
        name = f"{args.calls:,} tool calls, tools drawn {'Zipf-like (1/rank)' if zipf else 'uniformly'}"
        rows.append((name, tool_calls(data, tok, args.calls, zipf, random.Random(args.seed))))
    print("| replay | positions | prefix-keyed hits | equal row seen before (upper bound) | fill us per row "
          "| fill ms a prefix cache saves | rows it holds |")
    print("|---|---|---|---|---|---|---|")
    for name, tally in rows:
        print(tally.line(name))


if __name__ == "__main__":
    main()
