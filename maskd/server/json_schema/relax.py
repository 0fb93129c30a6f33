"""Complete JSON-schema mode: the closest schema the grammar engine can enforce, for one it refuses.

Every step here widens the set of documents the grammar allows (it drops or loosens constraints,
never adds one), so a document that satisfies the original schema still satisfies the relaxed
one; what the relaxation lets through is caught by the exact check of maskd.server.json_schema.validation,
which holds the original schema. The steps, in the order they are tried:

1. llguidance's own ``lenient`` option: keywords it cannot enforce (``not``, ``if/then/else``,
   ``dependencies``, ``uniqueItems``, ``contains``, ``propertyNames``, unknown ``format``) are
   ignored, ``oneOf`` becomes ``anyOf``. ``min/maxProperties`` beside optional properties are
   dropped first: lenient would keep them in a form that rejects every object.
2. Then, for what llguidance still refuses, a rewrite chosen by its message (each tried once):
   regexes it cannot parse are dropped (``pattern``; a ``patternProperties`` entry is folded into
   ``additionalProperties``); overlapping ``patternProperties`` are merged into one alternation
   whose schema is the ``anyOf`` of theirs; number bounds it cannot turn into a regex are
   dropped; siblings of a recursive ``$ref`` are dropped; an ``allOf`` whose intersection is too
   deep keeps its first member, then none.

A schema that still does not compile is refused with llguidance's message.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

# Keywords whose value is one schema / a list of schemas / a map of name -> schema.
_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties", "contentSchema", "items")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
# Siblings of "$ref" that are not constraints on the instance.
_REF_KEEP = frozenset({"$ref", "$defs", "definitions", "$id", "id", "$schema", "$anchor", "$comment", "title",
                       "description", "examples", "default"})
# Bounds beyond this are dropped when llguidance cannot build a regex for the range.
_HUGE_BOUND = 1e15
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

#: Keywords llguidance's lenient option may drop or loosen.
LENIENT_KEYWORDS = frozenset({"not", "oneOf", "if", "then", "else", "dependencies", "dependentRequired",
                              "dependentSchemas", "uniqueItems", "contains", "minContains", "maxContains",
                              "propertyNames", "minProperties", "maxProperties", "format",
                              "unevaluatedItems", "unevaluatedProperties"})


class RelaxError(ValueError):
    """Even the relaxed schema does not compile; the message says why."""


@dataclasses.dataclass(frozen=True)
class Relaxation:
    schema: Any                 # what the grammar enforces: a superset of the original's instances
    steps: tuple[str, ...]      # what was relaxed, in order (for logs and messages)
    #: Keywords the grammar may not enforce: a subschema holding none of them is enforced whole
    #: (validation uses this to pick the sub-documents worth checking early).
    keywords: frozenset[str] = LENIENT_KEYWORDS

    def describe(self) -> str:
        return ", ".join(self.steps)


# (schema, lenient) -> None when it compiles, else the engine's message
TryCompile = Callable[[Any, bool], "str | None"]
# regex -> whether the engine can build it
TryRegex = Callable[[str], bool]


def relax(schema: Any, try_compile: TryCompile, try_regex: TryRegex, *, max_rounds: int = 8) -> Relaxation:
    """The relaxed schema for one the engine refused (RelaxError when even that fails): with
    properties in any order where the engine can build that, else in the schema's order."""
    if not isinstance(schema, dict):
        raise RelaxError("only an object schema can be relaxed")
    ordered = unordered_constants(schema, try_regex)
    for _ in range(2):   # a written-out intersection may meet a reference in turn (one more round)
        ordered = merge_object_intersections(inline_intersected_refs(ordered, try_regex), try_regex)
    ordered = any_key_order(ordered, try_regex)
    if ordered != schema:
        try:
            found = _relax(ordered, schema, try_compile, try_regex, max_rounds)
            return dataclasses.replace(found, steps=(found.steps[0], _ANY_ORDER, *found.steps[1:]),
                                       keywords=found.keywords | _ORDER_FREE_WORDS)
        except RelaxError:
            pass
    return _relax(schema, schema, try_compile, try_regex, max_rounds)


