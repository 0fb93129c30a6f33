"""The exact JSON Schema check of complete mode: one validator per grammar, over the original schema.

The library is jsonschema-rs (``jsonschema_rs``), chosen by measurement on MaskBench-dev (see
docs/benchmarks.md, "JSON Schema validators"): with format assertion on it agreed with every
MaskBench verdict, builds a validator in 0.05 ms (p50) and checks an instance in 2 us (p50), and
knows drafts 4, 6, 7, 2019-09 and 2020-12 (detected from ``$schema``). It never fetches remote
references (``offline``); a schema it cannot build is refused with its message.

Early checks: a sub-document that is complete (an object member, an array item) is checked when
its subschema is pinned by its path alone (reached through ``properties``, ``items``,
``prefixItems``, ``additionalProperties``, ``allOf`` and local ``$ref``, never through a branch
such as ``anyOf``), so that every valid document has a value there that satisfies that subschema,
and when that subschema itself holds a keyword the relaxed grammar may not enforce. A failure
there means no continuation can pass: the sequence fails at once.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema_rs

from maskd.server.json_schema.formats import FORMAT_CHECKERS
from maskd.server.json_schema.numbers import BOUND_WORDS, NumberRule, inexact_integers, row_checked_numbers
from maskd.server.json_schema.relax import map_schemas, node_at, pointer_path, subschemas
from maskd.specs import json_depth

_LEGACY_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")
# Per oneOf / anyOf: the pointers of each branch still possible.
Unions = tuple[tuple[frozenset[str], ...], ...]


class ValidatorError(ValueError):
    """The validator cannot be built for this schema; the message is the validator's."""


def _message(exc: BaseException) -> str:
    msg = getattr(exc, "message", None) or str(exc)
    first = msg.strip().split("\n", 1)[0]
    return first if len(first) <= 500 else first[:500] + "..."


def _where(prefix: str, path) -> str:
    """A JSON pointer for messages: ``prefix`` (where the checked value sits) plus ``path``."""
    suffix = "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in (path or []))
    return (prefix + suffix) or "the document root"


def build(schema: Any):
    """A jsonschema-rs validator (draft 2020-12's formats asserted in every draft, see formats.py; no
    network), or ValidatorError."""
    try:
        return jsonschema_rs.validator_for(schema, formats=FORMAT_CHECKERS, validate_formats=True, offline=True)
    except (jsonschema_rs.ValidationError, ValueError, TypeError) as exc:
        raise ValidatorError(f"the JSON Schema validator cannot use this schema: {_message(exc)}") from exc
    except Exception as exc:   # a panic or a referencing error surfaces as another type
        raise ValidatorError(f"the JSON Schema validator cannot use this schema: "
                             f"{type(exc).__name__}: {_message(exc)}") from exc


