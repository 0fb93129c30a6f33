"""The xgrammar backend: exact rows of tiny grammars with the real cl100k vocabulary, agreement
with the llguidance backend (and the documented places where they differ), drafts, rollback,
serialization, compile errors, deepseek-v4's tokenizer.json, and one embedded server run."""
import json
import re
import time

import numpy as np
import pytest

from conftest import allowed_ids
from maskd.server.engines import GrammarCompileError, create_engine
from maskd.specs import GrammarSpec

EOS = 100257


@pytest.fixture(scope="module")
def engine(cl100k):
    return create_engine("xgrammar", cl100k, threads=2)


@pytest.fixture(scope="module")
def llg(cl100k):
    return create_engine("llguidance", cl100k, threads=2)


@pytest.fixture(scope="module")
def vocab(cl100k):
    return [cl100k.ll.decode_bytes([i]) for i in range(cl100k.vocab_size)]


def row_of(engine, m):
    out = engine.allocate(1)
    engine.fill_batch([m], [0], None, out)
    return out[0]


def first_row(engine, spec):
    m = engine.new_matcher(engine.compile(spec))
    return m, row_of(engine, m)


def test_engine_identity(engine, cl100k):
    from importlib.metadata import version
    assert engine.name == "xgrammar" and engine.version.startswith(version("xgrammar") + "+maskd.")
    assert engine.tokenizer_info.vocab_size == cl100k.logits_width
    assert engine.tokenizer_info.stop_token_ids == [EOS]


def test_digit_regex_allows_exactly_digit_tokens(engine, vocab, cl100k):
    _, row = first_row(engine, GrammarSpec.create("regex", "[0-9]{1,3}"))
    expected = {i for i, b in enumerate(vocab) if re.fullmatch(rb"[0-9]{1,3}", b)
                and not cl100k.ll.is_special_token(i)}
    assert allowed_ids(row) == expected
    assert len(expected) == 1110


def test_choice_rows(engine, vocab, cl100k):
    m, row = first_row(engine, GrammarSpec.create("choice", ["yes", "no"]))
    expected = {i for i, b in enumerate(vocab) if b and (b"yes".startswith(b) or b"no".startswith(b))}
    assert allowed_ids(row) == expected
    assert m.consume(cl100k.encode("y")) is None
    # xgrammar allows every token that spells a prefix of the forced rest ("e", "es");
    # llguidance allows only the canonical one ("es").
    assert allowed_ids(row_of(engine, m)) == {i for i, b in enumerate(vocab) if b and b"es".startswith(b)}
    assert m.consume(cl100k.encode("es")) is None
    assert allowed_ids(row_of(engine, m)) == {EOS} and m.is_stopped() and m.is_accepting()


def test_choice_literals_are_escaped(engine, cl100k):
    items = ['a "q" \\ b', "tab\there\nnl", "\u0001ctl", "ünï 😀", ""]
    g = engine.compile(GrammarSpec.create("choice", items))
    for s in items:
        m = engine.new_matcher(g)
        assert m.consume(cl100k.encode(s)) is None and m.is_accepting(), s
    assert engine.new_matcher(g).validate(cl100k.encode("a q")) < len(cl100k.encode("a q"))


def test_rows_after_tokens_and_eos(engine, cl100k):
    m, _ = first_row(engine, GrammarSpec.create("regex", "[0-9]{1,3}"))
    assert m.consume(cl100k.encode("12")) is None
    ids = allowed_ids(row_of(engine, m))
    assert ids == {i for i in ids if cl100k.decode([i]).isdigit() and len(cl100k.decode([i])) == 1} | {EOS}
    assert len(ids) == 11
    assert m.is_accepting() and not m.is_stopped()
    assert m.consume(cl100k.encode("3")) is None
    assert m.is_stopped() and allowed_ids(row_of(engine, m)) == {EOS}
    assert m.consume([EOS]) is None and m.is_stopped() and m.is_accepting()
    assert allowed_ids(row_of(engine, m)) == {EOS}  # terminated: never an all-zero row
    assert "follows the end of the grammar" in m.consume(cl100k.encode("4"))
    m.rollback(1)  # back before EOS
    assert m.is_stopped() and allowed_ids(row_of(engine, m)) == {EOS}