def _relax(start: Any, schema: Any, try_compile: TryCompile, try_regex: TryRegex, max_rounds: int) -> Relaxation:
    steps = ["lenient: unenforceable keywords left to the validator, oneOf as anyOf"]
    keywords = set(LENIENT_KEYWORDS)
    current = drop_property_counts(start, try_regex)
    if current != start:
        steps.append("min/maxProperties beside optional properties left to the validator")
    error = try_compile(current, True)
    tried: set[str] = set()
    for _ in range(max_rounds):
        if error is None:
            return Relaxation(current, tuple(steps), frozenset(keywords))
        rewrite = _pick(error, tried)
        if rewrite is None:
            raise RelaxError(error)
        name, fn, what, words = rewrite
        tried.add(name)
        relaxed = fn(copy.deepcopy(current), try_regex)
        if relaxed == current:
            continue
        steps.append(what)
        keywords |= words
        current = relaxed
        error = try_compile(current, True)
    if error is None:
        return Relaxation(current, tuple(steps), frozenset(keywords))
    raise RelaxError(error)


def _pick(error: str, tried: set[str]):
    low = error.lower()
    cycle = _CYCLE.search(error)
    if cycle is not None and f"cycle {cycle.group(1)}" not in tried:   # one rewrite per reference named
        target = cycle.group(1)
        return (f"cycle {target}", lambda schema, try_regex: open_cycles(schema, target),
                f"references back to {target} inside it left to the validator", frozenset({"$ref"}))
    for name, needle, fn, what, words in _REWRITES:
        if name not in tried and any(n in low for n in needle):
            return name, fn, what, words
    return None


# llguidance: "circular references with sibling keys are not supported: json-schema:///#/definitions/x"
_CYCLE = re.compile(r"circular references[^:]*:\s*\S*?(#/[^\s,;)]+)")


def open_cycles(schema: Any, target: str) -> Any:
    """Every ``$ref`` to ``target`` found inside the target (directly or through other local
    references) becomes ``{}``: the recursion stops after one level and the validator checks the
    deeper documents, so llguidance need not build a cycle it cannot (a reference with siblings).
    A wider branch widens the grammar because the relaxed schema is compiled lenient: ``oneOf`` is
    read as ``anyOf`` and ``not`` is ignored."""
    if not target.startswith("#/"):
        return schema
    inside: set[tuple] = set()
    todo = [pointer_path(target[1:])]
    while todo:
        path = todo.pop()
        if path in inside:
            continue
        inside.add(path)
        for _, node in _walk(node_at(schema, path), path):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/") and ref != target:
                todo.append(pointer_path(ref[1:]))
    out = schema
    for path in inside:
        out = put_at(out, path, _unref(node_at(out, path), target))
    return out


def _unref(node: Any, target: str) -> Any:
    def fix(sub: dict) -> dict:
        if sub.get("$ref") == target:
            return {k: v for k, v in sub.items() if k != "$ref"}
        return sub
    return _map(node, fix)


# -- walking the subschemas of a schema ------------------------------------------------------------
def map_schemas(schema: Any, fn: Callable[[dict], dict]) -> Any:
    """A copy of ``schema`` with ``fn`` applied to every subschema object, innermost first. Schema
    positions are visited (never const/enum/default data), and the targets of local ``$ref``s
    wherever they are (``fn`` must be idempotent: a target may be visited twice)."""
    out = _map(schema, fn)
    for path in sorted(_local_refs(schema), key=len):
        out = _replace_at(out, path, fn)
    return out


def _local_refs(schema: Any) -> set[tuple[str, ...]]:
    """JSON pointer paths of every local "$ref" ("#/a/b") in the document."""
    found: set[tuple[str, ...]] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                found.add(pointer_path(ref[1:]))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _replace_at(doc: Any, path: tuple[str, ...], fn: Callable[[dict], dict]) -> Any:
    if not path:
        return _map(doc, fn)
    head, rest = path[0], path[1:]
    if isinstance(doc, dict) and head in doc:
        return {**doc, head: _replace_at(doc[head], rest, fn)}
    if isinstance(doc, list) and head.isdigit() and int(head) < len(doc):
        i = int(head)
        return [*doc[:i], _replace_at(doc[i], rest, fn), *doc[i + 1:]]
    return doc


def _map(schema: Any, fn: Callable[[dict], dict]) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _map(out[key], fn)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_map(s, fn) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: _map(v, fn) for k, v in out[key].items()}
    return fn(out)


def subschemas(schema: Any):
    """The direct subschemas of one schema object (for walks that do not rewrite)."""
    if not isinstance(schema, dict):
        return
    for key in _ONE:
        if isinstance(schema.get(key), (dict, bool)):
            yield schema[key]
    for key in _LIST:
        if isinstance(schema.get(key), list):
            yield from schema[key]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            yield from (v for v in schema[key].values() if isinstance(v, (dict, bool)))


