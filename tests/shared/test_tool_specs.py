"""OpenAI's tools through GrammarSpec.from_request: the schema vLLM 0.33 constrains a forced tool
choice to (vllm/tool_parsers/utils.py, get_json_schema_from_tools; the same text, key order
included), garbage refused with the key named, and a call array driven token by token through a
real server."""
import copy
import json

import pytest

from maskd.specs import GrammarSpec, SpecError
from maskd.tool_specs import EMPTY_PARAMETERS, tool_call_schema

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}}]


def call_item(name, params):
    return {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"]}


# What vLLM's _get_json_schema_from_tools gives for TOOLS (key order included; maxItems last).
REQUIRED = {"type": "array", "minItems": 1,
            "items": {"type": "object", "anyOf": [call_item("get_weather", WEATHER),
                                                  call_item("noop", EMPTY_PARAMETERS)]}}
SINGLE = {**REQUIRED, "maxItems": 1}


def spec_of(schema, **kw):
    return GrammarSpec.create("json_schema", schema, **kw)


# -- the schemas --------------------------------------------------------------------------------------
@pytest.mark.parametrize("request_, schema", [
    ({"tools": TOOLS, "tool_choice": "required"}, REQUIRED),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True}, REQUIRED),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, SINGLE),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, WEATHER),
    ({"tools": TOOLS, "tool_choice": {"function": {"name": "noop"}}, "parallel_tool_calls": False},
     EMPTY_PARAMETERS),
])
def test_forced_tool_choice_schemas(request_, schema):
    spec = GrammarSpec.from_request(request_)
    assert spec == spec_of(schema)
    assert json.loads(spec.text) == schema
    assert list(json.loads(spec.text)) == list(schema)          # key order as vLLM's


def test_exact_text_of_the_required_array():
    got = GrammarSpec.from_request({"tools": TOOLS[1:], "tool_choice": "required", "parallel_tool_calls": False})
    assert got.text == ('{"type":"array","minItems":1,"items":{"type":"object","anyOf":['
                        '{"properties":{"name":{"type":"string","enum":["noop"]},'
                        '"parameters":{"type":"object","properties":{}}},"required":["name","parameters"]}]},'
                        '"maxItems":1}')


def test_same_grammar_as_the_schema_vllm_hands_its_backend():
    """vLLM's API server turns the tools into structured_outputs.json; both shapes are one grammar."""
    tools = GrammarSpec.from_request({"tools": TOOLS, "tool_choice": "required"})
    vllm = GrammarSpec.from_request({"structured_outputs": {"json": REQUIRED}})
    assert tools == vllm
    assert tools.grammar_id("fp", "llguidance", "1") == vllm.grammar_id("fp", "llguidance", "1")


@pytest.mark.parametrize("params", [None, {}])
def test_tools_without_parameters_take_any_object(params):
    fn = {"name": "f"} if params is None else {"name": "f", "parameters": params}
    tools = [{"type": "function", "function": fn}]
    assert tool_call_schema(tools, "required")["items"]["anyOf"] == [call_item("f", EMPTY_PARAMETERS)]
    assert tool_call_schema(tools, {"type": "function", "function": {"name": "f"}}) == EMPTY_PARAMETERS


def test_defs_move_to_the_root_where_their_refs_land():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    a = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": point}}
    b = {"type": "object", "properties": {"q": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": point}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": a}},
             {"type": "function", "function": {"name": "b", "parameters": b}}]
    before = copy.deepcopy(tools)
    schema = tool_call_schema(tools, "required")
    assert schema["$defs"] == {"Point": point}
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == {"type": "object",
                                                                      "properties": {"p": {"$ref": "#/$defs/Point"}}}
    assert tools == before                                  # the request is not changed
    # a named choice keeps the parameters whole, $defs included
    assert tool_call_schema(tools, {"type": "function", "function": {"name": "a"}}) == a