def test_bits_past_the_width_are_zero(cl100k):
    from maskd.server.tokenizers import load_tokenizer
    for tok in (cl100k, load_tokenizer("cl100k", 100352)):
        e = create_engine("xgrammar", tok, threads=1)
        _, row = first_row(e, GrammarSpec.create("regex", "(.|\n)*"))
        ids = allowed_ids(row)
        assert max(ids) < tok.vocab_size and EOS in ids
        assert not any(tok.ll.is_special_token(i) for i in ids - {EOS})


def test_rejected_token_gives_reason_and_keeps_state(engine, cl100k):
    m, row0 = first_row(engine, GrammarSpec.create("regex", "[0-9]+"))
    reason = m.consume(cl100k.encode("1") + cl100k.encode("x"))
    assert reason and "is not allowed by the grammar" in reason and "'x'" in reason
    assert np.array_equal(row_of(engine, m), row0)  # consume is atomic
    assert "special token" in m.consume([100258])
    assert "outside the vocabulary" in m.consume([10 ** 6])


def test_rollback_and_forced_tokens(engine, llg, cl100k):
    spec = GrammarSpec.create("regex", "hello world [0-9]")
    m, row0 = first_row(engine, spec)
    forced = m.forced_tokens()
    assert forced == llg.new_matcher(llg.compile(spec)).forced_tokens()
    assert [cl100k.decode([t]) for t in forced] == ["hello", " world", " "]
    assert np.array_equal(row_of(engine, m), row0)  # forced_tokens does not move the matcher
    assert m.consume(forced) is None
    assert m.forced_tokens() == []
    m.rollback(len(forced))
    assert np.array_equal(row_of(engine, m), row0)
    with pytest.raises(ValueError):
        m.rollback(1)


ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}},
    "paid": {"type": "boolean"}}, "required": ["id", "items", "paid"]}
ORDER_TEXT = {"id": "ORD-1234", "items": [{"sku": "abc-def ghi", "qty": 3}, {"sku": "x", "qty": 12}], "paid": True}


@pytest.mark.parametrize("ws", ["flexible", "compact"])
def test_forced_tokens_along_a_json_instance(engine, llg, cl100k, ws):
    """Forced tokens are always the tokenizer's own tokens for the text that follows; with
    flexible whitespace they are exactly llguidance's."""
    spec = GrammarSpec.create("json_schema", ORDER, whitespace=ws)
    text = json.dumps(ORDER_TEXT, separators=(",", ":") if ws == "compact" else None)
    toks = cl100k.encode(text)
    mx, ml = engine.new_matcher(engine.compile(spec)), llg.new_matcher(llg.compile(spec))
    some = 0
    for k, tok in enumerate(toks):
        forced = mx.forced_tokens()
        assert forced == toks[k:k + len(forced)], (k, forced)
        if ws == "flexible":
            assert forced == ml.forced_tokens(), k
        some += bool(forced)
        assert mx.consume([tok]) is None and ml.consume([tok]) is None
    assert some >= 8 and mx.is_stopped()


def test_draft_rows(engine, cl100k):
    m, row0 = first_row(engine, GrammarSpec.create("regex", "[0-9]{1,3}"))
    drafts = cl100k.encode("1") + cl100k.encode("x") + cl100k.encode("2")
    assert m.validate(drafts) == 1
    out = engine.allocate(4)
    out[:] = -1
    engine.fill_batch([m], [0], [drafts], out)
    assert np.array_equal(out[0], row0)
    assert len(allowed_ids(out[1])) == 111  # one or two more digits, or EOS
    assert not out[2].any() and not out[3].any()  # at and past the rejected draft
    assert np.array_equal(row_of(engine, m), row0)  # drafts left the matcher where it was
    # all drafts valid: one row per draft plus the bonus position, the last allowing only EOS
    ok = cl100k.encode("1") + cl100k.encode("2") + cl100k.encode("3")
    out = engine.allocate(4)
    engine.fill_batch([m], [0], [ok], out)
    assert [len(allowed_ids(r)) for r in out] == [1110, 111, 11, 1] and allowed_ids(out[3]) == {EOS}
    assert m.tokens == []


