"""Exact rows of tiny grammars on the llguidance backend with the real cl100k vocabulary."""
import re

import numpy as np
import pytest

from conftest import allowed_ids
from maskd.server.engines import GrammarCompileError, UnsupportedSpec, create_engine
from maskd.specs import GrammarSpec, SpecError


@pytest.fixture(scope="module")
def engine(cl100k):
    return create_engine("llguidance", cl100k, threads=2)


@pytest.fixture(scope="module")
def vocab(cl100k):
    return [cl100k.ll.decode_bytes([i]) for i in range(cl100k.vocab_size)]


def first_row(engine, spec):
    m = engine.new_matcher(engine.compile(spec))
    out = engine.allocate(1)
    engine.fill_batch([m], [0], None, out)
    return m, out[0]


def test_digit_regex_allows_exactly_digit_tokens(engine, vocab, cl100k):
    _, row = first_row(engine, GrammarSpec.create("regex", "[0-9]{1,3}"))
    expected = {i for i, b in enumerate(vocab) if re.fullmatch(rb"[0-9]{1,3}", b)
                and not cl100k.ll.is_special_token(i)}
    assert allowed_ids(row) == expected
    assert len(expected) == 1110  # cl100k has every 1-3 digit string as a token


def test_choice_allows_exactly_prefix_tokens(engine, vocab):
    _, row = first_row(engine, GrammarSpec.create("choice", ["yes", "no"]))
    expected = {i for i, b in enumerate(vocab) if b and (b"yes".startswith(b) or b"no".startswith(b))}
    assert allowed_ids(row) == expected


def test_rows_after_tokens_and_eos(engine, cl100k):
    m, _ = first_row(engine, GrammarSpec.create("regex", "[0-9]{1,3}"))
    assert m.consume(cl100k.encode("12")) is None
    out = engine.allocate(1)
    engine.fill_batch([m], [0], None, out)
    ids = allowed_ids(out[0])
    assert ids == {i for i in ids if cl100k.decode([i]).isdigit() and len(cl100k.decode([i])) == 1} | {100257}
    assert len(ids) == 11  # one more digit, or EOS
    assert m.is_accepting() and not m.is_stopped()


def test_rejected_token_gives_reason(engine, cl100k):
    m, _ = first_row(engine, GrammarSpec.create("regex", "[0-9]+"))
    reason = m.consume(cl100k.encode("x"))
    assert reason and "doesn't satisfy the grammar" in reason


def test_rollback_and_forced_tokens(engine, cl100k):
    m, row0 = first_row(engine, GrammarSpec.create("regex", "hello world [0-9]"))
    forced = m.forced_tokens()
    assert cl100k.decode(forced).startswith("hello")
    assert m.consume(forced) is None
    m.rollback(len(forced))
    out = engine.allocate(1)
    engine.fill_batch([m], [0], None, out)
    assert np.array_equal(out[0], row0)


def test_draft_rows(engine, cl100k):
    m, row0 = first_row(engine, GrammarSpec.create("regex", "[0-9]{1,3}"))
    drafts = cl100k.encode("1") + cl100k.encode("x")
    assert m.validate(drafts) == 1
    out = engine.allocate(3)
    out[:] = -1
    engine.fill_batch([m], [0], [drafts], out)
    assert np.array_equal(out[0], row0)
    assert len(allowed_ids(out[1])) > 0 and allowed_ids(out[1]) != allowed_ids(out[0])
    assert not out[2].any()  # past the rejected draft
    out2 = engine.allocate(1)
    engine.fill_batch([m], [0], None, out2)
    assert np.array_equal(out2[0], row0)  # drafts left the matcher where it was


def test_batch_fill_matches_single_fills(engine, cl100k):
    specs = [GrammarSpec.create("regex", "[a-z]+"), GrammarSpec.create("json_schema", {"type": "boolean"}),
             GrammarSpec.create("choice", ["alpha", "beta"])]
    matchers = [engine.new_matcher(engine.compile(s)) for s in specs]
    batch = engine.allocate(3)
    engine.fill_batch(matchers, [2, 0, 1], None, batch)
    for m, r in zip(matchers, [2, 0, 1]):
        single = engine.allocate(1)
        engine.fill_batch([m], [0], None, single)
        assert np.array_equal(single[0], batch[r])


def test_consume_batch_parallel(engine, cl100k):
    spec = GrammarSpec.create("regex", "[0-9]+")
    ms = [engine.new_matcher(engine.compile(spec)) for _ in range(4)]
    each = [cl100k.encode("1"), cl100k.encode("x"), cl100k.encode("2"), []]     # one flat array, and counts
    reasons = engine.consume_batch(ms, [t for ts in each for t in ts], [len(ts) for ts in each])
    assert reasons[0] is None and reasons[2] is None and reasons[3] is None
    assert reasons[1]