@pytest.mark.parametrize("request_", [
    {"tools": TOOLS, "tool_choice": "auto"},
    {"tools": TOOLS, "tool_choice": "none"},
    {"tools": TOOLS},                                     # vLLM: no tool_choice with tools is "auto"
    {"tools": TOOLS, "parallel_tool_calls": False},
    {"tool_choice": "none"},
    {"tools": [], "tool_choice": "required"},            # vLLM and OpenAI: as "none"
    {"tools": TOOLS, "tool_choice": "auto", "model": "m", "messages": [{"role": "user", "content": "hi"}]},
])
def test_no_constraint_from_the_tools(request_):
    assert GrammarSpec.from_request(request_) is None


@pytest.mark.parametrize("other", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "[0-9]+"}},
])
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_unforced_tool_choice_leaves_the_other_constraint(choice, other):
    request_ = {"tools": TOOLS, "tool_choice": choice, "messages": [], **other}
    expected = GrammarSpec.from_request(other)
    assert expected is not None and GrammarSpec.from_request(request_) == expected


def test_options_and_body_keys_beside_forced_calls():
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "temperature": 0.2,
            "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    assert GrammarSpec.from_request(body) == spec_of(SINGLE)
    assert GrammarSpec.from_request({**body, "whitespace": "compact"}) == spec_of(SINGLE, whitespace="compact")
    assert GrammarSpec.from_request({**body, "disable_any_whitespace": True}) == spec_of(SINGLE, whitespace="compact")
    assert GrammarSpec.from_request({**body, "reasoning": "</think>", "max_whitespace": 2}) == \
        spec_of(SINGLE, reasoning="</think>", max_whitespace=2)


def test_pydantic_request_objects_are_read():
    pydantic = pytest.importorskip("pydantic")

    class Function(pydantic.BaseModel):
        name: str
        description: str | None = None
        parameters: dict | None = None

    class Tool(pydantic.BaseModel):
        type: str = "function"
        function: Function

    class Named(pydantic.BaseModel):
        type: str = "function"
        function: Function

    class Request(pydantic.BaseModel):           # the fields of vLLM's ChatCompletionRequest that matter
        tools: list[Tool] | None = None
        tool_choice: str | Named | None = "none"
        parallel_tool_calls: bool | None = True
        response_format: dict | None = None
        structured_outputs: dict | None = None

    tools = [Tool(function=Function(**t["function"])) for t in TOOLS]
    assert GrammarSpec.from_request(Request(tools=tools, tool_choice="required")) == spec_of(REQUIRED)
    named = Named(function=Function(name="get_weather"))
    assert GrammarSpec.from_request(Request(tools=tools, tool_choice=named)) == spec_of(WEATHER)
    assert GrammarSpec.from_request(Request(structured_outputs={"regex": "a"})) == \
        GrammarSpec.create("regex", "a")


# -- garbage -------------------------------------------------------------------------------------------
NAMED_X = {"type": "function", "function": {"name": "x"}}


@pytest.mark.parametrize("request_, message", [
    ({"tools": {"get_weather": WEATHER}, "tool_choice": "required"}, "tools is a list of"),
    ({"tools": "get_weather", "tool_choice": "required"}, "tools is a list of"),
    ({"tools": ["get_weather"], "tool_choice": "required"}, "tools[0] is a"),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools[0] has type 'code_interpreter'"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0].function is an object"),
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": ""}}]}, "tools[1].function.name"),
    ({"tools": [*TOOLS, TOOLS[0]], "tool_choice": "required"},
     "tools[0] and tools[2] both name the function 'get_weather'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}},
     "tool_choice names the function 'send_email', which is not one of the tools ('get_weather', 'noop')"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice names a function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "noop"}}, "tool_choice names a function"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice type 'allowed_tools'"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice 'any' is not one of"),
    ({"tools": TOOLS, "tool_choice": ["required"]}, "tool_choice is 'none', 'auto', 'required' or"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tool_choice": NAMED_X}, "tool_choice 'x' needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "false"}, "parallel_tool_calls is true or false"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters ('f') has type 'string'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": '{"type": "object"}'}}]},
     "tools[0].function.parameters ('f') is a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [WEATHER]}}]},
     "tools[0].function.parameters ('f') is a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "default": {1, 2}}}}]},
     "tools[0].function.parameters ('f') is not JSON"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"next": {"$ref": "#"}}}}}], "tool_choice": "required"},
     "tool 'f': parameters refer to '#'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "definitions": {"P": {}}, "properties": {"p": {"$ref": "#/definitions/P"}}}}}],
      "tool_choice": "required"}, "refer to '#/definitions/P'"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"$defs": {"P": {"type": "string"}}}}},
                {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"P": {"type": "number"}}}}}],
      "tool_choice": "required"}, "tools 'a' and 'b' both define $defs/P, differently"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice 'required' makes the output tool calls and ['response_format'] constrains it too"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "noop"}},
      "structured_outputs": {"json": WEATHER}}, "and ['structured_outputs'] constrains it too"),
    ({"tools": TOOLS, "tool_choice": "required", "json": WEATHER}, "and ['json'] constrains it too"),
    ({"tools": TOOLS, "tool_choice": "required", "disable_additional_properties": True},
     "disable_additional_properties does not apply to tool calls"),
    ({"tools": TOOLS, "tool_choice": "required", "whitespace": "tabs"}, "unknown whitespace option"),
])
def test_garbage_is_refused_naming_the_key(request_, message):
    with pytest.raises(SpecError) as err:
        GrammarSpec.from_request(request_)
    assert message in str(err.value)


