"""llguidance, with xgrammar for the specs llguidance cannot express.

The server's default backend is llguidance. Some specs that engines build every day are beyond it:
the XML argument styles of structural tags (``json_schema`` with ``style`` ``qwen_xml``,
``deepseek_xml``, ``deepseek_v4_1_xml``, ``glm_xml``, ... : what vLLM builds for
``tool_choice: "required"`` with the tool parsers of Qwen3.5 / Qwen3-Coder, DeepSeek-V3.2 / V4 /
V4.1, GLM-4.7 and MiMo) and the xgrammar-only tag formats. llguidance refuses them as
``UnsupportedSpec``; this engine then compiles them with xgrammar, whose own formats they are, so a
server started with the default backend serves every structured output request such an engine
sends. Each grammar belongs to the engine that compiled it: its matchers, fills, consumes and
serialized form are that engine's; a batch that mixes them is split by engine and filled into the
same rows buffer. The xgrammar engine is built at the first spec that needs it (its tokenizer
info costs seconds and memory a server that never meets such a spec should not pay).

Grammar ids carry both engines' versions (a new xgrammar serializes differently; a server that
only refused these specs must not share its cached refusals with one that serves them). In
complete JSON-schema mode, a grammar xgrammar compiles has xgrammar's own checks (for a structural
tag: its grammar alone; an XML argument style has no JSON document to validate).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from maskd.server.engines.base import (
    CompiledGrammar,
    Engine,
    GrammarCompileError,
    Matcher,
    UnsupportedSpec,
    split_tokens,
)
from maskd.specs import GrammarSpec

_SECONDARY_MAGIC = b"MASKD-XGR\x00"   # a serialized grammar the secondary engine compiled


class FallbackEngine(Engine):
    """``primary`` for every spec it compiles; ``make_secondary()`` for those it refuses as unsupported."""

    def __init__(self, primary: Engine, make_secondary: Callable[[], Engine], secondary_version: str) -> None:
        super().__init__(primary.tokenizer, threads=primary.threads, json_schema_mode=primary.json_schema_mode)
        self.primary = primary
        self.name = primary.name
        self.version = f"{primary.version}/{secondary_version}"
        self._make_secondary = make_secondary
        self._secondary: Engine | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        """Anything else is the primary's own (its tokenizer handle, its executor, ...)."""
        if name == "primary":   # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.primary, name)

    @property
    def secondary(self) -> Engine:
        with self._lock:
            if self._secondary is None:
                if self.load_listener is not None:
                    self.load_listener("loading")
                try:
                    secondary = self._make_secondary()
                except (ImportError, RuntimeError, ValueError) as exc:
                    raise GrammarCompileError(f"the fallback engine cannot start: {exc}") from exc
                finally:
                    if self.load_listener is not None:
                        self.load_listener("loaded")
                if secondary.words_per_row != self.words_per_row or secondary.width != self.width:
                    raise GrammarCompileError(f"the {secondary.name} engine's rows ({secondary.width} ids) do not "
                                              f"match {self.primary.name}'s ({self.width})")
                self._secondary = secondary
            return self._secondary

    def _owner(self, grammar: CompiledGrammar) -> Engine:
        return self.secondary if grammar.by_fallback else self.primary

    # -- compile ---------------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            return self.primary.compile(spec)
        except UnsupportedSpec as refused:
            try:
                compiled = self.secondary.compile(spec)
            except GrammarCompileError as exc:
                raise GrammarCompileError(f"{exc} ({self.primary.name}: {refused})") from exc
        compiled.by_fallback = True
        return compiled

    def serialize(self, grammar: CompiledGrammar) -> bytes:
        if grammar.by_fallback:
            return _SECONDARY_MAGIC + self.secondary.serialize(grammar)
        return self.primary.serialize(grammar)

    def deserialize(self, spec: GrammarSpec, data: bytes, *, lazy: bool = False) -> CompiledGrammar:
        if not data.startswith(_SECONDARY_MAGIC):
            return self.primary.deserialize(spec, data, lazy=lazy)
        compiled = self.secondary.deserialize(spec, data[len(_SECONDARY_MAGIC):], lazy=lazy)
        compiled.by_fallback = True
        return compiled

    def prepare(self, nice: int = 0) -> None:
        self.primary.prepare(nice)

    # -- tool-call arrays: the primary's (its composition) ---------------------------------------
    def composed_parts(self, spec: GrammarSpec):
        return self.primary.composed_parts(spec)

    def piece_spec(self, spec: GrammarSpec, text: str) -> GrammarSpec:
        return self.primary.piece_spec(spec, text)

    def router(self, spec: GrammarSpec, parts):
        return self.primary.router(spec, parts)

    def compose(self, spec: GrammarSpec, parts, pieces: Sequence[CompiledGrammar], router=None):
        return self.primary.compose(spec, parts, pieces, router)

    # -- matchers and rows -----------------------------------------------------------------------
    def new_matcher(self, grammar: CompiledGrammar) -> Matcher:
        return self._owner(grammar).new_matcher(grammar)

    def _split(self, matchers: Sequence[Matcher]) -> tuple[list[int], list[int]]:
        """Indices of the primary's matchers and of the secondary's."""
        if self._secondary is None:
            return list(range(len(matchers))), []
        mine = self._secondary.matcher_type
        first: list[int] = []
        second: list[int] = []
        for i, m in enumerate(matchers):
            (second if isinstance(m, mine) else first).append(i)
        return first, second

    def consume_batch(self, matchers: Sequence[Matcher], tokens: Sequence[int],
                      counts: Sequence[int] | None = None) -> list[str | None]:
        first, second = self._split(matchers)
        if not second:
            return self.primary.consume_batch(matchers, tokens, counts)
        reasons: list[str | None] = [None] * len(matchers)
        each = split_tokens(tokens, counts)
        for engine, part in ((self.primary, first), (self.secondary, second)):
            if part:
                flat = [t for i in part for t in each[i]]
                for i, r in zip(part, engine.consume_batch([matchers[i] for i in part], flat,
                                                           [len(each[i]) for i in part])):
                    reasons[i] = r
        return reasons

    def fill_batch(self, matchers: Sequence[Matcher], rows: Sequence[int],
                   drafts: Sequence[Sequence[int]] | None, out: np.ndarray) -> None:
        first, second = self._split(matchers)
        if not second:
            self.primary.fill_batch(matchers, rows, drafts, out)
            return
        for engine, part in ((self.primary, first), (self.secondary, second)):
            if part:
                part_drafts = [drafts[i] for i in part] if drafts is not None else None
                engine.fill_batch([matchers[i] for i in part], [rows[i] for i in part],
                                  part_drafts if part_drafts and any(part_drafts) else None, out)
