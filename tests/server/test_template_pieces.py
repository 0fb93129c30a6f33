"""JSON schema templates with named holes, composed from the template and one piece per argument
(issue 19; WGrammar's structure factory).

A template (a schema with ``{"$hole": NAME}`` under properties and items) and its arguments are
served as a router (the template, its holes any object) and one piece per argument (compiled once,
the same grammar as a tool's parameters). The composed rows must be the rows of the filled-in
schema compiled whole at every position: checked on deepseek-v4 (129,280 tokens) over valid
documents in three layouts (compact JSON: one) and three tokenizations, and over random walks that
favour structural tokens, in both JSON-schema modes and both whitespace options, with forced
tokens, rollback, validate and draft rows; in compact JSON also where the forced bytes run across
the template and its arguments (a piece's close and the template's next key, an argument forced
whole between forced keys). Through a real server: a template registered, then the
same template with one argument changed, composed from the router and the pieces it has; a valid
document accepted token by token, an invalid hole's value refused.
"""
import dataclasses
import json
import random

import grpc
import numpy as np
import pytest
from test_tool_call_pieces import Pair, allowed, first_row, layouts, pieces, random_walks, rows, valid_outputs

from maskd.server import MaskServer, ServerConfig
from maskd.server.engines.llguidance_engine import LLGuidanceEngine
from maskd.server.json_schema import TemplateChecker, document_checker
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc
from maskd_client import MaskClient, SeqStatus

# A hole under properties, one as an array's items, one two objects down beside other keys; the
# object around the first hole is closed (after its hole the template forces its next key).
TEMPLATE = {
    "type": "object",
    "properties": {
        "thought": {"type": "string"},
        "action": {"$hole": "action"},
        "steps": {"type": "array", "items": {"$hole": "step"}, "maxItems": 3},
        "meta": {"type": "object", "properties": {"extra": {"$hole": "extra"}, "n": {"type": "integer"}},
                 "required": ["extra"]},
    },
    "required": ["thought", "action", "steps", "meta"],
    "additionalProperties": False,
}
ARGUMENTS = {
    "action": {"type": "object", "properties": {"city": {"type": "string", "minLength": 2},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 9}},
               "required": ["city"], "additionalProperties": False},
    "step": {"type": "object", "properties": {"do": {"type": "string"}, "with": {"type": "array",
                                                                              "items": {"type": "string"}}},
             "required": ["do"]},
    "extra": {"type": "object"},
}
# Valid documents, with "}" and "{" inside strings, empty objects and arrays, nesting.
DOCUMENTS = [
    {"thought": "look {it} up", "action": {"city": "Paris}", "days": 3}, "steps": [],
     "meta": {"extra": {}}},
    {"thought": "", "action": {"city": "Oslo"}, "steps": [{"do": "a}", "with": ["x", "{y"]}, {"do": "b"}],
     "meta": {"extra": {"k": [1, {"z": None}]}, "n": 7}},
    {"thought": "t\"q", "action": {"city": "Rome", "days": 9}, "steps": [{"do": "c", "with": []}],
     "meta": {"extra": {"a": "}"}, "n": -1}},
]


def template_spec(whitespace: str, arguments=ARGUMENTS) -> GrammarSpec:
    return GrammarSpec.from_dict({"template": {"schema": TEMPLATE, "arguments": arguments}, "whitespace": whitespace})


@pytest.fixture(scope="module", params=[("strict", "flexible"), ("complete", "flexible"), ("strict", "compact"),
                                        ("complete", "compact")], ids="-".join)
def grammars(request, deepseek):
    """(engine, the filled-in schema compiled whole, the template composed from its pieces, whitespace)."""
    mode, whitespace = request.param
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode=mode)
    spec = template_spec(whitespace)
    parts = engine.composed_parts(spec)
    assert parts is not None and parts.names == ("action", "extra", "step")
    pieces = [engine.compile(engine.piece_spec(spec, text)) for text in parts.pieces]
    composed = engine.compose(spec, parts, pieces)
    assert composed is not None
    whole = engine.compile(dataclasses.replace(spec, parts=None))    # no parts: compiled whole
    return engine, whole, composed, whitespace


