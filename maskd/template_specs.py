"""A JSON schema template with named holes and the arguments that fill them (issue 19; WGrammar's
structure factory: a static part compiled once, dynamic arguments bound per request).

A template is a JSON schema in which some object-valued places are holes, ``{"$hole": "<name>"}``;
a request sends the template and, for each hole, an argument: a JSON schema of an object. The
grammar is the template's schema with each hole replaced by its argument (``schema_text``, the
grammar a server compiles whole where it does not compose), and a server that composes compiles
it from parts: the template once, its holes standing for any object (the router, kept per
template), and each argument once, by its content, as the same piece a tool's parameters are
(shared with tool-call arrays, across requests and, through the cluster's store, replicas).

Holes sit where the composition is exact: under ``properties`` and ``items`` only, the schemas on
the way from the root to a hole using only keywords that do not constrain the hole's value
(``_PATH_KEYWORDS``); arguments are schemas of ``"type": "object"`` without ``$ref`` (a pointer into the argument
would land elsewhere once it sits inside the template). Anything else is a SpecError that says so.

Import-light like ``maskd.specs``: the client builds the same specs.
"""
from __future__ import annotations

import collections
import hashlib
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from maskd.specs import SpecError, json_depth, read_json
from maskd.tool_specs import _PIECE_TEXTS, _compact, _text_sha256

__all__ = ["HOLE", "TemplateParts", "template_parts", "template_parts_from_plain", "template_parts_from_wire"]

#: The key that marks a hole: ``{"$hole": "<name>"}`` and nothing else in that object.
HOLE = "$hole"
#: Keywords a schema on the way from the root to a hole may have: none of them constrains the
#: values under ``properties`` or ``items`` (they count keys or items, or describe).
_PATH_KEYWORDS = frozenset(("type", "properties", "required", "additionalProperties", "items", "minItems",
                            "maxItems", "minProperties", "maxProperties", "title", "description", "$comment"))
# Keywords whose values are JSON instances, not schemas: a "$hole" key inside them is data.
_INSTANCE_KEYWORDS = frozenset(("const", "enum", "default", "examples"))
_ANY_OBJECT_TEXT = '{"type":"object"}'
# What stands for a hole while the template's text is written: a string no JSON text of a schema
# holds (NUL bytes), found again in the text and cut there. A template whose text holds it anyway
# is refused.
_MARK = "\u0000maskd-hole\u0000"
_ITEM = None    # a hole path's step into an array's items (property names are strings)


@dataclass(frozen=True)
class _Layout:
    """What a template's text is made of: where each hole sits (a path of property names, None for
    an array's items), the text between its holes and their names in the text's order (the
    filled-in schema is that text with the arguments' between), the template's nesting depth and
    each hole's (the depth of its ``{"$hole": ...}`` object)."""
    paths: tuple[tuple[tuple[str | None, ...], str], ...]
    between: tuple[str, ...]
    order: tuple[str, ...]
    depth: int
    hole_depths: tuple[tuple[str, int], ...]

    def join(self, texts: Mapping[str, str]) -> str:
        out = [self.between[0]]
        for name, after in zip(self.order, self.between[1:]):
            out += (texts[name], after)
        return "".join(out)


@dataclass(frozen=True)
class TemplateParts:
    """A template and its arguments: the template's compact JSON text (holes included), the holes'
    names (sorted) and each one's argument (compact JSON text of an object schema, and its depth)."""
    template: str
    names: tuple[str, ...]
    params: tuple[str, ...]
    layout: _Layout = field(compare=False)
    depths: tuple[int, ...] = field(compare=False)

    @property
    def paths(self) -> tuple[tuple[tuple[str | None, ...], str], ...]:
        """Where each hole sits: its path of property names (None: an array's items), its name."""
        return self.layout.paths

    @property
    def pieces(self) -> tuple[str, ...]:
        """Each hole's argument, the grammar a server compiles once per argument."""
        return self.params

    def sha256(self) -> str:
        """A sha256 of the template's text and each argument's (each hashed once per text)."""
        digest = self.__dict__.get("_sha256")
        if digest is None:
            h = hashlib.sha256(b"template\0" + _text_sha256(self.template))
            for name, params in zip(self.names, self.params):
                h.update(b"\0" + json.dumps(name).encode() + b"\0" + _text_sha256(params))
            digest = self.__dict__["_sha256"] = h.hexdigest()
        return digest

    def router_key(self) -> tuple:
        """What the router depends on: the template alone (its holes stand for any object)."""
        return ("template", _text_sha256(self.template))

    def schema_text(self) -> str:
        """The template with each hole replaced by its argument: the grammar's JSON schema."""
        text = self.__dict__.get("_text")
        if text is None:
            text = self.__dict__["_text"] = self.layout.join(dict(zip(self.names, self.params)))
        return text

    def router_schema(self) -> dict[str, Any]:
        """The template with each hole any object: its rows are the grammar's outside the holes."""
        return json.loads(self.layout.join(dict.fromkeys(self.names, _ANY_OBJECT_TEXT)))

    def nesting(self) -> int:
        """The nesting depth of the grammar's schema (``maskd.specs.json_depth`` of its JSON)."""
        arguments = dict(zip(self.names, self.depths))
        return max(self.layout.depth, *(d - 1 + arguments[n] for n, d in self.layout.hole_depths))

    # -- the forms it travels in -------------------------------------------------------------------
    def write_proto(self, msg: Any) -> None:
        """Fills a GrammarSpec message's ``template`` (contract revision 7)."""
        msg.template.schema = self.template
        for name, params in zip(self.names, self.params):
            msg.template.arguments[name] = params

    def to_plain(self) -> dict[str, Any]:
        return {"template": {"schema": self.template, "arguments": dict(zip(self.names, self.params))}}


