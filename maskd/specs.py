"""Grammar specs: kinds, options, canonical form and the content-hash grammar id.

Import-light (no engine): the client builds the same specs from dicts. ``GrammarSpec.from_dict``
takes maskd's own shape; ``GrammarSpec.from_request`` also takes the shapes users already send
to vLLM, SGLang and OpenAI-compatible servers (one meaning per name; ambiguity is an error),
OpenAI's tools among them (the schema of a forced tool call is built in ``maskd.tool_specs``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from maskd.text_memo import TextMemo
from maskd.v1 import maskd_pb2 as pb

KINDS = ("json_schema", "regex", "lark", "ebnf", "choice", "structural_tag")
#: Kinds a server makes for itself and never sends: a tool's parameters, the piece of a composed
#: tool-call array (a JSON schema whose document may be followed by anything, as in the array).
PIECE_KIND = "tool_parameters"
OPTION_KEYS = ("whitespace", "reasoning", "max_whitespace")
#: A JSON schema template with named holes and their arguments (maskd.template_specs): a json_schema
#: grammar sent as its parts.
TEMPLATE = "template"
#: Flexible JSON whitespace: at most this many whitespace characters in a row (0: no bound).
DEFAULT_MAX_WHITESPACE = 8
MAX_WHITESPACE_LIMIT = 1 << 16
#: How JSON schemas are enforced (the server's --json-schema-mode; part of every grammar id).
JSON_SCHEMA_MODES = ("strict", "complete")
# Kinds whose grammar depends on the JSON schema mode (JSON schemas, the arguments of tool calls).
_MODE_KINDS = ("json_schema", "structural_tag", PIECE_KIND)
WHITESPACE = {"flexible": pb.WHITESPACE_FLEXIBLE, "compact": pb.WHITESPACE_COMPACT}
_WHITESPACE_NAMES = {pb.WHITESPACE_DEFAULT: "flexible", pb.WHITESPACE_FLEXIBLE: "flexible",
                     pb.WHITESPACE_COMPACT: "compact"}


class SpecError(ValueError):
    """A grammar spec that is malformed before any engine sees it."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    kind: str
    text: str                     # canonical text (JSON kinds are re-serialized compactly)
    whitespace: str = "flexible"  # "flexible" | "compact"
    reasoning_start: str = ""     # optional: the prompt may already have opened the reasoning
    reasoning_end: str = ""       # free text up to this marker comes before the grammar
    max_whitespace: int = DEFAULT_MAX_WHITESPACE  # flexible JSON: longest whitespace run (0: no bound)
    # The parts of a grammar a server may compose from pieces, when the spec was built from them: a
    # tool_choice "required" call array (maskd.tool_specs.ToolCallParts) or a template and its
    # arguments (maskd.template_specs.TemplateParts). ``text`` is then the whole schema they make,
    # and the wire carries the parts, not the text.
    parts: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS and self.kind != PIECE_KIND:
            raise SpecError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.whitespace not in WHITESPACE:
            raise SpecError(f"unknown whitespace option {self.whitespace!r}; use 'flexible' or 'compact'")
        if not isinstance(self.reasoning_start, str) or not isinstance(self.reasoning_end, str):
            raise SpecError("reasoning markers are strings such as '<think>' and '</think>'")
        if self.reasoning_start and not self.reasoning_end:
            raise SpecError("reasoning_start needs reasoning_end (the marker that ends the free text)")
        if isinstance(self.max_whitespace, bool) or not isinstance(self.max_whitespace, int) \
                or not 0 <= self.max_whitespace <= MAX_WHITESPACE_LIMIT:
            raise SpecError(f"max_whitespace is an integer in [0, {MAX_WHITESPACE_LIMIT}] (0: no bound), "
                            f"not {self.max_whitespace!r}")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, kind: str, source: Any, *, whitespace: str = "flexible",
               reasoning: tuple[str, str] | str | None = None,
               max_whitespace: int = DEFAULT_MAX_WHITESPACE) -> GrammarSpec:
        """``reasoning``: a ``(start, end)`` pair, or the end marker alone. A JSON schema that is a
        ``tool_choice: "required"`` call array (as vLLM or ``maskd.tool_specs`` builds it) keeps its
        parts: the server composes its grammar from them, and the wire carries them."""
        start, end = ("", reasoning) if isinstance(reasoning, str) else (reasoning or ("", ""))
        parts = _call_parts(source) if kind == "json_schema" else None
        text = parts.schema_text() if parts is not None else canonical_text(kind, source)
        return cls(kind, text, whitespace, start, end, max_whitespace, parts)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> GrammarSpec:
        """``{"json_schema": {...}}``, ``{"regex": "..."}``, ``{"choice": [...]}`` ... or
        ``{"template": {"schema": <a JSON schema with holes>, "arguments": {<hole>: <schema>}}}``
        (``maskd.template_specs``), plus optional ``whitespace``, ``reasoning`` (a ``[start, end]``
        pair, or the end marker alone when the prompt already opened the reasoning) and
        ``max_whitespace``."""
        if not isinstance(spec, Mapping):
            raise SpecError(f"a grammar spec is a dict such as {{'regex': '[0-9]+'}}, not {type(spec).__name__}")
        named = (*KINDS, TEMPLATE)
        kinds = [k for k in spec if k in named]
        unknown = [k for k in spec if k not in named and k not in OPTION_KEYS]
        if unknown:
            raise SpecError(f"unknown grammar spec keys {unknown}; kinds are {', '.join(named)}, "
                            f"options {', '.join(OPTION_KEYS)}")
        if len(kinds) != 1:
            raise SpecError(f"a grammar spec names exactly one kind of {', '.join(named)}; got {kinds}")
        return _from_keys(spec)

    @classmethod
    def from_request(cls, request: Any) -> GrammarSpec | None:
        """A spec from any shape users already send (see :func:`spec_from_request`): maskd's own
        dict, vLLM ``structured_outputs``, OpenAI ``response_format`` and ``tools``/``tool_choice``,
        SGLang's keys, a pydantic model class. None where the request asks for no constraint
        (``{"type": "text"}``, ``tool_choice: "auto"``).
        Ambiguous or unknown shapes raise SpecError."""
        return spec_from_request(request)

    @classmethod
    def from_proto(cls, msg: pb.GrammarSpec) -> GrammarSpec:
        kind = msg.WhichOneof("kind")
        if kind is None:
            raise SpecError("grammar spec names no kind; set one of " + ", ".join(KINDS) + ", tool_calls or template")
        opts = msg.options
        ws = _WHITESPACE_NAMES.get(opts.whitespace)
        if ws is None:
            raise SpecError(f"unknown whitespace option {opts.whitespace}")
        reasoning = (opts.reasoning_start, opts.reasoning_end) if (opts.reasoning_start or opts.reasoning_end) else None
        max_ws = opts.max_whitespace if opts.HasField("max_whitespace") else DEFAULT_MAX_WHITESPACE
        parts: Any
        if kind == "tool_calls":
            from maskd.tool_specs import parts_from_wire  # here: maskd.tool_specs imports this module
            parts = parts_from_wire(msg.tool_calls)
        elif kind == "template":
            from maskd.template_specs import template_parts_from_wire  # here: it imports this module
            parts = template_parts_from_wire(msg.template)
        if kind in ("tool_calls", "template"):
            spec = cls.create("json_schema", True, whitespace=ws, reasoning=reasoning, max_whitespace=max_ws)
            return dataclasses.replace(spec, text=parts.schema_text(), parts=parts)
        source: Any = list(msg.choice.items) if kind == "choice" else getattr(msg, kind)
        return cls.create(kind, source, whitespace=ws, reasoning=reasoning, max_whitespace=max_ws)

    def to_proto(self) -> pb.GrammarSpec:
        msg = pb.GrammarSpec()
        if self.parts is not None:
            self.parts.write_proto(msg)
        elif self.kind == "choice":
            msg.choice.items.extend(json.loads(self.text))
        else:
            setattr(msg, self.kind, self.text)
        msg.options.whitespace = WHITESPACE[self.whitespace]
        msg.options.reasoning_start = self.reasoning_start
        msg.options.reasoning_end = self.reasoning_end
        msg.options.max_whitespace = self.max_whitespace
        return msg

    def to_plain(self) -> dict[str, Any]:
        """The spec as plain data (strings, ints, bools, lists), read back by :meth:`from_plain`
        without parsing any JSON: how a vLLM API server hands the spec it admitted to its engine
        core (a 200-tool array costs ~5 ms to build from the request again)."""
        plain: dict[str, Any] = {"kind": self.kind, "whitespace": self.whitespace,
                                 "reasoning": [self.reasoning_start, self.reasoning_end],
                                 "max_whitespace": self.max_whitespace}
        if self.parts is not None:
            plain.update(self.parts.to_plain())     # the text is the parts' (a 200-tool array's: once, not twice)
        else:
            plain["text"] = self.text
        return plain

    @classmethod
    def from_plain(cls, plain: Any) -> GrammarSpec:
        """The spec :meth:`to_plain` wrote. Its texts are taken as they are (they were canonical
        where they were written; a spec with parts has its parts' text); a value of the wrong shape
        raises SpecError."""
        try:
            start, end = plain["reasoning"]
            tools, template = plain.get("tools"), plain.get("template")
            parts: Any = None
            if template is not None:
                from maskd.template_specs import template_parts_from_plain  # here: it imports this module
                parts = template_parts_from_plain(template)
            elif tools is not None:
                from maskd.tool_specs import ToolCallParts  # here: maskd.tool_specs imports this module
                names, params = tuple(tools["names"]), tuple(tools["params"])
                calls = parts = ToolCallParts(names, params, tools["defs"], tools["single"])
                if not all(isinstance(f, str) for f in (*names, *params, calls.defs)):
                    raise TypeError("names, params and defs must be strings")
                if len(names) != len(params) or not names or not isinstance(calls.single, bool):
                    raise TypeError("names and params are non-empty lists of one length, single a bool")
            text = plain["text"] if parts is None else parts.schema_text()
            if not all(isinstance(f, str) for f in (plain["kind"], text, plain["whitespace"], start, end)):
                raise TypeError("texts must be strings")
            return cls(plain["kind"], text, plain["whitespace"], start, end, plain["max_whitespace"], parts)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, SpecError):
                raise
            raise SpecError(f"not a spec written by GrammarSpec.to_plain: {exc!r}") from None

    # -- identity -----------------------------------------------------------------------------
    def grammar_id(self, tokenizer_fingerprint: str, backend: str, backend_version: str, *,
                   json_schema_mode: str = "complete") -> str:
        """Content hash: the same grammar has the same id on every replica. The server's JSON
        schema mode is part of it for the kinds it changes (json_schema, structural_tag)."""
        # The text goes in as its hash: json.dumps of a 134 KB tool set's text cost more than its sha256;
        # a tool-call array's as the hash of its parts (each tool's parameters hashed once).
        payload = {
            "kind": self.kind,
            **({"parts_sha256": self.parts.sha256()} if self.parts is not None
               else {"text_sha256": hashlib.sha256(self.text.encode()).hexdigest()}),
            "whitespace": self.whitespace,
            "reasoning": [self.reasoning_start, self.reasoning_end], "max_whitespace": self.max_whitespace,
            "tokenizer": tokenizer_fingerprint, "backend": backend, "backend_version": backend_version,
        }
        if self.kind in _MODE_KINDS:
            payload["json_schema_mode"] = json_schema_mode
        text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return "g-" + hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def size(self) -> int:
        return len(self.text) + len(self.reasoning_start) + len(self.reasoning_end)

    @property
    def bounded_whitespace(self) -> int:
        """The whitespace bound that applies: 0 when there is none (compact JSON has no whitespace)."""
        return self.max_whitespace if self.whitespace == "flexible" else 0

    @functools.cached_property
    def depth(self) -> int:
        """Nesting depth of a JSON source (objects and arrays); 0 for other kinds."""
        if self.kind not in ("json_schema", "structural_tag"):
            return 0
        if self.parts is not None:
            return self.parts.nesting()
        return _remembered("depth", self.text, lambda text: json_depth(json.loads(text)))


