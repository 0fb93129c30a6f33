"""Tool-call arrays composed from per-tool pieces (issue 19; WGrammar's templates and arguments).

A ``tool_choice: "required"`` request asks for a JSON array of ``{"name": ..., "parameters":
{...}}`` calls whose parameters match the named tool's schema. Compiled whole, one new tool among
200 known costs a compile of all 200 schemas. Composed, the grammar is two kinds of parts:

* the **router** (one per bound and whitespace, compiled once in process): the same array with one
  item schema, the name any string and the parameters any object. It reads everything outside the
  parameters (standing in ``{}`` for them), so it is where the array and the end of the output are
  decided; its rows are the whole grammar's there but inside the names;
* the **names** (``NameSet``, per set of names): where the output is inside a call's name, the
  whole grammar's row is built from the names (the tokens the rest of some name starts with, and
  of those that run on past its closing quote the ones the router takes), and where every name
  left goes on with the same bytes those are forced, as llguidance forces an enum's common bytes;
  elsewhere a token that opens or writes a name outside the set is taken out of the router's row.
  A name JSON writes escaped (a '"', a backslash, a control character) makes the array compile
  whole;
* a **piece** per tool (its parameters schema, followed by any bytes as in the array; compiled once
  and cached by content like any grammar, across requests and, through the cluster's store,
  across replicas). Inside a call's parameters the named tool's piece reads the output and gives
  the row.

The bytes at a boundary decide the rest. A token that reaches into the parameters (`` {"`` after
``"parameters":``) is allowed where the router takes its bytes up to the ``{`` and the piece its
bytes from there; a token that reaches out of them (``}},``, ``"}]``) where the piece takes its
bytes up to the closing ``}`` and the router takes ``}`` and the rest. A piece that starts inside
a token is positioned by tokenizing the bytes it got (``LLTokenizer.tokenize_bytes``). Most such
decisions are a lookup: the token of those bytes in the piece's row.

Compact JSON has one more boundary: where a grammar forces bytes, llguidance's row is the first
canonical token of them (``forcing ff_token by mask``), and the whole grammar forces bytes across
the parts that no part forces alone: after ``"parameters`` the array forces ``":{"`` and the
tool's first key (the router's ``":{`` is chopped to nothing, as its object may go on with any
key); after a template's hole whose last value is written, the piece's ``}`` and the template's
next key (``},"steps":[``); an argument that admits one object is forced whole between the
template's keys. Where the open part's forced bytes run into another, the composed matcher takes
each part's forced bytes in turn and chops the whole span as llguidance chops a grammar's forced
tokens (``_forced_across_parts``). The composed rows equal the whole grammar's
(tests/server/test_tool_call_pieces.py, tests/server/test_template_pieces.py) in both layouts.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import numpy as np

from maskd.server.engines.base import CompiledGrammar, Matcher

_QUOTE, _BACKSLASH, _COLON, _COMMA = 0x22, 0x5C, 0x3A, 0x2C
_OPENS, _CLOSES = frozenset(b"{["), frozenset(b"}]")
_WS = frozenset(b" \t\r\n")
# What an object expects next (a call's item object, depth 2; each object on the way to a template's hole).
_KEY, _COLON_NEXT, _VALUE, _AFTER = 1, 2, 3, 4


class ComposedScanner:
    """What the scanners of composed grammars share (``CallScanner`` here, a template's
    ``template_holes.HoleScanner``): whether the output is in a string, after a backslash in one,
    and how deep it is; ``params`` the depth just inside the open piece (0 outside one), ``name``
    its name, ``entering`` whether a token from here may open one."""
    __slots__ = ()
    in_str: bool
    esc: bool
    depth: int
    params: int

    @property
    def mode(self) -> int:
        """0 outside a string, 1 inside one, 2 right after a backslash in one."""
        return 0 if not self.in_str else (2 if self.esc else 1)


class CallScanner(ComposedScanner):
    """Where the output stands in the call array, byte by byte: depth, strings, the current item's
    keys and name, and whether (and where) a call's parameters are open."""
    __slots__ = ("buf", "depth", "esc", "expect", "in_str", "key", "name", "params", "role")

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.role = 0            # the open string: 0 not read, 1 a key of the item, 2 the item's name
        self.buf: Any = None     # the open string's bytes, where it is read
        self.expect = 0          # at depth 2, outside the parameters: _KEY, _COLON_NEXT, _VALUE, _AFTER
        self.key: str | None = None
        self.name: str | None = None
        self.params = 0          # depth just inside the open parameters object; 0 outside them

    def copy(self) -> CallScanner:
        c = CallScanner.__new__(CallScanner)
        c.depth, c.in_str, c.esc, c.role, c.expect = self.depth, self.in_str, self.esc, self.role, self.expect
        c.buf = None if self.buf is None else bytearray(self.buf)
        c.key, c.name, c.params = self.key, self.name, self.params
        return c

    @property
    def entering(self) -> bool:
        """Whether a token from here may open a call's parameters: inside a call's object."""
        return self.depth == 2

    def feed(self, data: bytes, events: list | None = None) -> None:
        """Reads ``data``; appends ``("in", offset of the "{", name)`` where parameters open and
        ``("out", offset after the "}")`` where they close."""
        for i, c in enumerate(data):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == _BACKSLASH:
                    self.esc = True
                elif c == _QUOTE:
                    self.in_str = False
                    if self.role:
                        self._string_done()
                    continue
                if self.role:
                    self.buf.append(c)
                continue
            item = self.depth == 2 and not self.params
            if c == _QUOTE:
                self.in_str = True
                self.role = 0
                if item:
                    if self.expect == _KEY:
                        self.role = 1
                    elif self.expect == _VALUE:
                        self.role = 2 if self.key == "name" else 0
                        self.expect = _AFTER
                    self.buf = bytearray() if self.role else None
            elif c in _OPENS:
                if item and self.expect == _VALUE:
                    self.expect = _AFTER
                    if c == 0x7B and self.key == "parameters":
                        self.params = self.depth + 1
                        if events is not None:
                            events.append(("in", i, self.name))
                self.depth += 1
                if self.depth == 2 and c == 0x7B:     # a call's object opens
                    self.expect, self.key, self.name = _KEY, None, None
            elif c in _CLOSES:
                self.depth -= 1
                if self.params and self.depth < self.params:
                    self.params = 0
                    if events is not None:
                        events.append(("out", i + 1, None))
            elif item:
                if c == _COLON:
                    self.expect = _VALUE
                elif c == _COMMA:
                    self.expect = _KEY
                elif c not in _WS and self.expect == _VALUE:
                    self.expect = _AFTER          # a number or a literal

    def _string_done(self) -> None:
        try:
            text = json.loads(b'"' + bytes(self.buf) + b'"')
        except ValueError:
            text = None
        if self.role == 1:
            self.key, self.expect = text, _COLON_NEXT
        else:
            self.name = text
        self.role, self.buf = 0, None


