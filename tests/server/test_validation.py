"""The exact check of complete mode, piece by piece: the incremental JSON scanner, the sub-documents
pinned for early checks, the per-sequence document buffer, and garbage on the way in."""
import json
import random

import numpy as np
import pytest

from maskd.server.json_schema import checker_from_description, describe_checker
from maskd.server.json_schema.documents import DocumentBuffer, JsonDocumentChecker, TagSpan, ToolCallChecker
from maskd.server.json_schema.relax import LENIENT_KEYWORDS
from maskd.server.json_schema.scan import JsonScanner
from maskd.server.json_schema.validation import SchemaValidator, ValidatorError, parse

DOC = b'{"a": [1, {"b": "x\\"]}y", "c": [true, null]}], "d": -2.5e3, "k\\"ey": {}, "e": "\\\\"}'


def scan_in_chunks(data, rng):
    sc = JsonScanner(lambda ctx, key: ctx + (key,), ())
    events, pos = [], 0
    while pos < len(data):
        pos = min(len(data), pos + rng.randint(1, 7))
        events += sc.feed(data[:pos])
    return events, sc


def test_scanner_reports_every_closed_value_whatever_the_chunks():
    rng = random.Random(7)
    first, sc = scan_in_chunks(DOC, rng)
    assert sc.root_start == 0 and sc.root_end == len(DOC)
    by_path = {ctx: DOC[a:b] for ctx, a, b in first}
    assert by_path[("a", 1, "b")] == b'"x\\"]}y"'
    assert by_path[("a", 1, "c")] == b"[true, null]"
    assert by_path[("d",)] == b"-2.5e3" and by_path[('k"ey',)] == b"{}" and by_path[("e",)] == b'"\\\\"'
    for _, a, b in first:
        json.loads(DOC[a:b])   # every range is a whole JSON value
    for _ in range(50):
        assert scan_in_chunks(DOC, rng)[0] == first


def test_scanner_finds_the_end_of_an_embedded_value():
    data = b'<call>{"x": [1, "}"]}</call> more'
    sc = JsonScanner(start=6)
    sc.feed(data)
    assert data[sc.root_start:sc.root_end] == b'{"x": [1, "}"]}'
    num = JsonScanner(start=0)
    num.feed(b"123")
    assert not num.done
    num.feed(b"123</x>")
    assert num.root_end == 3


SCHEMA = {"type": "object", "$defs": {"tag": {"type": "string", "not": {"const": "bad"}}},
          "properties": {
              "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "uniqueItems": True},
              "pair": {"type": "array", "prefixItems": [{"type": "integer", "not": {"const": 0}}, {"type": "string"}]},
              "either": {"anyOf": [{"type": "object", "properties": {"z": {"not": {"const": 1}}}}, {"type": "null"}]},
              "plain": {"type": "object", "properties": {"q": {"type": "integer"}}},
              "all": {"allOf": [{"properties": {"w": {"type": "integer", "not": {"const": 5}}}}]}}}


def test_pins_follow_properties_items_refs_and_allof_never_anyof():
    v = SchemaValidator(SCHEMA, LENIENT_KEYWORDS)
    tags = v.watch(v.root_ctx, "tags")
    assert tags == {"/properties/tags"}
    assert v.watch(tags, 3) == {"/properties/tags/items", "/$defs/tag"}
    assert v.watch(v.watch(v.root_ctx, "pair"), 0) == {"/properties/pair/prefixItems/0"}
    assert v.watch(v.watch(v.root_ctx, "pair"), 1) is None        # nothing relaxed there
    assert v.watch(v.root_ctx, "either") == {"/properties/either"}
    assert v.watch(v.watch(v.root_ctx, "either"), "z") is None   # under anyOf: not pinned
    assert v.watch(v.root_ctx, "plain") is None                   # enforced whole by the grammar
    assert v.watch(v.watch(v.root_ctx, "all"), "w") == {"/properties/all/allOf/0/properties/w"}
    assert v.check_at(v.watch(tags, 0), "bad", "/tags/0").startswith("at /tags/0: ")
    assert v.check_at(tags, ["a", "a"], "/tags") == 'at /tags: ["a","a"] has non-unique elements'