def valid_documents(grammars, tok, rng: random.Random, documents=DOCUMENTS) -> int:
    return valid_outputs(grammars, tok, rng, documents, forced=True)


def test_the_filled_in_schema_is_the_template_with_its_arguments():
    spec = template_spec("flexible")
    filled = json.loads(spec.text)
    assert filled["properties"]["action"] == ARGUMENTS["action"]
    assert filled["properties"]["steps"]["items"] == ARGUMENTS["step"]
    assert filled["properties"]["meta"]["properties"]["extra"] == {"type": "object"}
    router = spec.parts.router_schema()
    assert router["properties"]["action"] == {"type": "object"} == router["properties"]["steps"]["items"]
    other = template_spec("flexible", {**ARGUMENTS, "extra": {"type": "object", "maxProperties": 1}})
    assert other.parts.router_key() == spec.parts.router_key()
    assert other.grammar_id("t", "b", "v") != spec.grammar_id("t", "b", "v")


def test_composed_rows_equal_the_whole_grammars_on_valid_documents(grammars, deepseek):
    positions = valid_documents(grammars, deepseek, random.Random(0))
    assert positions > (400 if grammars[3] == "compact" else 1200), positions


# Holes at the root's level: an array of arrays of the argument's objects.
NESTED_LISTS = {"type": "array", "minItems": 1, "items": {"type": "array", "items": {"$hole": "call"}}}
NESTED_DOCUMENTS = [[[{"city": "Oslo"}], [{"city": "Rome", "days": 2}, {"city": "A}b"}]], [[]], [[], [{"city": "{["}]]]


def test_holes_in_nested_arrays_give_the_whole_grammars_rows(deepseek):
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="strict")
    spec = GrammarSpec.from_dict({"template": {"schema": NESTED_LISTS, "arguments": {"call": ARGUMENTS["action"]}}})
    parts = engine.composed_parts(spec)
    composed = engine.compose(spec, parts, [engine.compile(engine.piece_spec(spec, t)) for t in parts.pieces])
    grammars = (engine, engine.compile(dataclasses.replace(spec, parts=None)), composed, "flexible")
    assert valid_documents(grammars, deepseek, random.Random(3), NESTED_DOCUMENTS) > 300
    rng = random.Random(4)
    random_walks(grammars, deepseek.ll, walks=8, steps=50, choose=lambda allowed: int(rng.choice(allowed)), forced=True)


def test_composed_rows_equal_the_whole_grammars_on_random_walks(grammars, deepseek):
    rng = random.Random(1)
    ll = deepseek.ll
    structural = np.array([any(c in (ll.decode_bytes([t]) if not ll.is_special_token(t) else b"") for c in b'{}[]",:')
                           for t in range(ll.vocab_size)])

    def choose(allowed):
        pick = allowed[structural[allowed]]
        return int(rng.choice(pick if len(pick) and rng.random() < 0.67 else allowed))
    random_walks(grammars, ll, walks=10, steps=80, choose=choose, forced=True)


def test_rollback_validate_and_drafts_match_the_whole_grammar(grammars, deepseek):
    engine = grammars[0]
    text = layouts(grammars, DOCUMENTS[1])[0]
    tokens = deepseek.ll.tokenize_bytes(text.encode())
    pair = Pair(grammars)
    for i, t in enumerate(tokens):
        ahead = tokens[i:i + 6] + [deepseek.eos_token_ids[0]]
        assert pair.composed.validate(ahead) == pair.whole.validate(ahead), i
        draft = ahead[:4]
        out, at = rows(engine, [pair.whole, pair.composed], [draft, draft])
        n = 1 + len(draft)
        assert np.array_equal(out[at[0]:at[0] + n], out[at[1]:at[1] + n]), f"draft rows differ at {i}"
        pair.check(("after drafts", i))
        pair.take(t, i)
        if i % 7 == 6:
            pair.whole.rollback(5)
            pair.composed.rollback(5)
            pair.check(("rolled back", i))
            for u in tokens[i - 4:i + 1]:
                pair.take(u, ("again", i))
    pair.check("end")
    assert pair.composed.is_accepting()