# -- rewrites ---------------------------------------------------------------------------------------
def _fold_pattern_properties(node: dict, bad: list[str], merged: bool) -> dict:
    """Moves patternProperties entries into a widened ``additionalProperties`` (``bad`` keys) or
    merges them all into one alternation (``merged``)."""
    pp = node.get("patternProperties")
    if not isinstance(pp, dict):
        return node
    out = dict(node)
    if merged and len(pp) > 1:
        alternation = "|".join(f"(?:{p})" for p in pp)
        out["patternProperties"] = {alternation: {"anyOf": list(pp.values())}}
        return out
    if not bad:
        return out
    keep = {k: v for k, v in pp.items() if k not in bad}
    options = [pp[k] for k in bad]
    extra = node.get("additionalProperties", True)
    if extra is not False:
        options.append(extra)
    out["patternProperties"] = keep
    if not keep:
        del out["patternProperties"]
    out["additionalProperties"] = {"anyOf": options} if len(options) > 1 else options[0]
    return out


def drop_bad_regexes(schema: Any, try_regex: TryRegex) -> Any:
    def fix(node: dict) -> dict:
        if isinstance(node.get("pattern"), str) and not try_regex(node["pattern"]):
            node = {k: v for k, v in node.items() if k != "pattern"}
        pp = node.get("patternProperties")
        if isinstance(pp, dict):
            bad = [k for k in pp if not try_regex(k)]
            node = _fold_pattern_properties(node, bad, merged=False)
        return node
    return map_schemas(schema, fix)


def merge_pattern_properties(schema: Any, try_regex: TryRegex) -> Any:
    return map_schemas(schema, lambda node: _fold_pattern_properties(node, [], merged=True))


_ANY_ORDER = "properties in any order (required ones left to the validator)"
# What the grammar no longer enforces once keys are free: required keys (also those of the anyOf /
# oneOf / allOf members dropped with them), and const / enum objects.
_ORDER_FREE_WORDS = frozenset({"required", "enum", "const", "anyOf", "oneOf", "allOf"})
#: What the grammar leaves to the validator where an object takes its keys in any order.
ORDER_FREE_WORDS = _ORDER_FREE_WORDS
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _literal(name: str) -> str:
    """A regex matching exactly ``name`` (only regex metacharacters escaped)."""
    return "^" + "".join("\\" + c if c in _REGEX_META else c for c in name) + "$"


def any_key_order(schema: Any, try_regex: TryRegex) -> Any:
    """Every ``properties`` entry becomes an anchored literal ``patternProperties`` entry: llguidance
    fixes declared properties to the schema's order but takes pattern properties in any order, and a
    document may list its keys in any order. ``required`` goes with it (the engine would put required
    keys first): the validator checks it. Only objects that stand alone are rewritten: llguidance
    merges declared properties by name where schemas intersect (``allOf``, a branch beside the
    parent's own properties, ``$ref`` with siblings) but not pattern properties, so those keep
    their order; so does a node whose own patternProperties may match a declared name."""
    if not isinstance(schema, dict):
        return schema
    blocked = _intersected(schema)
    out = schema
    for path in sorted(_object_nodes(schema), key=len, reverse=True):   # deepest first: paths stay valid
        if path in blocked:
            continue
        rewritten = _free_order(node_at(out, path), try_regex)
        if rewritten is not None:
            out = put_at(out, path, rewritten)
    return out


def _free_order(node: dict, try_regex: TryRegex) -> dict | None:
    """One object's declared properties as anchored literal pattern properties (its combinators,
    which hold only ``required`` or conditions, go to the validator with ``required``), or None
    where its own patternProperties may match a declared name or the engine cannot build a literal."""
    props = node.get("properties")
    pp = node.get("patternProperties", {})
    if not isinstance(props, dict) or not isinstance(pp, dict) or (pp and not _names_outside(props, pp)):
        return None
    literals = {_literal(name): sub for name, sub in props.items()}
    if not all(try_regex(p) for p in literals):
        return None
    rewritten = {k: v for k, v in node.items()
                 if k not in ("properties", "required", "patternProperties", "allOf", "anyOf", "oneOf")}
    rewritten["patternProperties"] = {**literals, **pp}   # the combinators held "required" or conditions
    return rewritten


def _declares(member: Any) -> bool:
    return isinstance(member, dict) and isinstance(member.get("properties"), dict) and bool(member["properties"])


