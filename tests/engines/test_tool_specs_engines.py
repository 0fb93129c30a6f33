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


# -- the structural tags vLLM builds for tool calls (its tool parsers' model formats) ---------------
def _registry_tags():
    """Every structural tag vLLM 0.33 hands its backend for tool calls: each model format of its
    registry (xgrammar's builtins and vLLM's own), tool_choice required / named / auto with strict
    tools, with and without reasoning."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
        ChatCompletionToolsParam,
    )
    from vllm.tool_parsers import structural_tag_registry as registry
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    tools = [ChatCompletionToolsParam(**t) for t in [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                                             "days": {"type": "integer"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "search", "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"}}}}}]]
    choices = {"required": "required", "auto": "auto",
               "named": ChatCompletionNamedToolChoiceParam(type="function", function={"name": "search"})}
    for model in sorted(registry.SUPPORTED_STRUCTURAL_TAG_MODELS):
        for name, choice in choices.items():
            for reasoning in (False, True):
                tag = registry.get_model_structural_tag(model, tools, choice, reasoning,
                                                        strict_level=ToolStrictLevel.PARAMETER)
                yield f"{model}-{name}-{'reasoning' if reasoning else 'plain'}", json.dumps(tag.model_dump())


@pytest.fixture(scope="module")
def default_engine():
    from maskd.server.engines import create_engine
    from maskd.server.tokenizers import load_tokenizer

    return create_engine("llguidance", load_tokenizer("deepseek-v4"), threads=1, json_schema_mode="complete")


def test_every_tool_call_structural_tag_vllm_builds_compiles_on_the_default_backend(default_engine):
    """What a vLLM user with a structural-tag tool parser (Qwen3-Coder, DeepSeek-V3.2/V4, GLM-4.7, ...)
    and tool_choice "required" sends: the server's default backend serves every one (llguidance,
    with xgrammar for the XML argument styles llguidance cannot express)."""
    tags = dict(_registry_tags())
    assert len(tags) >= 17 * 6, sorted(tags)
    by_fallback = []
    for name, text in tags.items():
        compiled = default_engine.compile(GrammarSpec.create("structural_tag", text))
        if compiled.by_fallback:
            by_fallback.append(name)
    models = {name.rsplit("-", 2)[0] for name in by_fallback}
    assert {"qwen_3_coder", "deepseek_v4", "glm_4_7"} <= models, models   # their XML styles: xgrammar's
    print(f"\n{len(tags)} structural tags; compiled by xgrammar: {sorted(models)}")


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=repr)
def test_tool_call_format_is_the_tag_vllm_builds_for_that_parser(choice):
    """A client's tool_call_format and vLLM's tool parser of that format give one tag, so one grammar
    id (vLLM's strict tools: each tool's arguments constrained, as maskd's default)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.tool_parsers import structural_tag_registry as registry
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    tools = [TOOLS[0], {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    models = sorted(registry.XGRAMMAR_BUILTIN_STRUCTURAL_TAG_MODELS)
    assert {"qwen_3_coder", "qwen_3", "deepseek_v4", "llama"} <= set(models)
    for model in models:
        vllm_tag = registry.get_model_structural_tag(model, [ChatCompletionToolsParam(**t) for t in tools],
                                                     choice if isinstance(choice, str) else
                                                     ChatCompletionRequest(messages=MESSAGES, model="m", tools=tools,
                                                                           tool_choice=choice).tool_choice,
                                                     False, strict_level=ToolStrictLevel.PARAMETER)
        theirs = GrammarSpec.create("structural_tag", json.dumps(vllm_tag.model_dump()))
        ours = GrammarSpec.from_request({"tools": tools, "tool_choice": choice, "tool_call_format": model})
        assert ours == theirs, model
