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

import collections
import hashlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from maskd.specs import SpecError, json_depth, read_json
from maskd.text_memo import TextMemo

__all__ = ["ARRAY_HEAD", "EMPTY_PARAMETERS", "TOOL_CHOICES", "ToolCallParts", "calls_depth", "calls_schema_parts",
           "parts_from_wire", "tool_call_output", "tool_call_schema", "tool_call_tag"]

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
    found = tool_call_output(tools, tool_choice, parallel_tool_calls)
    return json.loads(found.schema_text()) if isinstance(found, ToolCallParts) else found


def tool_call_output(tools: Any, tool_choice: Any = None,
                     parallel_tool_calls: Any = None) -> ToolCallParts | dict[str, Any] | None:
    """What ``tool_call_schema`` gives, with the call array of ``"required"`` as its parts (not
    built as one dict: a server composes it from the parts, and its text is their concatenation)."""
    chosen = _chosen(tools, tool_choice, parallel_tool_calls)
    if chosen is None:
        return None
    functions, choice, name = chosen
    if choice == "auto":
        return None          # vLLM: the tool parser reads the model's own calls; nothing constrains them
    if name is not None:
        return functions[name].schema()
    if not functions:
        return None          # vLLM and OpenAI: "required" with an empty tools list means "none"
    return _calls_parts(functions, single=parallel_tool_calls is False)