# A discriminated union (GeoJSON's crs, OpenAPI's discriminator): "type" tells the branches apart.
TAGGED = {"type": ["object", "null"], "required": ["type", "properties"], "additionalProperties": False,
          "properties": {"type": {"type": "string"}, "properties": {"type": "object"}},
          "oneOf": [{"$ref": "#/definitions/named"}, {"$ref": "#/definitions/linked"}],
          "definitions": {
              "named": {"properties": {"type": {"enum": ["name"]},
                                       "properties": {"required": ["name"], "properties": {"name": {}}}}},
              "linked": {"properties": {"type": {"const": "link"}, "properties": {"$ref": "#/definitions/href"}}},
              "href": {"type": "object", "required": ["href"], "properties": {"href": {"type": "string"}}}}}


def test_members_narrow_a_union_to_the_branch_they_allow(cl100k):
    v = SchemaValidator(TAGGED, LENIENT_KEYWORDS | {"required"})
    (branches,) = v.unions(v.root_ctx)
    (linked,) = v.narrow(branches, "type", "link")          # a tag: one branch at once
    assert "/definitions/linked" in linked and "/definitions/named" not in linked
    assert v.narrow(branches, "type", "other") == ()
    assert v.narrow(branches, "properties", {"href": "x", "name": "y"}) == branches   # both take it
    assert v.narrow(branches, "properties", {"href": "x"}) == (linked,)      # a required key decides
    assert v.watch(v.root_ctx, "properties") is None          # before the tag: nothing pinned below
    # without a tag: a branch goes when the member breaks its type, object constants or
    # additionalProperties; a number equal to an enum's (1 and 1.0) never removes one
    untagged = {"oneOf": [{"type": "object", "properties": {"$ref": {"type": "string"}}, "additionalProperties": False},
                          {"enum": [{"type": "void"}, {"n": 1}]},
                          {"properties": {"type": {"enum": ["integer", "string"]}}},
                          {"type": "array"}]}
    u = SchemaValidator(untagged, LENIENT_KEYWORDS)
    (four,) = u.unions(u.root_ctx)
    assert len(four) == 4
    assert [sorted(b) for b in u.narrow(four, "type", "string")] == [["/oneOf/2"]]
    assert [sorted(b) for b in u.narrow(four, "type", "void")] == [["/oneOf/1"]]
    assert [sorted(b) for b in u.narrow(four, "n", 1.0)] == [["/oneOf/1"], ["/oneOf/2"]]
    assert [sorted(b) for b in u.narrow(four, "n", True)] == [["/oneOf/2"]]
    # through a document: after "type": "link", an empty "properties" object cannot close
    checker = JsonDocumentChecker(v, cl100k)
    for tag, closes in (("link", False), ("name", False), ("other", True)):
        buf = DocumentBuffer(checker)
        buf.extend(tokens(cl100k, f'{{"type": "{tag}", "properties": {{'))
        assert buf.advance() is None
        row = np.full((cl100k.vocab_size + 31) // 32, -1, dtype=np.int32)
        vetoed = set().union(*(set(ids.tolist()) for ids in checker.row_vetoes(buf.state, buf.data, row)))
        assert (cl100k.encode("}")[0] not in vetoed) is closes, tag
    # the colon and the empty object in one token (":{}"), and null at the root (both branches take
    # it: not one of oneOf), are vetoed too
    def vetoed_after(text):
        buf = DocumentBuffer(checker)
        buf.extend(tokens(cl100k, text))
        assert buf.advance() is None
        row = np.full((cl100k.vocab_size + 31) // 32, -1, dtype=np.int32)
        return set().union(*(set(ids.tolist()) for ids in checker.row_vetoes(buf.state, buf.data, row)))
    colon_empty, = cl100k.encode(":{}")
    assert colon_empty in vetoed_after('{"type": "link", "properties"')
    assert colon_empty not in vetoed_after('{"type": "other", "properties"')
    assert {cl100k.encode("null")[0], cl100k.encode("n")[0]} <= vetoed_after("")


# A union whose branches have dependencies between members (OpenAPI 1.2's data types, simplified).
DATA_TYPES = {"type": "object", "oneOf": [{"$ref": "#/definitions/ref"}, {"$ref": "#/definitions/prim"}],
              "definitions": {
                  "ref": {"required": ["$ref"], "properties": {"$ref": {"type": "string"}},
                          "additionalProperties": False},
                  "prim": {"required": ["type"], "additionalProperties": False,
                           "properties": {"type": {"enum": ["integer", "string"]}, "format": {"type": "string"},
                                          "minimum": {"type": "string"}},
                           "dependencies": {"format": {"oneOf": [
                               {"properties": {"type": {"enum": ["integer"]}, "format": {"enum": ["int32"]}}},
                               {"properties": {"type": {"enum": ["string"]}, "format": {"enum": ["date"]}}}]},
                               "minimum": {"properties": {"type": {"enum": ["integer"]}}}}}}}


def test_rows_take_away_what_a_union_or_a_dependency_rules_out_for_good(cl100k):
    """A member's value that leaves a union no branch, or whose branch's dependent schema it breaks,
    cannot end (also right after a backslash in a string, and as a whole literal); a key whose
    presence breaks a dependent schema cannot be written."""
    checker = JsonDocumentChecker(SchemaValidator(DATA_TYPES, LENIENT_KEYWORDS), cl100k)

    def vetoed_after(text):
        buf = DocumentBuffer(checker)
        buf.extend(tokens(cl100k, text))
        assert buf.advance() is None, text
        row = np.full((cl100k.vocab_size + 31) // 32, -1, dtype=np.int32)
        return set().union(*(set(ids.tolist()) for ids in checker.row_vetoes(buf.state, buf.data, row)))
    quote, quote_comma = cl100k.encode('"')[0], cl100k.encode('",')[0]
    # the member comes first: no branch is pinned yet, but the value leaves only "prim", whose
    # dependency on "format" it breaks
    assert {quote, quote_comma} <= vetoed_after('{"format": "abc')
    assert not {quote, quote_comma} & vetoed_after('{"format": "date')
    assert {quote, quote_comma} <= vetoed_after('{"type": "string", "format": "abc')
    # right after a backslash: the string as it stands decides (a token '""' would end it)
    escaped_enders = set(checker.closers.enders["escaped string"][0].tolist())
    assert cl100k.encode('""')[0] in escaped_enders and escaped_enders <= vetoed_after('{"format": "ab\\')
    assert cl100k.encode('""')[0] not in vetoed_after('{"format": "date\\')
    # a whole literal no branch takes
    assert {cl100k.encode(" null")[0], cl100k.encode("null")[0]} <= vetoed_after('{"type":')
    # keys: "minimum" needs an integer type
    after = vetoed_after('{"type": "string", "')
    assert cl100k.encode("minimum")[0] in after and cl100k.encode("format")[0] not in after


def test_legacy_drafts_ignore_the_siblings_of_ref():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"o": {"type": "object"}},
              "properties": {"a": {"$ref": "#/definitions/o", "properties": {"b": {"not": {"const": 1}}}}}}
    v = SchemaValidator(schema, LENIENT_KEYWORDS)
    a = v.watch(v.root_ctx, "a")
    assert a is None or v.watch(a, "b") is None


def tokens(tok, text):
    return tok.encode(text)


def test_document_buffer_fails_early_and_rollback_takes_it_back(cl100k):
    checker = JsonDocumentChecker(SchemaValidator(SCHEMA, LENIENT_KEYWORDS), cl100k)
    doc = DocumentBuffer(checker)
    head = tokens(cl100k, '{"tags": ["a"')
    doc.extend(head)
    assert doc.advance() is None
    close = tokens(cl100k, ', "a"]')
    doc.extend(close)
    assert "cannot match the JSON schema: at /tags: " in doc.advance()
    doc.rollback(len(close))
    assert doc.doomed is None and doc.advance() is None
    doc.extend(tokens(cl100k, ', "b"], "pair": [1, "x"]}'))
    assert doc.final() is None
    assert doc.final_with(tokens(cl100k, " ")) is None and doc.final() is None


def test_document_after_a_reasoning_marker(cl100k):
    checker = JsonDocumentChecker(SchemaValidator({"type": "integer", "not": {"const": 3}}, LENIENT_KEYWORDS),
                                  cl100k, (b"<think>", b"</think>"))
    doc = DocumentBuffer(checker)
    doc.extend(tokens(cl100k, "<think>the answer 3 is wrong</think>"))
    assert "no document yet" not in (doc.final() or "")
    doc.extend(tokens(cl100k, "3"))
    assert "does not match the JSON schema" in doc.final()
    doc.rollback(1)
    doc.extend(tokens(cl100k, "4"))
    assert doc.final() is None


def test_tool_call_checker_checks_each_call_and_skips_the_others(cl100k):
    v = SchemaValidator({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 1}}}},
                        LENIENT_KEYWORDS)
    checker = ToolCallChecker([TagSpan(b"<f>", (b"</f>",), True, v, "f"),
                               TagSpan(b"<g>", (b"</g>",), True, None, "g")], cl100k)
    doc = DocumentBuffer(checker)
    doc.extend(tokens(cl100k, 'hi <g>{"s": "<f>{\\"n\\": 1}"}</g> then <f>{"n": 2}</f>'))
    assert doc.final() is None
    doc.extend(tokens(cl100k, ' and <f>{"n": 1}</f>'))
    assert "tool call 3 (f)" in doc.advance()


