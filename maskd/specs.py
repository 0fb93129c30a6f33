"""Grammar specs: kinds, options, canonical form and the content-hash grammar id.

Import-light (no engine): the client builds the same specs from dicts.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from maskd.v1 import maskd_pb2 as pb

KINDS = ("json_schema", "regex", "lark", "ebnf", "choice", "structural_tag")
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
    reasoning_start: str = ""
    reasoning_end: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpecError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.whitespace not in WHITESPACE:
            raise SpecError(f"unknown whitespace option {self.whitespace!r}; use 'flexible' or 'compact'")
        if bool(self.reasoning_start) != bool(self.reasoning_end):
            raise SpecError("reasoning_start and reasoning_end must be given together")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, kind: str, source: Any, *, whitespace: str = "flexible",
               reasoning: tuple[str, str] | None = None) -> GrammarSpec:
        start, end = reasoning or ("", "")
        return cls(kind, canonical_text(kind, source), whitespace, start, end)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> GrammarSpec:
        """``{"json_schema": {...}}``, ``{"regex": "..."}``, ``{"choice": [...]}`` ... plus
        optional ``whitespace`` and ``reasoning`` (a ``[start, end]`` pair)."""
        if not isinstance(spec, Mapping):
            raise SpecError(f"a grammar spec is a dict such as {{'regex': '[0-9]+'}}, not {type(spec).__name__}")
        kinds = [k for k in spec if k in KINDS]
        unknown = [k for k in spec if k not in KINDS and k not in ("whitespace", "reasoning")]
        if unknown:
            raise SpecError(f"unknown grammar spec keys {unknown}; kinds are {', '.join(KINDS)}")
        if len(kinds) != 1:
            raise SpecError(f"a grammar spec names exactly one kind of {', '.join(KINDS)}; got {kinds}")
        reasoning = spec.get("reasoning")
        if reasoning is not None and (not isinstance(reasoning, (list, tuple)) or len(reasoning) != 2):
            raise SpecError("reasoning is a [start, end] pair such as ['<think>', '</think>']")
        return cls.create(kinds[0], spec[kinds[0]], whitespace=spec.get("whitespace", "flexible"),
                          reasoning=tuple(reasoning) if reasoning else None)

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
        return cls.create(kind, source, whitespace=ws, reasoning=reasoning)

    def to_proto(self) -> pb.GrammarSpec:
        msg = pb.GrammarSpec()
        if self.kind == "choice":
            msg.choice.items.extend(json.loads(self.text))
        else:
            setattr(msg, self.kind, self.text)
        msg.options.whitespace = WHITESPACE[self.whitespace]
        msg.options.reasoning_start = self.reasoning_start
        msg.options.reasoning_end = self.reasoning_end
        return msg

    # -- identity -----------------------------------------------------------------------------
    def grammar_id(self, tokenizer_fingerprint: str, backend: str, backend_version: str) -> str:
        """Content hash: the same grammar has the same id on every replica."""
        payload = json.dumps({
            "kind": self.kind, "text": self.text, "whitespace": self.whitespace,
            "reasoning": [self.reasoning_start, self.reasoning_end],
            "tokenizer": tokenizer_fingerprint, "backend": backend, "backend_version": backend_version,
        }, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return "g-" + hashlib.sha256(payload.encode()).hexdigest()[:32]

    @property
    def size(self) -> int:
        return len(self.text) + len(self.reasoning_start) + len(self.reasoning_end)

    @functools.cached_property
    def depth(self) -> int:
        """Nesting depth of a JSON source (objects and arrays); 0 for other kinds."""
        if self.kind not in ("json_schema", "structural_tag"):
            return 0
        return json_depth(json.loads(self.text))


def json_depth(value: Any) -> int:
    """Deepest nesting of dicts and lists (iterative: any depth, no recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in node)
    return deepest


def canonical_text(kind: str, source: Any) -> str:
    try:
        return _canonical_text(kind, source)
    except RecursionError:
        raise SpecError(f"{kind} is nested too deeply to parse") from None


def _canonical_text(kind: str, source: Any) -> str:
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
