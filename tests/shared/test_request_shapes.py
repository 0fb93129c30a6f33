"""GrammarSpec.from_request: the shapes users already send, one meaning per name, and the
ambiguous ones refused with a message (never a silent "any JSON")."""
import dataclasses
import json

import pytest

from maskd.specs import GrammarSpec, SpecError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TEXT = json.dumps(SCHEMA, separators=(",", ":"))


def spec(kind, source, **kw):
    return GrammarSpec.create(kind, source, **kw)


@pytest.mark.parametrize("request_, expected", [
    # maskd's own shape
    ({"json_schema": SCHEMA}, spec("json_schema", SCHEMA)),
    ({"regex": "[0-9]+", "whitespace": "compact"}, spec("regex", "[0-9]+", whitespace="compact")),
    ({"choice": ["yes", "no"], "reasoning": ["<think>", "</think>"]},
     spec("choice", ["yes", "no"], reasoning=("<think>", "</think>"))),
    ({"lark": "start: /a+/"}, spec("lark", "start: /a+/")),
    # vLLM structured_outputs
    ({"json": SCHEMA}, spec("json_schema", SCHEMA)),
    ({"json": TEXT, "disable_any_whitespace": True}, spec("json_schema", SCHEMA, whitespace="compact")),
    ({"grammar": 'root ::= "a"'}, spec("ebnf", 'root ::= "a"')),
    ({"json_object": True}, spec("json_schema", {"type": "object"})),
    ({"choice": ["x"], "regex": None, "json": None, "disable_any_whitespace": False}, spec("choice", ["x"])),
    ({"structured_outputs": {"regex": "a|b"}}, spec("regex", "a|b")),
    ({"json": SCHEMA, "disable_additional_properties": True},
     spec("json_schema", {**SCHEMA, "additionalProperties": False})),
    # OpenAI response_format
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}},
     spec("json_schema", SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
     spec("json_schema", SCHEMA)),
    ({"type": "json_schema", "schema": SCHEMA}, spec("json_schema", SCHEMA)),
    ({"type": "json_object"}, spec("json_schema", {"type": "object"})),
    # SGLang's keys: json_schema as JSON text, ebnf
    ({"json_schema": TEXT}, spec("json_schema", SCHEMA)),
    ({"ebnf": 'root ::= "b"'}, spec("ebnf", 'root ::= "b"')),
    ({"type": "structural_tag", "structures": [], "triggers": []},
     spec("structural_tag", {"type": "structural_tag", "structures": [], "triggers": []})),
])
def test_shapes(request_, expected):
    assert GrammarSpec.from_request(request_) == expected


def test_text_means_no_constraint():
    assert GrammarSpec.from_request({"type": "text"}) is None
    assert GrammarSpec.from_request({"response_format": {"type": "text"}}) is None


