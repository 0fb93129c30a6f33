"""Numbers in complete mode's grammar: what llguidance's number lexemes would refuse is left to the validator.

llguidance reads a number schema's bounds into a regex of plain decimals (``rx_float_range``), and
that regex is narrower than the bound in several ways (llguidance 1.9.1, measured against
jsonschema-rs):

- no exponent form at all: ``1e-06`` for ``"minimum": 0``, which is how Python's ``json.dumps``
  writes 0.000001 (and every float under 1e-4 or from 1e16 up);
- a number whose digits are a prefix of the bound's: ``0.999999`` (and ``0.9``) for
  ``"maximum": 0.9999999``, ``123.45`` for ``"maximum": 123.456``;
- trailing zeros (``12.50`` for ``"exclusiveMinimum": 12``) and negative zero (``-0.0`` for
  ``"minimum": 0``).

A bounded number's lexeme cannot take an exponent in llguidance's schema language (only the
unbounded one does), so complete mode's grammar takes a node that admits non-integers (``type``
``number``, absent, or a list holding ``number``) without its bounds; the validator holds them,
and the rows keep a pinned value from ending where it would not pass (``documents.py``). Integer
nodes keep their bounds (``rx_int_range`` is exact for integers written as integers).

``const`` / ``enum`` integers beyond 2^53 that no double holds (``9007199254740993``): llguidance
reads them as doubles and matches the nearest one's text. The grammar takes, in their place, the
integers between the two doubles around the value (``[2^53, 2^53 + 2]``: the value and its two
neighbours; any integer past 2^62, where llguidance's integer ranges end), and the validator decides.
"""
from __future__ import annotations

import json
import math
from typing import Any

from maskd.server.json_schema.relax import map_schemas

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_RANGE_LIMIT = 1 << 62   # llguidance's integer ranges work on i64: past this, any integer


def _takes_fractions(node: dict) -> bool:
    t = node.get("type")
    return t is None or t == "number" or (isinstance(t, list) and "number" in t)


def _inexact(value: Any) -> bool:
    """An integer no double holds exactly."""
    if not isinstance(value, int) or isinstance(value, bool) or -(1 << 53) <= value <= 1 << 53:
        return False
    try:
        return int(float(value)) != value
    except OverflowError:
        return True


def _integers_around(value: int) -> dict:
    """The integers between the doubles on either side of ``value`` (a superset of ``{value}``)."""
    if abs(value) >= _RANGE_LIMIT:
        return {"type": "integer"}
    f = float(value)
    lo, hi = (f, math.nextafter(f, math.inf)) if f < value else (math.nextafter(f, -math.inf), f)
    return {"type": "integer", "minimum": int(lo), "maximum": int(hi)}


def grammar_numbers(schema: Any) -> tuple[Any, frozenset[str]]:
    """(the schema complete mode's grammar takes, the keywords it leaves to the validator): number
    bounds dropped where the node admits non-integers, inexact big integers of ``const`` / ``enum``
    widened to the integers around them (see above). The schema itself where nothing changes."""
    if not isinstance(schema, dict):
        return schema, frozenset()
    text = json.dumps(schema)
    if not any(f'"{k}"' in text for k in BOUNDS) and not ('"const"' in text or '"enum"' in text):
        return schema, frozenset()
    words: set[str] = set()

    def fix(node: dict) -> dict:
        out = node
        if _takes_fractions(node) and any(k in node for k in BOUNDS):
            words.update(k for k in BOUNDS if k in node)
            out = {k: v for k, v in node.items() if k not in BOUNDS}
        word = "const" if "const" in node else "enum"
        values = [node["const"]] if word == "const" else node.get("enum")
        if isinstance(values, list) and any(_inexact(v) for v in values):
            words.add(word)
            options = [_integers_around(v) for v in values if _inexact(v)]
            rest = [v for v in values if not _inexact(v)]
            if rest:
                options.append({"enum": rest})
            out = {k: v for k, v in out.items() if k != word}
            if "anyOf" in out:   # the node's own anyOf stays: the constants join as an allOf member
                out["allOf"] = [*out.get("allOf", []), {"anyOf": options}]
            else:
                out["anyOf"] = options
        return out
    out = map_schemas(schema, fix)
    return (out, frozenset(words)) if words else (schema, frozenset())
