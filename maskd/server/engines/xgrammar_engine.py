"""xgrammar backend: EBNF, structural tags, and a compiled-grammar cache worth sharing.

xgrammar compiles a grammar against the whole vocabulary up front (adaptive token masks), so
compiles are slow and masks fast; ``CompiledGrammar.serialize_json`` lets the cluster cache
carry compiled grammars between replicas.

Vocabulary. xgrammar's ``TokenizerInfo`` is built from the same vocabulary as the loaded
tokenizer: for a tokenizer.json (``hf:PATH``, ``deepseek-v4``) through
``TokenizerInfo.from_huggingface``, otherwise (tiktoken files, model ids) as a RAW vocabulary of
the token byte strings llguidance holds. Either way the tokens llguidance treats as special are
given to xgrammar as empty strings, which xgrammar treats as special too: never allowed by a
grammar (from_huggingface alone would expose deepseek-v4's 1,279 special added tokens such as
``<｜place▁holder▁no▁0｜>`` as ordinary text inside JSON strings). Stop tokens are the
tokenizer's EOS ids.

Semantics, against the llguidance backend (same tokenizer, same spec):

- json_schema: ``strict_mode=False`` (JSON Schema semantics: additionalProperties default true,
  as llguidance); whitespace "flexible" is ``any_whitespace=True`` with ``max_whitespace_cnt`` the
  spec's ``max_whitespace`` (0: unbounded), "compact" is no whitespace and separators ``(",", ":")``.
  The JSON schema mode does not change what xgrammar compiles (it loosens by itself: minItems,
  maxItems, ...); in complete mode every finished JSON document is also checked by the validator
  before EOS (maskd.server.json_schema.documents), so no invalid document ends with EOS on this backend either.
- Where the grammar forces a literal, llguidance allows only the canonical token(s) of that text;
  xgrammar allows every token that is a prefix of it (e.g. ``h``, ``he`` ... ``hello``).
- Regex ``.`` also matches newlines in xgrammar.
- Inside JSON strings xgrammar also allows DEL (0x7f), the ``\\/`` escape and every ``\\uXXXX``
  escape; llguidance is narrower there.
- lark goes through xgrammar's own Lark front end (``compile_lark``): plain rules, terminals,
  regexes and ``%json`` work; llguidance-only operators (``&``, ``~``, ...) are compile errors.

- structural_tag: the JSON goes to ``compile_structural_tag`` (the legacy
  ``{"structures", "triggers"}`` form is converted); the whitespace option does not apply.
- A reasoning prefix is a structural-tag ``tag`` (begin, ``any_text``, end) concatenated before
  the body (``Grammar.concat``; a ``sequence`` for structural tags): every kind supports it.
- Forced tokens: the canonical tokens of ``find_jump_forward_string`` (see forced_tokens); equal
  to llguidance's with flexible JSON, sometimes one token longer with compact JSON.
- After EOS a matcher is terminated; its row allows only EOS (never an all-zero row).

Masks. Batches go through ``BatchGrammarMatcher`` (``threads`` workers) straight into the
caller's int32 array (numpy passes through DLPack; no torch tensor needed); xgrammar sets the
bits past the logits width in the last word, which are cleared. Drafts are filled level by
level (accept draft j on every matcher, batch-fill), then rolled back. The fill runs in C++ with
the GIL released: tvm_ffi releases it on every call (``TVM_FFI_RELEASE_GIL_BY_DEFAULT=1``);
measured, a 90 ms batch fill in one thread stalled a Python loop in another for at most 2 ms.
"""
from __future__ import annotations

import json
import logging
import re
import time
import zlib
from collections.abc import Sequence

import numpy as np
import xgrammar as xgr

from maskd.server.engines.base import CompiledGrammar, Engine, GrammarCompileError, Matcher, single_tokens
from maskd.server.engines.revisions import xgrammar_engine_version
from maskd.server.json_schema import ValidatorError, document_checker
from maskd.specs import GrammarSpec

log = logging.getLogger("maskd.server.engines.xgrammar")

_FORCED_LIMIT = 32            # forced_tokens looks this many tokens ahead at most
_ZMAGIC = b"XGZ1"             # serialized grammars: magic + zlib(serialize_json)
_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] [^\s:]+:\d+: ")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: ", re.S)