def test_checkers_rebuilt_from_their_description_check_the_same(cl100k):
    """Compiled grammars travel between processes and replicas; their checkers travel as descriptions."""
    json_checker = JsonDocumentChecker(SchemaValidator(SCHEMA, LENIENT_KEYWORDS), cl100k, (b"<t>", b"</t>"))
    v = SchemaValidator({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 1}}}},
                        LENIENT_KEYWORDS)
    tool_checker = ToolCallChecker([TagSpan(b"<f>", (b"</f>", b"\xffend"), True, v, "f"),
                                    TagSpan(b"<g>", (b"</g>",), True, None, "g")], cl100k)
    texts = {id(json_checker): ['<t></t>{"tags": ["a", "a"]}', '<t>x</t>{"tags": ["a"], "pair": [1, "x"]}'],
             id(tool_checker): ['<g>{"n": 1}</g><f>{"n": 2}</f>', '<f>{"n": 1}</f>']}
    for checker in (json_checker, tool_checker):
        desc = json.loads(json.dumps(describe_checker(checker)))
        rebuilt = checker_from_description(desc, cl100k)
        assert type(rebuilt) is type(checker) and describe_checker(rebuilt) == desc
        verdicts = []
        for text in texts[id(checker)]:
            a, b = DocumentBuffer(checker), DocumentBuffer(rebuilt)
            a.extend(tokens(cl100k, text))
            b.extend(tokens(cl100k, text))
            assert a.final() == b.final()
            verdicts.append(b.final() is None)
        assert verdicts == ([False, True] if checker is json_checker else [True, False])
    with pytest.raises(ValueError, match="unknown document checker kind"):
        checker_from_description({"kind": "yaml", "markers": ["", ""]}, cl100k)