# What a large spec text costs to work out again on every request that sends it (its canonical form,
# its depth, a call array's parts: a json.loads and a walk, ~10 ms each for 200 tools' schemas), kept
# for texts of 4 KiB or more, by what was worked out, 8 MiB of text each.
_MEMO_MIN_CHARS = 4096
_MEMOS: dict[str, TextMemo[Any]] = {purpose: TextMemo(8 << 20)
                                    for purpose in ("depth", "parts", "json_schema", "structural_tag")}


def _remembered(purpose: str, text: str, make: Callable[[str], Any]) -> Any:
    """``make(text)``, kept in the memo for ``purpose`` when ``text`` is large; what ``make`` raises
    is raised and nothing is kept."""
    if len(text) < _MEMO_MIN_CHARS:
        return make(text)
    return _MEMOS[purpose].get_or_make(text, make, lambda value: len(value) if isinstance(value, str) else 0)


def read_json(text: str | bytes, where: str) -> Any:
    """The value of a JSON text from a request; SpecError naming ``where`` where it is not JSON, or is
    nested too deeply for the parser."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SpecError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise SpecError(f"{where} is nested too deeply to parse") from None


def json_depth(value: Any) -> int:
    """Deepest nesting of dicts and lists (iterative: any depth, no recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in node)
    return deepest