def _message(exc: BaseException) -> str:
    """xgrammar's message without the C++ log prefix (time, file:line, failed check)."""
    msg = str(exc).strip()
    msg = _LOG_PREFIX.sub("", msg)
    msg = _CHECK_PREFIX.sub("", msg).strip()
    if not msg:
        msg = type(exc).__name__
    return msg if len(msg) <= 2000 else msg[:2000] + "..."


def _few_allowed(row: np.ndarray, limit: int = 64) -> list[int] | None:
    """The token ids a mask row allows, or None when there are more than ``limit`` (or they
    spread over more than ``limit // 8`` words, which is checked first because it is cheap)."""
    words = np.flatnonzero(row)
    if len(words) > limit // 8:
        return None
    ids = []
    for w in words.tolist():
        bits = int(row[w]) & 0xFFFFFFFF
        while bits:
            low = bits & -bits
            ids.append(w * 32 + low.bit_length() - 1)
            bits ^= low
    return ids if len(ids) <= limit else None


def build_tokenizer_info(tokenizer, source: str = "auto") -> xgr.TokenizerInfo:
    """An xgrammar TokenizerInfo over the loaded tokenizer's vocabulary and logits width.

    ``source``: "hf" (TokenizerInfo.from_huggingface on the tokenizer.json), "llguidance" (RAW
    byte strings from the llguidance tokenizer), or "auto" (hf where a tokenizer.json is known).
    """
    ll = tokenizer.ll
    width = tokenizer.logits_width
    n = tokenizer.vocab_size
    stop = list(tokenizer.eos_token_ids)
    special = [i for i in range(n) if ll.is_special_token(i)]
    path = getattr(tokenizer, "hf_tokenizer_file", None)
    if source == "auto":
        source = "hf" if path else "llguidance"
    if source == "hf":
        if not path:
            raise ValueError(f"tokenizer {tokenizer.spec!r} has no tokenizer.json for from_huggingface")
        import transformers

        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=width, stop_token_ids=stop)
        known = set(info.special_token_ids)
        if all(i in known for i in special):
            return info
        # Same vocabulary and detected encoding, with llguidance's special tokens blanked.
        encoded = [""] * width
        for token, idx in hf.get_vocab().items():
            if idx < width:
                encoded[idx] = token
        for i in special:
            encoded[i] = ""
        return xgr.TokenizerInfo(encoded, info.vocab_type, vocab_size=width, stop_token_ids=stop,
                                 add_prefix_space=info.add_prefix_space)
    if source != "llguidance":
        raise ValueError(f"unknown vocabulary source {source!r}; use auto, hf or llguidance")
    special_set = set(special)
    encoded_bytes = [b"" if i in special_set else ll.decode_bytes([i]) for i in range(n)]
    return xgr.TokenizerInfo(encoded_bytes, xgr.VocabType.RAW, vocab_size=width, stop_token_ids=stop)