def _bit(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _set(row: np.ndarray, token: int) -> None:
    row[token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))


def _tokens_in(words: np.ndarray) -> list[int]:
    out = []
    for w in np.flatnonzero(words).tolist():
        v = int(words[w]) & 0xFFFFFFFF
        while v:
            low = v & -v
            out.append((w << 5) + low.bit_length() - 1)
            v ^= low
    return out


@dataclasses.dataclass
class Leaving:
    """Tokens that leave the parameters with bytes to spare, from one (mode, closes needed): each
    with the token of its bytes up to the close (``heads``, -1: several tokens, ``head_tokens``),
    the token after it (``tails``, -1: several tokens or a "{" among them), the first token of its
    bytes up to the close, and what the router reads for it: "}" and the bytes after the close."""
    keep: np.ndarray             # the row mask of every other token
    tokens: np.ndarray
    heads: np.ndarray
    tails: np.ndarray
    firsts: np.ndarray
    head_tokens: list[list[int]]
    routes: list[list[int]]
    braced: np.ndarray           # a "{" after the close: it could open another call's parameters


class BoundaryTables:
    """Per tokenizer: each token's bytes and the token of any byte string that is one; the tokens
    that can reach into parameters (they hold a "{"); and, by where a token starts (outside a
    string, in one, after a backslash) and how many containers it must close to leave the
    parameters, those that leave them with bytes to spare: each with the token of its bytes up to
    the close (-1: none is one token) and of the bytes after it (-1: none, or they hold a "{")."""

    def __init__(self, tokenizer, words_per_row: int) -> None:
        ll = tokenizer.ll
        self.ll = ll
        self.words = words_per_row
        self.eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.data: list[bytes | None] = [None if ll.is_special_token(t) else ll.decode_bytes([t])
                                         for t in range(ll.vocab_size)]
        self.ids: dict[bytes, int] = {}
        for t, b in enumerate(self.data):
            if b and b not in self.ids:
                self.ids[b] = t
        self.longest = max(len(b) for b in self.data if b)
        self.sorted_bytes = sorted(b for b in self.ids)       # each token's bytes once, for extensions
        self.byte_tokens = [self.ids.get(bytes([c]), -1) for c in range(256)]
        braces = [t for t, b in enumerate(self.data) if b and 0x7B in b]
        self.braces = self._mask(braces)
        self.brace_bytes = [self.data[t] or b"" for t in braces]   # the bytes of each token with a "{"
        # those with a '"' before a "{": the only ones that can open an object from inside a string
        self.quoted_braces = self._mask(t for t, b in zip(braces, self.brace_bytes)
                                        if 0 <= b.find(b'"') < b.rfind(b"{"))
        # the tokens with a '"' (only they can open a name or close one), and those that start with one
        self.quoted = self._mask(t for t, b in enumerate(self.data) if b and 0x22 in b)
        self.quote_first = self._mask(t for t, b in enumerate(self.data) if b and b[0] == 0x22)
        self._rests: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self._rests_lock = threading.Lock()
        # (mode, closes needed) -> the tokens that leave the parameters there with bytes to spare
        self.leaving: dict[tuple[int, int], Leaving] = {}
        found: dict[tuple[int, int], list[tuple[int, bytes, bytes]]] = {}
        for t, b in enumerate(self.data):
            if not b or not any(c in _CLOSES for c in b[:-1]):
                continue
            for mode in (0, 1, 2):
                for need, at in self._closes(b, mode):
                    if at < len(b) - 1:
                        found.setdefault((mode, need), []).append((t, b[:at + 1], b[at + 1:]))
        for key, rows in found.items():
            tokens = np.array([t for t, _, _ in rows], dtype=np.int64)
            self.leaving[key] = Leaving(
                ~self._mask(tokens.tolist()), tokens,
                np.array([self.ids.get(h, -1) for _, h, _ in rows], dtype=np.int64),
                np.array([-1 if 0x7B in tl else self.ids.get(tl, -1) for _, _, tl in rows], dtype=np.int64),
                np.array([ll.tokenize_bytes(h)[0] for _, h, _ in rows], dtype=np.int64),
                [ll.tokenize_bytes(h) for _, h, _ in rows],
                [ll.tokenize_bytes(b"}" + tl) for _, _, tl in rows],
                np.array([0x7B in tl for _, _, tl in rows], dtype=bool))

    def rest(self, rest: bytes) -> tuple[np.ndarray, np.ndarray]:
        """For the ``rest`` of a name: the tokens whose bytes it starts with (they stay inside the
        name), and those that start with it and its closing quote (they run on past the name).
        Kept for the last rests seen: the same names come again in the next request's set."""
        found = self._rests.get(rest)
        if found is None:
            ids = self.ids
            within = [t for t in (ids.get(rest[:k]) for k in range(1, min(len(rest), self.longest) + 1))
                      if t is not None]
            past = [ids[b] for b in self.extensions(rest + b'"', itself=True)]
            found = (np.array(within, dtype=np.int64), np.array(past, dtype=np.int64))
            with self._rests_lock:
                if len(self._rests) >= _RESTS_KEPT:
                    del self._rests[next(iter(self._rests))]
                self._rests[rest] = found
        return found

    def extensions(self, prefix: bytes, itself: bool = False):
        """The bytes of each token longer than ``prefix`` that starts with it (``itself``: and of
        the token that is ``prefix``, where there is one)."""
        i = (bisect.bisect_left if itself else bisect.bisect_right)(self.sorted_bytes, prefix)
        while i < len(self.sorted_bytes) and self.sorted_bytes[i].startswith(prefix):
            yield self.sorted_bytes[i]
            i += 1

    @staticmethod
    def _closes(b: bytes, mode: int) -> list[tuple[int, int]]:
        """(k, offset) where the token, started in ``mode``, first closes k more containers than it opened."""
        in_str, esc = mode > 0, mode == 2
        depth, low, out = 0, 0, []
        for i, c in enumerate(b):
            if in_str:
                if esc:
                    esc = False
                elif c == _BACKSLASH:
                    esc = True
                elif c == _QUOTE:
                    in_str = False
            elif c == _QUOTE:
                in_str = True
            elif c in _OPENS:
                depth += 1
            elif c in _CLOSES:
                depth -= 1
                if depth < low:
                    low = depth
                    out.append((-depth, i))
        return out

    def _mask(self, tokens) -> np.ndarray:
        row = np.zeros(self.words, dtype=np.int32)
        for t in tokens:
            _set(row, t)
        return row


