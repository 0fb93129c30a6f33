"""Numbers in complete mode's grammar: integer constants no double holds are left to the validator.

``const`` / ``enum`` integers beyond 2^53 that no double holds (``9007199254740993``): llguidance
reads them as doubles and matches the nearest one's text. The grammar takes, in their place, the
integers between the two doubles around the value (``[2^53, 2^53 + 2]``: the value and its two
neighbours; any integer past 2^62, where llguidance's integer ranges end), and the validator decides.

Number bounds stay llguidance's, although its range regex (``rx_float_range``, llguidance 1.9.1) is
narrower than the bound: no exponent form (``1e-06`` for ``"minimum": 0``), no number whose digits
are a prefix of the bound's (``0.999999`` for ``"maximum": 0.9999999``), no trailing zeros, no
``-0.0``. Leaving those bounds to the validator was tried (issue 50) and not kept: the grammar then
lets a model start a value out of range (``-5`` under ``"minimum": 0``) that no continuation can end,
and the rows keep it from ending: on the 69 MaskBench-dev schemas the rewrite touched, random
writers that ran into the token limit rose from 44 to 52 of 251. Exact bounds in every number form
need a number grammar of maskd's own (the test of each class is marked xfail with this reason;
docs/decisions/0025-number-bounds-stay-llguidances.md).
"""
from __future__ import annotations

import json
import math
from typing import Any

from maskd.server.json_schema.relax import map_schemas

_RANGE_LIMIT = 1 << 62   # llguidance's integer ranges work on i64: past this, any integer


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
    """(the schema complete mode's grammar takes, the keywords it leaves to the validator): inexact
    big integers of ``const`` / ``enum`` widened to the integers around them (see above). The schema
    itself where nothing changes."""
    if not isinstance(schema, dict):
        return schema, frozenset()
    text = json.dumps(schema)
    if '"const"' not in text and '"enum"' not in text:
        return schema, frozenset()
    words: set[str] = set()

    def fix(node: dict) -> dict:
        out = node
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


def inexact_integers(schema: Any) -> tuple[bytes, ...]:
    """The decimal texts of the ``const`` / ``enum`` integers of ``schema`` that the grammar widens
    (``grammar_numbers``): the rows keep a number from growing past 2^53 into one that no continuation
    can make pass (``JsonDocumentChecker``)."""
    found: set[bytes] = set()

    def visit(node: dict) -> dict:
        values = [node["const"]] if "const" in node else node.get("enum")
        if isinstance(values, list):
            found.update(str(v).encode() for v in values if _inexact(v))
        return node
    if isinstance(schema, dict) and ('"const"' in json.dumps(schema) or '"enum"' in json.dumps(schema)):
        map_schemas(schema, visit)
    return tuple(sorted(found))