def free_all_of_order(schema: Any, try_regex: TryRegex) -> Any:
    """For a schema the engine compiles whole: an object whose properties come from several
    ``allOf`` members (or from its own ``properties`` and a member's) takes them in any order.
    llguidance merges the members' properties into one list, in the members' order, so
    ``{"b": 1, "a": "x"}`` was refused where member 1 declares ``a`` and member 2 ``b``. The
    members (an ``allOf`` inside a member spread out, ``_flat_all_of``; notes such as ``title``
    that differ do not stop it) are folded into the object exactly (``_meet``, as
    ``merge_object_intersections`` does; ``unevaluatedProperties`` beside them becomes
    ``additionalProperties`` where that is exact, ``_unevaluated_as_additional``)
    and its properties become literal pattern properties (``any_key_order``): ``required`` goes to
    the validator and to the rows (an object missing a required key is kept open). Only such
    objects change: keys in the schema's order stay the rule elsewhere; an object the engine
    intersects with another (an ``allOf`` member itself, the target of a ``$ref`` with siblings)
    and members holding anything else that concerns keys (references, pattern properties, unions
    of more than ``required``) stay as they are."""
    if not isinstance(schema, dict):
        return schema
    blocked = _intersected(schema)
    legacy = _legacy(schema)
    out = schema
    for path, node in sorted(_walk(schema), key=lambda pn: len(pn[0]), reverse=True):
        all_of = node.get("allOf")
        if path in blocked or not isinstance(all_of, list) \
                or _declares(node) + sum(map(_declares_some, _flat_all_of(all_of))) < 2:
            continue
        current = node_at(out, path)
        t = current.get("type")
        if "$ref" in current or "patternProperties" in current \
                or not (_object_typed(current) or (isinstance(t, list) and "object" in t)):
            continue
        folded = _fold_all_of(current, legacy)
        rewritten = _free_folded(folded, try_regex) if folded is not None else None
        if rewritten is not None:
            out = put_at(out, path, rewritten)
    return out


def _free_folded(folded: dict, try_regex: TryRegex) -> dict | None:
    """A folded object in any key order: alone (``_free_order``), or where a union of object
    fragments came with its members, written out as the ``anyOf`` of each branch met with the
    object, each in any order (``oneOf`` as ``anyOf``: the validator checks that one branch holds)."""
    unions = [k for k in _UNIONS if k in folded and not _required_only(folded[k])]
    if "allOf" in folded and not _required_only(folded["allOf"]):
        return None
    if not unions:
        return _free_order(folded, try_regex)
    if len(unions) > 1 or not all(_fragment(b) for b in folded[unions[0]]):
        return None
    own = _own(folded)
    meets = [_meet(own, b) for b in folded[unions[0]]]
    freed = [_free_order(m, try_regex) if m is not None else None for m in meets]
    if any(f is None for f in freed):
        return None
    base = {k: v for k, v in folded.items() if k not in _MEET_KEYS and k not in ("allOf", "anyOf", "oneOf")}
    return {**_objects_only(base, unions[0], folded[unions[0]]), "anyOf": freed}


def _objects_only(node: dict, key: str, branches: list) -> dict:
    """``node`` typed ``object`` where its ``oneOf`` of object fragments (``branches``) holds no
    other value: a value that is not an object passes every branch without a type (fragments
    constrain only objects), so it passes the ``oneOf`` only where exactly one branch has none. The
    grammar takes the branches as ``anyOf``, which would let such a value in where no continuation
    can pass (a root string where two untyped branches both hold)."""
    t = node.get("type")
    if key != "oneOf" or sum("type" not in b for b in branches) == 1 \
            or not (t is None or (isinstance(t, list) and "object" in t)):
        return node
    return {**node, "type": "object"}


def unordered_constants(schema: Any, try_regex: TryRegex) -> Any:
    """``const`` / ``enum`` objects in any key order: llguidance matches them as the text of one
    serialization, so ``{"b": 2, "a": 1}`` is refused where the schema says ``const: {"a": 1,
    "b": 2}``. Each object value becomes an object schema whose keys are literal patterns with
    their values as constants (nested objects alike; arrays and scalars stay constants); which
    keys must be there is left to the validator (and to the rows, that keep such an object open)."""
    def fix(node: dict) -> dict:
        values = [node["const"]] if "const" in node else node.get("enum")
        if not isinstance(values, list) or not any(isinstance(v, dict) for v in values):
            return node
        if not all(try_regex(_literal(k)) for v in values if isinstance(v, dict) for k in _keys_in(v)):
            return node
        options = [_unordered(v) for v in values if isinstance(v, dict)]
        rest = [v for v in values if not isinstance(v, dict)]
        if rest:
            options.append({"enum": rest})
        out = {k: v for k, v in node.items() if k not in ("const", "enum")}
        if "anyOf" in out:   # keep the node's own anyOf: the constants join as an allOf member
            out["allOf"] = [*out.get("allOf", []), {"anyOf": options}]
        else:
            out["anyOf"] = options
        return out
    return map_schemas(schema, fix)


