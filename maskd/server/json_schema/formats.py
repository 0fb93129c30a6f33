"""The string formats asserted in every schema, whatever its draft.

MaskBench's reference validators check every format they know in every schema; jsonschema-rs
follows each draft's own list, so a draft-04 schema's ``"format": "iri"`` (or ``uuid``,
``uri-reference``, ``json-pointer``, ...) would pass anything. Complete mode asserts the formats
of draft 2020-12 in every schema: each one here is checked by jsonschema-rs's own 2020-12 checker
(a one-keyword validator per format, built once), so the rules are the library's, not ours.

Departure from the letter of drafts 4 to 2019-09: a format their list does not name is asserted
anyway (those drafts say an unknown format passes). What a person writing ``"format": "uuid"``
in a draft-04 schema means is a UUID; a document the schema's author would reject is not valid
output, so the stricter reading is the one a server that promises valid documents must take.
Formats no draft defines (``"format": "textFile"``) are still ignored.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema_rs

from maskd.server.json_schema.relax import map_schemas

#: Every format draft 2020-12 defines (jsonschema-rs checks each one).
FORMATS_2020_12 = ("date", "date-time", "duration", "email", "hostname", "idn-email", "idn-hostname", "ipv4",
                   "ipv6", "iri", "iri-reference", "json-pointer", "regex", "relative-json-pointer", "time",
                   "uri", "uri-reference", "uri-template", "uuid")

_DRAFT = "https://json-schema.org/draft/2020-12/schema"


def _checker(name: str) -> Callable[[str], bool]:
    validator = jsonschema_rs.validator_for({"$schema": _DRAFT, "format": name}, validate_formats=True)
    return validator.is_valid


#: Format name -> checker, passed to every validator complete mode builds.
FORMAT_CHECKERS: dict[str, Callable[[str], bool]] = {name: _checker(name) for name in FORMATS_2020_12}


# -- the grammar's side ------------------------------------------------------------------------------
# llguidance's regexes for "date", "time" and "date-time" are wider than the validator: any year
# has 02-29, and a leap second (":60") is taken at any time of day. Once such a value is written no
# continuation passes, and the rows only learn it when the string ends (a dead end: tokens before,
# the writer chose a value the schema refuses). Complete mode's grammar takes these patterns instead.
_FRACTION = r"(?:\.[0-9]+)?"
_OFFSET = r"(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_DATE = (r"(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
         r"|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29)")


def _leap_seconds() -> str:
    """``hh:59:60`` where it is 23:59:60 in UTC, for every whole-hour offset: local hour ``hh`` with
    offset ``+(hh+1)`` or ``-(23-hh)``; at 23 also ``Z``."""
    ways = []
    for hh in range(24):
        plus, minus = (hh + 1) % 24, 23 - hh
        zones = r"[zZ]|[+-]00:00" if hh == 23 else rf"\+{plus:02d}:00|-{minus:02d}:00"
        ways.append(rf"{hh:02d}:59:60{_FRACTION}(?:{zones})")
    return "(?:" + "|".join(ways) + ")"


_TIME = rf"(?:(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]{_FRACTION}{_OFFSET}|{_leap_seconds()})"

#: Format -> the pattern complete mode's grammar enforces instead of the engine's own format. Exact
#: but for one narrowing: a leap second is taken at whole-hour offsets only (``15:59:60-08:00``),
#: not at offsets with minutes (``05:29:60+05:30``, which the validator accepts): writing every
#: such pair out would take 1,440 alternatives per sign.
GRAMMAR_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[tT]{_TIME}$",
}


def grammar_formats(schema: Any) -> Any:
    """``schema`` with each ``format`` of GRAMMAR_PATTERNS written as its pattern (where the node has
    no ``pattern`` of its own: one string keeps one regex); the validator keeps the format."""
    text = json.dumps(schema)
    if not any(f'"{name}"' in text for name in GRAMMAR_PATTERNS):
        return schema

    def fix(node: dict) -> dict:
        fmt = node.get("format")
        if not isinstance(fmt, str) or fmt not in GRAMMAR_PATTERNS or "pattern" in node:
            return node
        out = {k: v for k, v in node.items() if k != "format"}
        out["pattern"] = GRAMMAR_PATTERNS[fmt]
        return out
    return map_schemas(schema, fix)
