"""Runaway whitespace: flexible JSON allows at most max_whitespace (default 8) whitespace characters
in a row, so a model cannot loop on spaces until its token limit; 0 lifts the bound."""
import grpc
import pytest

from maskd.server import MaskServer, ServerConfig
from maskd.server.engines import create_engine
from maskd.specs import DEFAULT_MAX_WHITESPACE, GrammarSpec, SpecError
from maskd.v1 import maskd_pb2 as pb
from maskd_client import MaskClient

SCHEMA = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}


def accepts(engine, tok, spec, text):
    m = engine.new_matcher(engine.compile(spec))
    tokens = tok.encode(text)
    return m.validate(tokens) == len(tokens) and m.consume(tokens) is None and m.is_accepting()


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_whitespace_runs_are_bounded(cl100k, backend):
    engine = create_engine(backend, cl100k, threads=1)
    default = GrammarSpec.create("json_schema", SCHEMA)
    assert default.max_whitespace == DEFAULT_MAX_WHITESPACE == 8
    for n, ok in ((1, True), (8, True), (9, False), (40, False)):
        for text in ('{"a":' + " " * n + "[1]}", '{"a": [1,' + "\n" * n + "2]}"):
            assert accepts(engine, cl100k, default, text) is ok, (backend, n, text)
    unbounded = GrammarSpec.create("json_schema", SCHEMA, max_whitespace=0)
    assert accepts(engine, cl100k, unbounded, '{"a":' + " " * 40 + "[1]}")
    two = GrammarSpec.create("json_schema", SCHEMA, max_whitespace=2)
    assert accepts(engine, cl100k, two, '{"a":  [1]}') and not accepts(engine, cl100k, two, '{"a":   [1]}')
    compact = GrammarSpec.create("json_schema", SCHEMA, whitespace="compact")
    assert not accepts(engine, cl100k, compact, '{"a": [1]}') and accepts(engine, cl100k, compact, '{"a":[1]}')


def test_the_bound_needs_llguidance_1_8():
    # llguidance 1.7.6 (vLLM 0.32's pin) took whitespace_pattern and ignored it: 6 spaces passed a bound of 2
    from maskd.server.engines.llguidance_engine import bounds_whitespace

    assert bounds_whitespace()          # this venv's: the bound holds (test_whitespace_runs_are_bounded)
    assert not bounds_whitespace("1.7.6") and bounds_whitespace("1.8.0") and bounds_whitespace("2.0.0rc1")


def test_the_bound_holds_in_a_relaxed_grammar_and_beside_reasoning(cl100k):
    engine = create_engine("llguidance", cl100k, threads=1, json_schema_mode="complete")
    relaxed = GrammarSpec.create("json_schema", {**SCHEMA, "not": {"required": ["b"]}})
    assert engine.compile(relaxed).checker is not None
    assert accepts(engine, cl100k, relaxed, '{"a":' + " " * 8 + "[1]}")
    assert not accepts(engine, cl100k, relaxed, '{"a":' + " " * 9 + "[1]}")
    think = GrammarSpec.create("json_schema", SCHEMA, reasoning="</think>")
    assert accepts(engine, cl100k, think, "a    b" + " " * 20 + "</think>" + '{"a":' + " " * 8 + "[1]}")
    assert not accepts(engine, cl100k, think, "</think>" + '{"a":' + " " * 9 + "[1]}")


def test_option_is_part_of_the_spec_and_its_id():
    a = GrammarSpec.from_dict({"json_schema": SCHEMA})
    b = GrammarSpec.from_dict({"json_schema": SCHEMA, "max_whitespace": 4})
    assert a.grammar_id("fp", "llguidance", "1") != b.grammar_id("fp", "llguidance", "1")
    assert GrammarSpec.from_proto(b.to_proto()) == b and GrammarSpec.from_proto(a.to_proto()) == a
    unset = pb.GrammarSpec(json_schema='{"type": "integer"}')   # an older client: the default bound
    assert GrammarSpec.from_proto(unset).max_whitespace == DEFAULT_MAX_WHITESPACE


@pytest.mark.parametrize("value", [-1, "8", 1.5, True, 1 << 20])
def test_garbage_bounds(value):
    with pytest.raises(SpecError, match="max_whitespace"):
        GrammarSpec.from_dict({"json_schema": SCHEMA, "max_whitespace": value})


def test_garbage_bound_over_the_wire_is_refused_and_the_server_stays_up():
    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1)) as srv:
        spec = pb.GrammarSpec(json_schema='{"type": "integer"}')
        spec.options.max_whitespace = 1 << 20
        with grpc.insecure_channel(srv.address) as ch:
            from maskd.v1 import maskd_pb2_grpc as pb_grpc
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.MaskServiceStub(ch).RegisterGrammar(pb.RegisterGrammarRequest(spec=spec, wait=True))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_whitespace" in err.value.details()
        with MaskClient(srv.address) as mc:
            mc.register({"json_schema": {"type": "integer"}, "max_whitespace": 3})
            with pytest.raises(SpecError, match="max_whitespace"):   # refused before it is sent
                mc.register({"json_schema": {"type": "integer"}, "max_whitespace": -3})