def _call_parts(source: Any) -> Any:
    """The parts of a call array given as a dict, or as its compact JSON text; None for any other schema."""
    from maskd.tool_specs import ARRAY_HEAD, calls_schema_parts  # here: maskd.tool_specs imports this module

    if isinstance(source, str):
        if not source.startswith(ARRAY_HEAD):
            return None
        try:
            return _remembered("parts", source, lambda text: calls_schema_parts(json.loads(text)))
        except (ValueError, RecursionError):
            return None      # canonical_text names the problem
    try:
        return calls_schema_parts(source) if isinstance(source, dict) else None
    except (TypeError, ValueError, RecursionError):
        return None          # not JSON: canonical_text names the problem


def canonical_text(kind: str, source: Any) -> str:
    try:
        if isinstance(source, str) and kind in ("json_schema", "structural_tag"):
            return _remembered(kind, source, lambda text: _canonical_text(kind, text))
        return _canonical_text(kind, source)
    except RecursionError:
        raise SpecError(f"{kind} is nested too deeply to parse") from None


def _canonical_text(kind: str, source: Any) -> str:
    if kind in ("json_schema", "structural_tag"):
        if isinstance(source, (str, bytes)):
            try:
                source = json.loads(source)
            except ValueError as exc:
                raise SpecError(f"{kind} is not valid JSON: {exc}") from exc
        if kind == "json_schema" and not isinstance(source, (dict, bool)):
            raise SpecError(f"json_schema must be a JSON object or boolean, not {type(source).__name__}")
        if kind == "json_schema" and isinstance(source, dict):
            source = unwrap_openai_json_schema(source)
        if kind == "structural_tag" and not isinstance(source, dict):
            raise SpecError("structural_tag must be a JSON object")
        # Key order is kept: property order matters to the engines.
        return json.dumps(source, ensure_ascii=False, separators=(",", ":"))
    if kind == "choice":
        if isinstance(source, str) or not all(isinstance(x, str) for x in source):
            raise SpecError("choice is a list of strings")
        items = list(source)
        if not items:
            raise SpecError("choice needs at least one string")
        return json.dumps(items, ensure_ascii=False, separators=(",", ":"))
    if not isinstance(source, str):
        raise SpecError(f"{kind} grammar must be a string, not {type(source).__name__}")
    if not source.strip():
        raise SpecError(f"{kind} grammar is empty")
    return source


