"""llguidance backend: the default engine.

Compilation is validation plus the grammar string llguidance builds matchers from;
batched consume and fill run on llguidance's parallel executor with the GIL released.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from maskd.server.engines.base import CompiledGrammar, Engine, GrammarCompileError, Matcher, UnsupportedSpec
from maskd.specs import GrammarSpec


def _first_line(message: str) -> str:
    """llguidance appends its parser state dump to errors; keep what a person can act on."""
    head = message.split("\n<state>", 1)[0].strip()
    return head if len(head) <= 2000 else head[:2000] + "..."


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _reasoning_lexeme(start: str, end: str) -> str:
    """A lexeme for start ... end where the body never contains end (a lazy match)."""
    s, e = re.escape(start).replace("/", "\\/"), re.escape(end).replace("/", "\\/")
    return f"/{s}(?s:.*){e}/ & ~/(?s:.*{e}.+)/"


class LLGuidanceMatcher(Matcher):
    __slots__ = ("m",)

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self.m = m

    def consume(self, tokens: Sequence[int]) -> str | None:
        if not tokens:
            return None
        if self.m.consume_tokens(list(tokens)):
            return None
        return _first_line(self.m.get_error())

    def validate(self, tokens: Sequence[int]) -> int:
        return self.m.validate_tokens(list(tokens))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.m.rollback(num_tokens):
            raise ValueError(_first_line(self.m.get_error()) or f"cannot roll back {num_tokens} tokens")

    def forced_tokens(self) -> list[int]:
        return self.m.compute_ff_tokens()

    def is_accepting(self) -> bool:
        return self.m.is_accepting()

    def is_stopped(self) -> bool:
        return self.m.is_stopped()

    def reset(self) -> None:
        self.m.reset()


class _Prototype:
    """A matcher in its initial state that new sequences copy; copies are serialized by a lock
    because sessions on other threads may copy the same grammar's prototype at once."""
    __slots__ = ("lock", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.lock = threading.Lock()

    def copy(self) -> llguidance.LLMatcher:
        with self.lock:
            return self.matcher.deep_copy()


class LLGuidanceEngine(Engine):
    name = "llguidance"
    version = llguidance.__version__

    def __init__(self, tokenizer, *, threads: int) -> None:
        super().__init__(tokenizer, threads=threads)
        self.ll = tokenizer.ll
        self.executor = llguidance.LLExecutor(num_threads=max(1, threads))

    def grammar_text(self, spec: GrammarSpec) -> str:
        """The llguidance grammar for a spec (raises GrammarCompileError when it cannot be built)."""
        compact = spec.whitespace == "compact"
        if spec.reasoning_start:
            return llguidance.LLMatcher.grammar_from_lark(self._reasoning_lark(spec, compact))
        if spec.kind == "json_schema":
            overrides: Any = {"whitespace_flexible": False} if compact else None
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=overrides)
            except ValueError as exc:
                raise GrammarCompileError(str(exc)) from exc
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec.text)
        if spec.kind == "ebnf":
            try:
                return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.text))
            except Exception as exc:
                raise GrammarCompileError(f"cannot convert the GBNF grammar to Lark: {exc}") from exc
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(self._choice_lark(spec))
        raise UnsupportedSpec(f"the llguidance backend does not support {spec.kind}; use --backend xgrammar")

    @staticmethod
    def _choice_lark(spec: GrammarSpec) -> str:
        return "start: " + " | ".join(_lark_literal(c) for c in json.loads(spec.text))

    def _reasoning_lark(self, spec: GrammarSpec, compact: bool) -> str:
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            if compact and isinstance(schema, dict):
                schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_flexible": False}}
            body = "%json " + json.dumps(schema, ensure_ascii=False)
        elif spec.kind == "regex":
            body = "/" + spec.text.replace("/", "\\/") + "/"
        elif spec.kind == "choice":
            body = "(" + " | ".join(_lark_literal(c) for c in json.loads(spec.text)) + ")"
        else:
            raise UnsupportedSpec(f"a reasoning prefix is supported for json_schema, regex and choice, not {spec.kind}")
        return (f"start: REASONING body\nbody: {body}\n"
                f"REASONING: {_reasoning_lexeme(spec.reasoning_start, spec.reasoning_end)}\n")

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        grammar = self.grammar_text(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll)
        if is_error:
            raise GrammarCompileError(_first_line(messages[0] if messages else "grammar does not compile"))
        # Building one matcher does the remaining (lexer/parser) construction and catches
        # errors that validation leaves to the first matcher.
        probe = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if probe.is_error():
            raise GrammarCompileError(_first_line(probe.get_error()))
        return CompiledGrammar(spec, grammar, time.perf_counter() - t0, _Prototype(probe))

    def new_matcher(self, grammar: CompiledGrammar) -> LLGuidanceMatcher:
        # A fresh matcher is a copy of the grammar's untouched prototype (microseconds), not a
        # new parse of the grammar (milliseconds).
        proto = grammar.prototype
        if proto is None:
            proto = grammar.prototype = _Prototype(llguidance.LLMatcher(self.ll, grammar.handle, log_level=0))
        return LLGuidanceMatcher(proto.copy())

    def consume_batch(self, matchers, tokens):
        reasons: list[str | None] = [None] * len(matchers)
        singles = [(i, m.m, t[0]) for i, (m, t) in enumerate(zip(matchers, tokens)) if len(t) == 1]
        if len(singles) > 1:
            ok = self.executor.consume_token_par([(m, t) for _, m, t in singles])
            for (i, m, _), good in zip(singles, ok):
                if not good:
                    reasons[i] = _first_line(m.get_error())
            done = {i for i, _, _ in singles}
        else:
            done = set()
        for i, (m, t) in enumerate(zip(matchers, tokens)):
            if i not in done and t:
                reasons[i] = m.consume(t)
        return reasons

    def fill_batch(self, matchers, rows, drafts, out: np.ndarray) -> None:
        assert out.dtype == np.int32 and out.flags["C_CONTIGUOUS"] and out.shape[1] == self.words_per_row
        batch = out.shape[0]
        if drafts is None or not any(drafts):
            self.executor.unsafe_compute_mask_ptr(
                [(m.m, r) for m, r in zip(matchers, rows)], out.ctypes.data, out.shape[1] * 4, batch)
            return
        # llguidance's draft fill refuses an empty draft list: a batch in speculative decoding
        # mixes sequences with and without drafts, so those without go through the plain fill.
        plain, jobs = [], []
        for m, r, d in zip(matchers, rows, drafts):
            if d:
                out[r: r + 1 + len(d)] = 0
                jobs.append((m.m, r, list(d)))
            else:
                plain.append((m.m, r))
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, out.ctypes.data, out.shape[1] * 4, batch)
        self.executor.unsafe_compute_mask_ptr_with_draft_token(jobs, out.ctypes.data, out.shape[1] * 4, batch)

    def serialize(self, grammar: CompiledGrammar) -> bytes:
        return grammar.handle.encode()

    def deserialize(self, spec: GrammarSpec, data: bytes) -> CompiledGrammar:
        """A grammar compiled elsewhere (a compile worker, another replica): its prototype matcher is
        built here, off the step path."""
        t0 = time.perf_counter()
        grammar = data.decode()
        probe = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if probe.is_error():
            raise GrammarCompileError(_first_line(probe.get_error()))
        return CompiledGrammar(spec, grammar, time.perf_counter() - t0, _Prototype(probe))
