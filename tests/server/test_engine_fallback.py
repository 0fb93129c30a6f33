"""The server's llguidance backend with xgrammar for the specs llguidance cannot express
(maskd/server/engines/fallback.py): the structural tags engines build for tool calls in XML argument
styles (xgrammar's own builtin formats of Qwen3-Coder, GLM-4.7 and DeepSeek-V4, as vLLM hands them
to its backend), compiled by xgrammar, their rows exactly xgrammar's, in batches that mix them with
llguidance's grammars; serialized and loaded back; through a real server, a valid call accepted
token by token and a call of a tool outside the set refused."""
import random

import numpy as np
import pytest
import xgrammar as xgr

from maskd.server import MaskServer, ServerConfig
from maskd.server.engines import GrammarCompileError, create_engine
from maskd.server.engines.xgrammar_engine import XGrammarEngine
from maskd.specs import GrammarSpec
from maskd_client import MaskClient, SeqStatus

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "exact": {"type": "boolean"}}, "required": ["q"]}}}]
# A valid output of each model's format for tool_choice "required" (as its tool parser reads it).
CALLS = {
    "qwen_3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, FR\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "glm_4_7": "<tool_call>search<arg_key>q</arg_key><arg_value>maskd</arg_value>"
               "<arg_key>exact</arg_key><arg_value>true</arg_value></tool_call>",
    "deepseek_v4": "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                   "<｜DSML｜parameter name=\"city\" string=\"true\">Oslo</｜DSML｜parameter>\n"
                   "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
}


def tool_tag(model: str) -> GrammarSpec:
    """The request a client sends for calls in the model's own format (maskd.tool_specs.tool_call_tag)."""
    return GrammarSpec.from_request({"tools": TOOLS, "tool_choice": "required", "tool_call_format": model})


@pytest.fixture(scope="module")
def engines(deepseek):
    """(the server's llguidance backend, xgrammar alone): one tokenizer, the model's (deepseek-v4)."""
    return (create_engine("llguidance", deepseek, threads=2, json_schema_mode="complete"),
            XGrammarEngine(deepseek, threads=2, json_schema_mode="complete"))


def row_of(engine, matcher) -> np.ndarray:
    out = engine.allocate(1)
    engine.fill_batch([matcher], [0], None, out)
    return out[0]


@pytest.mark.parametrize("model", sorted(CALLS))
def test_xml_argument_styles_compile_with_xgrammar_and_their_rows_are_xgrammars(engines, deepseek, model):
    served, alone = engines
    spec = tool_tag(model)
    compiled = served.compile(spec)
    assert compiled.by_fallback and isinstance(compiled.handle, xgr.CompiledGrammar)
    ours, theirs = served.new_matcher(compiled), alone.new_matcher(alone.compile(spec))
    tokens = deepseek.ll.tokenize_bytes(CALLS[model].encode())
    for i, t in enumerate(tokens):
        assert np.array_equal(row_of(served, ours), row_of(alone, theirs)), (model, i)
        assert ours.consume([t]) is None, (model, i, deepseek.ll.decode_bytes([t]))
        assert theirs.consume([t]) is None
    assert ours.is_accepting() and np.array_equal(row_of(served, ours), row_of(alone, theirs))
    # a call of a tool outside the set: refused where its name starts to differ
    wrong = CALLS[model].replace("get_weather", "get_wealth").replace("search", "seance")
    fresh = served.new_matcher(compiled)
    assert fresh.validate(deepseek.ll.tokenize_bytes(wrong.encode())) < len(deepseek.ll.tokenize_bytes(wrong.encode()))