def test_openai_wrapper_passed_as_json_schema_is_unwrapped():
    """The bug of the issue: {"name", "schema", "strict"} as json_schema allowed any JSON."""
    wrapped = {"json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    got = GrammarSpec.from_dict(wrapped)
    assert got == spec("json_schema", SCHEMA)
    assert GrammarSpec.from_request(wrapped) == got
    # the proto path (what a server sees) unwraps the same way, so ids agree on both ends
    raw = GrammarSpec("json_schema", json.dumps(wrapped["json_schema"]))
    assert GrammarSpec.from_proto(raw.to_proto()) == got


def test_openai_wrapper_unwrapped_rows_reject_what_any_json_allowed(cl100k):
    """Through the engine: the wrapped schema constrains like the schema itself."""
    from maskd.server.engines import create_engine
    engine = create_engine("llguidance", cl100k, threads=1)
    compiled = engine.compile(GrammarSpec.from_dict({"json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}))
    for doc, ok in (('{"a": 1}', True), ('{"b": 1}', False), ("[1,2,3]", False), ('"str"', False)):
        m = engine.new_matcher(compiled)
        tokens = cl100k.encode(doc)
        reason = engine.consume_batch([m], tokens, [len(tokens)])[0]
        accepted = reason is None and m.is_accepting()
        assert accepted == ok, doc


@pytest.mark.parametrize("request_, message", [
    ({"json_schema": {"name": "r", "strict": True}}, "no 'schema'"),
    ({"json_schema": {"schema": SCHEMA, "type": "object"}}, "wrapper or a schema"),
    ({"type": "json_schema", "json_schema": {"name": "r", "strict": True}}, "no 'schema'"),
    ({"type": "json_schema"}, "exactly one of"),
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}, "schema": SCHEMA}, "exactly one of"),
    ({"type": "json_object", "schema": SCHEMA}, "no other keys"),
    ({"type": "yaml"}, "not one of"),
    ({"json": SCHEMA, "regex": "a"}, "exactly one constraint"),
    ({"json_schema": SCHEMA, "json": SCHEMA}, "exactly one constraint"),
    ({}, "exactly one constraint"),
    ({"json_object": False}, "json_object is true"),
    ({"jsonschema": SCHEMA}, "unknown grammar spec keys"),
    ({"regex": "a", "whitespace_pattern": " ?"}, "whitespace_pattern"),
    ({"json": SCHEMA, "disable_any_whitespace": True, "whitespace": "flexible"}, "contradicts"),
    ({"regex": "a", "disable_additional_properties": True}, "JSON schemas only"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "twice"),
    ({"structured_outputs": {"regex": "a"}, "json": SCHEMA}, "twice"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "JSON object or boolean"),
    ({"choice": "yes"}, "list of strings"),
    ({"regex": 5}, "must be a string"),
])
def test_ambiguous_or_malformed_is_an_error(request_, message):
    with pytest.raises(SpecError, match=message):
        GrammarSpec.from_request(request_)


@pytest.mark.parametrize("garbage", [None, 42, "regex", ["json"], b"\x00\xff", object()])
def test_garbage_is_an_error(garbage):
    with pytest.raises(SpecError):
        GrammarSpec.from_request(garbage)


def test_objects_with_fields_like_vllms_params():
    @dataclasses.dataclass
    class Params:   # the fields of vLLM's StructuredOutputsParams
        json: object = None
        regex: object = None
        choice: object = None
        grammar: object = None
        json_object: object = None
        disable_any_whitespace: bool = False
        disable_additional_properties: bool = False
        whitespace_pattern: object = None
        structural_tag: object = None

    assert GrammarSpec.from_request(Params(choice=["a", "b"])) == spec("choice", ["a", "b"])
    assert GrammarSpec.from_request(Params(json=SCHEMA, disable_any_whitespace=True)) == \
        spec("json_schema", SCHEMA, whitespace="compact")


def test_pydantic_model_class():
    pydantic = pytest.importorskip("pydantic")

    class Answer(pydantic.BaseModel):
        a: int

    got = GrammarSpec.from_request(Answer)
    assert got.kind == "json_schema"
    assert json.loads(got.text) == Answer.model_json_schema()


def test_closed_objects_walks_subschemas_only():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {}},
                                               "xs": {"type": "array", "items": {"type": "object"}}},
              "$defs": {"d": {"anyOf": [{"type": "object"}, {"type": "string"}]}}}
    got = json.loads(GrammarSpec.from_request({"json": schema, "disable_additional_properties": True}).text)
    assert got["additionalProperties"] is False
    assert got["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]   # a map of names, not a schema
    assert got["properties"]["xs"]["items"]["additionalProperties"] is False
    assert got["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in got["$defs"]["d"]["anyOf"][1]


def test_large_spec_texts_are_worked_out_once_and_the_memo_stays_bounded(monkeypatch):
    """A large JSON source's canonical text and depth are kept (tool sets resent on every request),
    bad input is refused every time and never kept, and the memo drops its oldest texts past its
    budget."""
    from maskd import specs
    from maskd.text_memo import TextMemo
    memos = {purpose: TextMemo(8 << 20) for purpose in specs._MEMOS}
    monkeypatch.setattr(specs, "_MEMOS", memos)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40}
                                               for i in range(120)}}
    text = json.dumps(schema, indent=2)
    assert len(text) >= specs._MEMO_MIN_CHARS
    a = GrammarSpec.create("json_schema", text)
    b = GrammarSpec.create("json_schema", text)
    assert a == b == GrammarSpec.create("json_schema", schema) and a.depth == b.depth == 3
    assert text in memos["json_schema"] and a.text in memos["depth"]   # this text's canonical form, its depth
    assert len(memos["json_schema"]._items) == len(memos["depth"]._items) == 1
    for _ in range(2):
        with pytest.raises(SpecError, match="not valid JSON"):
            GrammarSpec.create("json_schema", text[:-1])
    assert len(memos["json_schema"]._items) == 1
    small = json.dumps({"type": "string"})
    GrammarSpec.create("json_schema", small)
    assert small not in memos["json_schema"]                           # small texts are read again
    memos["json_schema"].max_chars = 6 * len(text)
    for i in range(6):
        GrammarSpec.create("json_schema", text.replace('"p0"', f'"q{i}"'))
    assert memos["json_schema"].chars <= 6 * len(text) and text not in memos["json_schema"]