def test_a_long_tool_list_is_cut_short_in_the_message():
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(200)]
    with pytest.raises(SpecError) as err:
        tool_call_schema(tools, NAMED_X)
    assert "'t7' and 192 more" in str(err.value) and "'t8'" not in str(err.value)


def test_a_ref_inside_a_const_is_data_not_a_pointer():
    params = {"type": "object", "properties": {"default": {"$ref": "#/$defs/D"}, "k": {"const": {"$ref": "#"}}},
              "$defs": {"D": {"type": "string"}}}
    schema = tool_call_schema([{"type": "function", "function": {"name": "f", "parameters": params}}], "required")
    assert schema["$defs"] == {"D": {"type": "string"}}


# -- through a real server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from maskd.server import MaskServer, ServerConfig
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1)).start()
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture
def mc(server):
    from maskd_client import MaskClient
    with MaskClient(server.address, want_forced_tokens=False) as client:
        yield client


def bit(result, sid, token):
    row = result.bitmask[result.seqs[sid].row]
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def drive(mc, sid, spec, tokens):
    """Opens sid and feeds tokens one per step, each checked against the row before it: how many
    went in, and the last result."""
    from maskd_client import SeqStatus
    mc.open(sid, spec)
    r = mc.step({sid: []})
    for _ in range(1000):
        if r.seqs[sid].status is not SeqStatus.WAITING:
            break
        r = mc.step({sid: []})
    for i, t in enumerate(tokens):
        if r.seqs[sid].status is not SeqStatus.READY or not bit(r, sid, t):
            return i, r
        r = mc.step({sid: [t]})
    return len(tokens), r


REQUIRED_REQUEST = {"tools": TOOLS, "tool_choice": "required"}


def test_registered_tools_get_the_grammar_id_of_their_schema(mc):
    assert mc.register(REQUIRED_REQUEST) == mc.register({"json": REQUIRED})


@pytest.mark.parametrize("calls", [
    [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}],
    [{"name": "noop", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}],
])
def test_a_valid_call_array_passes_token_by_token_and_may_end(mc, cl100k, calls):
    from maskd_client import SeqStatus
    tokens = cl100k.encode(json.dumps(calls))
    n, r = drive(mc, "calls", REQUIRED_REQUEST, tokens)
    res = r.seqs["calls"]
    assert n == len(tokens), (calls, n, res.status, res.reason)
    assert res.status in (SeqStatus.READY, SeqStatus.FINISHED) and res.accepting
    assert bit(r, "calls", cl100k.eos_token_ids[0])
    mc.close("calls")


@pytest.mark.parametrize("name, accepted", [("send_email", '[{"name": "'),
                                            ("get_weather_now", '[{"name": "get_weather')])