@pytest.mark.parametrize("schema,message", [
    ({"type": 12}, "cannot use this schema"),
    ({"$ref": "https://example.com/schema.json"}, "cannot use this schema"),
    ({"type": "string", "pattern": "(unclosed"}, "is not a \"regex\""),
])
def test_validator_refuses_garbage_schemas_with_its_message(schema, message):
    with pytest.raises(ValidatorError, match=message):
        SchemaValidator(schema, LENIENT_KEYWORDS)


@pytest.mark.parametrize("data,message", [
    (b"[" * 5000 + b"]" * 5000, "nests too deeply"),
    (b'{"a": ', "not JSON the validator can read"),
    (b"\xff\xfe", "not JSON the validator can read"),
])
def test_garbage_documents_give_a_message(data, message):
    value, problem = parse(data)
    assert value is None and message in problem


def test_values_the_validator_cannot_take_give_a_message():
    v = SchemaValidator({"type": "string", "not": {"const": "x"}}, LENIENT_KEYWORDS)
    value, problem = parse(b'"\\ud800"')
    assert problem is None
    assert "the validator cannot check this document" in v.check(value)


@pytest.mark.parametrize("draft", ["http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-07/schema#",
                                   "https://json-schema.org/draft/2020-12/schema"])
@pytest.mark.parametrize(("fmt", "good", "bad"), [
    ("iri", "https://example.com/caf\u00e9", "not an iri"),
    ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567-e89b-12d3-a456"),
    ("uri-reference", "/a/b?c#d", "\\\\ not a reference"),
    ("json-pointer", "/a/b", "a/b"),
    ("duration", "P3D", "3 days"),
    ("date", "2024-02-29", "2023-02-29"),
])
def test_every_known_format_is_asserted_whatever_the_draft(draft, fmt, good, bad):
    # As MaskBench's reference validators do; draft-04 alone would let "not an iri" pass.
    v = SchemaValidator({"$schema": draft, "type": "string", "format": fmt}, frozenset())
    assert v.check(good) is None
    assert "not a" in v.check(bad) and fmt in v.check(bad)


