"""Tool calls in a model's own format (issue 19, item 1: the structural-tag form for models that
wrap calls in tags), in the real engine: with a tool parser that has a structural-tag format (here
``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...``, the
``qwen_xml`` argument style, as for Qwen3-Coder, Qwen3.5 and MiMo), vLLM hands its backend a
structural tag for ``tool_choice: "required"`` and a named function. maskd's default backend
serves it (llguidance, with xgrammar for the XML argument style), and its outputs equal vLLM's own
xgrammar backend's token for token (greedy). Two engines at once."""
import contextlib
import json

import pytest
from harness import server_metric, vllm_engine
from workloads import tools

QWEN_PARSER = ("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")
XGRAMMAR = ("--structured-outputs-config", '{"backend": "xgrammar"}')


@pytest.fixture(scope="module")
def engines(logs, maskd_server):
    env = {"MASKD_TARGET": maskd_server.address, "MASKD_ADMISSION_WAIT_S": "5", "MASKD_WAIT_TIMEOUT_S": "120"}
    with contextlib.ExitStack() as stack:
        yield (stack.enter_context(vllm_engine(logs, *XGRAMMAR, *QWEN_PARSER, env=env, name="maskd-qwen-tags")),
               stack.enter_context(vllm_engine(logs, *XGRAMMAR, *QWEN_PARSER, name="xgrammar-qwen-tags")))


def test_tool_calls_in_qwen_xml_tags_equal_vllms_xgrammar_token_for_token(engines, maskd_server):
    ours_engine, theirs_engine = engines
    sent = tools(4)
    before = server_metric(maskd_server, "maskd_rows_sent_total")
    choices = {"required": "required", "named": {"type": "function", "function": {"name": sent[1]["function"]["name"]}}}
    for name, choice in choices.items():
        body = {"messages": [{"role": "user", "content": "Call a tool."}], "tools": sent, "tool_choice": choice,
                "max_tokens": 160, "temperature": 0, "return_token_ids": True}
        (s1, ours), (s2, theirs) = ours_engine.post(body, "/v1/chat/completions"), \
            theirs_engine.post(body, "/v1/chat/completions")
        assert s1 == 200 and s2 == 200, (name, ours, theirs)
        mine, ref = ours["choices"][0], theirs["choices"][0]
        assert mine.get("token_ids") == ref.get("token_ids"), (name, mine, ref)
        assert mine["finish_reason"] == ref["finish_reason"], (name, mine, ref)
        calls = [[c["function"] for c in m["message"].get("tool_calls") or []] for m in (mine, ref)]
        assert calls[0] == calls[1], (name, calls)     # (call ids are random per answer)
        print(f"\n{name}: {mine['finish_reason']}, {json.dumps(mine['message'].get('tool_calls'))[:300]}")
    assert server_metric(maskd_server, "maskd_rows_sent_total") > before, "maskd computed no rows for the calls"