# OpenAI's ``response_format.json_schema`` object: the schema sits under "schema", next to these.
OPENAI_WRAPPER_KEYS = frozenset(("name", "schema", "strict", "description"))


def unwrap_openai_json_schema(schema: dict) -> Any:
    """The schema inside OpenAI's ``{"name", "schema", "strict"}`` wrapper; other dicts as they are.

    A wrapper taken as a schema would allow any JSON ("name", "schema" and "strict" are no JSON
    Schema keywords), so it is unwrapped; a dict that mixes the wrapper's keys with schema keywords
    is ambiguous and refused."""
    if "schema" not in schema:
        if "name" in schema and "strict" in schema and not set(schema) - OPENAI_WRAPPER_KEYS:
            raise SpecError("json_schema looks like OpenAI's {'name', 'strict'} wrapper but has no 'schema': "
                            "put the JSON schema under 'schema'")
        return schema
    extra = sorted(set(schema) - OPENAI_WRAPPER_KEYS)
    if extra:
        raise SpecError(f"json_schema has a 'schema' key next to {extra}: is it OpenAI's "
                        "{'name', 'schema', 'strict'} wrapper or a schema? Send the schema itself, or the "
                        "wrapper with only name/schema/strict/description")
    inner = schema["schema"]
    if isinstance(inner, str):
        try:
            inner = json.loads(inner)
        except ValueError as exc:
            raise SpecError(f"json_schema.schema is not valid JSON: {exc}") from exc
    if not isinstance(inner, (dict, bool)):
        raise SpecError(f"json_schema.schema must be a JSON object or boolean, not {type(inner).__name__}")
    return inner


