"""JSON Schema exactness: what makes a JSON-schema request end in a document its schema accepts.

A grammar engine enforces what it can of a schema; this package does the rest, and is the only
place that knows how. Its modules:

- ``relax``: complete mode's relaxed schema, for one the grammar engine refuses (a superset of the
  schema's documents that the engine can compile).
- ``validation``: the exact check (jsonschema-rs over the original schema, formats asserted as
  MaskBench's reference validators do) and the map of sub-documents worth checking early.
- ``formats``: the formats asserted whatever the schema's draft, and the exact patterns complete
  mode's grammar takes for the date and time formats.
- ``numbers``: the number bounds (checked by the rows) and big integer constants complete mode's
  grammar leaves to the validator (llguidance's number lexemes would refuse valid numbers).
- ``scan``: the incremental JSON structure of the output (where sub-documents open and close).
- ``documents``: one sequence's output as the checks see it (bytes, scan state, rollbacks).
- ``step_checks``: the hooks the step protocol calls (``DocumentChecks``).

Engines use the functions below (they never reach into the modules); the step protocol uses
``DocumentChecks``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from maskd.server.json_schema.documents import (
    CallArrayChecker,
    DocumentChecker,
    JsonDocumentChecker,
    TagSpan,
    TemplateChecker,
    ToolCallChecker,
    checker_from_description,
)
from maskd.server.json_schema.formats import grammar_formats
from maskd.server.json_schema.numbers import grammar_number_bounds, grammar_numbers
from maskd.server.json_schema.relax import (
    LENIENT_KEYWORDS,
    ORDER_FREE_WORDS,
    Relaxation,
    RelaxError,
    TryCompile,
    TryRegex,
    free_all_of_order,
    inline_intersected_refs,
    relax,
)
from maskd.server.json_schema.step_checks import DocumentChecks, Verdict
from maskd.server.json_schema.validation import SchemaValidator, ValidatorError

__all__ = [
    "LENIENT_KEYWORDS",
    "CallArrayChecker",
    "DocumentChecks",
    "RelaxError",
    "Relaxation",
    "TagSpan",
    "TemplateChecker",
    "ValidatorError",
    "Verdict",
    "checker_from_description",
    "describe_checker",
    "document_checker",
    "grammar_formats",
    "relax_schema",
    "tag_span",
    "tool_call_checker",
    "whole_schema",
]

Markers = tuple[bytes, bytes]


def relax_schema(schema: Any, try_compile: TryCompile, try_regex: TryRegex, number_rows: bool = False) -> Relaxation:
    """Complete mode's relaxed schema for one the grammar engine refused (RelaxError when even
    that does not compile): see ``relax``; its numbers as ``grammar_numbers`` takes them (every
    candidate is compiled so), and with ``number_rows`` (a JSON document the rows check, not a
    tool call's arguments) the bounds ``grammar_number_bounds`` leaves to the rows."""
    bounds: frozenset[str] = frozenset()
    if number_rows:
        schema, bounds = grammar_number_bounds(schema)
    found = relax(schema, lambda candidate, lenient: try_compile(grammar_numbers(candidate)[0], lenient), try_regex)
    grammar, words = grammar_numbers(found.schema)
    words |= bounds
    if not words:
        return found
    return dataclasses.replace(found, schema=grammar, keywords=found.keywords | words,
                               steps=(*found.steps, _NUMBERS_STEP))


_NUMBERS_STEP = "number bounds (to the rows) and big integer constants left to the validator"


def whole_schema(schema: Any, try_regex: TryRegex) -> tuple[Any, frozenset[str]]:
    """(the schema complete mode's grammar takes for one the engine compiles whole, the keywords it
    leaves to the validator): number bounds the rows check (``grammar_number_bounds``), ``allOf``
    members' properties in any order (``free_all_of_order``) and numbers as ``grammar_numbers``
    takes them. The schema itself, and no keyword, where none changes anything; the engine
    compiles the schema itself where this does not compile."""
    schema, words = grammar_number_bounds(schema)
    inlined = schema
    for _ in range(4):   # allOf members that are references, as copies (a copy's own such members in turn)
        before, inlined = inlined, inline_intersected_refs(inlined, try_regex)
        if inlined == before:
            break
    ordered = free_all_of_order(inlined, try_regex)
    if ordered != inlined:
        schema, words = ordered, words | ORDER_FREE_WORDS
    grammar, number_words = grammar_numbers(schema)
    return grammar, words | number_words


def document_checker(schema: Any, tokenizer, markers: Markers = (b"", b""),
                     relaxed: frozenset[str] = frozenset()) -> JsonDocumentChecker:
    """The checker of one JSON document against ``schema``: the final check before EOS, and early
    checks of sub-documents where the grammar may not enforce one of the ``relaxed`` keywords
    (none for a grammar that enforces the schema whole). ValidatorError when the validator cannot
    take the schema."""
    return JsonDocumentChecker(SchemaValidator(schema, relaxed), tokenizer, markers)


def tag_span(begin: bytes, ends: tuple[bytes, ...], is_json: bool, schema: Any = None,
             relaxed: frozenset[str] | None = None, name: str = "") -> TagSpan:
    """One tag of a structural tag; its JSON content is checked when ``schema`` is given."""
    validator = SchemaValidator(schema, relaxed or frozenset()) if schema is not None else None
    return TagSpan(begin, ends, is_json, validator, name)


def describe_checker(checker: DocumentChecker) -> dict:
    """A JSON-able description that rebuilds ``checker`` in another process or replica
    (``checker_from_description``): compiled grammars travel, validators are built again."""
    return checker.describe()


def tool_call_checker(spans: list[TagSpan], tokenizer, markers: Markers = (b"", b"")) -> ToolCallChecker:
    return ToolCallChecker(spans, tokenizer, markers)