def test_a_batch_mixing_both_engines_fills_and_consumes_each_sequence_with_its_own(engines, deepseek):
    served, _ = engines
    json_spec = GrammarSpec.create("json_schema", TOOLS[0]["function"]["parameters"])
    tag_spec = tool_tag("qwen_3_coder")
    plain, tagged = served.compile(json_spec), served.compile(tag_spec)
    assert not plain.by_fallback and tagged.by_fallback
    texts = {id(plain): '{"city": "Rome", "days": 2}', id(tagged): CALLS["qwen_3_coder"]}
    grammars = [plain, tagged, tagged, plain, tagged]
    matchers = [served.new_matcher(g) for g in grammars]
    singles = [served.new_matcher(g) for g in grammars]       # each stepped alone, by its own engine
    streams = [deepseek.ll.tokenize_bytes(texts[id(g)].encode()) for g in grammars]
    rng = random.Random(0)
    for step in range(max(len(s) for s in streams) + 1):
        rows = [3 * slot for slot in rng.sample(range(2 * len(matchers)), len(matchers))]   # any order
        drafts = [list(s[step + 1: step + 1 + rng.randrange(3)]) for s in streams]
        out = served.allocate(6 * len(matchers))
        out[:] = -1
        served.fill_batch(matchers, rows, drafts, out)
        for k, (m, r, d) in enumerate(zip(singles, rows, drafts)):
            want = served.allocate(1 + len(d))
            served.fill_batch([m], [0], [d] if d else None, want)
            assert np.array_equal(out[r: r + 1 + len(d)], want), (step, k)
        tokens = [[s[step]] if step < len(s) else [] for s in streams]
        if step == 1:
            tokens[1] = [deepseek.ll.tokenize_bytes(b"<")[0]]      # not what qwen's format allows here
        reasons = served.consume_batch(matchers, [t for ts in tokens for t in ts], [len(ts) for ts in tokens])
        for k, (m, t) in enumerate(zip(singles, tokens)):
            assert (reasons[k] is None) == (m.consume(t) is None), (step, k, reasons[k])
        if step == 1:
            assert reasons[1] is not None and reasons[0] is None and reasons[2] is None
            streams[1], matchers[1], singles[1] = [], served.new_matcher(tagged), served.new_matcher(tagged)


def test_fallback_grammars_serialize_and_load_back_as_xgrammars(engines, deepseek):
    served, _ = engines
    spec = tool_tag("glm_4_7")
    compiled = served.compile(spec)
    data = served.serialize(compiled)
    for lazy in (False, True):
        back = served.deserialize(spec, data, lazy=lazy)
        assert back.by_fallback
        a, b = served.new_matcher(compiled), served.new_matcher(back)
        for t in deepseek.ll.tokenize_bytes(CALLS["glm_4_7"].encode()):
            assert np.array_equal(row_of(served, a), row_of(served, b))
            assert a.consume([t]) is None and b.consume([t]) is None
    # llguidance's own grammars keep their form; garbage behind the fallback's mark is a compile error
    json_spec = GrammarSpec.create("json_schema", {"type": "object"})
    assert not served.deserialize(json_spec, served.serialize(served.compile(json_spec))).by_fallback
    with pytest.raises(GrammarCompileError, match="cannot load the serialized xgrammar grammar"):
        served.deserialize(spec, data[:20] + b"garbage")


def test_grammar_ids_name_both_engines(engines):
    served, alone = engines
    assert served.name == "llguidance" and served.version.endswith(f"/xgrammar {alone.version}")
    spec = tool_tag("qwen_3_coder")
    assert spec.grammar_id("fp", served.name, served.version) != spec.grammar_id("fp", served.name,
                                                                                   served.primary.version)


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(host="127.0.0.1", port=0, tokenizer="deepseek-v4", threads=1)).start()
    yield srv
    srv.stop(grace=0.5)


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


@pytest.mark.parametrize("model", ["qwen_3_coder", "deepseek_v4"])
def test_through_a_server_a_valid_call_is_accepted_and_another_tool_refused(server, deepseek, model):
    spec = tool_tag(model)
    with MaskClient(server.address, timeout_s=60) as mc:
        assert mc.info().backend == "llguidance"
        grammar_id = mc.register(spec.to_proto(), wait=True)
        mc.open("call", spec.to_proto(), grammar_id=grammar_id)
        r = mc.step({"call": []})
        for t in deepseek.ll.tokenize_bytes(CALLS[model].encode()):
            seq = r.seqs["call"]
            assert seq.status is SeqStatus.READY, seq
            assert allowed(r.bitmask[seq.row], t), f"{model}: the row refuses {deepseek.ll.decode_bytes([t])!r}"
            r = mc.step({"call": [t]})
        assert r.seqs["call"].accepting and allowed(r.bitmask[r.seqs["call"].row], deepseek.eos_token_ids[0])
        mc.close("call")
        # the same call of a tool outside the set: its row refuses it where the name leaves the set
        mc.open("wrong", spec.to_proto(), grammar_id=grammar_id)
        r = mc.step({"wrong": []})
        for t in deepseek.ll.tokenize_bytes(CALLS[model].replace("get_weather", "get_wealth").encode()):
            if not allowed(r.bitmask[r.seqs["wrong"].row], t):
                break
            r = mc.step({"wrong": [t]})
        else:
            pytest.fail(f"{model}: a call of a tool outside the set was allowed whole")
        r = mc.step({"wrong": [t]})
        assert r.seqs["wrong"].status is SeqStatus.FAILED, r.seqs["wrong"]
        mc.close("wrong")
