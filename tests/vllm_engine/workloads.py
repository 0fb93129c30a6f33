"""Requests the real-engine tests send, and the checks of their outputs."""
from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any

import jsonschema

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "admin": {"type": "boolean"}},
          "required": ["name", "age", "admin"], "additionalProperties": False}
RECORDS = {"type": "object", "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}
CODE = r"[a-z]{3,6}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
GBNF = 'root ::= "[" digit ("," digit)* "]"\ndigit ::= [0-9]'
PROMPTS = ["Reply in JSON:", "Example: {\"items\":[{\"id\":\"x\",\"ok\":\"yes\"}]} Now yours:", "Q: a code? A:"]


def parity_requests() -> dict[str, dict[str, Any]]:
    """Greedy requests whose constraint vLLM's guidance backend and maskd compile alike (compact
    JSON): both must give the same bytes."""
    out: dict[str, dict[str, Any]] = {}
    for i, prompt in enumerate(PROMPTS):
        base = {"prompt": prompt, "max_tokens": 64, "temperature": 0}
        out[f"person-{i}"] = {**base, "structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}
        out[f"records-{i}"] = {**base, "max_tokens": 96,
                               "structured_outputs": {"json": RECORDS, "disable_any_whitespace": True}}
        out[f"regex-{i}"] = {**base, "structured_outputs": {"regex": CODE}}
        out[f"choice-{i}"] = {**base, "structured_outputs": {"choice": CHOICES}}
        out[f"gbnf-{i}"] = {**base, "max_tokens": 24, "structured_outputs": {"grammar": GBNF}}
    return out


def check(name: str, choice: dict[str, Any]) -> None:
    """The output of one of the parity requests (or one like it) obeys its constraint."""
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    kind = name.split("-")[0]
    finished = choice["finish_reason"] == "stop"
    if kind in ("person", "records"):
        assert finished, (name, choice)
        jsonschema.validate(json.loads(text), PERSON if kind == "person" else RECORDS)
    elif kind == "regex":
        assert finished and re.fullmatch(CODE, text), (name, text)
    elif kind == "choice":
        assert text in CHOICES, (name, text)
    elif kind == "gbnf":
        assert re.fullmatch(r"\[[0-9](,[0-9])*\]" if finished else r"\[[0-9](,[0-9])*,?", text), (name, text)
    else:
        raise AssertionError(f"unknown workload {name}")


# Function tools as agents send them (OpenAI chat completions), closed and bounded so that even the
# untrained tiny model finishes its call: four shapes, the property names of each tool its own.
_SHAPES = [
    lambda i: {"type": "object", "properties": {f"city_{i}": {"type": "string", "maxLength": 10},
                                                "days": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": [f"city_{i}"], "additionalProperties": False},
    lambda i: {"type": "object", "properties": {f"query_{i}": {"type": "string", "maxLength": 12},
                                                "exact": {"type": "boolean"}},
               "required": [f"query_{i}", "exact"], "additionalProperties": False},
    lambda i: {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        f"mode_{i}": {"enum": ["fast", "slow"]}}, "required": [f"mode_{i}"], "additionalProperties": False},
    lambda i: {"type": "object", "properties": {f"to_{i}": {"$ref": "#/$defs/Point"}}, "required": [f"to_{i}"],
               "additionalProperties": False,
               "$defs": {"Point": {"type": "object",
                                   "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                   "required": ["x", "y"], "additionalProperties": False}}},
]


def tools(n: int, tag: str = "t") -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"{tag}_{i}", "description": f"tool {i}",
                                              "parameters": _SHAPES[i % len(_SHAPES)](i)}} for i in range(n)]


def check_tool_calls(tools_sent: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """The calls of a tool_choice "required" answer name tools of the request, with arguments their schema takes."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools_sent}
    assert message.get("tool_calls"), message
    for call in message["tool_calls"]:
        name = call["function"]["name"]
        assert name in schemas, (name, message)
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def greedy_parity_with_drafts(engine, reference, maskd_server, repeats: int) -> None:
    """Greedy parity requests, and one whose grammar forces ``repeats`` repeats (ngram's drafts
    match there), on an engine with drafts: maskd's rows were used, drafts proposed and accepted,
    and every output equals the reference engine's (vLLM's guidance, no drafts) byte for byte."""
    from harness import server_metric

    requests = parity_requests()
    requests["forced-repeats"] = {"prompt": "maskd rocks maskd rocks", "max_tokens": 8 * repeats, "temperature": 0,
                                  "structured_outputs": {"regex": f"(maskd rocks ){{{repeats}}}"}}
    drafts, accepted = engine.metric("vllm:spec_decode_num_draft_tokens_total"), \
        engine.metric("vllm:spec_decode_num_accepted_tokens_total")
    rows = server_metric(maskd_server, "maskd_rows_sent_total")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ours = dict(zip(requests, pool.map(engine.post, requests.values())))
        theirs = dict(zip(requests, pool.map(reference.post, requests.values())))
    assert engine.metric("vllm:spec_decode_num_draft_tokens_total") > drafts, "ngram proposed no drafts"
    assert engine.metric("vllm:spec_decode_num_accepted_tokens_total") > accepted, "no draft was accepted"
    assert server_metric(maskd_server, "maskd_rows_sent_total") > rows
    for name, (status, reply) in ours.items():
        assert status == 200, (name, reply)
        mine, ref = reply["choices"][0], theirs[name][1]["choices"][0]
        if name != "forced-repeats":
            check(name, mine)
        assert (mine["text"], mine["finish_reason"]) == (ref["text"], ref["finish_reason"]), name