def test_a_call_naming_a_tool_outside_the_set_is_refused_by_the_rows(mc, cl100k, name, accepted):
    """Refused at the first token no tool's name continues with ('send', '_now')."""
    from maskd_client import SeqStatus
    tokens = cl100k.encode(json.dumps([{"name": name, "parameters": {}}]))
    n, r = drive(mc, "stranger", REQUIRED_REQUEST, tokens)
    assert r.seqs["stranger"].status is SeqStatus.READY          # refused by a row, not failed
    assert cl100k.decode(tokens[:n]) == accepted
    mc.close("stranger")


def test_no_second_call_when_parallel_tool_calls_is_false(mc, cl100k):
    comma, close = cl100k.encode(",")[0], cl100k.encode("]")[0]
    prefix = cl100k.encode('[{"name": "noop", "parameters": {}}')
    for parallel, second_allowed in ((False, False), (True, True)):
        sid = f"parallel-{parallel}"
        n, r = drive(mc, sid, {**REQUIRED_REQUEST, "parallel_tool_calls": parallel}, prefix)
        assert n == len(prefix)
        assert bit(r, sid, close) and bit(r, sid, comma) == second_allowed
        mc.close(sid)


# -- the call array as its parts (contract revision 6) ---------------------------------------------
DEFS_TOOLS = [{"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "properties": {"to": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}},
    *TOOLS]


@pytest.mark.parametrize("tools", [TOOLS, DEFS_TOOLS])
@pytest.mark.parametrize("parallel", [None, False])
def test_a_call_array_keeps_its_parts_and_their_text_is_the_arrays(tools, parallel):
    from maskd.specs import json_depth

    request = {"tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel}
    spec = GrammarSpec.from_request(request)
    schema = tool_call_schema(tools, "required", parallel)
    assert spec.parts is not None and spec.parts.names == tuple(t["function"]["name"] for t in tools)
    assert spec.text == json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    assert spec.depth == json_depth(schema)
    # vLLM hands its backend the dict (or its text): the same parts, the same grammar.
    for source in (schema, spec.text):
        same = GrammarSpec.create("json_schema", source)
        assert same.parts == spec.parts and same == spec
    # A piece is a tool's parameters alone, with the array's $defs where it refers to them.
    for name, piece in zip(spec.parts.names, spec.parts.pieces):
        params = json.loads(piece)
        assert ("$defs" in params) == (name == "move")


def test_parts_travel_as_themselves_and_come_back_checked():
    from maskd.v1 import maskd_pb2 as pb

    spec = GrammarSpec.from_request({"tools": DEFS_TOOLS, "tool_choice": "required", "max_whitespace": 3})
    msg = spec.to_proto()
    assert msg.WhichOneof("kind") == "tool_calls" and len(msg.tool_calls.tools) == 3
    back = GrammarSpec.from_proto(msg)
    assert back == spec and back.parts == spec.parts and back.max_whitespace == 3
    assert back.grammar_id("fp", "llguidance", "1") == spec_of(json.loads(spec.text), max_whitespace=3) \
        .grammar_id("fp", "llguidance", "1")
    # Texts that are JSON but not compact are made canonical: the same grammar.
    loose = pb.GrammarSpec()
    loose.CopyFrom(msg)
    loose.tool_calls.tools[1].parameters = json.dumps(WEATHER, indent=2)
    assert GrammarSpec.from_proto(loose) == spec


@pytest.mark.parametrize("value", [
    WEATHER, {"a": [True, None, 1.5, -0.0, 3.141592653589793]}, 1e16, 1e300, 5e-324, 2 ** 63, -2 ** 63, 2 ** 70,
    float("nan"), float("inf"), {"type": ["string", "null"]}, "é\u2028\x00\"\\", {"é": "ü", "\ud800": 1},
    {1: "an int key"}, (1, 2), [], {}, "", 0, True, None, [[[[]]]] * 3, {"a": {"b": [{"c": 0.1}]}},
])
def test_the_compact_writer_writes_json_dumps_text(value):
    # grammar ids are hashes of these texts: one character apart is another grammar
    from maskd.tool_specs import _compact

    assert _compact(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("value", [1e-05, 1e-07, 1.23e-06, {"minimum": 1e-05}])
def test_small_floats_are_written_as_orjson_writes_them_the_same_value(value):
    # orjson's one difference from json.dumps on JSON values: a small float's exponent form. The
    # value is the same, and the text is canonical: read and written again, it is the same text.
    from maskd.tool_specs import _compact

    text = _compact(value)
    assert json.loads(text) == value and _compact(json.loads(text)) == text
    assert text != json.dumps(value, separators=(",", ":"))


def test_nan_is_never_written_as_null():
    # orjson writes NaN and infinities as null: a schema would silently change ({"const": NaN}
    # becoming {"const": null}); they are written as json.dumps writes them, for the compile to refuse
    from maskd.tool_specs import _compact

    for value in ({"const": float("nan")}, {"maximum": float("inf")}, [float("-inf")]):
        assert "null" not in _compact(value) and _compact(value) == json.dumps(value, separators=(",", ":"))


def test_a_deep_schema_past_orjsons_limit_is_written_by_json():
    from maskd.tool_specs import _compact

    deep: object = {}
    for _ in range(300):
        deep = {"a": deep}
    assert _compact(deep) == json.dumps(deep, separators=(",", ":"))


def test_what_json_cannot_write_is_refused_naming_the_tool():
    cyclic: dict = {"type": "object"}
    cyclic["properties"] = {"self": cyclic}
    for params, message in (({"type": "object", "enum": {1, 2}}, "is not JSON"),
                            ({"type": "object", "default": b"x"}, "is not JSON"),
                            (cyclic, "nested too deeply")):
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        with pytest.raises(SpecError, match=message):
            tool_call_schema(tools, "required")


def test_the_memo_of_parameters_texts_keeps_the_tools_in_use(monkeypatch):
    # bounded: the least recently used text goes first, so a tool every request names stays read
    from maskd import tool_specs

    hot = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})
    texts = [json.dumps({"type": "object", "title": f"t{i}"}) for i in range(8)]
    monkeypatch.setattr(tool_specs._PieceTexts, "MAX_CHARS", 2 * (len(hot) + len(texts[0])) + 4 * 2 * len(texts[0]))
    memo = tool_specs._PieceTexts()
    memo.canonical([hot], str)
    for text in texts:
        memo.canonical([hot, text], str)         # every request names the hot tool, and one more
        assert hot in memo._memo
    assert texts[0] not in memo._memo and texts[-1] in memo._memo
    assert memo._memo.chars <= memo.MAX_CHARS


def _call_array(names, params, *, parallel=None):
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in zip(names, params)]
    return GrammarSpec.from_request({"tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel})


def test_a_call_arrays_id_is_of_all_its_parts_and_only_of_them():
    """A call array's id hashes its parts (names, each parameters text's hash, $defs, the bound),
    not its whole text: any change of a part is another id, and the same parts by any path are one."""
    from maskd.specs import json_depth

    a = {"type": "object", "properties": {"x": {"type": "integer"}}}
    b = {"type": "object", "properties": {"y": {"type": "string"}}}

    def gid(spec):
        return spec.grammar_id("fp", "llguidance", "1")

    base = _call_array(["ab", "c"], [a, b])
    others = [_call_array(["a", "bc"], [a, b]),          # the same bytes, cut elsewhere
              _call_array(["ab", "c"], [b, a]),          # the parameters of one tool given to the other
              _call_array(["c", "ab"], [b, a]),          # the same tools, another order (another text)
              _call_array(["ab", "c"], [a, b], parallel=False),
              _call_array(["ab", "c"], [a, {**b, "$defs": {"P": {"type": "integer"}}}]),
              _call_array(["ab"], [a])]
    ids = [gid(base)] + [gid(o) for o in others]
    assert len(set(ids)) == len(ids)
    back = GrammarSpec.from_proto(base.to_proto())
    assert gid(back) == gid(base) == gid(GrammarSpec.create("json_schema", base.text))
    assert back.depth == base.depth == json_depth(json.loads(base.text))
    deep = _call_array(["ab", "c"], [a, {"type": "object", "properties": {"y": {"type": "array", "items": {
        "type": "array", "items": {"type": "array", "items": {"type": "integer"}}}}}}])
    assert GrammarSpec.from_proto(deep.to_proto()).depth == deep.depth == json_depth(json.loads(deep.text))


@pytest.mark.parametrize("spec", [
    GrammarSpec.from_request({"tools": DEFS_TOOLS, "tool_choice": "required", "max_whitespace": 3}),
    GrammarSpec.from_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}),
    GrammarSpec.create("json_schema", WEATHER, whitespace="compact", reasoning=("<think>", "</think>")),
    GrammarSpec.create("regex", "[0-9]+", reasoning="</think>"),
    GrammarSpec.create("choice", ["a", "b"]),
])
def test_plain_data_brings_back_the_same_spec(spec):
    # what a vLLM API server hands its engine core (msgpack: strings, ints, bools, lists, dicts)
    plain = spec.to_plain()
    assert json.loads(json.dumps(plain)) == plain
    back = GrammarSpec.from_plain(plain)
    assert back == spec and back.parts == spec.parts
    assert back.grammar_id("fp", "llguidance", "1") == spec.grammar_id("fp", "llguidance", "1")
    assert back.to_proto() == spec.to_proto()