# -- the request shapes users already send --------------------------------------------------------
# Every name has one meaning, whichever engine's vocabulary it comes from:
#   json_schema (maskd, SGLang), json (vLLM): a JSON schema (object, boolean or its JSON text)
#   regex (all), choice (maskd, vLLM), lark (maskd), structural_tag (all)
#   ebnf (maskd, SGLang), grammar (vLLM): a GBNF/EBNF grammar
#   json_object (vLLM): true means "a JSON object"
# Options: whitespace ("flexible"/"compact", maskd), disable_any_whitespace (vLLM: compact),
# disable_additional_properties (vLLM: every object schema closed), reasoning and max_whitespace
# (maskd).
_CONSTRAINTS = {"json_schema": "json_schema", "json": "json_schema", "regex": "regex", "choice": "choice",
                "lark": "lark", "ebnf": "ebnf", "grammar": "ebnf", "structural_tag": "structural_tag",
                "json_object": "json_object", TEMPLATE: TEMPLATE}
_OPTIONS = ("whitespace", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
            "reasoning", "max_whitespace")
_WRAPPERS = ("structured_outputs", "response_format")
# OpenAI chat completions' tool keys (the schema they ask for: maskd.tool_specs).
_TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "tool_call_format")
_RESPONSE_FORMAT_TYPES = ("json_schema", "json_object", "text", "structural_tag")


#: The kinds a spec goes on the wire as its parts, and the contract revision that brought each. A
#: server of an older revision does not know them (it reads such a message as naming no kind), so
#: a client sends it the same grammar as the whole JSON schema its parts make: that server compiles
#: it whole (the same rows; the grammar id is the schema text's).
PARTS_REVISIONS = {"tool_calls": 6, "template": 7}
NEWEST_PARTS_REVISION = max(PARTS_REVISIONS.values())


def wire_for_revision(msg: pb.GrammarSpec, revision: int) -> pb.GrammarSpec:
    """``msg`` as a server of contract ``revision`` reads it: ``msg`` itself, or where its kind is
    newer than that revision, a new message of kind ``json_schema`` holding the whole schema, with
    the same options."""
    needed = PARTS_REVISIONS.get(msg.WhichOneof("kind") or "")
    if needed is None or revision >= needed:
        return msg
    return dataclasses.replace(GrammarSpec.from_proto(msg), parts=None).to_proto()


def spec_from_request(request: Any) -> GrammarSpec | None:
    """A GrammarSpec from the shapes users already send; None for "no constraint" (OpenAI's
    ``{"type": "text"}``). Accepted:

    * a GrammarSpec (as is), or a pydantic model class (its JSON schema);
    * maskd's dict (``{"json_schema": ...}``, ``{"regex": ...}``, ... plus whitespace/reasoning);
    * vLLM's ``structured_outputs`` (a dict or a ``StructuredOutputsParams``: json, regex, choice,
      grammar, json_object, structural_tag, disable_any_whitespace, disable_additional_properties);
    * OpenAI's ``response_format`` (``{"type": "json_schema", "json_schema": {"name", "schema",
      "strict"}}``, ``{"type": "json_object"}``, ``{"type": "text"}``) and SGLang's
      ``{"type": "structural_tag", ...}``;
    * SGLang's sampling keys (json_schema as JSON text, regex, ebnf, structural_tag);
    * a request body holding exactly one of ``structured_outputs`` / ``response_format``;
    * a chat-completions body with ``tools``, ``tool_choice`` and ``parallel_tool_calls``: what
      vLLM constrains for them (``maskd.tool_specs``): the array of calls for ``"required"``, the
      named function's parameters for a named one, nothing for ``"auto"``/``"none"`` (then the
      body's other constraint, if any, or None). A forced tool choice beside another constraint
      (``response_format``, ``structured_outputs``, ``json``...) is a SpecError: vLLM 0.33 lets a
      json_schema response_format silently replace the calls' schema and refuses a json_object
      one beside it (older vLLM let the tools win). maskd's options
      (whitespace, disable_any_whitespace, reasoning, max_whitespace) apply to the calls; the
      body's other keys (messages, model...) are not maskd's and are left alone. With
      ``tool_call_format`` (a model's format, such as ``"qwen_3_coder"``): the calls in that
      model's own tags instead, a structural tag (``maskd.tool_specs.tool_call_tag``; what vLLM
      builds for a tool parser with that format).

    Exactly one constraint must be named; a second one, an unknown key, or an option maskd cannot
    honour is a SpecError that says so, never a silent "any JSON".
    """
    if isinstance(request, GrammarSpec):
        return request
    if isinstance(request, type) and hasattr(request, "model_json_schema"):
        return GrammarSpec.create("json_schema", request.model_json_schema())
    if not isinstance(request, Mapping):
        request = _fields_of(request)
    if any(request.get(k) is not None for k in _TOOL_KEYS):
        return _from_tool_request(request)
    wrappers = [k for k in _WRAPPERS if request.get(k) is not None]
    if wrappers:
        rest = sorted(k for k, v in request.items() if v is not None and k not in _WRAPPERS)
        if len(wrappers) > 1 or any(k in _CONSTRAINTS for k in rest):
            raise SpecError(f"the request names its constraint twice ({wrappers + rest}); send one")
        return spec_from_request(request[wrappers[0]])
    if "type" in request:
        return _from_response_format(request)
    return _from_keys(request)


