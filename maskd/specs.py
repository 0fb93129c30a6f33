"""Grammar specs: kinds, options, canonical form and the content-hash grammar id.

Import-light (no engine): the client builds the same specs from dicts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from maskd.v1 import maskd_pb2 as pb

KINDS = ("json_schema", "regex", "lark", "ebnf", "choice", "structural_tag")
OPTION_KEYS = ("whitespace", "reasoning", "max_whitespace")
#: Flexible JSON whitespace: at most this many whitespace characters in a row (0: no bound).
DEFAULT_MAX_WHITESPACE = 8
MAX_WHITESPACE_LIMIT = 1 << 16
#: How JSON schemas are enforced (the server's --json-schema-mode; part of every grammar id).
JSON_SCHEMA_MODES = ("strict", "complete")
# Kinds whose grammar depends on the JSON schema mode (JSON schemas, the arguments of tool calls).
_MODE_KINDS = ("json_schema", "structural_tag")
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

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
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
        """``reasoning``: a ``(start, end)`` pair, or the end marker alone."""
        start, end = ("", reasoning) if isinstance(reasoning, str) else (reasoning or ("", ""))
        return cls(kind, canonical_text(kind, source), whitespace, start, end, max_whitespace)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> GrammarSpec:
        """``{"json_schema": {...}}``, ``{"regex": "..."}``, ``{"choice": [...]}`` ... plus
        optional ``whitespace``, ``reasoning`` (a ``[start, end]`` pair, or the end marker alone
        when the prompt already opened the reasoning) and ``max_whitespace``."""
        if not isinstance(spec, Mapping):
            raise SpecError(f"a grammar spec is a dict such as {{'regex': '[0-9]+'}}, not {type(spec).__name__}")
        kinds = [k for k in spec if k in KINDS]
        unknown = [k for k in spec if k not in KINDS and k not in OPTION_KEYS]
        if unknown:
            raise SpecError(f"unknown grammar spec keys {unknown}; kinds are {', '.join(KINDS)}, "
                            f"options {', '.join(OPTION_KEYS)}")
        if len(kinds) != 1:
            raise SpecError(f"a grammar spec names exactly one kind of {', '.join(KINDS)}; got {kinds}")
        reasoning = spec.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str) and (
                not isinstance(reasoning, (list, tuple)) or len(reasoning) != 2):
            raise SpecError("reasoning is a [start, end] pair such as ['<think>', '</think>'], "
                            "or the end marker alone")
        return cls.create(kinds[0], spec[kinds[0]], whitespace=spec.get("whitespace", "flexible"),
                          reasoning=reasoning if isinstance(reasoning, str) else
                          (tuple(reasoning) if reasoning else None),
                          max_whitespace=spec.get("max_whitespace", DEFAULT_MAX_WHITESPACE))

    @classmethod
    def from_proto(cls, msg: pb.GrammarSpec) -> GrammarSpec:
        kind = msg.WhichOneof("kind")
        if kind is None:
            raise SpecError("grammar spec names no kind; set one of " + ", ".join(KINDS))
        source: Any = list(msg.choice.items) if kind == "choice" else getattr(msg, kind)
        opts = msg.options
        ws = _WHITESPACE_NAMES.get(opts.whitespace)
        if ws is None:
            raise SpecError(f"unknown whitespace option {opts.whitespace}")
        reasoning = (opts.reasoning_start, opts.reasoning_end) if (opts.reasoning_start or opts.reasoning_end) else None
        max_ws = opts.max_whitespace if opts.HasField("max_whitespace") else DEFAULT_MAX_WHITESPACE
        return cls.create(kind, source, whitespace=ws, reasoning=reasoning, max_whitespace=max_ws)

    def to_proto(self) -> pb.GrammarSpec:
        msg = pb.GrammarSpec()
        if self.kind == "choice":
            msg.choice.items.extend(json.loads(self.text))
        else:
            setattr(msg, self.kind, self.text)
        msg.options.whitespace = WHITESPACE[self.whitespace]
        msg.options.reasoning_start = self.reasoning_start
        msg.options.reasoning_end = self.reasoning_end
        msg.options.max_whitespace = self.max_whitespace
        return msg

    # -- identity -----------------------------------------------------------------------------
    def grammar_id(self, tokenizer_fingerprint: str, backend: str, backend_version: str, *,
                   json_schema_mode: str = "complete") -> str:
        """Content hash: the same grammar has the same id on every replica. The server's JSON
        schema mode is part of it for the kinds it changes (json_schema, structural_tag)."""
        payload = {
            "kind": self.kind, "text": self.text, "whitespace": self.whitespace,
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


def canonical_text(kind: str, source: Any) -> str:
    if kind in ("json_schema", "structural_tag"):
        if isinstance(source, (str, bytes)):
            try:
                source = json.loads(source)
            except ValueError as exc:
                raise SpecError(f"{kind} is not valid JSON: {exc}") from exc
        if kind == "json_schema" and not isinstance(source, (dict, bool)):
            raise SpecError(f"json_schema must be a JSON object or boolean, not {type(source).__name__}")
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