_RESTS_KEPT = 1 << 16
_TABLES: dict[tuple[str, int], BoundaryTables] = {}
_TABLES_LOCK = threading.Lock()


def boundary_tables(tokenizer, words_per_row: int) -> BoundaryTables:
    key = (tokenizer.fingerprint, words_per_row)
    with _TABLES_LOCK:
        tables = _TABLES.get(key)
        if tables is None:
            tables = _TABLES[key] = BoundaryTables(tokenizer, words_per_row)
        return tables


def _bits(row: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Whether ``row`` allows each of ``tokens`` (-1: no)."""
    safe = np.maximum(tokens, 0)
    return (tokens >= 0) & (((row[safe >> 5].astype(np.int64) & 0xFFFFFFFF) >> (safe & 31)) & 1).astype(bool)


def _set_all(row: np.ndarray, tokens: np.ndarray) -> None:
    if len(tokens):
        np.bitwise_or.at(row.view(np.uint32), tokens >> 5, np.left_shift(np.uint32(1), (tokens & 31).astype(np.uint32)))


_UNPLAIN = re.compile(r'["\\\x00-\x1f]')


def plain_names(names: Sequence[str]) -> bool:
    """Whether every name is written in JSON as it is (no '"', backslash or control character):
    then a name's bytes in the output are its UTF-8 bytes, which ``NameSet`` matches."""
    return _UNPLAIN.search("".join(names)) is None


class NameSet:
    """A call array's names, held to by the composed matcher (its router takes any string there).
    Where the output is inside a name, the whole grammar's row is built from the names: the tokens
    whose bytes the rest of some name starts with, and of those that run on past its closing quote,
    the ones the router takes; where every name left goes on with the same bytes, those are forced
    (the whole grammar's names are one lexeme of literals: llguidance forces their common bytes)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)
        self.sorted = sorted(n.encode() for n in names)
        self._rows: dict[bytes, tuple[np.ndarray, np.ndarray, bool]] = {}
        self._lock = threading.Lock()

    def _range(self, prefix: bytes) -> tuple[int, int]:
        lo = bisect.bisect_left(self.sorted, prefix)
        hi = lo
        while hi < len(self.sorted) and self.sorted[hi].startswith(prefix):
            hi += 1
        return lo, hi

    def fits(self, prefix: bytes) -> bool:
        """Whether some name starts with ``prefix``."""
        i = bisect.bisect_left(self.sorted, prefix)
        return i < len(self.sorted) and self.sorted[i].startswith(prefix)

    def forced(self, prefix: bytes) -> bytes:
        """The bytes every name that starts with ``prefix`` goes on with (its closing quote too,
        where one name is left)."""
        lo, hi = self._range(prefix)
        if hi - lo == 1:
            return self.sorted[lo][len(prefix):] + b'"'
        if hi == lo or self.sorted[lo] == prefix:
            return b""
        first, last = self.sorted[lo], self.sorted[hi - 1]
        n = len(prefix)
        while n < min(len(first), len(last)) and first[n] == last[n]:
            n += 1
        return first[len(prefix):n]

    def row_parts(self, prefix: bytes, tables: BoundaryTables) -> tuple[np.ndarray, np.ndarray, bool]:
        """Inside a name, after ``prefix``: the row of the tokens that stay inside a name, the
        tokens that close one and run on (allowed where the router takes them), and whether
        ``prefix`` is a name (then any token from its closing quote on that the router takes). Kept
        per prefix (the sequences of a set share them: 0.08 ms a row again for 200 names) and
        each name's rest per tokenizer (``BoundaryTables.rest``: a set of 200 tools with one new
        costs its new name, not 2 ms of lookups)."""
        found = self._rows.get(prefix)
        if found is not None:
            return found
        lo, hi = self._range(prefix)
        rests = [tables.rest(name[len(prefix):]) for name in self.sorted[lo:hi] if len(name) > len(prefix)]
        within = np.zeros(tables.words, dtype=np.int32)
        if rests:
            _set_all(within, np.concatenate([r[0] for r in rests]))
        found = (within, np.concatenate([r[1] for r in rests]) if rests else _NO_TOKENS,
                 lo < hi and self.sorted[lo] == prefix)
        with self._lock:
            if len(self._rows) >= _NAME_ROWS_KEPT:
                self._rows.clear()
            self._rows[prefix] = found
        return found

    def prepare(self, tables: BoundaryTables) -> None:
        """Each name's tokens from its start (off the step path, where the array is composed: the
        names the tokenizer has seen before cost a lookup)."""
        for name in self.sorted:
            tables.rest(name)


_NO_TOKENS = np.zeros(0, dtype=np.int64)
_NAME_ROWS_KEPT = 16          # rows kept per set of names, 16 KB each at 129k tokens (a call passes a few)
_NAME_SETS_KEPT = 32          # the sets kept here besides those the cache's grammars hold
_NAME_SETS: collections.OrderedDict[tuple[int, frozenset], NameSet] = collections.OrderedDict()
_NAME_SETS_LOCK = threading.Lock()


def name_set(names: Sequence[str], tables: BoundaryTables) -> NameSet:
    """The set's ``NameSet`` for a tokenizer's tables, shared by the arrays of the same names in any
    order (the last sets kept)."""
    key = (id(tables), frozenset(names))
    with _NAME_SETS_LOCK:
        found = _NAME_SETS.get(key)
        if found is not None:
            _NAME_SETS.move_to_end(key)
            return found
    found = NameSet(names)
    with _NAME_SETS_LOCK:
        _NAME_SETS[key] = found
        while len(_NAME_SETS) > _NAME_SETS_KEPT:
            _NAME_SETS.popitem(last=False)
    return found


@dataclasses.dataclass
class Piece:
    """One tool's parameters, compiled alone (a grammar of the cache), and its row at the start."""
    compiled: CompiledGrammar
    first_row: np.ndarray | None = None
    forced_head: tuple[bytes, int] | None = None
    firsts: dict[int, bool] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, compiled: CompiledGrammar) -> Piece:
        """The piece of a compiled grammar, shared by every array that uses it (what it keeps is
        the piece's alone: its start row, its forced head, and which first tokens it takes)."""
        if compiled.piece is None:
            compiled.piece = cls(compiled)
        return compiled.piece

    def holds_an_object(self) -> bool:
        """Whether the schema says ``"type": "object"``: the router stands an object in for the
        piece, so a schema that also takes other values (no type, or a list of types) would allow
        more compiled whole than composed."""
        typed = self.__dict__.get("_typed")
        if typed is None:
            typed = self.__dict__["_typed"] = json.loads(self.compiled.spec.text).get("type") == "object"
        return typed

    def forced_start(self, ll) -> tuple[bytes, int]:
        """The bytes the piece forces at its start (compact JSON: ``{"`` and its first key where it
        has one) and how many of the last of them llguidance chops off its forced tokens (they could
        be the start of a longer token)."""
        if self.forced_head is None:
            m = self.matcher()
            forced = m.compute_ff_bytes()
            self.forced_head = (forced, len(forced) - len(ll.decode_bytes(m.compute_ff_tokens())))
        return self.forced_head

    def matcher(self) -> llguidance.LLMatcher:
        return self.compiled.prototype.copy()

    def takes_first(self, token: int, tables: BoundaryTables) -> bool:
        """Whether the piece's object may start with ``token``: its start row, or where the piece
        forces tokens at its start (compact JSON, ``{"`` and a first key the schema requires) and
        its row is only the first of them, whether it takes the token's bytes (kept per token)."""
        head, chopped = self.forced_start(tables.ll)
        if len(head) <= chopped:
            return _bit(self.start_row(tables.words), token)
        taken = self.firsts.get(token)
        if taken is None:
            taken = self.firsts[token] = self.matcher().validate_tokens([token]) == 1
        return taken

    def start_row(self, words: int) -> np.ndarray:
        if self.first_row is None:
            row = np.frombuffer(self.matcher().compute_bitmask(), dtype=np.int32)
            self.first_row = np.ascontiguousarray(row[:words])
        return self.first_row


