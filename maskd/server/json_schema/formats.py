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

from collections.abc import Callable

import jsonschema_rs

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
