"""GrammarSpec.from_request on OpenAI's tools gives the very text of the schema the engines build
for the same request (vLLM's get_json_schema_from_tools, SGLang's get_json_schema_constraint for
"required"), so a tool request and the structured output an engine hands its backend are one
grammar id; vLLM's own ChatCompletionRequest objects are read too."""
import copy
import json
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # vLLM's platform on a machine without a GPU

import pytest
from sglang.srt.entrypoints.openai.protocol import Tool as SglangTool
from sglang.srt.function_call.utils import get_json_schema_constraint
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.utils import get_json_schema_from_tools

from maskd.specs import GrammarSpec

POINT = {"type": "object", "properties": {"x": {"type": "number"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "at": {"$ref": "#/$defs/Point"}},
        "required": ["city"], "$defs": {"Point": POINT}}}},
    {"type": "function", "function": {"name": "noop"}},
    {"type": "function", "function": {"name": "empty", "parameters": {}}},
]
MESSAGES = [{"role": "user", "content": "hi"}]
CHOICES = ["required", "auto", "none", {"type": "function", "function": {"name": "get_weather"}},
           {"type": "function", "function": {"name": "noop"}}]


def compact(schema):
    return None if schema is None else json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("parallel", [None, True, False])
@pytest.mark.parametrize("choice", CHOICES, ids=repr)
def test_same_text_as_vllm(choice, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    request = ChatCompletionRequest(messages=MESSAGES, model="m", tools=copy.deepcopy(TOOLS), tool_choice=choice,
                                    **extra)
    theirs = compact(get_json_schema_from_tools(request.tool_choice, request.tools, request.parallel_tool_calls))
    ours = GrammarSpec.from_request({"tools": TOOLS, "tool_choice": choice, **extra})
    assert (ours and ours.text) == theirs
    fresh = ChatCompletionRequest(messages=MESSAGES, model="m", tools=copy.deepcopy(TOOLS), tool_choice=choice, **extra)
    assert GrammarSpec.from_request(fresh) == ours          # vLLM's request object itself


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_the_text_of_sglang_too(parallel):
    """Tools without $defs: SGLang copies them to the root but leaves them in the parameters too."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}, *TOOLS[1:]]
    theirs = get_json_schema_constraint([SglangTool(**t) for t in copy.deepcopy(tools)], "required", parallel)
    ours = GrammarSpec.from_request({"tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel})
    assert ours.text == compact(theirs)