@dataclasses.dataclass
class ComposedGrammar:
    """A composed grammar's handle: the router's prototype, the pieces by tool name (a template's:
    by hole), the tables, and what follows the output (a call array's ``CallScanner``, a template's
    ``template_holes.HoleScanner``) with the words its refusals name the grammar and a piece by."""
    router: Any                      # the router's _Prototype (llguidance_engine)
    router_text: str
    pieces: dict[str, Piece]
    tables: BoundaryTables
    compact: bool = False            # compact JSON: forced spans cross into the parameters
    names: NameSet | None = None     # a call array's names (its router takes any string there)
    scanner: Callable[[], Any] = CallScanner
    whole: str = "the tool-call array"
    inside: str = "the parameters of"


class ComposedMatcher(Matcher):
    """A sequence of a composed grammar. The router reads everything outside the parameters and
    stands in ``{`` ... ``}`` for each call's parameters (its own any-object is not the pieces':
    llguidance's generic strings refuse some escapes that a schema's keys take); the open call's
    piece reads what is inside them. Rollback keeps, per token, the scanner and the piece before
    it, and how many tokens it gave the piece and the router."""
    __slots__ = ("exit", "g", "history", "piece", "router", "scan")

    def __init__(self, grammar: ComposedGrammar) -> None:
        self.g = grammar
        self.router: llguidance.LLMatcher = grammar.router.copy()
        self.scan = grammar.scanner()
        self.piece: Any = None       # the open call's piece (an LLMatcher) inside its parameters
        self.history: list[tuple[CallScanner, Any, int, int]] = []
        self.exit: tuple[Any, list[int] | None] | None = None   # _forced_across_parts's, by position

    # -- one token --------------------------------------------------------------------------------
    def _plan(self, token: int):
        """What taking ``token`` does, checked without changing this matcher: (scanner after, the
        open piece after, tokens for the current piece, tokens for the router), or why it is refused."""
        data = self.g.tables.data[token]
        scan0 = self.scan
        if data is None:     # a special token: the router's (EOS once the array closed)
            if scan0.params:
                return "a special token inside a tool call's parameters"
            if token in self.g.tables.eos and self.router.is_accepting():
                return scan0, self.piece, None, [token]     # (llguidance validates no EOS once stopped)
            if self.router.validate_tokens([token]) != 1:
                return f"token {token} does not continue {self.g.whole} here"
            return scan0, self.piece, None, [token]
        scan = scan0.copy()
        events: list = []
        scan.feed(data, events)
        if self.g.names is not None and not self._names_fit(scan):
            return f"token {token} does not continue {self.g.whole} here"
        if not events:
            if scan0.params:
                if self.piece.validate_tokens([token]) != 1:
                    return f"token {token} does not continue {self.g.inside} {scan0.name!r}"
                return scan, self.piece, [token], None
            if self.router.validate_tokens([token]) != 1:
                return f"token {token} does not continue {self.g.whole} here"
            return scan, self.piece, None, [token]
        tokenize = self.g.tables.ll.tokenize_bytes
        piece, pos, fed = self.piece, 0, None
        routed = bytearray()
        for kind, at, name in events:
            if kind == "in":
                routed += data[pos:at + 1]             # the router reads up to the parameters' "{"
                part = self.g.pieces.get(name)
                if part is None:
                    return f"a call names {name!r}, which is not one of the tools"
                piece, pos = part.matcher(), at
                continue
            toks = tokenize(data[pos:at])
            if piece.validate_tokens(toks) != len(toks):
                return f"{self.g.inside} {scan0.name!r} cannot close here"
            piece.consume_tokens(toks)
            done = piece.is_accepting()
            if piece is self.piece:
                piece.rollback(len(toks))
                fed = toks
            if not done:
                return f"{self.g.inside} {scan0.name!r} are not complete where they close"
            routed += b"}"                             # ... and stands in "}" for them
            piece, pos = None, at
        if piece is not None:
            toks = tokenize(data[pos:])
            if piece.validate_tokens(toks) != len(toks):
                return f"token {token} does not begin {self.g.inside} {scan.name!r}"
            piece.consume_tokens(toks)                 # a piece opened by this token: its own copy
        else:
            routed += data[pos:]
        routing = tokenize(bytes(routed)) if routed else []
        if self.router.validate_tokens(routing) != len(routing):
            return f"token {token} does not continue {self.g.whole} here"
        return scan, piece, fed, routing

    def _take(self, plan) -> None:
        scan, piece, fed, routing = plan
        if routing:
            if len(routing) == 1:
                self.router.consume_token(routing[0])
            else:
                self.router.consume_tokens(routing)
        if fed:
            self.piece.consume_tokens(fed)
        self.history.append((self.scan, self.piece, len(fed) if fed else 0, len(routing) if routing else 0))
        self.scan, self.piece = scan, piece

    def allows(self, token: int) -> bool:
        return not isinstance(self._plan(token), str)

    def _names_fit(self, scan: Any) -> bool:
        """Whether the names ``scan`` has read are the set's: the open one starts one of them, the
        call's finished one is one of them."""
        names = self.g.names
        assert names is not None
        if scan.in_str and scan.role == 2:
            return names.fits(bytes(scan.buf))
        return scan.name is None or scan.name in names.names

    def _in_name(self) -> bool:
        return self.g.names is not None and self.scan.in_str and self.scan.role == 2

    # -- Matcher ----------------------------------------------------------------------------------
    def consume(self, tokens: Sequence[int]) -> str | None:
        for t in tokens:
            plan = self._plan(int(t))
            if isinstance(plan, str):
                return plan
            self._take(plan)
        return None

    def validate(self, tokens: Sequence[int]) -> int:
        n = taken = 0
        for t in tokens:
            plan = self._plan(int(t))
            if isinstance(plan, str):
                break
            n += 1
            if int(t) in self.g.tables.eos:   # the end: nothing follows (and llguidance keeps no EOS to roll back)
                break
            self._take(plan)
            taken += 1
        self.rollback(taken)
        return n

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        if num_tokens > len(self.history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self.history)} were consumed")
        routed = 0
        for _ in range(num_tokens):
            scan, piece, fed, routing = self.history.pop()
            if fed:
                piece.rollback(fed)
            routed += routing
            self.scan, self.piece = scan, piece
        if routed and not self.router.rollback(routed):
            raise ValueError(f"cannot roll back {num_tokens} tokens")

    def forced_tokens(self) -> list[int]:
        forced = self._forced_across_parts()
        if forced is None:
            forced = (self.piece if self.scan.params else self.router).compute_ff_tokens()
        return forced[:self.validate(forced)] if forced else []

    def _forced_across_parts(self) -> list[int] | None:
        """Inside a name, or where the router's forced bytes run into one (the names force their
        common bytes; an empty list where nothing is forced), and in compact JSON where the open
        part's forced bytes run into another (the router's into a
        piece: ``"parameters":{`` and the piece's first key; a piece's through its close: ``}``
        after a last value, then the router's next key): the whole grammar's forced tokens, all the
        bytes the parts force in turn from here, tokenized, less the last tokens that hold the
        longest suffix a longer token could go on from (``chop_tokens``: the last four tokens,
        decided by this matcher after all the forced bytes); None where none are left, and where
        the forced bytes stay in the open part (its own forced tokens are the whole grammar's).
        Kept for the position (the row and the forced tokens ask at the same one)."""
        at = self.history[-1] if self.history else None
        if self.exit is not None and self.exit[0] is at:
            return self.exit[1]
        forced = None
        inside = bool(self.scan.params)
        if self._in_name():
            forced = self._whole_forced_tokens() or []
        else:
            head = (self.piece if inside else self.router).compute_ff_bytes()
            if head and not inside and self.g.names is not None and 0x22 in head:
                scan = self.scan.copy()      # the router's forced bytes run into a name?
                scan.feed(head)
                if (scan.in_str and scan.role == 2) or scan.name != self.scan.name:
                    forced = self._whole_forced_tokens() or []
            if forced is None and self.g.compact and head and (0x7D if inside else 0x7B) in head:
                events: list = []
                self.scan.copy().feed(head, events)
                if any(kind == ("out" if inside else "in") for kind, _, _ in events):
                    forced = self._whole_forced_tokens()
        self.exit = (at, forced)
        return forced

    def _whole_forced_tokens(self) -> list[int] | None:
        """The forced bytes of every part in turn from here (each taken as it is forced), their
        canonical tokens, chopped as llguidance chops a grammar's forced tokens."""
        tables = self.g.tables
        tokenize = tables.ll.tokenize_bytes
        forced, taken = bytearray(), 0
        try:
            for _ in range(64):
                if self._in_name():
                    assert self.g.names is not None
                    ff = self.g.names.forced(bytes(self.scan.buf))
                else:
                    ff = (self.piece if self.scan.params else self.router).compute_ff_bytes()
                if not ff:
                    break
                for t in tokenize(ff):
                    plan = self._plan(t)
                    if isinstance(plan, str):
                        return None      # (a part's forced bytes refused by another: not a forced span)
                    self._take(plan)
                    taken += 1
                forced += ff
            tokens = tokenize(bytes(forced))
            window = b"".join(tables.data[t] or b"" for t in tokens[-4:])[-tables.longest:]
            for i in range(len(window)):
                if self._goes_on(window[i:]):
                    chopped = len(window) - i
                    while chopped > 0 and tokens:
                        chopped -= len(tables.data[tokens.pop()] or b"")
                    break
            return tokens or None
        finally:
            self.rollback(taken)

    def _goes_on(self, suffix: bytes) -> bool:
        """Whether a token longer than ``suffix`` starts with it and this matcher takes the rest of
        its bytes (``has_valid_extensions``)."""
        tables = self.g.tables
        firsts: dict[int, bool] = {}
        for data in tables.extensions(suffix):
            rest = data[len(suffix):]
            ok = firsts.get(rest[0])
            if ok is None:
                one = tables.byte_tokens[rest[0]]
                ok = firsts[rest[0]] = one < 0 or self.validate([one]) == 1
            if ok:
                toks = tables.ll.tokenize_bytes(rest)
                if self.validate(toks) == len(toks):
                    return True
        return False

    def is_accepting(self) -> bool:
        return not self.scan.params and self.router.is_accepting()

    def is_stopped(self) -> bool:
        return not self.scan.params and self.router.is_stopped()

    def reset(self) -> None:
        self.router.reset()
        self.scan, self.piece, self.history, self.exit = self.g.scanner(), None, [], None

    # -- rows ---------------------------------------------------------------------------------------
    def finish_row(self, row: np.ndarray, piece_row: np.ndarray | None) -> None:
        """``row`` holds the router's row; makes it the whole grammar's (``piece_row``: the open
        piece's row, inside the parameters)."""
        forced = self._forced_across_parts()
        if forced:     # llguidance's row where bytes are forced across parts: their first token alone
            row[:] = 0
            _set(row, forced[0])
            return
        if self.scan.params:
            assert piece_row is not None
            self._inside(row, piece_row)
            return
        if self.g.names is not None:
            self._names(row)
        if self.scan.entering:
            self._entering(row)

    def _names(self, row: np.ndarray) -> None:
        """The router's row held to the names: inside a name, the set's row (``NameSet.row_parts``);
        elsewhere, a token that opens a name with bytes the set has no name starting with, or
        writes a name the set does not have, is taken out."""
        names, tables, scan = self.g.names, self.g.tables, self.scan
        assert names is not None
        if scan.in_str and scan.role == 2:
            within, past, whole = names.row_parts(bytes(scan.buf), tables)
            taken = past[_bits(row, past)] if len(past) else past     # the router takes what follows the name
            if whole:
                np.bitwise_and(row, tables.quote_first, out=row)
                row |= within
            else:
                row[:] = within
            _set_all(row, taken)
            return
        maybe = row & tables.quoted
        if not maybe.any():
            return
        opens = (scan.depth == 2 and not scan.params and not scan.in_str and scan.key == "name"
                 and scan.expect in (_COLON_NEXT, _VALUE))      # the next '"' opens the call's name
        for t in _tokens_in(maybe):
            data = tables.data[t]
            assert data is not None
            if data.count(b'"') == 1:
                if not opens:
                    continue
                rest = data[data.index(b'"') + 1:]
                ok = not rest or names.fits(rest)
            else:
                after = scan.copy()
                after.feed(data)
                ok = self._names_fit(after)
            if not ok:
                row[t >> 5] &= np.int32(np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF).view(np.int32))

    def _inside(self, row: np.ndarray, piece_row: np.ndarray) -> None:
        """The piece's row, but for tokens that leave the parameters with bytes to spare: those
        are allowed where the piece takes the bytes up to the close (it is then complete) and the
        router takes "}" and the rest."""
        scan, tables = self.scan, self.g.tables
        leaving = tables.leaving.get((scan.mode, scan.depth - scan.params + 1))
        if leaving is None:
            row[:] = piece_row
            return
        np.bitwise_and(piece_row, leaving.keep, out=row)
        closes = _bits(piece_row, leaving.heads)                  # the piece takes the bytes to its close
        simple = closes & (leaving.tails >= 0)
        if simple.any():        # the router's row after the close, for the one-token rests
            self.router.consume_token(tables.ids[b"}"])
            if self.router.compute_ff_bytes():
                # Bytes forced after the close (a template's next key): the router's row is their
                # first canonical token alone, and any token that writes their start is taken.
                tails = np.unique(leaving.tails[simple])
                taken = tails[[self.router.validate_tokens([int(t)]) == 1 for t in tails.tolist()]]
                fits = np.isin(leaving.tails, taken)
            else:
                fits = _bits(np.frombuffer(self.router.compute_bitmask(), dtype=np.int32), leaving.tails)
            self.router.rollback(1)
            for t in leaving.tokens[simple & fits].tolist():
                _set(row, t)
        rest = (closes & (leaving.tails < 0)) | ((leaving.heads < 0) & _bits(piece_row, leaving.firsts))
        for i in np.flatnonzero(rest).tolist():
            if leaving.heads[i] < 0:     # the bytes to the close are several tokens: the piece takes them all?
                head = leaving.head_tokens[i]
                if self.piece.validate_tokens(head) != len(head):
                    continue
            route = leaving.routes[i]
            if self.router.validate_tokens(route) != len(route):
                continue
            t = int(leaving.tokens[i])
            if not leaving.braced[i] or self.allows(t):
                _set(row, t)

    def _entering(self, row: np.ndarray) -> None:
        """Inside a call's object: tokens that reach into the parameters are allowed where the
        router takes their bytes up to the "{" and the named tool's piece the bytes from it."""
        tables = self.g.tables
        maybe = row & (tables.quoted_braces if self.scan.in_str else tables.braces)
        if not maybe.any():
            return
        router_row = row.copy()
        for t in _tokens_in(maybe):
            scan = self.scan.copy()
            events: list = []
            data = tables.data[t]
            assert data is not None      # a token with a "{" is no special token
            scan.feed(data, events)
            if not events:
                continue
            _, at, name = events[0]
            head, rest = tables.ids.get(data[:at + 1], -1), tables.ids.get(data[at:], -1)
            if len(events) == 1 and name in self.g.pieces and head >= 0 and rest >= 0:
                ok = _bit(router_row, head) and self.g.pieces[name].takes_first(rest, tables)
            else:
                ok = self.allows(t)
            if not ok:
                row[t >> 5] &= np.int32(np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF).view(np.int32))