def _keys_in(value: Any):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _keys_in(v)


def _unordered(value: Any) -> Any:
    if not isinstance(value, dict):
        return {"const": value}
    return {"type": "object", "additionalProperties": False,
            "patternProperties": {_literal(k): _unordered(v) for k, v in value.items()}}


# A reference's target is copied where it is intersected only up to this size, and a schema grows by
# at most the second figure in all (JSON text, bytes); past that, references stay as they are.
_INLINE_BYTES = 1 << 15
_INLINE_BUDGET = 1 << 18
# What a copied target leaves behind: its definitions stay where they are (the copy's references
# still point there), and it takes no identifier or dialect of its own.
_NOT_COPIED = frozenset({"definitions", "$defs", "$id", "id", "$schema", "$anchor", "$dynamicAnchor",
                         "$recursiveAnchor", "$vocabulary"})


def inline_intersected_refs(schema: Any, try_regex: TryRegex) -> Any:
    """An ``allOf`` member that is only a local reference (``{"$ref": "#/definitions/base"}``, the
    usual way to extend a schema), and an ``anyOf`` / ``oneOf`` branch that is one beside an object's
    own properties, become a copy of the target, so the intersection can be written out
    (``merge_object_intersections``) and the target, intersected by reference nowhere, takes its keys
    in any order elsewhere. Exact: a reference means its target; the copy keeps the target's own
    references, which still resolve against the root (no identifier inside it changes their base:
    such targets, and schemas with dynamic references, stay references)."""
    if not isinstance(schema, dict) or _has_dynamic_refs(schema):
        return schema
    budget = [_INLINE_BUDGET]

    def target_of(member: Any) -> dict | None:
        seen: set[str] = set()
        while isinstance(member, dict) and len(member) == 1:   # a union of one branch: that branch
            branches = member.get("anyOf", member.get("oneOf"))
            if not (isinstance(branches, list) and len(branches) == 1):
                break
            member = branches[0]
        while isinstance(member, dict) and "$ref" in member and set(member) <= _REF_KEEP:
            ref = member["$ref"]
            if not isinstance(ref, str) or ref in seen or not (ref == "#" or ref.startswith("#/")):
                return None
            seen.add(ref)
            member = node_at(schema, pointer_path(ref[1:]))
        if not isinstance(member, dict) or not seen:
            return None
        copied = {k: v for k, v in member.items() if k not in _NOT_COPIED}
        own_id = member is not schema and any(isinstance(member.get(k), str) for k in ("$id", "id"))
        if own_id or any(isinstance(node.get(k), str) for _, node in _walk(copied) for k in ("$id", "id")):
            return None   # a resource of its own: its references would mean something else in a copy
        size = len(canonical(copied))
        if size > _INLINE_BYTES or size > budget[0]:
            return None
        budget[0] -= size
        return copy.deepcopy(copied)

    def fix(node: dict) -> dict:
        out = node
        for key in ("allOf", "anyOf", "oneOf"):
            members = node.get(key)
            if not isinstance(members, list) or (key != "allOf" and not any(k in node for k in _OBJECT_WORDS)):
                continue
            copies = [target_of(m) for m in members]
            if any(c is not None for c in copies):
                out = {**out, key: [m if c is None else c for m, c in zip(members, copies)]}
        return out
    return _map(schema, fix)


def _has_dynamic_refs(schema: Any) -> bool:
    text = canonical(schema)
    return '"$dynamicRef"' in text or '"$recursiveRef"' in text