class XGrammarMatcher(Matcher):
    """One xgrammar GrammarMatcher plus the tokens it accepted (for messages, forced tokens and
    cheap termination checks) and a generation counter that keys a cached probe row."""

    __slots__ = ("_gen", "_probe", "_probe_gen", "engine", "m", "tokens")

    def __init__(self, engine: XGrammarEngine, m: xgr.GrammarMatcher) -> None:
        self.m = m
        self.engine = engine
        self.tokens: list[int] = []
        self._gen = 0
        self._probe_gen = -1
        self._probe: np.ndarray | None = None

    # -- raw state changes (every accept/rollback goes through these) --------------------------
    def _terminated(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] in self.engine.stop_set

    def _push(self, token: int) -> bool:
        """Accepts one token; False (state unchanged) when the grammar does not allow it."""
        token = int(token)
        if token in self.engine.blocked or not 0 <= token < self.engine.width or self._terminated():
            return False  # checked here: xgrammar would also print a warning to stderr
        if not self.m.accept_token(token):
            return False
        self.tokens.append(token)
        self._gen += 1
        return True

    def _pop(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self.tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: the matcher has accepted {len(self.tokens)}")
        try:
            self.m.rollback(num_tokens)
        except RuntimeError as exc:
            raise ValueError(_message(exc)) from exc
        del self.tokens[-num_tokens:]
        self._gen += 1

    def _reason(self, token: int, index: int, count: int) -> str:
        where = f"after {len(self.tokens)} accepted tokens"
        if count > 1:
            where += f" (token {index + 1} of {count} in this step)"
        if not 0 <= token < self.engine.width:
            return f"token id {token} is outside the vocabulary [0, {self.engine.width}) {where}"
        if self._terminated():
            return f"token {token} follows the end of the grammar (EOS was accepted) {where}"
        text = self.engine.tokenizer.ll.decode_bytes([token]) if token < self.engine.tokenizer.vocab_size else b""
        kind = "special token" if token in self.engine.blocked else "token"
        return f"{kind} {token} {text!r} is not allowed by the grammar {where}"

    # -- Matcher interface -----------------------------------------------------------------------
    def consume(self, tokens: Sequence[int]) -> str | None:
        """Atomic: on a rejected token the matcher is left where it was before this call."""
        for i, token in enumerate(tokens):
            if not self._push(token):
                reason = self._reason(int(token), i, len(tokens))
                self._pop(i)
                return reason
        return None

    def validate(self, tokens: Sequence[int]) -> int:
        n = 0
        for token in tokens:
            if not self._push(token):
                break
            n += 1
        self._pop(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        self._pop(num_tokens)

    def forced_tokens(self) -> list[int]:
        """Canonical tokens of the text the grammar forces next.

        xgrammar's ``find_jump_forward_string`` gives the forced text; llguidance's
        ``tokenize_partial`` turns its unambiguous prefix into tokens (the rest could merge with
        whatever follows). When that leaves no token, the mask decides: if it allows exactly one
        token (EOS included in the count), or only tokens spelling a prefix of the forced text
        (so no token can cross its end), the forced text's tokenization is taken. Repeats up to a
        small limit, then rolls back: the matcher does not move.
        """
        ll = self.engine.tokenizer.ll
        taken = 0

        def push_all(tokens) -> bool:
            nonlocal taken
            progress = False
            for token in tokens[: _FORCED_LIMIT - taken]:
                if token in self.engine.stop_set or not self._push(token):
                    break
                taken += 1
                progress = True
            return progress

        try:
            while taken < _FORCED_LIMIT and not self._terminated():
                forced = self.m.find_jump_forward_string().encode("utf-8")
                if not forced:
                    break
                tokens, _rest = ll.tokenize_partial(forced, recent_tokens=self.tokens[-4:])
                if push_all(tokens):
                    continue
                allowed = _few_allowed(self.probe_row())
                if not allowed or self.engine.stop_set.intersection(allowed):
                    break
                if len(allowed) == 1:
                    if not push_all(allowed):
                        break
                elif not all(forced.startswith(ll.decode_bytes([i])) for i in allowed) \
                        or not push_all(ll.tokenize_bytes(forced)):
                    break
            return self.tokens[len(self.tokens) - taken:] if taken else []
        finally:
            self._pop(taken)

    def is_accepting(self) -> bool:
        return self._terminated() or self.m.is_completed()

    def is_stopped(self) -> bool:
        """Terminated, or complete with nothing but EOS allowed next."""
        if self._terminated():
            return True
        if not self.m.is_completed():
            return False
        return not np.any(self.probe_row() & self.engine.non_stop)

    def reset(self) -> None:
        self.m.reset()
        self.tokens.clear()
        self._gen += 1

    # -- masks -----------------------------------------------------------------------------------
    def probe_row(self) -> np.ndarray:
        """This state's mask row (computed once per state; fill_batch reuses it)."""
        if self._probe_gen != self._gen or self._probe is None:
            row = np.zeros((1, self.engine.words_per_row), dtype=np.int32)
            self.engine._fill([self], [0], row)
            self._probe = row[0]
            self._probe_gen = self._gen
        return self._probe


class XGrammarEngine(Engine):
    name = "xgrammar"
    matcher_type = XGrammarMatcher
    version = xgrammar_engine_version()     # its mapping revision: revisions.py

    def __init__(self, tokenizer, *, threads: int, json_schema_mode: str = "strict",
                 vocab_source: str = "auto", cache_limit_bytes: int = 512 << 20) -> None:
        super().__init__(tokenizer, threads=threads, json_schema_mode=json_schema_mode)
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_source)
        if self.tokenizer_info.vocab_size != self.width:
            raise ValueError(f"xgrammar vocabulary {self.tokenizer_info.vocab_size} != logits width {self.width}")
        # One compiler (and its cache of compiled grammars) per engine; it is thread safe.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max(1, threads),
                                            cache_enabled=True, cache_limit_bytes=cache_limit_bytes)
        self.batch = xgr.BatchGrammarMatcher(max(1, threads))
        self.stop_ids = tuple(int(i) for i in tokenizer.eos_token_ids)
        self.stop_set = frozenset(self.stop_ids)
        # Ids a grammar never allows (special tokens, padding past the vocabulary), stop ids aside.
        self.blocked = frozenset(int(i) for i in self.tokenizer_info.special_token_ids) - self.stop_set
        stop_row = np.zeros(self.words_per_row, dtype=np.uint32)
        for i in self.stop_ids:
            stop_row[i // 32] |= np.uint32(1 << (i % 32))
        self.stop_row = stop_row.view(np.int32)
        self.non_stop = ~self.stop_row
        # xgrammar sets the bits past the logits width in the last word; rows must have them 0.
        tail = self.width % 32
        self.tail_mask = np.array([(1 << tail) - 1], dtype=np.uint32).view(np.int32)[0] if tail else None

    # -- compile ---------------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        try:
            handle = self._compile(spec)
        except GrammarCompileError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors, pydantic's too
            raise GrammarCompileError(_message(exc)) from exc
        return CompiledGrammar(spec, handle, time.perf_counter() - t0, checker=self._checker(spec))

    def _checker(self, spec: GrammarSpec):
        """xgrammar loosens JSON schemas by itself (minItems, maxItems, ...), so every finished JSON
        document is checked by the validator before EOS (no early checks), in either mode. A schema
        the validator cannot take is refused in complete mode and left to the grammar in strict."""
        if spec.kind != "json_schema":
            return None
        try:
            markers = (spec.reasoning_start.encode(), spec.reasoning_end.encode())   # markers are text here
            return document_checker(json.loads(spec.text), self.tokenizer, markers)
        except ValidatorError as exc:
            if self.json_schema_mode != "complete":
                log.info("json schema enforced by the grammar alone: %s", exc)
                return None
            raise GrammarCompileError(f"complete mode: {exc}") from exc

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c = self.compiler
        if spec.kind == "structural_tag":
            tag = self._structural_tag(spec)
            if spec.reasoning_start:
                tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
                    self._reasoning_tag(spec), tag["format"]]}}
            return c.compile_structural_tag(json.dumps(tag, ensure_ascii=False))
        if spec.reasoning_start:
            reasoning = xgr.Grammar.from_structural_tag(json.dumps(
                {"type": "structural_tag", "format": self._reasoning_tag(spec)}, ensure_ascii=False))
            return c.compile_grammar(xgr.Grammar.concat(reasoning, self._grammar(spec)))
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.text, **self._json_options(spec))
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.text)
        if spec.kind == "lark":
            return c.compile_lark(spec.text)
        if spec.kind == "choice":
            return c.compile_grammar(self._choice_ebnf(spec))
        raise GrammarCompileError(f"unknown grammar kind {spec.kind!r}")

    def _grammar(self, spec: GrammarSpec) -> xgr.Grammar:
        """The spec's body as a Grammar object (for concatenation after a reasoning prefix)."""
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.text, **self._json_options(spec))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.text)
        if spec.kind == "lark":
            return xgr.Grammar.from_lark(spec.text, tokenizer_info=self.tokenizer_info)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(self._choice_ebnf(spec))
        raise GrammarCompileError(f"unknown grammar kind {spec.kind!r}")

    @staticmethod
    def _json_options(spec: GrammarSpec) -> dict:
        compact = spec.whitespace == "compact"
        return {"any_whitespace": not compact, "separators": (",", ":") if compact else None,
                "strict_mode": False, "max_whitespace_cnt": spec.bounded_whitespace or None}

    @staticmethod
    def _choice_ebnf(spec: GrammarSpec) -> str:
        # JSON string escapes (\" \\ \n \t \uXXXX) are valid xgrammar EBNF literal escapes.
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.text))

    @staticmethod
    def _reasoning_tag(spec: GrammarSpec) -> dict:
        return {"type": "tag", "begin": spec.reasoning_start, "content": {"type": "any_text"},
                "end": spec.reasoning_end}

    @staticmethod
    def _structural_tag(spec: GrammarSpec) -> dict:
        """The structural tag object; the legacy {structures, triggers} form is converted."""
        tag = json.loads(spec.text)
        if "format" not in tag and "structures" in tag and "triggers" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=s.get("schema", s.get("parameters", {})),
                                           end=s["end"]) for s in tag["structures"]]
            tag = json.loads(xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
                             .model_dump_json(indent=None))
        return tag

    # -- matchers --------------------------------------------------------------------------------
    def new_matcher(self, grammar: CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(self, xgr.GrammarMatcher(grammar.handle))

    def consume_batch(self, matchers, tokens, counts=None):
        reasons: list[str | None] = [None] * len(matchers)
        singles, rest = single_tokens(matchers, tokens, counts, XGrammarMatcher)
        batch = []
        for i, m, token in singles:      # the batched accept takes live matchers and ids the grammar may see
            t = int(token)
            if not m._terminated() and t not in self.blocked and 0 <= t < self.width:
                batch.append((i, m, t))
            else:
                rest.append((i, (t,)))
        if len(batch) > 1:
            ok = xgr.BatchGrammarMatcher.batch_accept_token([m.m for _, m, _ in batch], [t for _, _, t in batch])
            for (i, m, t), good in zip(batch, ok):
                if good:
                    m.tokens.append(t)
                    m._gen += 1
                else:
                    reasons[i] = m._reason(t, 0, 1)
        else:
            rest += [(i, (t,)) for i, _, t in batch]
        for i, each in rest:
            reasons[i] = matchers[i].consume(each)
        return reasons

    # -- masks -----------------------------------------------------------------------------------
    def _fill(self, matchers: Sequence[XGrammarMatcher], rows: Sequence[int], out: np.ndarray) -> None:
        """One mask row per matcher: batched xgrammar fill; cached probe rows are copied;
        a terminated matcher's row allows only EOS."""
        live_m, live_rows = [], []
        for m, r in zip(matchers, rows):
            if m._probe_gen == m._gen and m._probe is not None:
                out[r] = m._probe
            elif m._terminated():
                out[r] = self.stop_row
            else:
                live_m.append(m.m)
                live_rows.append(int(r))
        if len(live_m) == 1:
            live_m[0].fill_next_token_bitmask(out, live_rows[0])
        elif live_m:
            self.batch.batch_fill_next_token_bitmask(live_m, out, live_rows)
        if self.tail_mask is not None and live_rows:
            out[live_rows, -1] &= self.tail_mask

    def fill_batch(self, matchers, rows, drafts, out: np.ndarray) -> None:
        assert out.dtype == np.int32 and out.flags["C_CONTIGUOUS"] and out.shape[1] == self.words_per_row
        self._fill(matchers, rows, out)
        if drafts is None or not any(drafts):
            return
        # Drafts level by level: accept draft j on every matcher still valid, batch-fill the row
        # after it; a rejected draft leaves its rows (and the rest) zero. Then roll back.
        pending = [(m, int(r), [int(t) for t in d]) for m, r, d in zip(matchers, rows, drafts) if d]
        for _, r, d in pending:
            out[r + 1: r + 1 + len(d)] = 0
        accepted = [0] * len(pending)
        live = list(range(len(pending)))
        j = 0
        try:
            while live:
                fill_m, fill_rows, nxt = [], [], []
                for k in live:
                    m, r, d = pending[k]
                    if j < len(d) and m._push(d[j]):
                        accepted[k] += 1
                        fill_m.append(m)
                        fill_rows.append(r + 1 + j)
                        nxt.append(k)
                self._fill(fill_m, fill_rows, out)
                live = nxt
                j += 1
        finally:
            for (m, _, _), n in zip(pending, accepted):
                m._pop(n)

    # -- serialization ---------------------------------------------------------------------------
    def serialize(self, grammar: CompiledGrammar) -> bytes:
        # The JSON holds the adaptive token masks (hundreds of KB for a small schema); zlib at
        # level 1 shrinks it about 5x in a few ms.
        return _ZMAGIC + zlib.compress(grammar.handle.serialize_json().encode(), 1)

    def deserialize(self, spec: GrammarSpec, data: bytes, *, lazy: bool = False) -> CompiledGrammar:
        t0 = time.perf_counter()
        try:
            text = zlib.decompress(data[len(_ZMAGIC):]) if data.startswith(_ZMAGIC) else data
            handle = xgr.CompiledGrammar.deserialize_json(text.decode(), self.tokenizer_info)
        except (RuntimeError, ValueError, zlib.error) as exc:
            raise GrammarCompileError(f"cannot load the serialized xgrammar grammar: {_message(exc)}") from exc
        return CompiledGrammar(spec, handle, time.perf_counter() - t0, checker=self._checker(spec))
