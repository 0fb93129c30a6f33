"""llguidance backend: the default engine.

Compilation is validation plus the grammar string llguidance builds matchers from;
batched consume and fill run on llguidance's parallel executor with the GIL released.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from maskd.server.engines.base import (
    CompiledGrammar,
    Engine,
    GrammarCompileError,
    Matcher,
    UnsupportedSpec,
    single_tokens,
)
from maskd.server.engines.llguidance_lark import Specials, StructuralTagLark, TagInfo, reasoning_lark
from maskd.server.engines.template_holes import HoleScanner, hole_tree
from maskd.server.engines.tool_calls import (
    ComposedGrammar,
    ComposedMatcher,
    Piece,
    boundary_tables,
    fill_rows,
    fill_with_drafts,
    name_set,
    plain_names,
)
from maskd.server.json_schema import (
    CallArrayChecker,
    Relaxation,
    RelaxError,
    TagSpan,
    TemplateChecker,
    ValidatorError,
    checker_from_description,
    describe_checker,
    document_checker,
    grammar_formats,
    relax_schema,
    tag_span,
    tool_call_checker,
    whole_schema,
)
from maskd.server.json_schema.closers import closer_table
from maskd.server.priority import lower_priority
from maskd.specs import PIECE_KIND, GrammarSpec
from maskd.template_specs import TemplateParts
from maskd.tool_specs import ToolCallParts

log = logging.getLogger("maskd.server.engines.llguidance")

# Bumped when maskd changes how a spec maps onto llguidance (it is part of every grammar id).
_MAPPING_REVISION = 6
# A serialized grammar with document checks: magic, 8-byte length, the checker's description, grammar.
_CHECKED_MAGIC = b"maskd-checked-grammar-v2\n"
# x-guidance options that loosen the schema: only complete mode relaxes (and then validates).
_LOOSENING = ("lenient", "coerce_one_of")
_WHITESPACE_KEYS = {"whitespace_flexible", "whitespace_pattern"}
# Routers of composed tool-call arrays kept by (names, options): a request that only reorders its tools.
_ROUTERS_KEPT = 64


def _first_line(message: str) -> str:
    """llguidance appends its parser state dump to errors; keep what a person can act on."""
    head = message.split("\n<state>", 1)[0].strip()
    return head if len(head) <= 2000 else head[:2000] + "..."


class LLGuidanceMatcher(Matcher):
    __slots__ = ("m",)

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self.m = m

    def consume(self, tokens: Sequence[int]) -> str | None:
        if not tokens:
            return None
        # One token goes through consume_token, as in the batched path (consume_token_par): once a
        # grammar has stopped (a JSON document's root closed), llguidance's consume_token takes EOS
        # but its consume_tokens refuses it ("parser stopped"), so a sequence alone in its step
        # would fail where the same sequence in a batch passes.
        ok = self.m.consume_token(tokens[0]) if len(tokens) == 1 else self.m.consume_tokens(list(tokens))
        if ok:
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
    because sessions on other threads may copy the same grammar's prototype at once. A lazy one
    (a grammar a compile worker checked) builds its matcher at the first copy or ``build``."""
    __slots__ = ("grammar", "ll", "lock", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher | None, ll: llguidance.LLTokenizer | None = None,
                 grammar: str = "") -> None:
        self.matcher = matcher
        self.ll, self.grammar = ll, grammar
        self.lock = threading.Lock()

    def build(self) -> llguidance.LLMatcher:
        """The prototype's matcher (under the lock)."""
        if self.matcher is None:
            assert self.ll is not None
            matcher = llguidance.LLMatcher(self.ll, self.grammar, log_level=0)
            if matcher.is_error():
                raise GrammarCompileError(_first_line(matcher.get_error()))
            self.matcher = matcher
        return self.matcher

    def copy(self) -> llguidance.LLMatcher:
        with self.lock:
            return self.build().deep_copy()