def merge_object_intersections(schema: Any, try_regex: TryRegex) -> Any:
    """Where an object's declared properties meet those of ``allOf`` members or of ``anyOf`` /
    ``oneOf`` branches, the intersection is written out (``P and (B1 or B2)`` as ``(P and B1) or
    (P and B2)``; ``allOf`` folded into the object), so that each object stands alone and can take
    its keys in any order. The meet is exact for what JSON Schema says of objects: a name declared
    on one side only meets the other side's ``additionalProperties``, names meet as ``allOf``,
    ``required`` is the union. Members holding anything else that concerns keys (references,
    combinators, pattern properties, a non-object type) are left as they are."""
    legacy = _legacy(schema)

    def fix(node: dict) -> dict:
        t = node.get("type")
        if "$ref" in node or "patternProperties" in node or not (_object_typed(node) or
                                                                 (isinstance(t, list) and "object" in t)):
            return node
        if isinstance(node.get("allOf"), list) and node["allOf"]:
            folded = _fold_all_of(node, legacy)
            if folded is None:
                return node
            node = folded
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if not (isinstance(branches, list) and branches and isinstance(node.get("properties"), dict)
                    and all(_fragment(b) for b in branches)) or _required_only(branches):
                # branches that say only which keys must be there stay as they are: the object
                # takes its keys in any order without them (any_key_order), and an allOf holding it
                # can still be folded
                continue
            own = _own(node)
            meets = [_meet(own, b) for b in branches]
            if any(m is None for m in meets):
                continue
            node = {**_objects_only({k: v for k, v in node.items() if k not in _MEET_KEYS}, key, branches),
                    key: meets}
        return node
    return map_schemas(schema, fix)


_MEET_KEYS = ("properties", "required", "additionalProperties")


def _object_typed(node: dict) -> bool:
    t = node.get("type")
    return t is None or t == "object"


def _fragment(b: Any) -> bool:
    """A member that says only what keys an object has (and what the validator checks anyway)."""
    return (isinstance(b, dict) and _object_typed(b) and "$ref" not in b
            and all(_required_only(b[k]) for k in ("allOf", "anyOf", "oneOf") if k in b)
            and "patternProperties" not in b and "unevaluatedProperties" not in b
            and isinstance(b.get("properties", {}), dict) and isinstance(b.get("required", []), list))


# Keywords through which a subschema beside ``unevaluatedProperties`` evaluates properties.
_IN_PLACE = ("allOf", "anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "dependencies", "$ref",
             "$dynamicRef", "$recursiveRef")


def _legacy(schema: Any) -> bool:
    """Whether a draft before 2019-09 is named anywhere (``unevaluatedProperties`` means nothing there)."""
    return "draft-0" in canonical(schema)


def _unevaluated_as_additional(node: dict, legacy: bool) -> dict:
    """An object whose ``allOf`` members were folded into it (``allOf`` + ``unevaluatedProperties:
    false``, the usual closed extension since draft 2019-09): with no subschema left beside it that
    evaluates properties, ``unevaluatedProperties`` means what ``additionalProperties`` means (exact),
    which the grammar enforces (the engine's lenient option ignores the other), so a key no member
    declares is refused where it is written, not only at the object's end."""
    if legacy or "unevaluatedProperties" not in node or "additionalProperties" in node \
            or any(k in node for k in _IN_PLACE):
        return node
    out = {k: v for k, v in node.items() if k != "unevaluatedProperties"}
    out["additionalProperties"] = node["unevaluatedProperties"]
    return out