@pytest.mark.parametrize("change", [
    lambda p: p.pop("kind"),
    lambda p: p.update(reasoning=["<think>"]),
    lambda p: p["tools"].update(defs=7),
    lambda p: p.update(kind="yaml"),
    lambda p: p.update(max_whitespace="8"),
    lambda p: p["tools"].update(names=[]),
    lambda p: p["tools"].update(params=p["tools"]["params"][:1]),
    lambda p: p["tools"].update(single="no"),
    lambda p: p["tools"].update(params=[{}] * len(p["tools"]["names"])),
    lambda p: p.update(tools=[1]),
])
def test_garbage_plain_data_is_refused(change):
    plain = GrammarSpec.from_request({"tools": DEFS_TOOLS, "tool_choice": "required"}).to_plain()
    change(plain)
    with pytest.raises(SpecError):
        GrammarSpec.from_plain(plain)
    with pytest.raises(SpecError):
        GrammarSpec.from_plain("not a dict")


def test_plain_data_of_an_array_carries_its_text_once():
    # its text is its parts' (141 KB for 200 tools): a vLLM API server's IPC carries it once
    spec = GrammarSpec.from_request({"tools": DEFS_TOOLS, "tool_choice": "required"})
    plain = spec.to_plain()
    assert "text" not in plain and GrammarSpec.from_plain(plain).text == spec.text
    regex = GrammarSpec.create("regex", "[0-9]+").to_plain()
    assert regex["text"] == "[0-9]+"
    with pytest.raises(SpecError):
        GrammarSpec.from_plain({**regex, "text": 7})
    with pytest.raises(SpecError):
        GrammarSpec.from_plain({k: v for k, v in regex.items() if k != "text"})