def whitespace_pattern(max_whitespace: int) -> str:
    """llguidance's whitespace_pattern for flexible JSON with at most max_whitespace characters in a row."""
    return f"[\\x20\\x0A\\x0D\\x09]{{1,{max_whitespace}}}"


def bounds_whitespace(version: str = llguidance.__version__) -> bool:
    """Whether this llguidance honours whitespace_pattern, the bound of flexible JSON's whitespace
    runs: from 1.8.0. Older ones (vLLM 0.32 and 0.33 pin llguidance<1.8) accept it and ignore it."""
    try:
        return tuple(int(p) for p in version.split(".")[:2]) >= (1, 8)
    except ValueError:      # a development build: assume it is new
        return True


@functools.cache
def _warn_unbounded_whitespace() -> None:
    log.warning("llguidance %s ignores whitespace_pattern: flexible JSON's whitespace runs are not bounded "
                "(max_whitespace) in this process; the server needs llguidance>=1.8 (pip install "
                "'llguidance>=1.8')", llguidance.__version__)


class LLGuidanceEngine(Engine):
    name = "llguidance"
    version = f"{llguidance.__version__}+maskd.{_MAPPING_REVISION}"

    def __init__(self, tokenizer, *, threads: int, json_schema_mode: str = "strict") -> None:
        super().__init__(tokenizer, threads=threads, json_schema_mode=json_schema_mode)
        if not bounds_whitespace():
            _warn_unbounded_whitespace()
        self.ll = tokenizer.ll
        self.executor = llguidance.LLExecutor(num_threads=max(1, threads))
        self._specials: Specials | None = None
        self._specials_lock = threading.Lock()
        self._routers: collections.OrderedDict[tuple, tuple[str, _Prototype]] = collections.OrderedDict()
        self._routers_lock = threading.Lock()

    @property
    def specials(self) -> Specials:
        with self._specials_lock:
            if self._specials is None:
                self._specials = Specials(self.tokenizer)
            return self._specials

    # -- compile -----------------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        if spec.kind == "json_schema":
            (grammar, probe), checker = self._json_schema(spec)
        elif spec.kind == "structural_tag":
            (grammar, probe), checker = self._structural_tag(spec)
        elif spec.kind == PIECE_KIND:
            (grammar, probe), checker = self._tool_parameters(spec)
        else:
            grammar = self.grammar_text(spec)
            probe, checker = self._checked(grammar), None
        prototype = _Prototype(probe) if probe is not None else _Prototype(None, self.ll, grammar)
        return CompiledGrammar(spec, grammar, time.perf_counter() - t0, prototype, checker=checker)

    def grammar_text(self, spec: GrammarSpec) -> str:
        """The llguidance grammar of a regex, lark, ebnf or choice spec (before any check)."""
        if spec.kind == "regex":
            body = "/" + spec.text.replace("/", "\\/") + "/"
            if not spec.reasoning_end:
                return llguidance.LLMatcher.grammar_from_regex(spec.text)
        elif spec.kind == "choice":
            body = "(" + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.text)) + ")"
        elif spec.reasoning_end:
            raise UnsupportedSpec(f"a reasoning prefix is supported for json_schema, structural_tag, regex and "
                                  f"choice, not {spec.kind}")
        elif spec.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec.text)
        elif spec.kind == "ebnf":
            try:
                return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.text))
            except Exception as exc:
                raise GrammarCompileError(f"cannot convert the GBNF grammar to Lark: {exc}") from exc
        else:
            raise UnsupportedSpec(f"llguidance does not support {spec.kind}")
        if spec.reasoning_end:
            return self._lark(reasoning_lark(spec.reasoning_start, spec.reasoning_end, self.specials, body))
        return llguidance.LLMatcher.grammar_from_lark("start: " + body)

    def _checked(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher in the grammar's initial state, or GrammarCompileError with llguidance's message.
        Building the matcher parses and checks the grammar as ``validate_grammar_with_warnings``
        does (the same errors, the same messages) and builds its lexer and parser too; validating
        first parsed it twice (55 of 137 ms for a 200-tool call array)."""
        probe = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if probe.is_error():
            raise GrammarCompileError(_first_line(probe.get_error() or "grammar does not compile"))
        return probe

    def _validated(self, grammar: str) -> None:
        """GrammarCompileError with llguidance's message where the grammar does not compile; the
        matcher's own checks (the same errors, the same messages) without building its parser:
        0.5 of a tool piece's 1.5 ms."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll)
        if error:
            raise GrammarCompileError(_first_line(error))

    @staticmethod
    def _lark(text: str) -> str:
        try:
            return llguidance.LLMatcher.grammar_from_lark(text)
        except ValueError as exc:
            raise GrammarCompileError(_first_line(str(exc))) from exc

    # -- JSON schemas --------------------------------------------------------------------------------
    def _json_schema(self, spec: GrammarSpec):
        schema = json.loads(spec.text)
        markers = (self.specials.marked(spec.reasoning_start), self.specials.marked(spec.reasoning_end))
        try:
            compiled, words = self._whole(spec, schema)
        except GrammarCompileError as exc:
            if self.json_schema_mode != "complete" or not isinstance(schema, dict):
                raise
            strict_error = str(exc)
        else:
            if not words:
                return compiled, self._final_check(schema, markers)
            try:   # the grammar leaves some keywords to the validator: early checks where they apply
                return compiled, document_checker(schema, self.tokenizer, markers, words)
            except ValidatorError as exc:   # no validator: the schema's own grammar, enforced alone
                log.info("json schema enforced by the grammar alone: %s", exc)
                return self._json_grammar(spec, schema, lenient=False), None
        relaxed, compiled = self._relax(spec, schema, strict_error, number_rows=True)
        try:
            checker = document_checker(schema, self.tokenizer, markers, relaxed.keywords)
        except ValidatorError as exc:
            raise GrammarCompileError(f"{strict_error} (complete mode: {exc})") from exc
        log.info("json schema relaxed for complete mode (%s); the grammar refused it: %s",
                 relaxed.describe(), strict_error[:200])
        return compiled, checker

    def _whole(self, spec: GrammarSpec, schema: Any) -> tuple[tuple[str, llguidance.LLMatcher], frozenset[str]]:
        """The grammar of a schema compiled whole, and the keywords it leaves to the validator: in
        complete mode, the schema as ``whole_schema`` rewrites it (allOf members' keys in any
        order, number bounds to the rows, big integer constants), else (or where that does not
        compile) the schema itself."""
        if self.json_schema_mode == "complete" and isinstance(schema, dict):
            grammar_schema, words = whole_schema(schema, self._regex_ok)
            if words:
                try:
                    return self._json_grammar(spec, grammar_schema, lenient=False), words
                except GrammarCompileError:
                    pass
        return self._json_grammar(spec, schema, lenient=False), frozenset()

    def _final_check(self, schema: Any, markers: tuple[bytes, bytes]):
        """The validator's check of every finished document of a grammar llguidance compiled whole:
        microseconds per document, and it catches the grammar engine's own mistakes. A schema the
        validator cannot take keeps the grammar alone (it compiled exactly), with a log line."""
        try:
            return document_checker(schema, self.tokenizer, markers)
        except ValidatorError as exc:
            log.info("json schema enforced by the grammar alone: %s", exc)
            return None

    def _json_options(self, spec: GrammarSpec, schema: dict, lenient: bool) -> dict:
        """The schema's x-guidance options: ours for whitespace (unless the schema sets its own), never
        a loosening the caller asked for inside the schema (complete mode relaxes, with a validator)."""
        user = schema.get("x-guidance")
        opts = {k: v for k, v in user.items() if k not in _LOOSENING} if isinstance(user, dict) else {}
        if spec.whitespace == "compact":
            opts.pop("whitespace_pattern", None)
            opts["whitespace_flexible"] = False
        elif spec.max_whitespace and not _WHITESPACE_KEYS & opts.keys():
            opts["whitespace_pattern"] = whitespace_pattern(spec.max_whitespace)
        if lenient:
            opts["lenient"] = True
        return opts

    def _json_text(self, spec: GrammarSpec, schema: Any, lenient: bool) -> str:
        if schema is True:
            schema = {}
        if isinstance(schema, dict):
            if self.json_schema_mode == "complete":
                schema = grammar_formats(schema)   # date and time as exact as the validator
            schema = {**schema, "x-guidance": self._json_options(spec, schema, lenient)}
        return json.dumps(schema, ensure_ascii=False)

    def _json_grammar(self, spec: GrammarSpec, schema: Any, lenient: bool) -> tuple[str, llguidance.LLMatcher]:
        text = self._json_text(spec, schema, lenient)
        if spec.reasoning_end:
            grammar = self._lark(reasoning_lark(spec.reasoning_start, spec.reasoning_end, self.specials,
                                                "%json " + text))
        else:
            grammar = self._json_form(text)
        return grammar, self._checked(grammar)

    def _relax(self, spec: GrammarSpec, schema: dict, strict_error: str, number_rows: bool = False):
        built: dict[str, tuple[str, llguidance.LLMatcher]] = {}

        def try_compile(candidate: Any, lenient: bool) -> str | None:
            try:
                built["last"] = self._json_grammar(spec, candidate, lenient)
                return None
            except GrammarCompileError as exc:
                return str(exc)

        try:
            relaxed = relax_schema(schema, try_compile, self._regex_ok, number_rows)
        except RelaxError as exc:
            raise GrammarCompileError(f"{strict_error} (complete mode: even the relaxed schema does not "
                                      f"compile: {_first_line(str(exc))})") from exc
        return relaxed, built["last"]

    @staticmethod
    def _regex_ok(pattern: str) -> bool:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps({"type": "string", "pattern": pattern}, ensure_ascii=False))
            is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
            return not is_error
        except ValueError:
            return False

    # -- structural tags -----------------------------------------------------------------------------
    def _structural_tag(self, spec: GrammarSpec):
        tag = json.loads(spec.text)
        plain = dataclasses.replace(spec, kind="json_schema", reasoning_start="", reasoning_end="")
        relaxations: dict[str, Relaxation] = {}

        def json_body(schema: Any) -> tuple[str, bool]:
            try:
                self._json_grammar(plain, schema, lenient=False)
                return "%json " + self._json_text(plain, schema, False), False
            except GrammarCompileError as exc:
                if self.json_schema_mode != "complete" or not isinstance(schema, dict):
                    raise GrammarCompileError(f"a tool's JSON schema does not compile: {exc}") from exc
                relaxed, _ = self._relax(plain, schema, f"a tool's JSON schema does not compile: {exc}")
                relaxations[json.dumps(schema, sort_keys=True)] = relaxed
                return "%json " + self._json_text(plain, relaxed.schema, True), True

        builder = StructuralTagLark(self.specials, json_body)
        top = builder.build(tag)
        if builder.loose_json:
            raise GrammarCompileError(
                f"a JSON schema at {builder.loose_json[0]} needs complete mode's check, which applies to the "
                "JSON content of a tag (begin, content, end); put it in a tag or make it compile in strict mode")
        if spec.reasoning_end:
            body, rules = top.split("\n", 1)
            text = reasoning_lark(spec.reasoning_start, spec.reasoning_end, self.specials,
                                  body.removeprefix("start: ")) + rules
        else:
            text = top
        grammar = self._lark(text)
        probe = self._checked(grammar)
        checker = None
        if any(t.is_json and t.json_schema is not None for t in builder.tags):   # every call's arguments checked
            markers = (self.specials.marked(spec.reasoning_start), self.specials.marked(spec.reasoning_end))
            checker = tool_call_checker([self._tag_span(t, relaxations) for t in builder.tags], self.tokenizer, markers)
        return (grammar, probe), checker

    def _tag_span(self, tag: TagInfo, relaxations: dict[str, Relaxation]) -> TagSpan:
        names = {v: k.encode() for k, v in self.specials.ids.items()}

        def marked(x: str | int) -> bytes:
            return b"\xff" + names[x] if isinstance(x, int) else self.specials.marked(x)

        label = tag.begin if isinstance(tag.begin, str) else names[tag.begin].decode("utf-8", "replace")
        begin, ends = marked(tag.begin), tuple(marked(e) for e in tag.ends)
        schema = tag.json_schema if tag.is_json else None
        if not tag.relaxed:   # compiled whole: the final check only, if the validator takes the schema
            try:
                return tag_span(begin, ends, tag.is_json, schema, frozenset(), label[:80])
            except ValidatorError as exc:
                log.info("a tool's JSON schema is enforced by the grammar alone: %s", exc)
                return tag_span(begin, ends, tag.is_json, None, None, label[:80])
        keywords = relaxations[json.dumps(tag.json_schema, sort_keys=True)].keywords
        try:
            return tag_span(begin, ends, tag.is_json, schema, keywords, label[:80])
        except ValidatorError as exc:
            raise GrammarCompileError(f"a tool's JSON schema does not compile (complete mode: {exc})") from exc

    def prepare(self, nice: int = 0) -> None:
        boundary_tables(self.tokenizer, self.words_per_row)   # tool-call arrays' boundaries (~0.25 s)
        # JSON documents' closing tokens (a Python pass over the vocabulary: 1.1 s on deepseek-v4,
        # 4 s on qwen3.6). Built at the first grammar with document checks, it held the step path's
        # GIL and core for as long; built here on a thread at the compiles' priority, it is ready
        # before most servers see a grammar, without holding up the start (a grammar loaded sooner
        # waits for it).
        threading.Thread(target=self._warm_closers, args=(nice,), daemon=True, name="maskd-warm-closers").start()

    def _warm_closers(self, nice: int) -> None:
        lower_priority(nice, thread=True)
        closer_table(self.tokenizer)

    # -- tool-call arrays composed from per-tool pieces (tool_calls.py) ---------------------------
    def composed_parts(self, spec: GrammarSpec) -> ToolCallParts | TemplateParts | None:
        """The parts of a spec that is a ``tool_choice: "required"`` call array or a template with
        its arguments, or None (in compact JSON too: tool_calls.py says how a span of bytes forced
        across the router and the pieces is served)."""
        if spec.kind != "json_schema" or spec.reasoning_end:
            return None
        return spec.parts

    def piece_spec(self, spec: GrammarSpec, text: str) -> GrammarSpec:
        """A tool's parameters as a grammar of their own, with the array's options."""
        return dataclasses.replace(spec, kind=PIECE_KIND, text=text, parts=None)

    def _tool_parameters(self, spec: GrammarSpec):
        """A piece: the parameters' JSON document followed by any bytes, as in the array (where a
        call's object goes on after its parameters). Ending there would make llguidance force the
        document's last bytes and keep, of the tokens that write them, only the canonical ones (after
        ``{"x":7`` in compact JSON: ``}}`` but not ``}``), where the array's grammar forces nothing.
        Strict only: a schema the grammar refuses makes its array compile whole (complete mode's
        relaxations and checks work on whole documents). Checked, not built: a request names many
        tools and calls one or two, whose matchers are built where a call first needs them."""
        schema = json.loads(spec.text)
        text = self._json_text(spec, schema, lenient=False)
        self._validated(self._json_form(text))
        return (self._lark(f"start: %json {text} /(?s:.*)/\n"), None), self._final_check(schema, (b"", b""))

    @staticmethod
    def _json_form(text: str) -> str:
        """A JSON schema's text as an llguidance grammar (GrammarCompileError where it is refused).
        A tool piece is checked in this form: the same outcome as its Lark form on every
        MaskBench-dev schema (4,480 checks: both modes, both whitespace options) in about half the
        time (llguidance's Lark front end costs ~0.5 ms a grammar; docs/benchmarks.md, "Tool pieces
        checked as JSON-schema grammars")."""
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text)
        except ValueError as exc:
            raise GrammarCompileError(_first_line(str(exc))) from exc

    def compose(self, spec: GrammarSpec, parts: ToolCallParts | TemplateParts, pieces: Sequence[CompiledGrammar],
                router: tuple[str, _Prototype] | None = None) -> CompiledGrammar | None:
        """The call array (or template) of ``spec`` from its router (compiled here: a call array's
        shape is maskd's, only the names are the request's; a template's is the template with its
        holes any object) and its compiled pieces; None where a piece is only a relaxation (complete
        mode's early checks work on whole documents: the grammar compiles whole)."""
        t0 = time.perf_counter()
        validators = {}
        for name, piece in zip(parts.names, pieces):
            if not Piece.of(piece).holds_an_object():
                return None      # a tool's parameters that take more than objects: compiled whole
            checker = piece.checker
            if checker is not None and checker.scans:
                return None
            if checker is not None:
                validators[name] = checker.validator
        tables = boundary_tables(self.tokenizer, self.words_per_row)
        names = None
        if isinstance(parts, ToolCallParts):
            if not plain_names(parts.names):
                return None      # a name with a '"', a backslash or a control character: compiled whole
            names = name_set(parts.names, tables)
            names.prepare(tables)
        text, prototype = router or self.router(spec, parts)
        handle = ComposedGrammar(prototype, text, {n: Piece.of(p) for n, p in zip(parts.names, pieces)}, tables,
                                 compact=spec.whitespace == "compact", names=names)
        checker = CallArrayChecker(validators, self.tokenizer) if validators else None
        if isinstance(parts, TemplateParts):
            handle.scanner = functools.partial(HoleScanner, hole_tree(parts.paths))
            handle.whole, handle.inside = "the template", "the values of hole"
            checker = TemplateChecker(validators, parts.paths, self.tokenizer) if validators else None
        return CompiledGrammar(spec, handle, time.perf_counter() - t0, checker=checker)

    def router(self, spec: GrammarSpec, parts: ToolCallParts | TemplateParts) -> tuple[str, _Prototype]:
        """The router: its grammar and prototype, kept by what it depends on: a call array's bound
        and whitespace (its names are the composed matcher's: one router serves every set of
        tools) and the last templates (one router for any arguments)."""
        key = (parts.router_key(), spec.whitespace, spec.max_whitespace)
        with self._routers_lock:
            found = self._routers.get(key)
            if found is not None:
                self._routers.move_to_end(key)
                return found
        schema = parts.router_schema()
        router_spec = dataclasses.replace(spec, text=json.dumps(schema, ensure_ascii=False, separators=(",", ":")),
                                          parts=None)
        grammar, probe = self._json_grammar(router_spec, schema, lenient=False)
        found = (grammar, _Prototype(probe))
        with self._routers_lock:
            self._routers[key] = found
            while len(self._routers) > _ROUTERS_KEPT:
                self._routers.popitem(last=False)
        return found

    def new_matcher(self, grammar: CompiledGrammar) -> LLGuidanceMatcher | ComposedMatcher:
        if isinstance(grammar.handle, ComposedGrammar):
            return ComposedMatcher(grammar.handle)
        # A fresh matcher is a copy of the grammar's untouched prototype (microseconds), not a
        # new parse of the grammar (milliseconds).
        proto = grammar.prototype
        if proto is None:
            proto = grammar.prototype = _Prototype(llguidance.LLMatcher(self.ll, grammar.handle, log_level=0))
        return LLGuidanceMatcher(proto.copy())

    def consume_batch(self, matchers, tokens, counts=None):
        reasons: list[str | None] = [None] * len(matchers)
        singles, rest = single_tokens(matchers, tokens, counts, LLGuidanceMatcher)
        if len(singles) > 1:     # one token each, in parallel on llguidance's threads
            ok = self.executor.consume_token_par([(m.m, t) for _, m, t in singles])
            for (i, m, _), good in zip(singles, ok):
                if not good:
                    reasons[i] = _first_line(m.m.get_error())
        else:
            rest += [(i, (t,)) for i, _, t in singles]
        for i, each in rest:
            reasons[i] = matchers[i].consume(each)
        return reasons

    def fill_batch(self, matchers, rows, drafts, out: np.ndarray) -> None:
        assert out.dtype == np.int32 and out.flags["C_CONTIGUOUS"] and out.shape[1] == self.words_per_row
        if any(type(m) is ComposedMatcher for m in matchers):
            self._fill_composed(matchers, rows, drafts, out)
            return
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

    def _fill_composed(self, matchers, rows, drafts, out: np.ndarray) -> None:
        """A batch with composed sequences: theirs filled apart (with drafts one by one), the rest as usual."""
        drafts = drafts or [()] * len(matchers)
        composed = [(m, r) for m, r, d in zip(matchers, rows, drafts) if type(m) is ComposedMatcher and not d]
        if composed:
            fill_rows(self.executor, [m for m, _ in composed], [r for _, r in composed], out)
        for m, r, d in zip(matchers, rows, drafts):
            if type(m) is ComposedMatcher and d:
                fill_with_drafts(self.executor, m, r, d, out)
        rest = [(m, r, d) for m, r, d in zip(matchers, rows, drafts) if type(m) is not ComposedMatcher]
        if rest:
            self.fill_batch([m for m, _, _ in rest], [r for _, r, _ in rest],
                            [d for _, _, d in rest] if any(d for _, _, d in rest) else None, out)

    def serialize(self, grammar: CompiledGrammar) -> bytes:
        if isinstance(grammar.handle, ComposedGrammar):
            raise NotImplementedError("a composed tool-call grammar is composed again from its pieces")
        if grammar.checker is None:
            return grammar.handle.encode()
        head = json.dumps(describe_checker(grammar.checker), ensure_ascii=False).encode()
        return _CHECKED_MAGIC + len(head).to_bytes(8, "little") + head + grammar.handle.encode()

    def deserialize(self, spec: GrammarSpec, data: bytes, *, lazy: bool = False) -> CompiledGrammar:
        """A grammar compiled elsewhere (a compile worker, another replica): its prototype matcher is
        built here, off the step path, and its document checker (validators do not serialize) is
        built again from the description that came with it."""
        checker = None
        if data.startswith(_CHECKED_MAGIC):
            at = len(_CHECKED_MAGIC)
            size = int.from_bytes(data[at:at + 8], "little")
            try:
                checker = checker_from_description(json.loads(data[at + 8:at + 8 + size]), self.tokenizer)
            except (ValueError, KeyError, TypeError, ValidatorError) as exc:
                raise GrammarCompileError(f"cannot load the serialized grammar's document checks: {exc}") from exc
            data = data[at + 8 + size:]
        t0 = time.perf_counter()
        grammar = data.decode()
        if lazy:
            return CompiledGrammar(spec, grammar, time.perf_counter() - t0, _Prototype(None, self.ll, grammar),
                                   checker=checker)
        probe = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if probe.is_error():
            raise GrammarCompileError(_first_line(probe.get_error()))
        return CompiledGrammar(spec, grammar, time.perf_counter() - t0, _Prototype(probe), checker=checker)
