"""Schemas generated for the no-dead-end tests of complete mode (issue 50): the constructs the
relaxation drops or widens (``additionalProperties``, ``patternProperties``, ``items``, ``$ref``
chains, ``anyOf`` / ``oneOf`` branches of different types) nested in each other, with objects that
require keys below them, and a keyword llguidance cannot enforce (``not``, ``uniqueItems``,
``propertyNames``, ...) somewhere so that complete mode relaxes the schema. Each comes with a valid
instance (checked with the validator) as the writer's guide. Deterministic per seed."""
from __future__ import annotations

import random
from typing import Any

BIG = 2 ** 53 + 1   # an integer no double holds: complete mode's grammar widens it, the validator decides

_WORDS = ("id", "name", "kind", "size", "tags", "meta", "doc", "ref", "note", "value")


class _Gen:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.defs: dict[str, Any] = {}
        self.instances: dict[str, Any] = {}

    # -- leaves ----------------------------------------------------------------------------------
    def leaf(self) -> tuple[dict, Any]:
        r = self.rng.randrange(7)
        if r == 0:
            return {"type": "integer", "not": {"const": 3}}, 4
        if r == 1:
            return {"type": "string", "maxLength": 6}, "ab"
        if r == 2:
            return {"enum": ["x", "y", 7]}, "y"
        if r == 3:
            return {"type": "boolean"}, True
        if r == 4:
            return {"type": "integer", "multipleOf": 2}, 2
        if r == 5:
            return {"const": BIG}, BIG
        return {"type": "string", "format": "date"}, "2024-01-02"

    # -- constructs --------------------------------------------------------------------------------
    def value(self, depth: int) -> tuple[dict, Any]:
        if depth <= 0:
            return self.leaf()
        r = self.rng.randrange(8)
        if r == 0:
            return self.obj(depth)
        if r == 1:   # additionalProperties
            sub, inst = self.value(depth - 1)
            extra = self.rng.random() < 0.5
            schema = {"type": "object", "additionalProperties": sub}
            if extra:
                schema["properties"] = {"fixed": {"type": "integer"}}
            return schema, {"k1": inst}
        if r == 2:   # patternProperties (alone, or beside additionalProperties: false)
            sub, inst = self.value(depth - 1)
            schema = {"type": "object", "patternProperties": {"^p": sub}}
            if self.rng.random() < 0.5:
                schema["additionalProperties"] = False
            return schema, {"p1": inst}
        if r == 3:   # items
            sub, inst = self.value(depth - 1)
            schema = {"type": "array", "items": sub}
            if self.rng.random() < 0.4:
                schema["minItems"] = 1
            return schema, [inst]
        if r == 4:   # a $ref chain (one or two links)
            sub, inst = self.value(depth - 1)
            name = f"d{len(self.defs)}"
            self.defs[name] = sub
            if self.rng.random() < 0.5:
                link = f"l{len(self.defs)}"
                self.defs[link] = {"$ref": f"#/definitions/{name}"}
                name = link
            return {"$ref": f"#/definitions/{name}"}, inst
        if r in (5, 6):   # anyOf / oneOf of branches of different types
            word = "anyOf" if r == 5 else "oneOf"
            a, ia = self.value(depth - 1)
            b, _ = self.leaf() if self.rng.random() < 0.5 else self.obj(depth - 1)
            branches = [a, b] if self.rng.random() < 0.5 else [b, a]
            return {word: branches}, ia
        return self.obj(depth)

    def obj(self, depth: int) -> tuple[dict, Any]:
        """An object that requires keys (what a writer must not close without)."""
        names = self.rng.sample(_WORDS, self.rng.randint(1, 3))
        props, inst = {}, {}
        for name in names:
            sub, value = self.value(depth - 1)
            props[name] = sub
            inst[name] = value
        required = [n for n in names if self.rng.random() < 0.7] or names[:1]
        schema: dict = {"type": "object", "properties": props, "required": required}
        if self.rng.random() < 0.3:
            schema["additionalProperties"] = False
        return schema, inst


def generate(seed: int, depth: int = 3) -> tuple[dict, Any]:
    """(schema, a valid instance candidate): the root is an object or an anyOf of an object and a
    value of another type; a relaxed keyword sits at the root (``not``, ``propertyNames``) or below."""
    rng = random.Random(seed)
    g = _Gen(rng)
    if rng.random() < 0.25:   # a root-level union of different types
        inner, inst = g.obj(depth)
        other, _ = g.leaf()
        schema: dict = {"anyOf": [other, inner] if rng.random() < 0.5 else [inner, other]}
    else:
        schema, inst = g.value(depth) if rng.random() < 0.3 else g.obj(depth)
        schema = dict(schema)
    trigger = rng.randrange(3)
    if trigger == 0:
        schema["not"] = {"const": {}}
    elif trigger == 1 and schema.get("type") == "object":
        schema["propertyNames"] = {"maxLength": 8}
    else:
        schema["$comment"] = "relaxed below (a not in the leaves) or not at all"
        schema["not"] = {"const": []}
    if g.defs:
        schema["definitions"] = g.defs
    return schema, inst


def generated(n: int, start: int = 0, depth: int = 3) -> list[tuple[str, dict, Any]]:
    """``n`` generated (name, schema, valid instance) whose instance the validator accepts."""
    import jsonschema_rs
    out = []
    seed = start
    while len(out) < n:
        schema, inst = generate(seed, depth)
        try:
            ok = jsonschema_rs.validator_for(schema, validate_formats=True).is_valid(inst)
        except Exception:
            ok = False
        if ok:
            out.append((f"gen{seed}", schema, inst))
        seed += 1
    return out