# Keywords that say nothing of which instances pass (the validator holds the original schema).
_NOTES = frozenset({"title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                    "writeOnly"})


def _flat_all_of(members: list, depth: int = 0) -> list:
    """``allOf`` members with the ``allOf`` of a member spread out in its place: ``allOf: [{X,
    allOf: [A, B]}, C]`` is ``allOf: [X, A, B, C]`` (exact: an intersection of intersections), so
    members nested by a reference chain (``Dog`` is ``Pet`` and more, ``Pet`` is ``Animal`` and
    more) meet as one list."""
    out: list = []
    for m in members:
        if isinstance(m, dict) and isinstance(m.get("allOf"), list) and depth < 16:
            rest = {k: v for k, v in m.items() if k != "allOf"}
            out.extend([rest, *_flat_all_of(m["allOf"], depth + 1)] if rest else _flat_all_of(m["allOf"], depth + 1))
        else:
            out.append(m)
    return out


_UNIONS = ("anyOf", "oneOf")


def _union_member(member: Any) -> tuple[str, list] | None:
    """(``anyOf`` or ``oneOf``, its branches) for a member that is only a union of object fragments."""
    if not isinstance(member, dict):
        return None
    words = [k for k in member if k not in _NOTES]
    if len(words) != 1 or words[0] not in _UNIONS:
        return None
    branches = member[words[0]]
    if not (isinstance(branches, list) and branches and all(_fragment(b) for b in branches)):
        return None
    return words[0], branches


def _declares_some(member: Any) -> bool:
    """A member that declares properties itself or in one of its union's branches."""
    union = _union_member(member)
    return _declares(member) or (union is not None and any(map(_declares, union[1])))


def _fold_all_of(node: dict, legacy: bool) -> dict | None:
    """``node`` with its ``allOf`` members folded into it exactly, or None where one cannot be:
    members that say only what keys an object has meet (``_meet``; an ``allOf`` inside a member
    spread out first, ``_flat_all_of``); a member that is only a union of such (``allOf: [base,
    {"oneOf": [...]}]``) becomes the object's own union (one of each kind, where it has none), which
    the caller writes out branch by branch."""
    rest = {k: v for k, v in node.items() if k not in _MEET_KEYS and k != "allOf"}
    merged: dict | None = _own(node)
    for member in _flat_all_of(node["allOf"]):
        if _fragment(member):
            merged = _meet(merged, member) if merged is not None else None
            continue
        union = _union_member(member)
        if union is None or union[0] in rest:
            return None
        rest[union[0]] = union[1]
    if merged is None or any(k in merged and k not in node for k in _UNIONS if k in rest):
        return None   # a member's own union would stand where the lifted one does
    return _unevaluated_as_additional({**rest, **merged}, legacy)


def _own(node: dict) -> dict:
    return {k: node[k] for k in _MEET_KEYS if k in node}


def _and(a: Any, b: Any) -> Any:
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    return {"allOf": [a, b]}


def _meet(a: dict, b: dict) -> dict | None:
    """The exact intersection of two object fragments, or None where their other keywords clash."""
    pa, pb = a.get("properties", {}), b.get("properties", {})
    xa, xb = a.get("additionalProperties", True), b.get("additionalProperties", True)
    props = {name: _and(pa.get(name, xa), pb.get(name, xb)) for name in [*pa, *(n for n in pb if n not in pa)]}
    out = {k: v for k, v in a.items() if k not in _MEET_KEYS}
    for k, v in b.items():
        if k in _MEET_KEYS or (k in _NOTES and k in out):   # a note is no constraint: the first one stays
            continue
        if k in out and out[k] != v and k != "type":
            return None
        out[k] = v
    out["properties"] = props
    required = [*a.get("required", []), *(r for r in b.get("required", []) if r not in a.get("required", []))]
    if required:
        out["required"] = required
    extra = _and(xa, xb)
    if extra is not True:
        out["additionalProperties"] = extra
    return out


_COMBINATORS = ("allOf", "anyOf", "oneOf", "$ref")
_OBJECT_WORDS = ("properties", "patternProperties", "additionalProperties", "required")
# Siblings of a $ref that make llguidance intersect the target with them.
_INTERSECTING = frozenset({*_OBJECT_WORDS, "allOf", "anyOf", "oneOf", "unevaluatedProperties"})
# What a member may hold and still be dropped whole once its "required" goes to the validator: the
# relaxed grammar is compiled lenient, which ignores the conditional keywords (the validator checks).
_ANNOTATIONS = frozenset({"required", "title", "description", "$comment", "examples", "if", "then", "else", "not",
                          "dependencies", "dependentRequired", "dependentSchemas"})


def _walk(schema: Any, path: tuple = ()):
    """(path, node) of every subschema object, at schema positions only."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield from _walk(schema[key], (*path, key))
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from _walk(sub, (*path, key, str(i)))
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from _walk(sub, (*path, key, name))


def _object_nodes(schema: Any) -> list[tuple]:
    """Objects with declared properties that intersect with nothing, or only with members that hold
    nothing the grammar enforces but ``required`` ("one of these keys must be there", conditions)."""
    return [path for path, node in _walk(schema)
            if isinstance(node.get("properties"), dict) and node["properties"] and "$ref" not in node
            and all(_required_only(node.get(k)) for k in ("allOf", "anyOf", "oneOf") if k in node)]


def _required_only(branches: Any, depth: int = 0) -> bool:
    if not isinstance(branches, list) or depth > 16:
        return False
    for b in branches:
        if not isinstance(b, dict):
            return False
        for key, value in b.items():
            if key in ("allOf", "anyOf", "oneOf"):
                if not _required_only(value, depth + 1):
                    return False
            elif key not in _ANNOTATIONS:
                return False
    return True


def _intersected(schema: Any) -> set[tuple]:
    """Paths of subschemas llguidance intersects with another one holding object keywords."""
    blocked: set[tuple] = set()

    def block(path: tuple, depth: int = 0) -> None:
        if path in blocked or depth > 64:
            return
        blocked.add(path)
        node = node_at(schema, path)
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            block(pointer_path(ref[1:]), depth + 1)
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                for i in range(len(node[key])):
                    block((*path, key, str(i)), depth + 1)

    for path, node in _walk(schema):
        has_words = any(k in node for k in _OBJECT_WORDS)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and any(k in _INTERSECTING for k in node):
            block(pointer_path(ref[1:]))
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(key), list) and (key == "allOf" or has_words):
                for i in range(len(node[key])):
                    block((*path, key, str(i)))
    return blocked


def pointer_path(pointer: str) -> tuple[str, ...]:
    """The parts of a JSON pointer ("/a/b~1c", "" for the root), unescaped."""
    if not pointer:
        return ()
    return tuple(p.replace("~1", "/").replace("~0", "~") for p in pointer[1:].split("/"))


def node_at(doc: Any, path: tuple[str, ...]) -> Any:
    """The node at ``path`` in a JSON document, or None when there is none."""
    for part in path:
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            return None
    return doc


def put_at(doc: Any, path: tuple, value: Any) -> Any:
    """A copy of ``doc`` with the node at ``path`` replaced (copies along the path only)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(doc, dict):
        return {**doc, head: put_at(doc[head], rest, value)}
    i = int(head)
    return [*doc[:i], put_at(doc[i], rest, value), *doc[i + 1:]]


def _names_outside(props: dict, patterns: dict) -> bool:
    """Whether no declared name can match one of the patterns (checked with Python's regexes; a
    pattern Python cannot read counts as matching)."""
    for pattern in patterns:
        try:
            compiled = re.compile(pattern)
        except re.error:
            return False
        if any(compiled.search(name) for name in props):
            return False
    return True


def drop_property_counts(schema: Any, try_regex: TryRegex) -> Any:
    """min/maxProperties where some listed property is optional: llguidance enforces them only when
    every listed property is required, and its lenient option then rejects every object (narrower
    than the schema), so they go to the validator before lenient is tried."""
    def fix(node: dict) -> dict:
        props = node.get("properties")
        if not isinstance(props, dict) or not ("minProperties" in node or "maxProperties" in node):
            return node
        required = node.get("required")
        if isinstance(required, list) and all(k in required for k in props):
            return node
        return {k: v for k, v in node.items() if k not in ("minProperties", "maxProperties")}
    return map_schemas(schema, fix)


def drop_huge_bounds(schema: Any, try_regex: TryRegex) -> Any:
    def fix(node: dict) -> dict:
        return {k: v for k, v in node.items()
                if not (k in _BOUNDS and isinstance(v, (int, float)) and not isinstance(v, bool)
                        and abs(v) >= _HUGE_BOUND)}
    return map_schemas(schema, fix)


def drop_ref_siblings(schema: Any, try_regex: TryRegex) -> Any:
    def fix(node: dict) -> dict:
        if "$ref" in node:
            return {k: v for k, v in node.items() if k in _REF_KEEP}
        return node
    return map_schemas(schema, fix)


def first_of_all_of(schema: Any, try_regex: TryRegex) -> Any:
    def fix(node: dict) -> dict:
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return {**node, "allOf": node["allOf"][:1]}
        return node
    return map_schemas(schema, fix)


def without_all_of(schema: Any, try_regex: TryRegex) -> Any:
    return map_schemas(schema, lambda node: {k: v for k, v in node.items() if k != "allOf"})


_INTERSECTION = ("intersection", "are not disjoint", "sibling keys")
# name, message fragments (lower case), rewrite, what it did, keywords it may loosen
_REWRITES = (
    ("regex", ("regex parse error", "lookaround", "invalid regex", "regex syntax"), drop_bad_regexes,
     "regexes the grammar cannot parse left to the validator",
     frozenset({"pattern", "patternProperties", "additionalProperties"})),
    ("pattern_properties", ("are not disjoint",), merge_pattern_properties,
     "overlapping patternProperties merged", frozenset({"patternProperties"})),
    ("bounds", ("integer range", "float range", "number range"), drop_huge_bounds,
     "number bounds beyond 1e15 left to the validator", frozenset(_BOUNDS)),
    ("ref_siblings", ("sibling keys",), drop_ref_siblings, "siblings of $ref left to the validator",
     frozenset({"$ref"})),
    # Intersections the engine cannot build (too deep, overlapping patternProperties of several
    # members, recursive references with siblings): allOf keeps its first member, then none.
    ("all_of_first", _INTERSECTION, first_of_all_of, "allOf reduced to its first member", frozenset({"allOf"})),
    ("all_of_none", _INTERSECTION, without_all_of, "allOf left to the validator", frozenset({"allOf"})),
)


def canonical(schema: Any) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