# Forced spans across parts in compact JSON: an argument that forces its whole object (``{"k":1}``)
# between template keys the router forces, an argument whose last value forces its close, holes
# as the items of a bounded array (the close of the last item forces ``]``), and a hole the
# router's forced bytes open.
CHAINS = {
    "type": "object",
    "properties": {
        "fixed": {"$hole": "fixed"},
        "pair": {"type": "array", "items": {"$hole": "last"}, "minItems": 1, "maxItems": 2},
        "then": {"type": "object", "properties": {"x": {"$hole": "fixed"}}, "required": ["x"],
                 "additionalProperties": False},
        "tail": {"type": "boolean"},
    },
    "required": ["fixed", "pair", "then", "tail"],
    "additionalProperties": False,
}
CHAIN_ARGUMENTS = {
    "fixed": {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"], "additionalProperties": False},
    "last": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"type": "boolean"}},
             "required": ["a", "b"], "additionalProperties": False},
}
CHAIN_DOCUMENTS = [
    {"fixed": {"k": 1}, "pair": [{"a": "}", "b": True}], "then": {"x": {"k": 1}}, "tail": False},
    {"fixed": {"k": 1}, "pair": [{"a": "", "b": False}, {"a": "{[", "b": True}], "then": {"x": {"k": 1}},
     "tail": True},
]


@pytest.fixture(scope="module")
def chains(deepseek):
    engine = LLGuidanceEngine(deepseek, threads=1, json_schema_mode="strict")
    spec = GrammarSpec.from_dict({"template": {"schema": CHAINS, "arguments": CHAIN_ARGUMENTS},
                                  "whitespace": "compact"})
    parts = engine.composed_parts(spec)
    assert parts is not None, "a compact template is composed"
    composed = engine.compose(spec, parts, [engine.compile(engine.piece_spec(spec, t)) for t in parts.pieces])
    assert composed is not None
    return engine, engine.compile(dataclasses.replace(spec, parts=None)), composed, "compact"


def test_forced_spans_across_the_template_and_its_arguments_give_the_whole_grammars_rows(chains, deepseek):
    """Rows and forced tokens equal the filled-in schema's where the forced bytes run from a piece
    through the router into the next piece and out again (llguidance's row there is the first
    token of the whole span, chopped); fails where only each part's own forced bytes are followed."""
    assert valid_documents(chains, deepseek, random.Random(5), CHAIN_DOCUMENTS) > 150
    rng = random.Random(6)
    random_walks(chains, deepseek.ll, walks=10, steps=60, choose=lambda allowed: int(rng.choice(allowed)), forced=True)


def test_a_value_outside_its_holes_schema_is_refused(grammars, deepseek):
    engine, _, composed, _ = grammars
    for wrong in (b'{"thought": "x", "action": {"town"', b'{"thought": "x", "action": {"city": "Oslo", "days": 0',
                  b'{"thought": "x", "action": []', b'{"thought": "x", "action": {"city": "Oslo"}, "steps": [{"with"'):
        m = engine.new_matcher(composed)
        tokens = deepseek.ll.tokenize_bytes(wrong)
        assert m.validate(tokens) < len(tokens), wrong
        assert m.consume(tokens) is not None, wrong


def test_the_final_check_validates_each_holes_value(deepseek):
    validator = document_checker({"type": "object", "properties": {"q": {"type": "string", "minLength": 3}}},
                                 deepseek).validator
    checker = TemplateChecker({"step": validator}, ((("steps", None), "step"), (("a",), "other")), deepseek)
    assert checker.final(None, bytearray(b'{"steps": [{"q": "abc"}, {}], "a": {"q": 1}}')) is None
    problem = checker.final(None, bytearray(b'{"steps": [{"q": "abc"}, {"q": "ab"}]}'))
    assert problem is not None and "/steps/1" in problem and "'step'" in problem


# -- through a real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(host="127.0.0.1", port=0, tokenizer="deepseek-v4", threads=2, compile_threads=2,
                                  metrics_port=0)).start()
    yield srv
    srv.stop(grace=1.0)