def test_a_format_no_draft_defines_is_not_asserted():
    v = SchemaValidator({"$schema": "http://json-schema.org/draft-04/schema#", "format": "textFile"}, frozenset())
    assert v.check("anything at all") is None


@pytest.mark.parametrize("garbage", [b"not json at all", b'{"kind": "json"}', b'{"kind": "json", "markers": [1, 2]}',
                                     b'{"kind": "json", "markers": ["", ""], "schema": {"type": 12}, "relaxed": []}'])
def test_a_serialized_grammar_with_garbage_checks_is_refused_with_a_message(cl100k, garbage):
    """A serialized grammar comes from a compile worker or another replica's cache: garbage in its
    checker's description is a compile error naming it, never a grammar without its checks."""
    from maskd.server.engines import GrammarCompileError, create_engine
    from maskd.server.engines.llguidance_engine import _CHECKED_MAGIC
    from maskd.specs import GrammarSpec
    engine = create_engine("llguidance", cl100k, threads=1, json_schema_mode="complete")
    spec = GrammarSpec.create("json_schema", {"type": "integer"})
    good = engine.serialize(engine.compile(spec))
    assert good.startswith(_CHECKED_MAGIC) and engine.deserialize(spec, good).checker is not None
    head = len(_CHECKED_MAGIC)
    grammar = good[head + 8 + int.from_bytes(good[head:head + 8], "little"):]
    data = _CHECKED_MAGIC + len(garbage).to_bytes(8, "little") + garbage + grammar
    with pytest.raises(GrammarCompileError, match="serialized grammar's document checks"):
        engine.deserialize(spec, data)


def test_a_document_too_deep_is_refused_whatever_the_recursion_limit():
    """A library in the same process may raise the interpreter's recursion limit (torch's inductor
    sets 2,000): documents deeper than MAX_DEPTH are refused all the same, shallower ones parse."""
    import sys

    from maskd.server.json_schema.validation import MAX_DEPTH, parse
    old = sys.getrecursionlimit()
    try:
        for limit in (old, 5000):
            sys.setrecursionlimit(limit)
            assert parse(b"[" * 1500 + b"]" * 1500) == (None, "the document nests too deeply to be checked")
            assert parse(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))[1] is not None
            value, problem = parse(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
            assert problem is None and isinstance(value, list), limit
            assert parse(b'["' + b"[" * 2000 + b'"]') == (["[" * 2000], None)   # brackets in a string
    finally:
        sys.setrecursionlimit(old)
