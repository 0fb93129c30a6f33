"""Tool calls and a response format in one chat request: a call of one of the tools, or the final
answer in the response format's schema (issue 48, item 5; vLLM #16313, #39929).

Agent frameworks (the OpenAI Agents SDK among them) send ``tools`` (``tool_choice`` "auto", the
default) and ``response_format`` (the agent's output type) on every turn: the model is to call a
tool or give its final answer in that schema. vLLM 0.32 and 0.33 serve one of the two:

* ``tool_choice`` "required" or a named function: the calls (``ToolParser.adjust_request`` replaces
  the structured output with the calls' schema and drops ``response_format``), which is OpenAI's
  meaning too (the turn must call);
* "auto": the response format (``get_json_schema_from_tools`` builds nothing for "auto", and
  ``to_sampling_params`` turns ``response_format`` into the constraint of the whole output), so the
  model cannot begin a call. Only for a tool parser with a structural tag of its own (hermes,
  qwen3_coder, llama, deepseek, glm, ...: ``structural_tag_model``) does vLLM build the one grammar
  "the calls (at least one) or the answer" (``DelegatingParser._apply_structural_tag``), and then
  only where some tool is ``strict: true`` or the server runs ``--tool-strict-level function`` or
  higher; otherwise it logs "Tool calls are not constrained for tool_choice=auto with structured
  outputs" and the answer's schema applies.

For the requests maskd serves (``MASKD_TARGET`` set, ``MASKD_VLLM_REQUESTS`` all), a chat request with
tools, tool_choice "auto" and a JSON answer constraint (``response_format`` json_schema or
json_object, or ``structured_outputs.json``) gets the one grammar, in the parser's own format, so
that vLLM's response path reads it back: a call comes back as ``tool_calls`` (finish reason
"tool_calls"), an answer as ``content`` that parses under the schema. This wraps the parser's
``DelegatingParser.adjust_request`` (the one method that sees the tools, the tool parser and the
response format together, once per request, before the sampling params are built):

* a parser with a structural tag: the request's strict-level floor is raised to ``function`` on the
  request's own parser object, so vLLM composes its own ``or`` of the calls' tag and the answer
  (what it does for strict tools; a non-strict tool's arguments stay free, as vLLM's level
  ``function`` leaves them). maskd serves that structural tag.
* ``xlam`` (calls as a bare JSON array ``[{"name": ..., "arguments": {...}}]``, which its parser
  reads back; no structural tag): one JSON schema, ``anyOf`` the array of calls (one at most with
  ``parallel_tool_calls`` false) and the answer. An answer the schema allows to be an array would
  be read back as calls, so such a schema is refused with HTTP 400 naming why, as are answers
  whose ``$ref`` pointers or ``$defs`` would change meaning beside the tools'.
* any other parser: vLLM's behaviour (the answer's schema applies; no call can begin), with a
  warning naming the parser, logged once.

The Responses API, ``tool_choice`` "none" / "required" / named and requests naming maskd in
``vllm_xargs`` are left as they are.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from maskd.specs import SpecError, unwrap_openai_json_schema
from maskd.tool_specs import local_refs, tool_call_schema
from maskd_client.engine_env import EngineConfigError
from maskd_client.vllm.common import EXTRA_ARGS_KEY, _configured, _serves_all, log

__all__ = ["AnswerFormatError", "xlam_call_or_answer"]

#: Where a schema's ``$ref`` may point once it sits in a branch of the combined schema (its own
#: ``$defs`` / ``definitions`` are moved to the root, where these pointers land).
_MOVABLE_REFS = ("#/$defs/", "#/definitions/")


class AnswerFormatError(ValueError):
    """A response format that cannot share one grammar with the tool calls (HTTP 400)."""


# -- the hook (vLLM's API server) ------------------------------------------------------------------
def _adjust_request(original: Any, parser: Any, request: Any) -> Any:
    """``DelegatingParser.adjust_request`` (vLLM calls it once per chat request, on the request's own
    parser object): for maskd's requests with tools "auto" and a JSON answer, one grammar for both."""
    answer = _answer_constraint(parser, request)
    if answer is None:
        return original(parser, request)
    tool_parser = parser._tool_parser
    if getattr(tool_parser, "structural_tag_model", None) is not None:
        _raise_strict_floor(parser, tool_parser)
        request = original(parser, request)
        so = request.structured_outputs
        if request.response_format is not None or so is None or so.structural_tag is None:
            _warn_once(type(tool_parser).__name__, "vLLM did not compose the structural tag of its calls with the "
                       "response format (see its warning above)")
        return request
    if _is_xlam(tool_parser):
        request = original(parser, request)
        return _serve_xlam(request, answer)
    _warn_once(type(tool_parser).__name__, "this tool parser has no structural tag and maskd knows no JSON format of "
               "its calls")
    return original(parser, request)


