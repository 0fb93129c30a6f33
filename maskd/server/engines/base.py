"""The engine interface every backend implements (cf. vLLM's StructuredOutputBackend).

An engine compiles grammar specs for one tokenizer and logits width; a matcher is the
per-sequence state. Batched operations take lists of matchers so that a backend can run
them in parallel with the GIL released; masks are written into one preallocated int32
array of shape (rows, words_per_row).
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from maskd.specs import GrammarSpec


class GrammarCompileError(ValueError):
    """The engine refused the grammar; the message is the engine's."""


class UnsupportedSpec(GrammarCompileError):
    """The spec is well formed but this backend does not support it."""


@dataclasses.dataclass
class CompiledGrammar:
    spec: GrammarSpec
    handle: Any            # backend object (llguidance grammar string, xgrammar CompiledGrammar)
    compile_seconds: float
    prototype: Any = None  # backend's initial-state matcher that new matchers copy, if it has one
    # JSON documents in the output are checked by the validator: every finished one, and in complete
    # mode the sub-documents a relaxed grammar may not enforce (a maskd.server.json_schema
    # DocumentChecker); None for grammars without JSON schemas.
    checker: Any = None
    # Compiled by a server's fallback engine (engines/fallback.py): its matchers and bytes are that engine's.
    by_fallback: bool = False
    # A tool-call piece's state in composed arrays (its start row, its forced head: engines/tool_calls.py),
    # one for every array that uses the piece.
    piece: Any = None


def split_tokens(tokens: Sequence[int], counts: Sequence[int] | None) -> list[Sequence[int]]:
    """A batch's flat tokens as each matcher's own (``counts`` None: one each)."""
    if counts is None:
        return [(t,) for t in tokens]
    out: list[Sequence[int]] = []
    start = 0
    for c in counts:
        out.append(tokens[start:start + c])
        start += c
    return out


def single_tokens(matchers: Sequence[Any], tokens: Sequence[int], counts: Sequence[int] | None,
                  kind: type) -> tuple[list[tuple[int, Any, int]], list[tuple[int, Sequence[int]]]]:
    """A batch split for an engine's parallel one-token consume: (index, matcher, token) of the
    matchers of exactly ``kind`` given one token, and (index, tokens) of every other one with tokens."""
    singles: list[tuple[int, Any, int]] = []
    rest: list[tuple[int, Sequence[int]]] = []
    if counts is None:
        for i, (m, t) in enumerate(zip(matchers, tokens)):
            if type(m) is kind:
                singles.append((i, m, t))
            else:
                rest.append((i, (t,)))
        return singles, rest
    start = 0
    for i, (m, c) in enumerate(zip(matchers, counts)):
        if c == 1 and type(m) is kind:
            singles.append((i, m, tokens[start]))
        elif c:
            rest.append((i, tokens[start:start + c]))
        start += c
    return singles, rest


class Matcher(abc.ABC):
    """Per-sequence grammar state; a pure function of (grammar, accepted tokens)."""

    @abc.abstractmethod
    def consume(self, tokens: Sequence[int]) -> str | None:
        """Advances over tokens; returns None, or the engine's reason for rejecting one."""

    @abc.abstractmethod
    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar accepts, without advancing."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abc.abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward), possibly empty."""

    @abc.abstractmethod
    def is_accepting(self) -> bool: ...

    @abc.abstractmethod
    def is_stopped(self) -> bool:
        """Nothing but EOS can follow."""

    @abc.abstractmethod
    def reset(self) -> None: ...


class Engine(abc.ABC):
    name: str
    version: str
    matcher_type: type = Matcher     # what new_matcher builds (an engine with several: their base)
    # Told "loading" before and "loaded" after an engine loads more at a compile (the fallback's
    # secondary engine: seconds): a compile worker's time limit is for the grammar, not the load.
    load_listener: Callable[[str], None] | None = None

    def __init__(self, tokenizer, *, threads: int, json_schema_mode: str = "strict") -> None:
        self.tokenizer = tokenizer
        self.threads = threads
        # "strict" or "complete" (see maskd.specs.JSON_SCHEMA_MODES); part of every grammar id.
        self.json_schema_mode = json_schema_mode
        self.width = tokenizer.logits_width
        self.words_per_row = (self.width + 31) // 32

    @abc.abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compiles a spec; raises GrammarCompileError with the engine's message."""

    @abc.abstractmethod
    def new_matcher(self, grammar: CompiledGrammar) -> Matcher: ...

    # Tool-call arrays and templates composed from pieces (llguidance_engine, tool_calls.py); an
    # engine that does not compose them compiles each whole (the spec's text).
    def composed_parts(self, spec: GrammarSpec) -> Any:
        """The spec's parts where this engine composes its grammar from them, else None."""
        return None

    def piece_spec(self, spec: GrammarSpec, text: str) -> GrammarSpec:
        raise NotImplementedError

    def router(self, spec: GrammarSpec, parts: Any) -> Any:
        raise NotImplementedError

    def compose(self, spec: GrammarSpec, parts: Any, pieces: Sequence[CompiledGrammar],
                router: Any = None) -> CompiledGrammar | None:
        raise NotImplementedError

    def prepare(self, nice: int = 0) -> None:  # noqa: B027 -- most engines have nothing to build
        """What the engine builds once per process before serving (the server calls it at start);
        what it builds in the background runs at CPU priority ``nice`` (the server's compile_nice)."""

    def consume_batch(self, matchers: Sequence[Matcher], tokens: Sequence[int],
                      counts: Sequence[int] | None = None) -> list[str | None]:
        """Advances every matcher over its tokens, one flat array for the batch: matcher i's are
        the next ``counts[i]`` of ``tokens`` (``counts`` None: one each, the decode step).
        Returns a reason per rejected matcher (None where it consumed them all)."""
        return [m.consume(t) if len(t) else None for m, t in zip(matchers, split_tokens(tokens, counts))]

    @abc.abstractmethod
    def fill_batch(self, matchers: Sequence[Matcher], rows: Sequence[int],
                   drafts: Sequence[Sequence[int]] | None, out: np.ndarray) -> None:
        """Writes each matcher's mask into out[rows[i]]; with drafts, also the masks after each
        accepted draft token into out[rows[i] + 1 + j]. Rows past an invalid draft are zero."""

    # Serialized compiled grammars travel through the cluster cache.
    def serialize(self, grammar: CompiledGrammar) -> bytes:
        raise NotImplementedError

    def deserialize(self, spec: GrammarSpec, data: bytes, *, lazy: bool = False) -> CompiledGrammar:
        """``lazy``: the grammar was compiled by a worker that checked it; what only a matcher needs
        may wait for the first matcher."""
        raise NotImplementedError

    def allocate(self, rows: int) -> np.ndarray:
        return np.zeros((rows, self.words_per_row), dtype=np.int32)