def _fields_of(obj: Any) -> Mapping[str, Any]:
    """The constraint and option fields of an object such as vLLM's StructuredOutputsParams."""
    # Methods are no fields (a pydantic request object has a .json() method, not a JSON schema).
    fields = {n: getattr(obj, n) for n in (*_CONSTRAINTS, *_OPTIONS, *_WRAPPERS, *_TOOL_KEYS) if hasattr(obj, n)}
    fields = {n: v for n, v in fields.items() if not callable(v)}
    if not fields:
        raise SpecError(f"a grammar spec is a dict such as {{'regex': '[0-9]+'}}, a pydantic model class or a "
                        f"structured-outputs object, not {type(obj).__name__}")
    return fields


def _from_tool_request(request: Mapping[str, Any]) -> GrammarSpec | None:
    from maskd.tool_specs import ToolCallParts, tool_call_output, tool_call_tag  # maskd.tool_specs imports this module

    keys = (request.get("tools"), request.get("tool_choice"), request.get("parallel_tool_calls"))
    model = request.get("tool_call_format")
    schema = tool_call_output(*keys) if model is None else tool_call_tag(*keys, model)
    rest = {k: v for k, v in request.items() if k not in _TOOL_KEYS and v is not None}
    others = sorted(k for k in rest if k in _CONSTRAINTS or k in _WRAPPERS)
    if schema is None:    # tool_choice "auto"/"none", or no tools: the body's other constraint, if any
        return spec_from_request(rest) if others else None
    if others:
        raise SpecError(f"tool_choice {request.get('tool_choice')!r} makes the output tool calls and {others} "
                        "constrains it too; send one (vLLM would silently drop one of them)")
    if rest.get("disable_additional_properties"):
        raise SpecError("disable_additional_properties does not apply to tool calls (vLLM drops it for them "
                        "too); close the parameters schemas themselves with additionalProperties false")
    options = {k: rest[k] for k in _OPTIONS if k in rest}
    if model is not None:                          # the model's own tags around each call
        return _from_keys({"structural_tag": schema, **options})
    if not isinstance(schema, ToolCallParts):      # a named function: its parameters schema
        return _from_keys({"json_schema": schema, **options})
    # The call array as its parts: its text is assembled from them, and it travels as them.
    spec = _from_keys({"json_schema": True, **options})
    return dataclasses.replace(spec, text=schema.schema_text(), parts=schema)