def _answer_constraint(parser: Any, request: Any) -> Any:
    """The request's JSON answer constraint (vLLM's StructuredOutputsParams) where the request is one
    this module serves: a chat request maskd serves, tools with tool_choice "auto", a tool parser
    (auto tool choice on), and a json schema / json object answer. None: leave it to vLLM."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    if not isinstance(request, ChatCompletionRequest) or getattr(parser, "_tool_parser", None) is None:
        return None
    if not request.tools or request.tool_choice != "auto":
        return None
    if EXTRA_ARGS_KEY in (request.vllm_xargs or {}):
        return None                          # admission refuses the second constraint, naming both
    try:
        if not (_configured() and _serves_all()):
            return None
    except EngineConfigError:
        return None                          # admission refuses every structured request with the reason
    so = request.extract_structured_outputs()
    if so is None or so.structural_tag is not None or (so.json is None and not so.json_object):
        return None
    return so


def _raise_strict_floor(parser: Any, tool_parser: Any) -> None:
    """This request's parser builds the calls' structural tag at level ``function`` at least (vLLM
    0.32 reads an unset level as AUTO, 0.33 as None: both then take the tool parser's default)."""
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    floor = max(ToolStrictLevel.FUNCTION, parser.tool_strict_level or ToolStrictLevel.AUTO,
                getattr(tool_parser, "default_tool_strict_level", None) or ToolStrictLevel.AUTO)
    parser.tool_strict_level = floor           # the instance's own: the class (the server's level) is untouched


def _is_xlam(tool_parser: Any) -> bool:
    try:
        from vllm.tool_parsers.xlam_tool_parser import xLAMToolParser
    except ImportError:
        return False
    return isinstance(tool_parser, xLAMToolParser)


def _serve_xlam(request: Any, so: Any) -> Any:
    from vllm.exceptions import VLLMValidationError

    answer: Any = {"type": "object"} if so.json is None else so.json
    try:
        if isinstance(answer, str):
            answer = json.loads(answer)
        if isinstance(answer, dict):
            answer = unwrap_openai_json_schema(answer)    # structured_outputs.json may be OpenAI's wrapper
        calls = tool_call_schema([_plain(t) for t in request.tools], "required", request.parallel_tool_calls)
        assert calls is not None           # tools are non-empty (the caller checked)
        combined = xlam_call_or_answer(calls, answer)
    except (SpecError, AnswerFormatError, ValueError) as exc:
        raise VLLMValidationError(f"tools (tool_choice 'auto') with a response format, served as one grammar (a "
                                  f"call in xlam's format or the answer): {exc}", parameter="response_format") from None
    request.structured_outputs = dataclasses.replace(so, json=combined, json_object=None)
    request.response_format = None
    _note_served()
    return request


@functools.cache
def _note_served() -> None:
    log.info("maskd serves chat requests with tools (tool_choice 'auto') and a response format as one grammar: a "
             "call in xlam's format or the answer (vLLM's \"Tool calls are not constrained for tool_choice=auto\" "
             "warning does not apply to them)")


def _plain(tool: Any) -> Any:
    dump = getattr(tool, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else tool


@functools.cache
def _warn_once(parser_name: str, why: str) -> None:
    log.warning("maskd: a chat request with tools (tool_choice 'auto') and a response format, tool parser %s: %s; "
                "the response format applies to the whole output and the model cannot call a tool (vLLM's "
                "behaviour)", parser_name, why)


# -- the combined schema (pure) --------------------------------------------------------------------
def xlam_call_or_answer(calls: dict[str, Any], answer: Any) -> dict[str, Any]:
    """One JSON schema: a call array in xlam's format, or the answer.

    ``calls`` is vLLM's ``tool_choice: "required"`` array (``maskd.tool_specs.tool_call_schema``:
    items ``{"name", "parameters"}``, the tools' ``$defs`` at its root); xlam's parser reads calls as
    ``{"name", "arguments"}``, so each item's ``parameters`` becomes ``arguments`` (and the item
    is closed: a key the parser ignores is not written). The answer's ``$defs`` / ``definitions``
    move to the root beside the tools' (a name both define differently is refused). Refused
    (AnswerFormatError): an answer that may be a JSON array (xlam reads a bare array as calls), a
    ``$ref`` into the answer that would land elsewhere inside the combined schema, an ``$id`` at
    the answer's root."""
    if not isinstance(answer, dict):
        raise AnswerFormatError(f"the response format's schema is {json.dumps(answer)}, which "
                                + ("admits no answer" if answer is False else "allows a JSON array (xlam's parser "
                                   "reads an output that is a JSON array as tool calls)")
                                + "; give it a root type other than array (an object, as OpenAI requires)")
    calls = dict(calls)
    defs: dict[str, Any] = dict(calls.pop("$defs", None) or {})
    items = dict(calls["items"])
    items["anyOf"] = [_xlam_item(item) for item in items["anyOf"]]
    calls["items"] = items
    body = {k: v for k, v in answer.items() if k not in ("$defs", "definitions", "$schema")}
    if "$id" in body:
        raise AnswerFormatError("the response format's schema has an $id at its root: inside one grammar with the "
                                "tool calls its references would resolve elsewhere; send it without $id")
    _check_refs(answer)
    for key, sub in (answer.get("$defs") or {}).items():
        if key in defs and defs[key] != sub:
            raise AnswerFormatError(f"the tools and the response format both define $defs/{key}, differently: one "
                                    "grammar has one $defs; rename one of them")
        defs[key] = sub
    if _may_be_array(body, answer, depth=0):
        raise AnswerFormatError("the response format's schema allows a JSON array at its root, and xlam's parser "
                                "reads an output that is a JSON array as tool calls; give the schema a root type "
                                "other than array (an object, as OpenAI requires)")
    combined: dict[str, Any] = {"anyOf": [calls, body]}
    if defs:
        combined["$defs"] = defs
    if answer.get("definitions"):
        combined["definitions"] = answer["definitions"]
    return combined


def _xlam_item(item: dict[str, Any]) -> dict[str, Any]:
    props = dict(item["properties"])
    props["arguments"] = props.pop("parameters")
    return {"type": "object", "properties": props, "required": ["name", "arguments"], "additionalProperties": False}


def _check_refs(schema: Any) -> None:
    for ref in local_refs(schema):
        if not ref.startswith(_MOVABLE_REFS):
            raise AnswerFormatError(f"the response format's schema refers to {ref!r}; inside one grammar with the "
                                    "tool calls that pointer would land elsewhere. Put shared schemas under $defs "
                                    "and refer to '#/$defs/NAME'")


def _may_be_array(node: Any, root: dict[str, Any], depth: int) -> bool:
    """Whether a document of this schema may be a JSON array (True where it cannot tell)."""
    if depth > 32 or not isinstance(node, dict):
        return node is not False
    if "const" in node:
        return isinstance(node["const"], list)
    if isinstance(node.get("enum"), list):
        return any(isinstance(v, list) for v in node["enum"])
    declared = node.get("type")
    if isinstance(declared, str):
        return declared == "array"
    if isinstance(declared, list):
        return "array" in declared
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith(_MOVABLE_REFS):
        where, name = ("$defs", ref[len("#/$defs/"):]) if ref.startswith("#/$defs/") else \
            ("definitions", ref[len("#/definitions/"):])
        target = (root.get(where) or {}).get(name)
        return target is None or _may_be_array(target, root, depth + 1)
    if isinstance(node.get("allOf"), list) and any(not _may_be_array(s, root, depth + 1) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            return any(_may_be_array(s, root, depth + 1) for s in node[key])
    return True
