"""Tools (tool_choice "auto") and a response format in one chat request, with vLLM 0.32's own tool
parsers built as its renderer builds them for the tiny model's tokenizer, in this process (no
engine: the generations run in test_structured_outputs.py). For a parser with a structural tag,
vLLM composes "the calls or the answer" for maskd's requests and maskd's default backend compiles
it (qwen3_coder's XML argument style: by its xgrammar fallback); without maskd, vLLM lets the
response format alone constrain the output."""
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # vLLM's platform on a machine without a GPU

import json

import pytest
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager
from workloads import PERSON, tools

from maskd.server.engines import create_engine
from maskd.server.tokenizers import load_tokenizer
from maskd.specs import GrammarSpec
from maskd_client import vllm as plugin


@pytest.fixture(scope="module")
def tokenizer():
    from maskd_tools.vllm_serve import model_dir
    return AutoTokenizer.from_pretrained(str(model_dir()))


@pytest.fixture(scope="module")
def default_backend():
    return create_engine("llguidance", load_tokenizer("deepseek-v4"), threads=1, json_schema_mode="complete")


def structured_outputs(parser_name: str, tokenizer):
    plugin.register()
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], model="m", tools=tools(4),
                                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    parser = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True)(tokenizer, req.tools)
    return parser.adjust_request(request=req).to_sampling_params(256, {}).structured_outputs


@pytest.mark.parametrize("parser_name,fallback", [("qwen3_coder", True), ("hermes", False)])
def test_a_structural_tag_parser_gets_the_calls_or_the_answer_and_maskd_compiles_it(
        parser_name, fallback, tokenizer, default_backend, monkeypatch):
    monkeypatch.setenv("MASKD_TARGET", "127.0.0.1:1")          # maskd serves the structured requests
    so = structured_outputs(parser_name, tokenizer)
    tag = json.loads(so.structural_tag)
    calls, answer = tag["format"]["elements"]
    assert tag["format"]["type"] == "or" and answer["json_schema"] == PERSON
    assert all(f"t_{i}" in json.dumps(calls) for i in range(4))
    compiled = default_backend.compile(GrammarSpec.from_request(so))
    assert compiled.by_fallback == fallback
    monkeypatch.delenv("MASKD_TARGET")                           # vLLM alone: the answer's schema only
    so = structured_outputs(parser_name, tokenizer)
    assert so.structural_tag is None and so.json == PERSON
