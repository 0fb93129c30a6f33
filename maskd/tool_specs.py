"""OpenAI chat-completions tool calls as a JSON schema: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` read as vLLM reads them (``vllm/tool_parsers/utils.py``,
``get_json_schema_from_tools``, and the request checks of ``ChatCompletionRequest``), so a request
asks maskd for the output it asks vLLM for.

* ``tool_choice: "required"``: a JSON array of at least one call, each
  ``{"name": <a tool's name>, "parameters": <that tool's parameters>}``; at most one call when
  ``parallel_tool_calls`` is false (vLLM 0.33 and SGLang bound the array so; older vLLM left it
  unbounded and dropped the calls after the first from its answer).
* a named function (``{"type": "function", "function": {"name": "f"}}``): f's parameters schema,
  the JSON of the call's arguments.
* ``"auto"``, ``"none"``, no ``tool_choice``, no tools: no constraint from the tools. ``"auto"``
  matters only where an engine has a tool parser: the model writes text or calls in its own
  format and the parser finds the calls afterwards; nothing here constrains that output.

``GrammarSpec.from_request`` takes these keys (see ``maskd.specs``); this module only builds the
schema. Import-light like ``maskd.specs``: the client builds the same specs.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from maskd.specs import SpecError

__all__ = ["EMPTY_PARAMETERS", "TOOL_CHOICES", "tool_call_schema"]

#: The parameters of a function that declares none (vLLM's default): an object, any members.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_CHOICES = ("none", "auto", "required")
_NAMED = "{'type': 'function', 'function': {'name': ...}}"
_TOOL = "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}"
# Keywords whose values are JSON instances, not schemas: a "$ref" key inside them is data.
_INSTANCE_KEYWORDS = frozenset(("const", "enum", "default", "examples"))
# Keywords whose values map names (of properties, definitions) to schemas.
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))


def tool_call_schema(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> dict[str, Any] | None:
    """The JSON schema of the output a request's tool keys ask for, or None where they ask for
    no constraint. Pydantic objects (vLLM's ``ChatCompletionToolsParam``, a named tool choice)
    are read through ``model_dump``. Malformed keys raise SpecError naming the key."""
    functions, with_refs = (None, set()) if tools is None else _functions(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise SpecError(f"parallel_tool_calls is true or false, not {parallel_tool_calls!r}")
    choice = _plain(tool_choice)
    if choice is None or choice == "none":
        return None          # vLLM: no tool_choice is "auto" with tools, "none" without
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise SpecError(f"tool_choice {choice!r} is not one of {', '.join(map(repr, TOOL_CHOICES))} "
                        f"or a named function {_NAMED}")
    name = None if isinstance(choice, str) else _named(choice)
    if functions is None:
        raise SpecError(f"tool_choice {choice if name is None else name!r} needs tools: the request has none")
    if choice == "auto":
        return None
    if name is not None:
        if name not in functions:
            raise SpecError(f"tool_choice names the function {name!r}, which is not one of the tools "
                            f"({_some(functions)})")
        return functions[name]
    if not functions:
        return None          # vLLM and OpenAI: "required" with an empty tools list means "none"
    return _calls_schema(functions, with_refs, single=parallel_tool_calls is False)


def _some(names: Mapping[str, Any], shown: int = 8) -> str:
    listed = ", ".join(repr(n) for n, _ in zip(names, range(shown)))
    return (listed or "none") + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _plain(value: Any) -> Any:
    """Mappings and plain values as they are; pydantic objects as their dict."""
    if value is None or isinstance(value, (Mapping, str)):
        return value
    dump = getattr(value, "model_dump", None)
    return dump() if callable(dump) else value


def _functions(tools: Any) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Each tool's name and its parameters schema (a fresh copy), in the tools' order; and the
    names of the tools whose parameters hold a "$ref" anywhere (the others need no ref check)."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise SpecError(f"tools is a list of {_TOOL}, not {type(tools).__name__}")
    functions: dict[str, dict[str, Any]] = {}
    with_refs: set[str] = set()
    where_named: dict[str, int] = {}
    for i, raw in enumerate(tools):
        tool = _plain(raw)
        if not isinstance(tool, Mapping):
            raise SpecError(f"tools[{i}] is a {_TOOL} object, not {type(tool).__name__}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise SpecError(f"tools[{i}] has type {kind!r}: only function tools ({_TOOL}) are taken")
        function = _plain(tool.get("function"))
        if not isinstance(function, Mapping):
            raise SpecError(f"tools[{i}].function is an object with a name and parameters, not "
                            f"{type(function).__name__}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError(f"tools[{i}].function.name is the function's name, a non-empty string; got {name!r}")
        if name in functions:
            raise SpecError(f"tools[{where_named[name]}] and tools[{i}] both name the function {name!r}: "
                            "a call could not say which one it means")
        functions[name], has_ref = _parameters(function.get("parameters"),
                                               f"tools[{i}].function.parameters ({name!r})")
        if has_ref:
            with_refs.add(name)
        where_named[name] = i
    return functions, with_refs


def _parameters(params: Any, where: str) -> tuple[dict[str, Any], bool]:
    """A copy of the parameters schema, and whether its JSON text holds a "$ref" key anywhere."""
    params = _plain(params)
    if params is None or (isinstance(params, Mapping) and not params):
        return dict(EMPTY_PARAMETERS), False    # vLLM: none declared, an object with any members
    if not isinstance(params, Mapping):
        raise SpecError(f"{where} is a JSON schema object describing the arguments, not {type(params).__name__}")
    declared = params.get("type")
    if declared is not None and declared != "object" and not (isinstance(declared, list) and "object" in declared):
        raise SpecError(f"{where} has type {declared!r}: a call's arguments are a JSON object, so the "
                        "parameters schema describes an object (type 'object')")
    try:    # a copy of our own (the $defs are moved out of it), and JSON through and through
        text = json.dumps(params, ensure_ascii=False)
        copy = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{where} is not JSON: {exc}") from None
    except RecursionError:
        raise SpecError(f"{where} is nested too deeply to parse") from None
    return copy, '"$ref"' in text


def _named(choice: Any) -> str:
    if not isinstance(choice, Mapping):
        raise SpecError(f"tool_choice is 'none', 'auto', 'required' or {_NAMED}, not {type(choice).__name__}")
    kind = choice.get("type", "function")
    if kind != "function":
        raise SpecError(f"tool_choice type {kind!r} is not taken: name a function as {_NAMED}")
    function = _plain(choice.get("function"))
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise SpecError(f"tool_choice names a function as {_NAMED}; got function {function!r}")
    return name


def _calls_schema(functions: dict[str, dict[str, Any]], with_refs: set[str], *, single: bool) -> dict[str, Any]:
    """vLLM's array for "required", key order included (the same text, so the same grammar id as
    the schema vLLM hands its backend): items any of ``{"name": enum [one name], "parameters":
    ...}``, both required; each tool's ``$defs`` moved to the root, where its ``#/$defs/...``
    refs land."""
    defs: dict[str, Any] = {}
    defined_by: dict[str, str] = {}
    calls = []
    for name, params in functions.items():
        own = params.pop("$defs", None)
        if own is not None and not isinstance(own, Mapping):
            raise SpecError(f"tool {name!r}: parameters.$defs is an object of named schemas, not {type(own).__name__}")
        for key, sub in (own or {}).items():
            if key in defs and defs[key] != sub:
                raise SpecError(f"tools {defined_by[key]!r} and {name!r} both define $defs/{key}, differently: the "
                                "call array has one $defs for all tools (as vLLM's), so a name means one schema")
            defs.setdefault(key, sub)
            defined_by.setdefault(key, name)
        if name in with_refs:
            _check_refs(params, name)
        calls.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _check_refs(params: Any, name: str) -> None:
    """Refs into the parameters schema itself ('#', '#/properties/...', '#/definitions/...') would
    point elsewhere once it sits inside the call array: refused rather than silently retargeted."""
    stack: list[tuple[Any, bool]] = [(params, False)]     # (node, is a map of named schemas)
    while stack:
        node, named = stack.pop()
        if isinstance(node, list):
            stack.extend((x, False) for x in node)
        elif isinstance(node, dict) and named:
            stack.extend((x, False) for x in node.values())
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and not ref.startswith("#/$defs/"):
                raise SpecError(f"tool {name!r}: parameters refer to {ref!r}, inside the parameters schema; in the "
                                "call array of tool_choice 'required' that pointer would land elsewhere. Put shared "
                                "schemas under the parameters' $defs and refer to '#/$defs/NAME'")
            stack.extend((v, k in _SCHEMA_MAPS) for k, v in node.items() if k not in _INSTANCE_KEYWORDS)