@pytest.mark.parametrize("change, message", [
    (lambda m: m.tool_calls.ClearField("tools"), "names no tools"),
    (lambda m: setattr(m.tool_calls.tools[0], "name", ""), "tools[0].name is empty"),
    (lambda m: setattr(m.tool_calls.tools[1], "name", "move"), "both name the function 'move'"),
    (lambda m: setattr(m.tool_calls.tools[1], "parameters", "[1]"), "is a JSON object, not list"),
    (lambda m: setattr(m.tool_calls.tools[1], "parameters", '{"a": '), "is not valid JSON"),
    (lambda m: setattr(m.tool_calls.tools[1], "parameters", '{"$defs": {}}'), "they go in tool_calls.defs"),
    (lambda m: setattr(m.tool_calls.tools[1], "parameters", '{}]}],"x":{'), "is not valid JSON"),
    (lambda m: setattr(m.tool_calls, "defs", '"P"'), "tool_calls.defs is a JSON object"),
    (lambda m: setattr(m.tool_calls.tools[1], "parameters", "\ufffd\x00{"), "is not valid JSON"),
])
def test_garbage_parts_are_refused_naming_the_part(change, message):
    msg = GrammarSpec.from_request({"tools": DEFS_TOOLS, "tool_choice": "required"}).to_proto()
    change(msg)
    for _ in range(2):     # the same bytes again: a refused set is not kept by the wire's set cache
        with pytest.raises(SpecError) as err:
            GrammarSpec.from_proto(msg)
        assert message in str(err.value)