def test_a_template_with_a_new_argument_composes_from_the_router_and_pieces_the_server_has(server, deepseek):
    with MaskClient(server.address) as mc:
        composed = pieces(server, "composed")
        first = mc.register({"template": {"schema": TEMPLATE, "arguments": ARGUMENTS}})
        assert pieces(server, "composed") == composed + 1
        compiled, cached = pieces(server, "compiled"), pieces(server, "cached")
        changed = {**ARGUMENTS, "extra": {"type": "object", "properties": {"id": {"type": "integer"}},
                                          "required": ["id"], "additionalProperties": False}}
        request = {"template": {"schema": TEMPLATE, "arguments": changed}}
        gid = mc.register(request)
        assert gid != first
        assert pieces(server, "compiled") - compiled == 1        # only the changed argument
        assert pieces(server, "cached") - cached == 2
        assert pieces(server, "composed") == composed + 2

        # A valid document, token by token: every token in its row, then EOS.
        document = {"thought": "ok", "action": {"city": "Oslo"}, "steps": [{"do": "x}"}], "meta": {"extra": {"id": 4}}}
        tokens = deepseek.ll.tokenize_bytes(json.dumps(document).encode())
        r, row = first_row(mc, "good", request)
        for t in tokens:
            assert allowed(row, t), f"token {deepseek.ll.decode_bytes([t])!r} of a valid document refused"
            r = mc.step({"good": [t]})
            assert r.seqs["good"].status in (SeqStatus.READY, SeqStatus.FINISHED), r.seqs["good"]
            row = r.bitmask[r.seqs["good"].row].copy()
        assert allowed(row, deepseek.eos_token_ids[0]) and r.seqs["good"].accepting
        mc.close("good")

        # A key the changed argument does not have: refused where it stops being one of its keys.
        r, row = first_row(mc, "bad", request)
        for t in deepseek.ll.tokenize_bytes(b'{"thought": "ok", "action": {"city": "Oslo"}, "steps": [], '
                                            b'"meta": {"extra": {"name": 1'):
            if not allowed(row, t):
                break
            r = mc.step({"bad": [t]})
            row = r.bitmask[r.seqs["bad"].row].copy()
        else:
            pytest.fail("a key outside the argument's schema was allowed")
        r = mc.step({"bad": [t]})
        assert r.seqs["bad"].status is SeqStatus.FAILED and "hole 'extra'" in r.seqs["bad"].reason, r.seqs["bad"]
        mc.close("bad")


@pytest.mark.parametrize("schema, arguments, reason", [
    ({"properties": {"a": {"$hole": "a"}}, "allOf": [{}]}, {"a": '{"type":"object"}'}, "allOf"),
    (TEMPLATE, {"action": '{"type":"object"}'}, "no argument"),
    (TEMPLATE, {**{k: json.dumps(v) for k, v in ARGUMENTS.items()}, "step": '{"type":"string"}'}, "type 'string'"),
    (TEMPLATE, {**{k: json.dumps(v) for k, v in ARGUMENTS.items()}, "step": '{"type":'}, "not valid JSON"),
    ("[1", {}, "not valid JSON"),
    ({"type": "object"}, {}, "no hole"),
])
def test_a_malformed_template_on_the_wire_is_refused_with_its_reason_and_again(server, schema, arguments, reason):
    """Sent as the message itself (the client would refuse it before sending): INVALID_ARGUMENT
    naming the fault, twice (a refused template is not kept), and the server serves on."""
    stub = pb_grpc.MaskServiceStub(grpc.insecure_channel(server.address))
    msg = pb.GrammarSpec(template=pb.Template(schema=schema if isinstance(schema, str) else json.dumps(schema),
                                              arguments=arguments))
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=msg, wait=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()
    good = pb.GrammarSpec(template=pb.Template(schema=json.dumps(TEMPLATE),
                                               arguments={k: json.dumps(v) for k, v in ARGUMENTS.items()}))
    assert stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=good, wait=True)).state == pb.GRAMMAR_STATE_READY