def test_eos_after_a_stopped_document_alone_or_in_a_batch(engine, cl100k):
    # a JSON document's grammar stops once the root closes; EOS then passes whether the sequence
    # is alone in its step (one matcher) or one of several (the parallel path)
    spec = GrammarSpec.create("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})
    compiled = engine.compile(spec)
    eos = cl100k.eos_token_ids[0]
    for batch in (1, 2, 3):
        ms = [engine.new_matcher(compiled) for _ in range(batch)]
        doc = cl100k.encode('{"a": 1}')
        assert engine.consume_batch(ms, doc * batch, [len(doc)] * batch) == [None] * batch
        assert all(m.is_stopped() and m.is_accepting() for m in ms)
        assert engine.consume_batch(ms, [eos] * batch) == [None] * batch, batch     # one token each: no counts
    m = engine.new_matcher(compiled)
    assert m.consume(cl100k.encode('{"a": 1}')) is None and m.consume([eos]) is None
    # a stopped grammar still refuses anything but EOS
    m = engine.new_matcher(compiled)
    assert m.consume(cl100k.encode('{"a": 1}')) is None and m.consume(cl100k.encode("x"))


def test_compact_whitespace(engine, cl100k):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    flexible = engine.new_matcher(engine.compile(GrammarSpec.create("json_schema", schema)))
    compact = engine.new_matcher(engine.compile(GrammarSpec.create("json_schema", schema, whitespace="compact")))
    assert flexible.validate(cl100k.encode('{"a": 1}')) == len(cl100k.encode('{"a": 1}'))
    assert compact.validate(cl100k.encode('{"a": 1}')) < len(cl100k.encode('{"a": 1}'))
    assert compact.validate(cl100k.encode('{"a":1}')) == len(cl100k.encode('{"a":1}'))


def test_reasoning_prefix(engine, cl100k):
    spec = GrammarSpec.create("json_schema", {"type": "boolean"}, reasoning=("<think>", "</think>"))
    m = engine.new_matcher(engine.compile(spec))
    text = "<think>maybe {not json} here</think>true"
    assert m.consume(cl100k.encode(text)) is None
    assert m.is_accepting()


def test_lark_with_json_and_ebnf(engine, cl100k):
    lark = 'start: "answer: " %json {"type": "integer"}'
    m = engine.new_matcher(engine.compile(GrammarSpec.create("lark", lark)))
    assert m.consume(cl100k.encode("answer: 42")) is None and m.is_accepting()
    ebnf = 'root ::= "x" [0-9]+'
    m = engine.new_matcher(engine.compile(GrammarSpec.create("ebnf", ebnf)))
    assert m.consume(cl100k.encode("x12")) is None and m.is_accepting()


@pytest.mark.parametrize("kind,source,match", [
    ("lark", "start: foo", "unknown name"),
    ("json_schema", {"type": "foo"}, "Invalid type"),
    ("regex", "[0-9", "."),
    ("ebnf", "root ::= (", "."),
])
def test_compile_errors_carry_engine_message(engine, kind, source, match):
    with pytest.raises(GrammarCompileError, match=match):
        engine.compile(GrammarSpec.create(kind, source))


def test_structural_tag_formats_llguidance_lacks_go_to_xgrammar(engine, cl100k):
    # llguidance alone refuses them, naming them; the server's llguidance backend compiles them
    # with xgrammar (engines/fallback.py), and a spec xgrammar refuses too carries both messages
    from maskd.server.engines.llguidance_engine import LLGuidanceEngine

    empty = GrammarSpec.create("structural_tag",
                               {"type": "structural_tag", "format": {"type": "dispatch", "rules": []}})
    with pytest.raises(UnsupportedSpec, match="'dispatch' is not supported on llguidance"):
        LLGuidanceEngine(cl100k, threads=1).compile(empty)
    with pytest.raises(GrammarCompileError,
                       match=r"rules must be non-empty.*'dispatch' is not supported on llguidance"):
        engine.compile(empty)
    dispatch = GrammarSpec.create("structural_tag", {"type": "structural_tag", "format": {
        "type": "dispatch", "rules": [["<a>", {"type": "const_string", "value": "A"}]]}})
    assert engine.compile(dispatch).by_fallback
    with pytest.raises(GrammarCompileError, match="has a 'format'"):
        engine.compile(GrammarSpec.create("structural_tag", {"type": "structural_tag"}))


@pytest.mark.parametrize("spec", [
    {"regex": 5}, {"json_schema": "{not json"}, {"choice": []}, {"choice": "abc"}, {"bogus": 1},
    {"regex": "a", "lark": "start: x"}, {"regex": " "}, {"regex": "a", "whitespace": "tabs"},
    {"regex": "a", "reasoning": ["<think>"]}, "not a dict",
])
def test_garbage_specs(spec):
    with pytest.raises(SpecError):
        GrammarSpec.from_dict(spec)


def test_grammar_id_is_content_hash(cl100k):
    a = GrammarSpec.from_dict({"json_schema": '{"type":  "integer"}'})
    b = GrammarSpec.from_dict({"json_schema": {"type": "integer"}})
    c = GrammarSpec.from_dict({"json_schema": {"type": "integer"}, "whitespace": "compact"})
    fp = cl100k.fingerprint
    assert a.grammar_id(fp, "llguidance", "1") == b.grammar_id(fp, "llguidance", "1")
    assert a.grammar_id(fp, "llguidance", "1") != c.grammar_id(fp, "llguidance", "1")
    assert a.grammar_id(fp, "llguidance", "1") != a.grammar_id(fp, "xgrammar", "1")
    assert a.grammar_id(fp, "llguidance", "1") != a.grammar_id("other", "llguidance", "1")
    assert GrammarSpec.from_proto(a.to_proto()) == a