def _chosen(tools: Any, tool_choice: Any,
            parallel_tool_calls: Any) -> tuple[dict[str, _Function], str, str | None] | None:
    """The tool keys read and checked: (each tool's parameters by name, "auto" / "required" /
    "named", the named function or None), or None where they ask for nothing (``"none"``, or no
    tool_choice and no tools). Malformed keys raise SpecError naming the key."""
    functions = None if tools is None else _functions(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise SpecError(f"parallel_tool_calls is true or false, not {parallel_tool_calls!r}")
    choice = _plain(tool_choice)
    if choice is None:
        if functions is None:
            return None
        choice = "auto"      # OpenAI and vLLM: tools without a tool_choice are "auto"
    if choice == "none":
        return None
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise SpecError(f"tool_choice {choice!r} is not one of {', '.join(map(repr, TOOL_CHOICES))} "
                        f"or a named function {_NAMED}")
    name = None if isinstance(choice, str) else _named(choice)
    if functions is None:
        raise SpecError(f"tool_choice {choice if name is None else name!r} needs tools: the request has none")
    if name is not None and name not in functions:
        raise SpecError(f"tool_choice names the function {name!r}, which is not one of the tools "
                        f"({_some(functions)})")
    return functions, "named" if name is not None else choice, name


def tool_call_tag(tools: Any, tool_choice: Any, parallel_tool_calls: Any, model: Any) -> dict[str, Any] | None:
    """The structural tag of ``model``'s own tool-call format (``tool_call_format``: a model the
    xgrammar installed here has a builtin format for, such as ``qwen_3_coder``, ``qwen_3``,
    ``deepseek_v4``, ``glm_4_7``, ``llama``, ``harmony``): the tags that model wraps its calls in,
    each tool's arguments per its parameters schema (unless the tool says ``strict: false``). Where
    vLLM takes a parser's format from xgrammar (vLLM 0.33 builds some itself, such as ``hermes``
    and its own ``glm_4_7``), the same tag vLLM builds, so the same grammar. ``"auto"`` (the
    default with tools): free text, and any call the model starts in its format is constrained;
    ``"required"`` and a named function: at least one call (of that function); ``"none"``, or no
    tools: None. Needs xgrammar (the client's import of it is lazy); a malformed key, an unknown
    format or xgrammar's refusal is a SpecError."""
    if not isinstance(model, str) or not model:
        raise SpecError(f"tool_call_format names a model's tool-call format (such as 'qwen_3_coder'), "
                        f"not {model!r}")
    if tools is None:
        raise SpecError(f"tool_call_format {model!r} needs tools: the request has none")
    chosen = _chosen(tools, tool_choice, parallel_tool_calls)
    if chosen is None or not chosen[0]:
        return None
    choice, name = chosen[1], chosen[2]
    try:
        from xgrammar import get_model_structural_tag
    except ImportError:
        raise SpecError(f"tool_call_format {model!r} is built from xgrammar's model formats and xgrammar is not "
                        "installed here (pip install xgrammar); or send the structural tag itself") from None
    wanted: Any = choice if name is None else {"type": "function", "function": {"name": name}}
    plain: list[Any] = []
    for raw in tools:
        tool = dict(_plain(raw))
        tool["function"] = {k: v for k, v in dict(_plain(tool["function"])).items() if v is not None}
        plain.append({k: v for k, v in tool.items() if v is not None})
    try:
        tag = get_model_structural_tag(model, tools=plain, reasoning=False, tool_choice=wanted,
                                       parallel_tool_calls=parallel_tool_calls is not False)
    except (ValueError, TypeError) as exc:     # pydantic's ValidationError is a ValueError
        raise SpecError(f"tool_call_format {model!r}: {str(exc).splitlines()[0]}") from None
    return json.loads(tag.model_dump_json())


def _some(names: Mapping[str, Any], shown: int = 8) -> str:
    listed = ", ".join(repr(n) for n, _ in zip(names, range(shown)))
    return (listed or "none") + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _plain(value: Any) -> Any:
    """Mappings and plain values as they are; pydantic objects as their dict."""
    if type(value) is dict or value is None or isinstance(value, (Mapping, str)):
        return value
    dump = getattr(value, "model_dump", None)
    return dump() if callable(dump) else value


class _Function(NamedTuple):
    """One tool's parameters: their compact JSON text without ``$defs``, its own ``$defs`` (or
    None), and the body as a dict (read, never changed). A tuple: a 200-tool request builds 200 of
    them (a frozen dataclass's constructor cost twice as much)."""
    text: str
    body: Mapping[str, Any]
    defs: Mapping[str, Any] | None
    has_ref: bool

    def schema(self) -> dict[str, Any]:
        """The parameters schema as a fresh dict, its own ``$defs`` included."""
        schema = json.loads(self.text)
        if self.defs is not None:
            schema["$defs"] = json.loads(_compact(self.defs))
        return schema


def _functions(tools: Any) -> dict[str, _Function]:
    """Each tool's name and parameters, in the tools' order. Plain dicts (a request parsed from
    JSON) take the short way: a 200-tool request is read on every request that sends it."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise SpecError(f"tools is a list of {_TOOL}, not {type(tools).__name__}")
    functions: dict[str, _Function] = {}
    for i, raw in enumerate(tools):
        tool = raw if type(raw) is dict else _plain(raw)
        if type(tool) is not dict and not isinstance(tool, Mapping):
            raise SpecError(f"tools[{i}] is a {_TOOL} object, not {type(tool).__name__}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise SpecError(f"tools[{i}] has type {kind!r}: only function tools ({_TOOL}) are taken")
        function = tool.get("function")
        if type(function) is not dict:
            function = _plain(function)
            if not isinstance(function, Mapping):
                raise SpecError(f"tools[{i}].function is an object with a name and parameters, not "
                                f"{type(function).__name__}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError(f"tools[{i}].function.name is the function's name, a non-empty string; got {name!r}")
        if name in functions:
            raise SpecError(f"tools[{list(functions).index(name)}] and tools[{i}] both name the function "
                            f"{name!r}: a call could not say which one it means")
        functions[name] = _parameters(function.get("parameters"), i, name)
    return functions


def _parameters(params: Any, i: int, name: str) -> _Function:
    """The parameters schema as JSON text (checked to be JSON, of an object), its ``$defs`` apart;
    ``i`` and ``name``: the tool's place and name, for an error."""
    if type(params) is not dict:
        params = _plain(params)
        if params is not None and not isinstance(params, Mapping):
            raise SpecError(f"{_where(i, name)} is a JSON schema object describing the arguments, not "
                            f"{type(params).__name__}")
    if not params:
        params = EMPTY_PARAMETERS    # vLLM: none declared, an object with any members
    declared = params.get("type")
    if declared is not None and declared != "object" and not (isinstance(declared, list) and "object" in declared):
        raise SpecError(f"{_where(i, name)} has type {declared!r}: a call's arguments are a JSON object, so the "
                        "parameters schema describes an object (type 'object')")
    defs = params.get("$defs")
    body = {k: v for k, v in params.items() if k != "$defs"} if "$defs" in params else params
    if defs is not None and type(defs) is not dict and not isinstance(defs, Mapping):
        raise SpecError(f"{_where(i, name)}: $defs is an object of named schemas, not {type(defs).__name__}")
    try:
        text = _compact(body)
        defs_text = _compact(defs) if defs is not None else ""
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{_where(i, name)} is not JSON: {exc}") from None
    except RecursionError:
        raise SpecError(f"{_where(i, name)} is nested too deeply to write as JSON (or contains itself)") from None
    return _Function(text, body, defs, '"$ref"' in text or '"$ref"' in defs_text)


def _where(i: int, name: str) -> str:
    return f"tools[{i}].function.parameters ({name!r})"


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


def _calls_parts(functions: dict[str, _Function], *, single: bool) -> ToolCallParts:
    """vLLM's array for "required" as its parts (its text, key order included, is the schema vLLM
    hands its backend, so the same grammar id): items any of ``{"name": enum [one name],
    "parameters": ...}``, both required; each tool's ``$defs`` moved to the root, where its
    ``#/$defs/...`` refs land."""
    defs: dict[str, Any] = {}
    defined_by: dict[str, str] = {}
    for name, f in functions.items():
        for key, sub in (f.defs or {}).items():
            if key in defs and defs[key] != sub:
                raise SpecError(f"tools {defined_by[key]!r} and {name!r} both define $defs/{key}, differently: the "
                                "call array has one $defs for all tools (as vLLM's), so a name means one schema")
            defs.setdefault(key, sub)
            defined_by.setdefault(key, name)
        if f.has_ref:
            _check_refs(f.body, name)
    return ToolCallParts(tuple(functions), tuple(f.text for f in functions.values()),
                         _compact(defs) if defs else "", single)


def local_refs(schema: Any) -> Iterator[str]:
    """Every ``$ref`` into the document itself (``#...``) at a schema position of ``schema`` (not
    inside ``const``/``enum``/``default``/``examples``, which are instances), in no set order."""
    stack: list[tuple[Any, bool]] = [(schema, False)]     # (node, is a map of named schemas)
    while stack:
        node, named = stack.pop()
        if isinstance(node, list):
            stack.extend((x, False) for x in node)
        elif isinstance(node, dict) and named:
            stack.extend((x, False) for x in node.values())
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                yield ref
            stack.extend((v, k in _SCHEMA_MAPS) for k, v in node.items() if k not in _INSTANCE_KEYWORDS)


def _check_refs(params: Any, name: str) -> None:
    """Refs into the parameters schema itself ('#', '#/properties/...', '#/definitions/...') would
    point elsewhere once it sits inside the call array: refused rather than silently retargeted."""
    for ref in local_refs(params):
        if not ref.startswith("#/$defs/"):
            raise SpecError(f"tool {name!r}: parameters refer to {ref!r}, inside the parameters schema; in the "
                            "call array of tool_choice 'required' that pointer would land elsewhere. Put shared "
                            "schemas under the parameters' $defs and refer to '#/$defs/NAME'")


# -- the call array taken apart (per-tool pieces, issue 19) -------------------------------------
ARRAY_HEAD = '{"type":"array","minItems":1,"items":{"type":"object","anyOf":['
_CALL_HEAD = '{"properties":{"name":{"type":"string","enum":['
_CALL_MID = ']},"parameters":'
_CALL_TAIL = '},"required":["name","parameters"]}'
_json_string = json.encoder.encode_basestring   # json.dumps of a str, ensure_ascii=False


@dataclass(frozen=True)
class ToolCallParts:
    """A ``tool_choice: "required"`` call array as its parts: the tools' names and each one's
    parameters schema (compact JSON text, without ``$defs``), the array's ``$defs`` (compact JSON,
    "" for none), and whether it holds one call at most. ``schema_text`` is the array's JSON text
    (the text ``tool_call_schema`` gives, so the same grammar id); ``pieces`` each tool's parameters
    as a JSON schema of its own, the grammar a server compiles once per tool."""
    names: tuple[str, ...]
    params: tuple[str, ...]
    defs: str = ""
    single: bool = False

    @property
    def pieces(self) -> tuple[str, ...]:
        """Each tool's parameters with the array's ``$defs`` where they refer to them."""
        if not self.defs:
            return self.params
        return tuple(p[:-1] + ("," if p != "{}" else "") + '"$defs":' + self.defs + "}" if '"$ref"' in p else p
                     for p in self.params)

    def sha256(self) -> str:
        """A sha256 of the array's content, for its grammar id: over the names, the sha256 of each
        parameters text (kept per text: the same tools come again), the ``$defs`` and the bound,
        not over the whole text (a new array of 200 known tools: 0.22 ms against 0.52 ms for its
        134 KB text on a CPU without SHA instructions)."""
        digest = self.__dict__.get("_sha256")
        if digest is None:
            h = hashlib.sha256()
            for name, params in zip(self.names, self.params):
                h.update(_json_string(name).encode())    # a JSON string: no NUL byte in it
                h.update(b"\0" + _text_sha256(params))
            h.update(b"\0" + _text_sha256(self.defs) + (b"\1" if self.single else b"\0"))
            digest = self.__dict__["_sha256"] = h.hexdigest()
        return digest

    def schema_text(self) -> str:
        text = self.__dict__.get("_text")
        if text is None:
            text = self.__dict__["_text"] = self._assemble()
        return text

    def _assemble(self) -> str:
        calls = ",".join(_CALL_HEAD + _json_string(n) + _CALL_MID + p + _CALL_TAIL
                         for n, p in zip(self.names, self.params))
        return (ARRAY_HEAD + calls + "]}" + (',"maxItems":1' if self.single else "")
                + (',"$defs":' + self.defs if self.defs else "") + "}")

    def router_key(self) -> tuple:
        """What the router depends on: the bound alone (its names are any string; the composed
        matcher holds each call's name to the set: one router serves every array)."""
        return ("calls", self.single)

    def nesting(self) -> int:
        """The nesting depth of the array's schema (``calls_depth``)."""
        return calls_depth(self)

    def write_proto(self, msg: Any) -> None:
        """Fills a GrammarSpec message's ``tool_calls`` (contract revision 6)."""
        calls = msg.tool_calls
        for name, params in zip(self.names, self.params):
            calls.tools.add(name=name, parameters=params)
        calls.defs = self.defs
        calls.single = self.single

    def to_plain(self) -> dict[str, Any]:
        return {"tools": {"names": list(self.names), "params": list(self.params), "defs": self.defs,
                          "single": self.single}}

    def router_schema(self) -> dict[str, Any]:
        """The same array with one item schema: a name that is any string, parameters any object.
        Its rows equal the whole grammar's outside the names and the parameters: the composed
        matcher holds each name to the set (engines/tool_calls.py, ``NameSet``), a piece gives the
        rows inside the parameters. Built once per bound and whitespace, not per set of names (a
        200-name enum cost 0.8 ms of llguidance per new set)."""
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
            "required": ["name", "parameters"]}}
        if self.single:
            schema["maxItems"] = 1
        return schema