def _from_response_format(fmt: Mapping[str, Any]) -> GrammarSpec | None:
    kind = fmt.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise SpecError(f"response_format type {kind!r} is not one of {', '.join(_RESPONSE_FORMAT_TYPES)}")
    rest = {k: v for k, v in fmt.items() if k != "type"}
    if kind == "text":
        if rest:
            raise SpecError(f"response_format type 'text' takes no other keys, got {sorted(rest)}")
        return None
    if kind == "json_object":
        if rest:
            raise SpecError(f"response_format type 'json_object' takes no other keys, got {sorted(rest)}")
        return GrammarSpec.create("json_schema", {"type": "object"})
    if kind == "structural_tag":
        return GrammarSpec.create("structural_tag", dict(fmt))
    inner, schema = rest.pop("json_schema", None), rest.pop("schema", None)
    if rest:
        raise SpecError(f"response_format type 'json_schema' has unknown keys {sorted(rest)}")
    if (inner is None) == (schema is None):
        raise SpecError("response_format type 'json_schema' needs exactly one of json_schema "
                        "({'name', 'schema', 'strict'}) or schema")
    if inner is None:
        return GrammarSpec.create("json_schema", schema)
    if not isinstance(inner, Mapping) or "schema" not in inner:
        raise SpecError("response_format.json_schema is OpenAI's {'name', 'schema', 'strict'} object; "
                        "it has no 'schema', and a missing schema would allow any JSON")
    return GrammarSpec.create("json_schema", dict(inner))


def _from_keys(request: Mapping[str, Any]) -> GrammarSpec:
    unknown = sorted(k for k in request if k not in _CONSTRAINTS and k not in _OPTIONS)
    if unknown:
        raise SpecError(f"unknown grammar spec keys {unknown}; constraints are {', '.join(_CONSTRAINTS)} "
                        f"and options {', '.join(_OPTIONS)}")
    named = [k for k in _CONSTRAINTS if request.get(k) is not None]
    if len(named) != 1:
        raise SpecError(f"a grammar spec names exactly one constraint of {', '.join(_CONSTRAINTS)}; got {named}")
    name = named[0]
    kind, source = _CONSTRAINTS[name], request[name]
    if request.get("whitespace_pattern") is not None:
        raise SpecError("whitespace_pattern is not supported by maskd; use whitespace 'compact' or 'flexible'")
    whitespace = request.get("whitespace")
    if request.get("disable_any_whitespace"):
        if whitespace not in (None, "compact"):
            raise SpecError(f"disable_any_whitespace contradicts whitespace={whitespace!r}")
        whitespace = "compact"
    if kind == "json_object":
        if source is not True:
            raise SpecError(f"json_object is true (any JSON object) or absent, not {source!r}")
        kind, source = "json_schema", {"type": "object"}
    if kind == TEMPLATE:
        return _from_template(source, request)
    if request.get("disable_additional_properties"):
        if kind != "json_schema":
            raise SpecError("disable_additional_properties applies to JSON schemas only")
        text = canonical_text(kind, source)
        source = _closed_objects(json.loads(text))
    reasoning = request.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str) and (
            not isinstance(reasoning, (list, tuple)) or len(reasoning) != 2):
        raise SpecError("reasoning is a [start, end] pair such as ['<think>', '</think>'], "
                        "or the end marker alone")
    max_whitespace = request.get("max_whitespace")
    return GrammarSpec.create(kind, source, whitespace=whitespace or "flexible",
                              reasoning=reasoning if isinstance(reasoning, str) else
                              (tuple(reasoning) if reasoning else None),
                              max_whitespace=DEFAULT_MAX_WHITESPACE if max_whitespace is None else max_whitespace)


def _from_template(source: Any, request: Mapping[str, Any]) -> GrammarSpec:
    from maskd.template_specs import template_parts  # here: maskd.template_specs imports this module

    if request.get("disable_additional_properties"):
        raise SpecError("disable_additional_properties does not apply to a template; close its objects "
                        "(and its arguments') with additionalProperties false")
    if not isinstance(source, Mapping) or set(source) != {"schema", "arguments"}:
        raise SpecError("template is {'schema': <a JSON schema with holes {'$hole': NAME}>, "
                        f"'arguments': {{NAME: <a JSON schema of an object>}}}}; got {_keys_of(source)}")
    parts = template_parts(source["schema"], source["arguments"])
    spec = _from_keys({"json_schema": True, **{k: v for k, v in request.items() if k in _OPTIONS}})
    return dataclasses.replace(spec, text=parts.schema_text(), parts=parts)


def _keys_of(value: Any) -> str:
    return f"keys {sorted(map(str, value))}" if isinstance(value, Mapping) else type(value).__name__


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def _closed_objects(node: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without additionalProperties
    gets ``"additionalProperties": false`` (walking the subschema keywords only)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            sub = out[key]
            out[key] = [_closed_objects(x) for x in sub] if isinstance(sub, list) else _closed_objects(sub)
    types = out.get("type")
    if (types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