def _find_holes(node: Any, path: tuple, found: list, where: str, level: int = 1) -> bool:
    """Appends (path, name, depth) for each hole under ``node`` (at nesting ``level``); True where
    there is one. A hole anywhere but under ``properties`` and ``items``, or under a keyword that
    would constrain it, is refused."""
    if not isinstance(node, dict):
        if isinstance(node, list):
            for x in node:
                _no_hole(x, where)
        return False
    if HOLE in node:
        name = node[HOLE]
        if set(node) != {HOLE}:
            raise SpecError(f"{where}: a hole is {{\"$hole\": NAME}} and nothing else; this one has "
                            f"{sorted(k for k in node if k != HOLE)} beside it")
        if not isinstance(name, str) or not name:
            raise SpecError(f"{where}: a hole's name is a non-empty string, not {name!r}")
        if not path:
            raise SpecError("the template is a hole itself: send its argument as a json_schema instead")
        found.append((path, name, level))
        return True
    below = False
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            for prop, sub in value.items():
                below |= _find_holes(sub, path + (prop,), found, f"{where}.properties[{prop!r}]", level + 2)
        elif key == "items" and isinstance(value, dict):
            below |= _find_holes(value, path + (_ITEM,), found, f"{where}.items", level + 1)
        elif key not in _INSTANCE_KEYWORDS:
            _no_hole(value, f"{where}.{key}")
    if below:
        other = sorted(k for k in node if k not in _PATH_KEYWORDS)
        if other:
            raise SpecError(f"{where} has {other} on the way to a hole: a hole sits where nothing but its "
                            f"argument constrains its value (the keywords allowed there: "
                            f"{', '.join(sorted(_PATH_KEYWORDS))})")
    return below


def _no_hole(node: Any, where: str) -> None:
    """Refuses a hole under ``node`` (a keyword a hole cannot sit under)."""
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if HOLE in x:
                raise SpecError(f"{where}: a hole sits under 'properties' or 'items' only, not here")
            stack.extend(v for k, v in x.items() if k not in _INSTANCE_KEYWORDS)
        elif isinstance(x, list):
            stack.extend(x)


def _argument(value: Any, where: str) -> tuple[str, int]:
    """An argument's canonical text and depth, checked: a JSON schema of an object, without $ref."""
    if isinstance(value, (str, bytes)):
        text, depth = _PIECE_TEXTS.get(value if isinstance(value, str) else value.decode(), where)
    elif isinstance(value, Mapping):
        try:
            text = _compact(dict(value))
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{where} is not JSON: {exc}") from None
        except RecursionError:
            raise SpecError(f"{where} is nested too deeply to write as JSON") from None
        text, depth = _PIECE_TEXTS.get(text, where)
    else:
        raise SpecError(f"{where} is a JSON schema of an object, not {type(value).__name__}")
    if '"$ref"' in text:
        raise SpecError(f"{where} has a $ref: a pointer into the argument would land elsewhere once it sits in "
                        "the template; write the argument out")
    declared = json.loads(text).get("type") if '"type"' in text else None
    if declared != "object":
        raise SpecError(f"{where} has type {declared!r}: a hole holds a JSON object, so its argument says "
                        "\"type\": \"object\"")
    return text, depth