_TEXT_SHA256: dict[str, bytes] = {}
_TEXT_SHA256_KEPT = 1 << 16


def _text_sha256(text: str) -> bytes:
    """A parameters (or $defs) text's sha256, kept for the last texts seen."""
    digest = _TEXT_SHA256.get(text)
    if digest is None:
        digest = hashlib.sha256(text.encode()).digest()
        if len(_TEXT_SHA256) >= _TEXT_SHA256_KEPT:
            _TEXT_SHA256.clear()
        _TEXT_SHA256[text] = digest
    return digest


def _json_writer() -> Callable[[Any], str]:
    """``json.dumps(value, ensure_ascii=False, separators=(",", ":"))``, the same text from the same
    C writer, built once (json.dumps builds it again on every call). No cycle check (nothing parsed
    from JSON has a cycle; a cyclic value ends in RecursionError, which the callers refuse as too
    deep)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:      # an interpreter without the _json speedups
        return json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False).encode
    write = make(None, json.JSONEncoder().default, json.encoder.encode_basestring, None, ":", ",",
                 False, False, True)     # no indent; sort_keys, skipkeys off; NaN as json.dumps writes it

    def compact(value: Any) -> str:
        if isinstance(value, str):
            return json.encoder.encode_basestring(value)
        return "".join(write(value, 0))
    return compact


def _compact_writer() -> Callable[[Any], str]:
    """Compact JSON text (no spaces, non-ASCII as it is), the canonical form of a tool's parameters
    and so of its piece's grammar id: orjson's (a 200-tool request's parameters in ~0.1 ms against
    ~1 ms from json's C writer; docs/decisions/0015-tool-spec-writer.md), and json's writer
    for what orjson does not write as ``json.dumps`` would: NaN and infinities (orjson writes them
    as null, so any text holding "null" is written by json's, which keeps them NaN and Infinity for
    the compile to refuse), ints past 64 bits, keys that are not strings, nesting past orjson's 254
    levels, and values json refuses too (dataclasses and dates, handed through to json's refusal).
    Where both write a text, the values are the same; the texts differ only in small floats'
    exponents (``1e-05``, ``1e-07``: orjson ``0.00001``, ``1e-7``) and in UUIDs and plain enums, which orjson writes as
    their values and json.dumps refuses."""
    fallback = _json_writer()
    dumps, refused = orjson.dumps, orjson.JSONEncodeError
    option = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME

    def compact(value: Any) -> str:
        try:
            out = dumps(value, option=option)
        except refused:
            return fallback(value)
        if b"null" in out:
            return fallback(value)
        return out.decode()
    return compact


_compact = _compact_writer()


def calls_schema_parts(schema: Any) -> ToolCallParts | None:
    """The parts of a JSON schema that is exactly the call array ``tool_call_schema`` builds for
    ``"required"``, or None for any other schema."""
    if not isinstance(schema, dict) or list(schema)[:3] != ["type", "minItems", "items"] \
            or set(schema) - {"type", "minItems", "items", "maxItems", "$defs"} \
            or schema["type"] != "array" or schema["minItems"] != 1 or schema.get("maxItems", 1) != 1:
        return None
    items, defs = schema["items"], schema.get("$defs")
    if not isinstance(items, dict) or list(items) != ["type", "anyOf"] or items["type"] != "object" \
            or not isinstance(items["anyOf"], list) or not items["anyOf"] \
            or (defs is not None and (not isinstance(defs, dict) or not defs)):
        return None
    names: list[str] = []
    params: list[str] = []
    for call in items["anyOf"]:
        if not isinstance(call, dict) or list(call) != ["properties", "required"] \
                or call["required"] != ["name", "parameters"]:
            return None
        props = call["properties"]
        if not isinstance(props, dict) or list(props) != ["name", "parameters"]:
            return None
        name, p = props["name"], props["parameters"]
        if not isinstance(name, dict) or list(name) != ["type", "enum"] or name["type"] != "string" \
                or not isinstance(name["enum"], list) or len(name["enum"]) != 1 \
                or not isinstance(name["enum"][0], str) or not isinstance(p, dict) or "$defs" in p:
            return None
        names.append(name["enum"][0])
        params.append(_compact(p))
    if len(set(names)) != len(names):
        return None
    return ToolCallParts(tuple(names), tuple(params), _compact(defs) if defs else "", "maxItems" in schema)


class _PieceTexts:
    """Parameters texts that came over the wire, checked once: their canonical form and depth
    (a bounded memo: a server sees the same tools again and again)."""

    MAX_CHARS = 64 << 20

    def __init__(self) -> None:
        self._memo: TextMemo[tuple[str, int]] = TextMemo(self.MAX_CHARS)

    def canonical(self, texts: list[str], where) -> list[tuple[str, int]]:
        """The canonical form and depth of each text (``where(i)`` names the i-th in an error)."""
        found = self._memo.get_many(texts)
        return [f if f is not None else self.get(t, where(i)) for i, (t, f) in enumerate(zip(texts, found))]

    def get(self, text: str, where: str) -> tuple[str, int]:
        return self._memo.get_or_make(text, lambda t: _read_parameters(t, where), lambda found: len(found[0]))


def _read_parameters(text: str, where: str) -> tuple[str, int]:
    """A parameters text's canonical form and depth (SpecError naming ``where`` if it is not an object)."""
    value = read_json(text, where)
    if not isinstance(value, dict):
        raise SpecError(f"{where} is a JSON object, not {type(value).__name__}")
    return _compact(value), json_depth(value)


_PIECE_TEXTS = _PieceTexts()


_WIRE_PARTS_KEPT = 256    # the last tool sets that came over the wire (an open sends its set again)
_WIRE_PARTS: collections.OrderedDict[bytes, ToolCallParts] = collections.OrderedDict()
_WIRE_PARTS_LOCK = threading.Lock()


def parts_from_wire(msg: Any) -> ToolCallParts:
    """The parts a ``ToolCalls`` message carries, checked (SpecError naming what is wrong): at
    least one tool, names non-empty and unique, each parameters text a JSON object schema without
    ``$defs`` (they go in ``defs``), ``defs`` empty or a JSON object. Texts are made canonical.
    The same set again (the open after its register, every request of an agent) is looked up."""
    key = msg.SerializeToString()    # the set as it came: one copy, hashed once (its 400 fields read: 0.3 ms)
    with _WIRE_PARTS_LOCK:
        found = _WIRE_PARTS.get(key)
        if found is not None:
            _WIRE_PARTS.move_to_end(key)
            return found
    tools = msg.tools
    found = _parts_from_wire(tuple(t.name for t in tools), tuple(t.parameters for t in tools), msg.defs,
                             bool(msg.single))
    with _WIRE_PARTS_LOCK:
        _WIRE_PARTS[key] = found
        while len(_WIRE_PARTS) > _WIRE_PARTS_KEPT:
            _WIRE_PARTS.popitem(last=False)
    return found


def _parts_from_wire(names: tuple[str, ...], texts: tuple[str, ...], wire_defs: str, single: bool) -> ToolCallParts:
    if not names:
        raise SpecError("tool_calls names no tools: a call array needs at least one")
    if not all(names) or len(set(names)) != len(names):
        seen: dict[str, int] = {}
        for i, name in enumerate(names):
            if not name:
                raise SpecError(f"tool_calls.tools[{i}].name is empty")
            if name in seen:
                raise SpecError(f"tool_calls.tools[{seen[name]}] and [{i}] both name the function {name!r}")
            seen[name] = i
    checked = _PIECE_TEXTS.canonical([t or "{}" for t in texts],
                                     lambda i: f"tool_calls.tools[{i}].parameters ({names[i]!r})")
    params = [text for text, _ in checked]
    for i, text in enumerate(params):
        if '"$defs"' in text and "$defs" in json.loads(text):
            raise SpecError(f"tool_calls.tools[{i}].parameters ({names[i]!r}) has $defs: they go in "
                            "tool_calls.defs, shared by every tool of the array")
    defs, defs_depth = _PIECE_TEXTS.get(wire_defs, "tool_calls.defs") if wire_defs else ("", 0)
    parts = ToolCallParts(names, tuple(params), "" if defs == "{}" else defs, single)
    parts.__dict__["_depth"] = _depth(max(depth for _, depth in checked), defs_depth if parts.defs else 0)
    return parts


def calls_depth(parts: ToolCallParts) -> int:
    """The nesting depth of the array's schema (as ``maskd.specs.json_depth`` of its JSON): the
    name's enum list is at 7, a tool's parameters at 6, the $defs at 2. Kept with the parts (the
    wire's parts are read with it: a server checks it on every register)."""
    deepest = parts.__dict__.get("_depth")
    if deepest is None:
        deepest = _depth(max(_PIECE_TEXTS.get(p, "parameters")[1] for p in parts.params),
                         _PIECE_TEXTS.get(parts.defs, "defs")[1] if parts.defs else 0)
        parts.__dict__["_depth"] = deepest
    return deepest


def _depth(deepest_parameters: int, defs_depth: int) -> int:
    return max(7, 5 + deepest_parameters, 1 + defs_depth if defs_depth else 0)