def ecma_regex(pattern: str) -> str:
    """An ECMA-262 regex (JSON Schema's dialect) in the syntax of jsonschema-rs's engine: inside a
    character class, ``[`` is a literal in ECMA-262 but opens a nested class in Rust's regex, and
    ``&&`` / ``~~`` are set operations there; outside one, a lone ``]`` is a literal. Those are
    escaped."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if not in_class:
            in_class = c == "["
            out.append("\\]" if c == "]" else c)   # a lone "]" is a literal (ECMA-262 Annex B)
            if in_class and pattern[i + 1:i + 2] == "^":
                out.append("^")
                i += 1
        elif c == "]":
            in_class = False
            out.append(c)
        elif c == "[" or (c in "&~" and pattern[i + 1:i + 2] == c):
            out.append("\\" + c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _ecma_patterns(schema: Any) -> Any:
    def fix(node: dict) -> dict:
        out = dict(node)
        if isinstance(node.get("pattern"), str):
            out["pattern"] = ecma_regex(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            out["patternProperties"] = {ecma_regex(k): v for k, v in node["patternProperties"].items()}
        return out
    return map_schemas(schema, fix)


def build_ecma(schema: Any) -> tuple[Any, Any]:
    """(validator, the schema it holds): where the validator's regex engine refuses a pattern, the
    schema again with its patterns read as ECMA-262 (``ecma_regex``); ValidatorError if that fails too."""
    try:
        return build(schema), schema
    except ValidatorError as exc:
        if 'is not a "regex"' not in str(exc):
            raise
        translated = _ecma_patterns(schema)
        if translated == schema:
            raise
        try:
            return build(translated), translated
        except ValidatorError:
            raise exc from None


def check(validator, value: Any, where: str = "") -> str | None:
    """None when ``value`` passes, else the first error as a message a person can act on."""
    try:
        if validator.is_valid(value):   # no error objects built (iter_errors costs ~100x more)
            return None
        for err in validator.iter_errors(value):
            return f"at {_where(where, err.instance_path)}: {_message(err)}"
        return None
    except Exception as exc:   # values the validator cannot take (lone surrogates, ...)
        return f"the validator cannot check this document: {type(exc).__name__}: {_message(exc)}"


class Problem:
    """A failed early check whose message is built only when read: the check itself is cheap, the
    message is not (a ``oneOf`` collects every branch's errors: ~50 us against ~0.5 us), and a
    row's vetoes need it only when they leave the row empty."""
    __slots__ = ("_make", "_text")

    def __init__(self, make: Callable[[], str]) -> None:
        self._make: Callable[[], str] | None = make
        self._text = ""

    def __str__(self) -> str:
        if self._make is not None:
            self._text, self._make = self._make(), None
        return self._text

    def __repr__(self) -> str:
        return f"Problem({str(self)!r})"

    def after(self, lead: str) -> Problem:
        """The same problem with ``lead`` before its message."""
        return Problem(lambda: lead + str(self))


def passes(validator, value: Any) -> bool:
    try:
        return bool(validator.is_valid(value))
    except Exception:   # values the validator cannot take: check() says why
        return False


def _dependent_message(key: str, validator, obj: dict, where: str) -> str:
    return f"with {json.dumps(key)} present: {check(validator, obj, where) or 'a dependent schema does not pass'}"


# Deeper documents are not checked (the validator recurses per level): refused whatever the
# interpreter's recursion limit, which a library in the same process may have raised (torch's
# inductor sets it to 2,000).
MAX_DEPTH = 900
_TOO_DEEP = "the document nests too deeply to be checked"


def parse(data: bytes | bytearray) -> tuple[Any, str | None]:
    """The JSON value of ``data``, or an error message (never raises)."""
    try:
        value = json.loads(bytes(data))
    except RecursionError:
        return None, _TOO_DEEP
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"the document is not JSON the validator can read: {exc}"
    # a value is no deeper than its opening brackets are many: the walk only for documents with that many
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and json_depth(value) > MAX_DEPTH:
        return None, _TOO_DEEP
    return value, None


class SchemaValidator:
    """The original schema's validator plus the map of sub-documents worth checking early."""

    def __init__(self, schema: Any, relaxed_keywords: frozenset[str]) -> None:
        self.root, self.schema = build_ecma(schema)
        schema = self.schema
        self.relaxed = relaxed_keywords
        # integer constants the grammar widens to a range (numbers.py): a number may not grow into the
        # range's other integers where it could then only end failing
        self.big_integers = inexact_integers(schema) if {"const", "enum"} & relaxed_keywords else ()
        # number nodes whose bounds the grammar leaves to the rows (numbers.py): pointer -> interval
        self.number_nodes = row_checked_numbers(schema) if BOUND_WORDS & relaxed_keywords else {}
        self._number_rules: dict[frozenset[str], NumberRule | None] = {}
        sch = schema.get("$schema", "") if isinstance(schema, dict) else ""
        self.legacy = isinstance(sch, str) and any(d in sch for d in _LEGACY_DRAFTS)
        self._map: Any = None
        self._pins: dict[str, bool] = {}
        self._nodes: dict[str, Any] = {}
        self._by_node: dict[int, bool] = {}   # id(subschema) -> holds a relaxed keyword (the schema is kept alive)
        self._unions: dict[frozenset[str], Unions] = {}
        self._inherited: dict[tuple[Unions, str | int], Unions] = {}
        self._patterns: dict[tuple[str, str], bool | None] = {}
        self._pattern_validators: dict[str, Any] = {}
        self._dependents: dict[frozenset[str], dict[str, tuple[Any, ...]]] = {}
        self._choices: dict[tuple, frozenset[str] | None] = {}
        self.root_ctx: frozenset[str] | None = None   # None: nothing below the root to check early
        if relaxed_keywords and isinstance(schema, dict):
            try:
                root = self._expand("")
                if any(self.subtree_relaxed(p) for p in root):
                    self.root_ctx = root
            except RecursionError:   # references chained deeper than a walk can follow: the final check only
                self._pins.clear()
                self._by_node.clear()

    def check(self, value: Any) -> str | None:
        return check(self.root, value)

    # -- early checks -----------------------------------------------------------------------------
    def watch(self, ctx: frozenset[str], key: str | int) -> frozenset[str] | None:
        """The pinned subschemas (JSON pointers) of the child ``key`` of a value pinned to ``ctx``,
        keeping only those with something relaxed at or below them; None when there is none."""
        out: set[str] = set()
        for ptr in ctx:
            node = self._node(ptr)
            if isinstance(node, dict):
                for child in self._children(ptr, node, key):
                    out.update(p for p in self._expand(child) if self.subtree_relaxed(p))
        return frozenset(out) if out else None

    def inherit(self, unions: Unions, key: str | int) -> Unions:
        """The unions the child ``key`` of a value under ``unions`` (its open ``oneOf`` / ``anyOf``,
        each branch as pointers) is under in turn: per union, each branch that can take the child,
        as the pointers that apply to the child through it. The child must pass one of them (its
        parent passes one branch); a union where a branch that takes the child says nothing of it
        says nothing, and is left out."""
        if not unions:
            return ()
        known = self._inherited.get((unions, key))
        if known is not None:
            return known
        out = []
        for branches in unions:
            children = []
            for branch in branches:
                child = self._branch_child(branch, key)
                if child is None:
                    continue        # this branch cannot hold such a child: the parent is not in it
                if not child:
                    break           # it may: and says nothing of the child
                children.append(child)
            else:
                if children:
                    out.append(tuple(children))
        found = tuple(out)
        if len(self._inherited) < 4096:
            self._inherited[(unions, key)] = found
        return found

    def _branch_child(self, branch: frozenset[str], key: str | int) -> frozenset[str] | None:
        """The pointers that apply to the child ``key`` through one branch (empty: nothing there), or
        None when the branch rules such a child out (the parent's type, a key it forbids)."""
        out: set[str] = set()
        for ptr in branch:
            node = self._node(ptr)
            if node is False:
                return None
            if not isinstance(node, dict) or (self.legacy and "$ref" in node):
                continue
            t = node.get("type")
            want = "object" if isinstance(key, str) else "array"
            if (isinstance(t, str) and t != want) or (isinstance(t, list) and want not in t):
                return None
            children = self._children(ptr, node, key)
            if isinstance(key, str) and not children and node.get("additionalProperties") is False \
                    and not node.get("patternProperties"):
                return None
            for child in children:
                out |= self._expand(child)
        return frozenset(out)

    def union_fails(self, unions: Unions, value: Any) -> tuple[frozenset[str], ...] | None:
        """The first union ``value`` passes no branch of (each branch checked whole, every keyword:
        the grammar takes the union of relaxed branches, not each one), or None."""
        for branches in unions:
            if not any(self._branch_passes(b, value) for b in branches):
                return branches
        return None

    def _branch_passes(self, branch: frozenset[str], value: Any) -> bool:
        for ptr in branch:
            validator = self._validator(ptr)
            if validator is not None and not passes(validator, value):
                return False
        return True

    # -- unions: the branches an object can still match -------------------------------------------
    def unions(self, ctx: frozenset[str]) -> Unions:
        """The ``oneOf`` / ``anyOf`` (two branches or more) that apply to a value pinned to ``ctx``:
        per union, each branch as the pointers that apply through it (local $ref, allOf)."""
        known = self._unions.get(ctx)
        if known is not None:
            return known
        found = []
        for ptr in sorted(ctx):
            node = self._node(ptr)
            if not isinstance(node, dict) or (self.legacy and "$ref" in node):
                continue
            for word in ("oneOf", "anyOf"):
                branches = node.get(word)
                if isinstance(branches, list) and len(branches) > 1:
                    found.append(tuple(self._expand(f"{ptr}/{word}/{i}") for i in range(len(branches))))
        out = tuple(found)
        if len(self._unions) < 4096:
            self._unions[ctx] = out
        return out

    def narrow(self, branches: tuple[frozenset[str], ...], key: str, value: Any) -> tuple[frozenset[str], ...]:
        """The branches an object can still match once it has the member ``key: value``: a branch
        goes when the value fails its subschema for that key (a const or enum tag, a type), when it
        forbids the key (``additionalProperties: false``), or when its object constants or type
        rule the object out. Only what is certain removes a branch."""
        return tuple(b for b in branches if self._member_may_pass(b, key, value))

    def _member_may_pass(self, branch: frozenset[str], key: str, value: Any) -> bool:
        for ptr in branch:
            node = self._node(ptr)
            if node is False:
                return False
            if not isinstance(node, dict) or (self.legacy and "$ref" in node):
                continue
            t = node.get("type")
            if (isinstance(t, str) and t != "object") or (isinstance(t, list) and "object" not in t):
                return False
            for word in ("const", "enum"):
                if word in node:
                    allowed = [node["const"]] if word == "const" else node[word]
                    if isinstance(allowed, list) and not any(
                            isinstance(o, dict) and key in o and _may_equal(o[key], value) for o in allowed):
                        return False
            props = node.get("properties")
            if isinstance(props, dict) and key in props:
                sub = f"{ptr}/properties/{_escape(key)}"
            elif node.get("patternProperties"):
                continue   # the key may match a pattern: not decided here
            elif node.get("additionalProperties") is False:
                return False
            elif isinstance(node.get("additionalProperties"), dict):
                sub = f"{ptr}/additionalProperties"
            else:
                continue
            validator = self._validator(sub)
            if validator is not None and check(validator, value) is not None:
                return False
        return True

    # -- dependencies whose failure no later member can repair ------------------------------------
    def dependents(self, ctx: frozenset[str]) -> dict[str, tuple[Any, ...]]:
        """For an object pinned to ``ctx``: key -> validators of the schemas its presence applies to
        the whole object (``dependencies`` / ``dependentSchemas``), where that schema only says things
        a later member cannot undo (``properties``, ``additionalProperties``, ``maxProperties``, and
        ``anyOf`` / ``oneOf`` of those, a ``oneOf`` checked as ``anyOf``: two branches that match may
        come down to one, none never to one): once one fails on the members written so far, the
        object can never pass."""
        known = self._dependents.get(ctx)
        if known is not None:
            return known
        found: dict[str, list[Any]] = {}
        draft = self.schema.get("$schema") if isinstance(self.schema, dict) else None
        for ptr in sorted(ctx):
            node = self._node(ptr)
            if not isinstance(node, dict) or (self.legacy and "$ref" in node):
                continue
            for word in ("dependencies", "dependentSchemas"):
                deps = node.get(word)
                if not isinstance(deps, dict):
                    continue
                for key, sub in deps.items():
                    if isinstance(sub, dict) and sub and _monotone(sub):
                        lasting = _one_of_as_any_of(sub)
                        if isinstance(draft, str):
                            lasting = {**lasting, "$schema": draft}
                        try:
                            found.setdefault(key, []).append(build(lasting))
                        except ValidatorError:
                            continue
        out = {k: tuple(v) for k, v in found.items()}
        if len(self._dependents) < 4096:
            self._dependents[ctx] = out
        return out

    def number_rule(self, ctx: frozenset[str]) -> NumberRule | None:
        """The rows' check of a number pinned to ``ctx`` whose bounds the grammar leaves to them, or
        None where the grammar keeps them (or there are none)."""
        if not self.number_nodes:
            return None
        if ctx in self._number_rules:
            return self._number_rules[ctx]
        intervals = [self.number_nodes[p] for p in ctx if p in self.number_nodes]
        rule = None
        if intervals:
            interval = intervals[0]
            for other in intervals[1:]:
                interval = interval.meet(other)
            rule = NumberRule(interval) if not interval.empty else None
        if len(self._number_rules) < 4096:
            self._number_rules[ctx] = rule
        return rule

    # -- strings that must be one of a few ----------------------------------------------------------
    def string_choices(self, parent: frozenset[str], key: str | int, unions: Unions) -> frozenset[str] | None:
        """The strings a child ``key`` of a value pinned to ``parent`` must be one of, if it is a
        string, as far as ``enum`` / ``const`` / ``type`` of the subschemas that apply to it say: those
        its parent's pointers give it (allOf and local $ref followed), and per union it is under
        (``unions``: each branch as pointers) those of one branch. None when they allow any string.
        A necessary condition: a string outside it passes no document."""
        known_key = (parent, key, unions)
        if known_key in self._choices:
            return self._choices[known_key]
        ptrs: set[str] = set()
        for ptr in parent:
            node = self._node(ptr)
            if isinstance(node, dict):
                for child in self._children(ptr, node, key):
                    ptrs |= self._expand(child)
        found = self._strings(frozenset(ptrs))
        for branches in unions:
            each = [self._strings(b) for b in branches]
            if all(e is not None for e in each):
                union = frozenset().union(*each)   # type: ignore[arg-type]
                found = union if found is None else found & union
        if len(self._choices) < 4096:
            self._choices[known_key] = found
        return found

    def _strings(self, ptrs: frozenset[str], depth: int = 0) -> frozenset[str] | None:
        """The strings every subschema of ``ptrs`` allows, where one of them lists them (None: any)."""
        found: frozenset[str] | None = None
        for ptr in ptrs:
            node = self._node(ptr)
            if node is False:
                return frozenset()
            if not isinstance(node, dict) or (self.legacy and "$ref" in node):
                continue
            own: frozenset[str] | None = None
            if "const" in node:
                own = frozenset([node["const"]]) if isinstance(node["const"], str) else frozenset()
            if isinstance(node.get("enum"), list):
                listed = frozenset(v for v in node["enum"] if isinstance(v, str))
                own = listed if own is None else own & listed
            t = node.get("type")
            if (isinstance(t, str) and t != "string") or (isinstance(t, list) and "string" not in t):
                own = frozenset()
            for word in ("anyOf", "oneOf"):
                branches = node.get(word)
                if isinstance(branches, list) and branches and depth < 4:
                    each = [self._strings(self._expand(f"{ptr}/{word}/{i}"), depth + 1) for i in range(len(branches))]
                    if all(e is not None for e in each):
                        union = frozenset().union(*each)   # type: ignore[arg-type]
                        own = union if own is None else own & union
            if own is not None:
                found = own if found is None else found & own
        return found

    def closed_keys(self, ctx: frozenset[str]) -> frozenset[str] | None:
        """The only keys an object pinned to ``ctx`` may have (``additionalProperties: false`` with no
        ``patternProperties``, at one pointer or more), or None when other keys may come."""
        names: frozenset[str] | None = None
        for ptr in ctx:
            node = self._node(ptr)
            if not isinstance(node, dict) or (self.legacy and "$ref" in node):
                continue
            props = node.get("properties", {})
            if node.get("additionalProperties") is False and not node.get("patternProperties") \
                    and isinstance(props, dict):
                names = frozenset(props) if names is None else names & frozenset(props)
        return names

    def check_at(self, ctx: frozenset[str], value: Any, where: str) -> str | None:
        """The first failure of ``value`` against the relaxed subschemas ``ctx`` pins, or None."""
        validator = self._failing_at(ctx, value)
        return None if validator is None else check(validator, value, where)

    def fails_at(self, ctx: frozenset[str], value: Any, where: str) -> Problem | None:
        """``check_at`` with the message left for when it is read."""
        validator = self._failing_at(ctx, value)
        if validator is None:
            return None
        return Problem(lambda: check(validator, value, where) or "the value does not pass")

    def _failing_at(self, ctx: frozenset[str], value: Any):
        for ptr in sorted(ctx):
            if self._own_relaxed(ptr):
                validator = self._validator(ptr)
                if validator is not None and not passes(validator, value):
                    return validator
        return None

    def check_dependents(self, dependents: dict[str, tuple[Any, ...]], keys, obj: dict, where: str) -> str | None:
        """The first failure of the dependent schemas that ``keys`` trigger, on the object ``obj``."""
        failing = self._failing_dependent(dependents, keys, obj)
        return None if failing is None else _dependent_message(*failing, obj, where)

    def fails_dependents(self, dependents: dict[str, tuple[Any, ...]], keys, obj: dict,
                         where: str) -> Problem | None:
        """``check_dependents`` with the message left for when it is read."""
        failing = self._failing_dependent(dependents, keys, obj)
        return None if failing is None else Problem(lambda: _dependent_message(*failing, obj, where))

    @staticmethod
    def _failing_dependent(dependents: dict[str, tuple[Any, ...]], keys, obj: dict) -> tuple[str, Any] | None:
        for key in keys:
            for validator in dependents.get(key, ()):
                if not passes(validator, obj):
                    return key, validator
        return None

    def _validator(self, ptr: str):
        if self._map is None:
            try:
                self._map = jsonschema_rs.validator_map_for(self.schema, formats=FORMAT_CHECKERS, validate_formats=True,
                                                             offline=True)
            except Exception:
                self._map = False
        return self._map.get("#" + ptr) if self._map else None

    # -- the schema as JSON pointers ------------------------------------------------------------
    def _node(self, ptr: str) -> Any:
        if ptr in self._nodes:
            return self._nodes[ptr]
        node = node_at(self.schema, pointer_path(ptr))
        if len(self._nodes) < 65536:
            self._nodes[ptr] = node
        return node

    def _expand(self, ptr: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
        """``ptr`` and what applies to the same value through allOf and local $ref."""
        if ptr in seen:
            return frozenset()
        node = self._node(ptr)
        out = {ptr}
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                out |= self._expand(ref[1:], seen | {ptr})
            if isinstance(node.get("allOf"), list) and not (self.legacy and "$ref" in node):
                for i in range(len(node["allOf"])):
                    out |= self._expand(f"{ptr}/allOf/{i}", seen | {ptr})
        return frozenset(out)

    def _children(self, ptr: str, node: dict, key: str | int) -> list[str]:
        """The subschemas of ``ptr`` that apply to its child ``key``: a member's property, the
        ``patternProperties`` its key matches, ``additionalProperties`` where neither does (decided
        by the validator's own regex engine; a pattern it cannot decide pins nothing there); an
        item's ``prefixItems`` / ``items`` / ``additionalItems``."""
        if self.legacy and "$ref" in node:
            return []    # siblings of $ref do not apply before draft 2019-09
        if isinstance(key, str):
            out = []
            props = node.get("properties")
            named = isinstance(props, dict) and key in props
            if named:
                out.append(f"{ptr}/properties/{_escape(key)}")
            matched = undecided = False
            patterns = node.get("patternProperties")
            if isinstance(patterns, dict):
                for pattern in patterns:
                    hit = self._matches(pattern, key)
                    if hit is None:
                        undecided = True
                    elif hit:
                        matched = True
                        out.append(f"{ptr}/patternProperties/{_escape(pattern)}")
            if not (named or matched or undecided) and isinstance(node.get("additionalProperties"), dict):
                out.append(f"{ptr}/additionalProperties")
            return out
        prefix = node.get("prefixItems")
        items = node.get("items")
        if isinstance(prefix, list) and not self.legacy:
            if key < len(prefix):
                return [f"{ptr}/prefixItems/{key}"]
            return [f"{ptr}/items"] if isinstance(items, dict) else []
        if isinstance(items, list):
            if key < len(items):
                return [f"{ptr}/items/{key}"]
            return [f"{ptr}/additionalItems"] if isinstance(node.get("additionalItems"), dict) else []
        return [f"{ptr}/items"] if isinstance(items, dict) else []

    def _matches(self, pattern: str, key: str) -> bool | None:
        """Whether ``key`` matches a ``patternProperties`` pattern, as the validator reads it; None
        when the validator cannot say."""
        known = self._patterns.get((pattern, key))
        if known is not None or (pattern, key) in self._patterns:
            return known
        hit: bool | None = None
        validator = self._pattern_validators.get(pattern)
        if validator is None and pattern not in self._pattern_validators:
            try:
                validator = build({"pattern": pattern})
            except ValidatorError:
                validator = None
            self._pattern_validators[pattern] = validator
        if validator is not None:
            try:
                hit = bool(validator.is_valid(key))
            except Exception:
                hit = None
        if len(self._patterns) < 65536:
            self._patterns[(pattern, key)] = hit
        return hit

    def _own_relaxed(self, ptr: str) -> bool:
        node = self._node(ptr)
        return isinstance(node, dict) and any(k in self.relaxed for k in node)

    def subtree_relaxed(self, ptr: str) -> bool:
        """Whether ``ptr`` or anything it reaches (children, references) holds a relaxed keyword."""
        known = self._pins.get(ptr)
        if known is not None:
            return known
        self._pins[ptr] = False   # cycles count as nothing new
        node = self._node(ptr)
        found = self._own_relaxed(ptr)
        if not found and isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                found = self.subtree_relaxed(ref[1:])
            if not found:
                found = any(_contains_relaxed(s, self.relaxed, self) for s in subschemas(node))
        self._pins[ptr] = found
        return found


def _contains_relaxed(node: Any, relaxed: frozenset[str], owner: SchemaValidator, depth: int = 0) -> bool:
    if not isinstance(node, dict) or depth > 64:
        return False
    known = owner._by_node.get(id(node))
    if known is not None:
        return known
    owner._by_node[id(node)] = False   # cycles count as nothing new
    found = any(k in relaxed for k in node)
    ref = node.get("$ref")
    if not found and isinstance(ref, str) and ref.startswith("#"):
        found = owner.subtree_relaxed(ref[1:])
    if not found:
        found = any(_contains_relaxed(s, relaxed, owner, depth + 1) for s in subschemas(node))
    owner._by_node[id(node)] = found
    return found


# What a schema may say of an object and still fail for good once it fails on some of its members.
_MONOTONE_WORDS = frozenset({"properties", "patternProperties", "additionalProperties", "propertyNames",
                             "maxProperties", "type", "title", "description", "$comment", "examples", "default"})


def _monotone(schema: Any, depth: int = 0) -> bool:
    if not isinstance(schema, dict) or depth > 8:
        return False
    t = schema.get("type", "object")
    if t != "object" and not (isinstance(t, list) and "object" in t):
        return False
    for key, sub in schema.items():
        if key in ("anyOf", "allOf", "oneOf"):
            if not (isinstance(sub, list) and sub and all(_monotone(b, depth + 1) for b in sub)):
                return False
        elif key not in _MONOTONE_WORDS:
            return False
    return True


def _one_of_as_any_of(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_one_of_as_any_of(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {("anyOf" if k == "oneOf" else k): (_one_of_as_any_of(v) if k in ("anyOf", "allOf", "oneOf") else v)
            for k, v in schema.items()}


def _may_equal(a: Any, b: Any) -> bool:
    """Whether two JSON values may be equal (1 and 1.0 are; true and 1 are not, nor are 1 and "1"):
    False only when they certainly differ."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_may_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_may_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