def _layout(source: dict, text: str, holes: list) -> _Layout:
    """The layout of a template (its schema, its compact text, its holes as found)."""
    mark = _compact(_MARK)
    if mark in text:
        raise SpecError("template.schema holds the string maskd marks its holes with while it reads them")
    marked = _compact(_marked(source, {path for path, _, _ in holes}))
    between = tuple(marked.split(mark))
    # The holes in the text's order: the order they were found in (the writer writes keys in their
    # order, depth first, as _find_holes reads them).
    assert len(between) == len(holes) + 1
    return _Layout(tuple((path, name) for path, name, _ in holes), between, tuple(name for _, name, _ in holes),
                   json_depth(source), tuple((name, depth) for _, name, depth in holes))


def _marked(node: Any, paths: set, path: tuple = ()) -> Any:
    """``node`` with the holes at ``paths`` below ``path`` replaced by the mark (the rest shared)."""
    if path in paths:
        return _MARK
    if not any(len(p) > len(path) and p[:len(path)] == path for p in paths):
        return node
    out = dict(node)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _marked(v, paths, path + (k,)) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _marked(out["items"], paths, path + (_ITEM,))
    return out


class _Templates:
    """Templates read once: canonical text and holes by the text that came (a bounded memo: the
    same template comes with every request)."""

    KEPT = 256

    def __init__(self) -> None:
        self._items: collections.OrderedDict[str, tuple[str, _Layout]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, source: Any) -> tuple[str, _Layout]:
        key = source if isinstance(source, str) else None
        if key is not None:
            with self._lock:
                found = self._items.get(key)
                if found is not None:
                    self._items.move_to_end(key)
                    return found
        if isinstance(source, (str, bytes)):
            source = read_json(source, "template.schema")
        if not isinstance(source, Mapping):
            raise SpecError(f"template.schema is a JSON schema object with holes, not {type(source).__name__}")
        holes: list = []
        try:
            _find_holes(dict(source), (), holes, "template.schema")
            text = _compact(dict(source))
            layout = _layout(dict(source), text, holes)
        except RecursionError:
            raise SpecError("template.schema is nested too deeply") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, SpecError):
                raise
            raise SpecError(f"template.schema is not JSON: {exc}") from None
        if not holes:
            raise SpecError("template.schema has no hole ({\"$hole\": NAME} under properties or items): "
                            "send it as a json_schema")
        found = (text, layout)
        if key is not None:
            with self._lock:
                self._items[key] = found
                while len(self._items) > self.KEPT:
                    self._items.popitem(last=False)
        return found


_TEMPLATES = _Templates()


def template_parts(template: Any, arguments: Any) -> TemplateParts:
    """The parts of a template (a schema with holes: a dict or its JSON text) and its arguments (a
    mapping of each hole's name to an object schema: a dict or its JSON text), checked."""
    text, layout = _TEMPLATES.get(template)
    paths = layout.paths
    if not isinstance(arguments, Mapping):
        raise SpecError(f"template.arguments maps each hole's name to a JSON schema, not {type(arguments).__name__}")
    wanted = {name for _, name in paths}
    missing, extra = sorted(wanted - set(arguments)), sorted(set(arguments) - wanted)
    if missing:
        raise SpecError(f"template.arguments has no argument for the holes {missing}")
    if extra:
        raise SpecError(f"template.arguments names {extra}, which the template has no hole for "
                        f"(its holes: {sorted(wanted)})")
    names = tuple(sorted(wanted))
    checked = [_argument(arguments[n], f"template.arguments[{n!r}]") for n in names]
    return TemplateParts(text, names, tuple(t for t, _ in checked), layout, tuple(d for _, d in checked))


_WIRE_KEPT = 256
_WIRE: collections.OrderedDict[bytes, TemplateParts] = collections.OrderedDict()
_WIRE_LOCK = threading.Lock()


def template_parts_from_wire(msg: Any) -> TemplateParts:
    """The parts a ``Template`` message carries, checked; the same message again is looked up."""
    key = msg.SerializeToString(deterministic=True)
    with _WIRE_LOCK:
        found = _WIRE.get(key)
        if found is not None:
            _WIRE.move_to_end(key)
            return found
    found = template_parts(msg.schema, dict(msg.arguments))
    with _WIRE_LOCK:
        _WIRE[key] = found
        while len(_WIRE) > _WIRE_KEPT:
            _WIRE.popitem(last=False)
    return found


def template_parts_from_plain(plain: Any) -> TemplateParts:
    """The parts ``TemplateParts.to_plain`` wrote (checked again: cheap, and memoized)."""
    if not isinstance(plain, Mapping) or set(plain) != {"schema", "arguments"}:
        raise SpecError(f"a template is {{'schema': ..., 'arguments': {{...}}}}, not {plain!r:.80}")
    return template_parts(plain["schema"], plain["arguments"])