def fill_rows(executor, matchers: Sequence[ComposedMatcher], rows: Sequence[int], out: np.ndarray) -> None:
    """The rows of composed sequences: the routers' (outside the parameters) and the open pieces'
    (inside them) in one parallel fill, then each row made the whole grammar's."""
    stride = out.shape[1] * 4
    outside = [(m.router, r) for m, r in zip(matchers, rows) if not m.scan.params]
    if outside:
        executor.unsafe_compute_mask_ptr(outside, out.ctypes.data, stride, out.shape[0])
    inside = [i for i, m in enumerate(matchers) if m.scan.params]
    pieces = None
    if inside:
        pieces = np.zeros((len(inside), out.shape[1]), dtype=np.int32)
        executor.unsafe_compute_mask_ptr([(matchers[i].piece, k) for k, i in enumerate(inside)],
                                         pieces.ctypes.data, stride, len(inside))
    at = {i: k for k, i in enumerate(inside)}
    for i, (m, r) in enumerate(zip(matchers, rows)):
        m.finish_row(out[r], pieces[at[i]] if pieces is not None and i in at else None)


def fill_with_drafts(executor, m: ComposedMatcher, row: int, draft: Sequence[int], out: np.ndarray) -> None:
    """A composed sequence's row and the rows after each draft token it allows (zero past the first
    it refuses); the matcher ends where it began."""
    out[row: row + 1 + len(draft)] = 0
    taken = 0
    for j in range(len(draft) + 1):
        fill_rows(executor, [m], [row + j], out)
        if j == len(draft) or not _bit(out[row + j], int(draft[j])) or int(draft[j]) in m.g.tables.eos:
            break
        plan = m._plan(int(draft[j]))
        if isinstance(plan, str):
            break
        m._take(plan)
        taken += 1
    m.rollback(taken)
