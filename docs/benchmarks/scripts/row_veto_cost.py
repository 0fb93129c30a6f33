"""What complete mode's row vetoes cost per sequence and step, in process, on MaskBench-dev's
o11666 (a oneOf of data types with dependencies between members) and o81746 (a tagged union):
first with a row that allows every token (the worst case for the key checks), then with the
grammar's own row at that point. Run: .venv/bin/python docs/benchmarks/scripts/row_veto_cost.py
(needs ../shared/maskbench-dev)."""
import json
import pathlib
import statistics
import time
import numpy as np
from maskd.server.tokenizers import load_tokenizer
from maskd.server.json_schema.validation import SchemaValidator
from maskd.server.json_schema.documents import JsonDocumentChecker, DocumentBuffer
from maskd.server.json_schema.relax import LENIENT_KEYWORDS
tok = load_tokenizer("deepseek-v4")
DATA = pathlib.Path(__file__).resolve().parents[3].parent / "shared" / "maskbench-dev"
cases = [("Github_medium---o11666", '{"format": "abc'), ("Github_medium---o11666", '{"type": "string", "format": "abc'),
         ("Github_medium---o11666", '{"type": "string", "'), ("Github_medium---o11666", '{"type": "integer", "minimum": "1"'),
         ("Github_medium---o81746", '{"type": "link", "properties": {"href": "x'),]
for name, text in cases:
    schema = json.load(open(f"{DATA}/{name}.json"))["schema"]
    checker = JsonDocumentChecker(SchemaValidator(schema, LENIENT_KEYWORDS | {"required"}), tok)
    buf = DocumentBuffer(checker); buf.extend(tok.encode(text)); assert buf.advance() is None
    row = np.full((tok.vocab_size + 31) // 32, -1, dtype=np.int32)
    checker.row_vetoes(buf.state, buf.data, row)
    ts = []
    for _ in range(200):
        t = time.perf_counter(); checker.row_vetoes(buf.state, buf.data, row); ts.append(time.perf_counter() - t)
    print(f"| {name} | `{text}` | {statistics.median(ts)*1e6:.0f} |")
import llguidance.numpy as lnp
print("with the grammar's own rows:")
from maskd.server.engines import create_engine
from maskd.specs import GrammarSpec
eng = create_engine("llguidance", tok, threads=1, json_schema_mode="complete")
for name, text in cases:
    schema = json.load(open(f"{DATA}/{name}.json"))["schema"]
    g = eng.compile(GrammarSpec.create("json_schema", schema))
    m = eng.new_matcher(g)
    toks = tok.encode(text)
    assert m.consume(toks) is None
        bm = lnp.allocate_token_bitmask(1, tok.vocab_size)
    lnp.fill_next_token_bitmask(m.m, bm, 0)
    row = bm[0].copy()
    checker = JsonDocumentChecker(SchemaValidator(schema, LENIENT_KEYWORDS | {"required"}), tok)
    buf = DocumentBuffer(checker); buf.extend(toks); assert buf.advance() is None
    ts = []
    for _ in range(200):
        t = time.perf_counter(); checker.row_vetoes(buf.state, buf.data, row); ts.append(time.perf_counter() - t)
    print(f"| {name} | `{text}` | {int(np.unpackbits(row.view(np.uint8)).sum())} | {statistics.median(ts)*1e6:.0f} |")