def test_drafts_in_a_mixed_batch(engine, cl100k):
    g = engine.compile(GrammarSpec.create("regex", "[a-z]+"))
    a, b, c = (engine.new_matcher(g) for _ in range(3))
    assert b.consume(cl100k.encode("ab")) is None
    singles = [row_of(engine, x) for x in (a, b, c)]
    out = engine.allocate(6)
    out[:] = -1
    engine.fill_batch([a, b, c], [0, 1, 4], [(), cl100k.encode("c") + cl100k.encode("1"), cl100k.encode("d")], out)
    assert np.array_equal(out[0], singles[0]) and np.array_equal(out[1], singles[1])
    assert np.array_equal(out[4], singles[2])
    assert out[2].any() and not out[3].any() and out[5].any()
    assert b.tokens == cl100k.encode("ab") and c.tokens == []


def test_batch_fill_matches_single_fills(engine):
    specs = [GrammarSpec.create("regex", "[a-z]+"), GrammarSpec.create("json_schema", {"type": "boolean"}),
             GrammarSpec.create("choice", ["alpha", "beta"])]
    matchers = [engine.new_matcher(engine.compile(s)) for s in specs]
    batch = engine.allocate(3)
    engine.fill_batch(matchers, [2, 0, 1], None, batch)
    for m, r in zip(matchers, [2, 0, 1]):
        assert np.array_equal(row_of(engine, m), batch[r])


def test_consume_batch(engine, cl100k):
    spec = GrammarSpec.create("regex", "[0-9]+")
    ms = [engine.new_matcher(engine.compile(spec)) for _ in range(5)]
    each = [cl100k.encode("1"), cl100k.encode("x"), cl100k.encode("2"), [], cl100k.encode("3") + cl100k.encode("4")]
    reasons = engine.consume_batch(ms, [t for ts in each for t in ts], [len(ts) for ts in each])
    assert reasons[0] is None and reasons[2] is None and reasons[3] is None and reasons[4] is None
    assert reasons[1] and "'x'" in reasons[1]
    assert [len(m.tokens) for m in ms] == [1, 0, 1, 0, 2]
    assert engine.consume_batch(ms[:3:2], cl100k.encode("5") * 2) == [None, None]     # one token each: no counts
    assert [len(m.tokens) for m in ms[:3:2]] == [2, 2]