@pytest.mark.parametrize("schema", [
    {**REQUIRED, "description": "calls"},                                    # a key vLLM's array has not
    {**REQUIRED, "minItems": 2},
    {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {**call_item("a", WEATHER), "additionalProperties": False}]}},
    {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        call_item("a", WEATHER), call_item("a", EMPTY_PARAMETERS)]}},        # a name twice
])
def test_other_schemas_are_no_call_arrays(schema):
    assert spec_of(schema).parts is None


# -- the calls in a model's own tags (tool_call_format) ------------------------------------------
def test_tool_call_format_gives_the_models_structural_tag():
    xgr = pytest.importorskip("xgrammar", reason="tool_call_format builds the tag with xgrammar's model formats")
    spec = GrammarSpec.from_request({"tools": TOOLS, "tool_choice": "required", "tool_call_format": "qwen_3_coder"})
    assert spec.kind == "structural_tag" and spec.parts is None
    tag = json.loads(spec.text)
    want = xgr.get_model_structural_tag("qwen_3_coder", tools=TOOLS, tool_choice="required", reasoning=False)
    assert tag == json.loads(want.model_dump_json())
    fmt = tag["format"]
    assert fmt["at_least_one"] and not fmt["stop_after_first"]
    assert [t["begin"] for t in fmt["tags"]] == [f"<tool_call>\n<function={t['function']['name']}>\n" for t in TOOLS]
    # at most one call; "auto" (the default with tools): free text, calls optional; "none": nothing
    single = json.loads(GrammarSpec.from_request({"tools": TOOLS, "tool_choice": "required",
                                                  "parallel_tool_calls": False,
                                                  "tool_call_format": "qwen_3_coder"}).text)
    assert single["format"]["stop_after_first"]
    auto = json.loads(GrammarSpec.from_request({"tools": TOOLS, "tool_call_format": "qwen_3_coder"}).text)
    assert not auto["format"]["at_least_one"]
    assert GrammarSpec.from_request({"tools": TOOLS, "tool_choice": "none", "tool_call_format": "qwen_3"}) is None
    named = json.loads(GrammarSpec.from_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "noop"}}, "tool_call_format": "qwen_3"}).text)
    assert "noop" in json.dumps(named) and "get_weather" not in json.dumps(named)
    # maskd's own options ride along
    assert GrammarSpec.from_request({"tools": TOOLS, "tool_choice": "required", "tool_call_format": "qwen_3",
                                     "reasoning": ["<think>", "</think>"]}).reasoning_end == "</think>"


@pytest.mark.parametrize("request_keys,message", [
    ({"tool_call_format": "no_such_model"}, "Unknown format type: no_such_model"),
    ({"tool_call_format": 5}, "names a model's tool-call format"),
    ({"tool_call_format": ""}, "names a model's tool-call format"),
    ({"tool_call_format": "qwen_3", "tools": None}, "needs tools"),
    ({"tool_call_format": "qwen_3", "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not one of the tools"),
    ({"tool_call_format": "qwen_3", "tool_choice": "sometimes"}, "is not one of"),
    ({"tool_call_format": "qwen_3", "parallel_tool_calls": "no"}, "true or false"),
    ({"tool_call_format": "qwen_3", "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "JSON schema object"),
    ({"tool_call_format": "qwen_3", "json_schema": {"type": "object"}}, "constrains it too"),
])
def test_tool_call_format_garbage_is_refused_naming_it(request_keys, message):
    pytest.importorskip("xgrammar", reason="tool_call_format builds the tag with xgrammar's model formats")
    body = {"tools": TOOLS, "tool_choice": "required", **request_keys}
    if body["tools"] is None:
        del body["tools"]
    with pytest.raises(SpecError, match=message):
        GrammarSpec.from_request(body)
