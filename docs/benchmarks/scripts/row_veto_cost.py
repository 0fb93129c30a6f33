"""What complete mode's row vetoes cost per sequence and step, in process, on MaskBench-dev's
o11666 (a oneOf of data types with dependencies between members) and o81746 (a tagged union):
first with a row that allows every token (the worst case for the key checks), then with the
grammar's own row at that point. Run: .venv/bin/python docs/benchmarks/scripts/row_veto_cost.py
(needs ../shared/maskbench-dev)."""
import json
import pathlib
import statistics
import time

import llguidance.numpy as lnp
import numpy as np

from maskd.server.engines import create_engine
from maskd.server.json_schema.documents import DocumentBuffer, JsonDocumentChecker
from maskd.server.json_schema.relax import LENIENT_KEYWORDS
from maskd.server.json_schema.validation import SchemaValidator
from maskd.server.tokenizers import load_tokenizer
from maskd.specs import GrammarSpec

DATA = pathlib.Path(__file__).resolve().parents[3].parent / "shared" / "maskbench-dev"
CASES = [("Github_medium---o11666", '{"format": "abc'),
         ("Github_medium---o11666", '{"type": "string", "format": "abc'),
         ("Github_medium---o11666", '{"type": "string", "'),
         ("Github_medium---o11666", '{"type": "integer", "minimum": "1"'),
         ("Github_medium---o81746", '{"type": "link", "properties": {"href": "x')]


def median_us(checker, buf, row, calls=200):
    checker.row_vetoes(buf.state, buf.data, row)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        checker.row_vetoes(buf.state, buf.data, row)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main():
    tok = load_tokenizer("deepseek-v4")
    engine = create_engine("llguidance", tok, threads=1, json_schema_mode="complete")
    print("| schema | written so far | tokens the grammar allows | µs, all allowed | µs, the grammar's row |")
    print("|---|---|---|---|---|")
    for name, text in CASES:
        schema = json.loads((DATA / f"{name}.json").read_text())["schema"]
        tokens = tok.encode(text)
        matcher = engine.new_matcher(engine.compile(GrammarSpec.create("json_schema", schema)))
        assert matcher.consume(tokens) is None
        bitmask = lnp.allocate_token_bitmask(1, tok.vocab_size)
        lnp.fill_next_token_bitmask(matcher.m, bitmask, 0)
        own = bitmask[0].copy()
        everything = np.full_like(own, -1)
        checker = JsonDocumentChecker(SchemaValidator(schema, LENIENT_KEYWORDS | {"required"}), tok)
        buf = DocumentBuffer(checker)
        buf.extend(tokens)
        assert buf.advance() is None
        allowed = int(np.unpackbits(own.view(np.uint8)).sum())
        print(f"| {name} | `{text}` | {allowed} | {median_us(checker, buf, everything):.0f} "
              f"| {median_us(checker, buf, own):.0f} |")


if __name__ == "__main__":
    main()