def test_same_masks_as_llguidance_along_a_json_instance(engine, llg, cl100k):
    """Equal rows everywhere except the two documented differences: where a literal is forced
    xgrammar also allows the tokens spelling a prefix of it, and inside strings it also allows
    DEL, the \\/ escape and more \\u escapes."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                               "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
              "required": ["name", "age", "ok", "tag"], "additionalProperties": False}
    cases = [("flexible", '{"name": "Bo \\"x\\"", "age": 42, "ok": true, "tag": "green"}'),
             ("compact", '{"name":"Bo","age":7,"ok":false,"tag":"red"}')]
    for ws, text in cases:
        spec = GrammarSpec.create("json_schema", schema, whitespace=ws)
        mx, ml = engine.new_matcher(engine.compile(spec)), llg.new_matcher(llg.compile(spec))
        toks = cl100k.encode(text)
        equal = 0
        for k in range(len(toks) + 1):
            a, b = allowed_ids(row_of(llg, ml)), allowed_ids(row_of(engine, mx))
            assert a <= b, (ws, k)
            extra = [cl100k.decode_bytes([i]) for i in b - a]
            if not extra:
                equal += 1
            elif len(a) == 1:  # a forced literal: llguidance's one canonical token, xgrammar its prefixes
                assert all(cl100k.decode_bytes(toks[k:]).startswith(x) for x in extra), (ws, k, extra)
            else:  # inside a string
                assert all(b"\x7f" in x or b"\\/" in x or b"\\u" in x for x in extra), (ws, k, extra[:5])
            if k < len(toks):
                assert mx.consume([toks[k]]) is None and ml.consume([toks[k]]) is None
        assert equal >= 8, (ws, equal)
        assert mx.is_stopped() and ml.is_stopped()


def test_compact_whitespace_and_schema_semantics(engine, cl100k):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    flexible = engine.new_matcher(engine.compile(GrammarSpec.create("json_schema", schema)))
    compact = engine.new_matcher(engine.compile(GrammarSpec.create("json_schema", schema, whitespace="compact")))
    assert flexible.validate(cl100k.encode('{"a": 1}')) == len(cl100k.encode('{"a": 1}'))
    assert compact.validate(cl100k.encode('{"a": 1}')) < len(cl100k.encode('{"a": 1}'))
    assert compact.validate(cl100k.encode('{"a":1}')) == len(cl100k.encode('{"a":1}'))
    # JSON Schema semantics (not xgrammar's strict mode): extra properties are allowed by default
    assert compact.validate(cl100k.encode('{"a":1,"b":2}')) == len(cl100k.encode('{"a":1,"b":2}'))


def test_reasoning_prefix(engine, cl100k):
    spec = GrammarSpec.create("json_schema", {"type": "boolean"}, reasoning=("<think>", "</think>"))
    m = engine.new_matcher(engine.compile(spec))
    assert m.consume(cl100k.encode("<think>maybe {not json} here</think>true")) is None
    assert m.is_accepting()
    m = engine.new_matcher(engine.compile(spec))
    assert m.validate(cl100k.encode("true")) == 0  # the reasoning block comes first
    m = engine.new_matcher(engine.compile(GrammarSpec.create("choice", ["yes", "no"],
                                                             reasoning=("<think>", "</think>"))))
    assert m.consume(cl100k.encode("<think>hmm</think>no")) is None and m.is_stopped()


def test_ebnf_and_lark(engine, cl100k):
    m = engine.new_matcher(engine.compile(GrammarSpec.create("ebnf", 'root ::= "x" [0-9]+')))
    assert m.consume(cl100k.encode("x12")) is None and m.is_accepting()
    lark = 'start: "answer: " %json {"type": "integer"}'
    m = engine.new_matcher(engine.compile(GrammarSpec.create("lark", lark)))
    assert m.consume(cl100k.encode("answer: 42")) is None and m.is_accepting()


TOOL_TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [{
        "type": "tag", "begin": '<tool_call>{"name": "get_weather", "arguments": ',
        "content": {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "end": "}</tool_call>"}]}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_structural_tag(engine, cl100k):
    g = engine.compile(GrammarSpec.create("structural_tag", TOOL_TAG))
    m = engine.new_matcher(g)
    assert m.consume(cl100k.encode("Let me check. " + CALL + " done")) is None and m.is_accepting()
    bad = CALL.replace("city", "town")
    assert engine.new_matcher(g).validate(cl100k.encode(bad)) < len(cl100k.encode(bad))
    think = engine.compile(GrammarSpec.create("structural_tag", TOOL_TAG, reasoning=("<think>", "</think>")))
    assert engine.new_matcher(think).consume(cl100k.encode("<think>no <tool_call> yet</think>" + CALL)) is None
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=f>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}},
         "end": "</function>"}]}
    m = engine.new_matcher(engine.compile(GrammarSpec.create("structural_tag", legacy)))
    assert m.consume(cl100k.encode('hi <function=f>{"x": 1}</function>')) is None


def test_serialize_round_trip_gives_identical_masks(engine, cl100k):
    spec = GrammarSpec.create("json_schema", {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "array", "items": {"type": "number"}}}})
    g = engine.compile(spec)
    data = engine.serialize(g)
    assert isinstance(data, bytes)
    g2 = engine.deserialize(spec, data)
    m1, m2 = engine.new_matcher(g), engine.new_matcher(g2)
    for tok in cl100k.encode('{"a": "hi", "b": [1, 2.5]}'):
        assert np.array_equal(row_of(engine, m1), row_of(engine, m2))
        assert m1.consume([tok]) is None and m2.consume([tok]) is None
    assert m2.is_stopped()
    with pytest.raises(GrammarCompileError, match="cannot load"):
        engine.deserialize(spec, b"{not json")


@pytest.mark.parametrize("kind,source,message", [
    ("ebnf", "root ::= (", "EBNF parser error at line 1, column 11"),
    ("ebnf", 'root ::= "a" foo', 'Rule "foo" is not defined'),
    ("regex", "[0-9", "Unclosed '\\['"),
    ("json_schema", {"type": "foo"}, 'Unsupported type "foo"'),
    ("json_schema", False, "cannot accept any value"),
    ("structural_tag", {"type": "structural_tag"}, "must have a format field"),
    ("lark", "start: foo", "unknown name 'foo'"),
    ("lark", "start: /[0-9]+/ & /1.*/", "'&' is not supported"),  # llguidance-only Lark operator
])
def test_compile_errors_carry_xgrammar_message(engine, kind, source, message):
    with pytest.raises(GrammarCompileError, match=message) as info:
        engine.compile(GrammarSpec.create(kind, source))
    assert not str(info.value).startswith("[")  # the C++ log prefix is gone


def test_compile_time_is_recorded(engine):
    g = engine.compile(GrammarSpec.create("regex", "[a-f]{2,9}x"))
    assert g.compile_seconds > 0 and g.handle.memory_size_bytes > 0


# -- deepseek-v4 (HF tokenizer.json) ------------------------------------------------------------

def test_deepseek_hf_and_llguidance_vocabularies_agree(deepseek):
    hf = create_engine("xgrammar", deepseek, threads=2)  # auto: from_huggingface on tokenizer.json
    assert deepseek.hf_tokenizer_file and hf.tokenizer_info.vocab_type.name == "BYTE_LEVEL"
    from maskd.server.engines.xgrammar_engine import XGrammarEngine
    raw = XGrammarEngine(deepseek, threads=2, vocab_source="llguidance")
    llg = create_engine("llguidance", deepseek, threads=2)
    specials = {i for i in range(deepseek.vocab_size) if deepseek.ll.is_special_token(i)}
    eos = set(deepseek.eos_token_ids)
    assert len(specials) > 1000 and set(hf.tokenizer_info.special_token_ids) >= specials - eos
    for spec, text in [(GrammarSpec.create("regex", "[0-9]{1,3}"), ""),
                       (GrammarSpec.create("regex", "[0-9]{1,3}"), "12"),
                       (GrammarSpec.create("json_schema", {"type": "string"}), '"ab'),
                       (GrammarSpec.create("regex", "(.|\n)*"), "x")]:
        rows = []
        for e in (hf, raw, llg):
            m = e.new_matcher(e.compile(spec))
            assert m.consume(deepseek.encode(text)) is None
            rows.append(row_of(e, m))
        assert np.array_equal(rows[0], rows[1]), spec
        ids = allowed_ids(rows[0])
        assert not (ids & specials) - eos  # special tokens are never text
        if spec.kind == "regex" and "0-9" in spec.text:
            assert ids == allowed_ids(rows[2])  # and the same row as llguidance


# -- one embedded server on the xgrammar backend -------------------------------------------------

def test_embedded_server_runs_a_json_sequence_to_the_end(cl100k):
    from maskd.server import MaskServer, ServerConfig
    from maskd_client import MaskClient, SeqStatus

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", backend="xgrammar", threads=2,
                                  compile_threads=1)).start()
    try:
        with MaskClient(srv.address, tokenizer=cl100k.fingerprint, timeout_s=60) as mc:
            assert mc.info().backend == "xgrammar"
            mc.open("s", {"json_schema": schema, "whitespace": "compact"})
            deadline = time.monotonic() + 30
            res = mc.step({"s": []})
            while res.seqs["s"].status is SeqStatus.WAITING and time.monotonic() < deadline:
                time.sleep(0.02)
                res = mc.step({"s": []})
            statuses = []
            toks = cl100k.encode('{"ok":true,"n":12}')
            for i, tok in enumerate(toks):
                r = res.seqs["s"]
                assert r.status in (SeqStatus.READY, SeqStatus.FINISHED), r.reason
                assert tok in allowed_ids(res.bitmask[r.row]), (i, cl100k.decode([tok]))
                statuses.append(r.status)
                res = mc.step({"s": [tok]})
            last = res.seqs["s"]
            assert statuses[0] is SeqStatus.READY and last.status is SeqStatus.FINISHED and last.accepting
            assert allowed_ids(res.bitmask[last.row]) == {EOS}
    finally:
        srv.stop(grace=1.0)
