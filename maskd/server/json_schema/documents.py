"""What complete mode checks: the documents inside a sequence's output, built from its tokens.

A ``DocumentChecker`` belongs to a compiled grammar whose JSON schema(s) the grammar only
relaxes; a ``DocumentBuffer`` belongs to one sequence and holds its accepted tokens, their bytes
and the checker's scan state, so that it follows rollbacks and replays like the matcher (a pure
function of the tokens). Bytes are the tokens' bytes, with a special token written as 0xFF plus
its name (0xFF never occurs in UTF-8 text, so a marker that is a special token is never confused
with the same letters typed as text).

Two layouts:

- ``JsonDocumentChecker``: one JSON document (a ``json_schema`` grammar), after the reasoning end
  marker when the grammar has one. Complete sub-documents are checked as they close (see
  maskd.server.json_schema.validation); the whole document is checked before EOS.
- ``ToolCallChecker``: the JSON arguments inside the tags of a structural tag (tool calls in free
  text); each tag's arguments are checked when they close.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from maskd.server.json_schema.closers import CloserTable, RowMask, closer_table
from maskd.server.json_schema.scan import JsonScanner
from maskd.server.json_schema.validation import Problem, SchemaValidator, parse

SPECIAL_MARK = b"\xff"
_WS = b" \t\r\n"
# How many open containers a closing check looks through, and the largest one it reparses per step.
_CLOSE_LEVELS = 3
_CLOSE_CHECK_BYTES = 1 << 16
# A value is checked once for each distinct addition the row's tokens could end it with, up to this
# many; past that (a string the grammar leaves free: dozens of '…"' tokens) only as it stands.
_ENDINGS_CHECKED = 16
# Values one token may write whole where a value starts (CloserTable.empty holds those tokens).
_WHOLE_VALUES: tuple[tuple[str, Any], ...] = (("{}", {}), ("[]", []), ("null", None), ("true", True), ("false", False),
                                              ('""', ""))


# A string value that must be one of this many strings or fewer is narrowed by what judges it there
# (its dependent schemas on the members so far, ...); past that, by its subschemas alone.
_CHOICES_JUDGED = 64


def _plain_end(text: bytes) -> int:
    """How many bytes of ``text`` a JSON string holds as they are (up to a quote, a backslash or a
    control character, which need an escape)."""
    for i, c in enumerate(text):
        if c == 0x22 or c == 0x5C or c < 0x20:
            return i
    return len(text)


def _shown(choices) -> str:
    shown = ", ".join(json.dumps(c.decode("utf-8", "replace")) for c in choices[:5])
    return shown + (", ..." if len(choices) > 5 else "")


def _whole_value_lead(sc: JsonScanner) -> str | None:
    """What a token writes before a whole value here (WHOLE_LEADS): "" where a value starts, ":"
    after an object's key, "," after an array's item; None where no value can come next."""
    if sc.in_string or sc.scalar_start >= 0 or sc.done:
        return None
    if not sc.stack:
        return "" if sc.root_start < 0 else None
    top = sc.stack[-1]
    if top.awaiting:
        return ""
    if top.is_object:
        return ":" if top.before_colon and top.key is not None else None
    return "," if top.ready else None


def token_bytes(tokenizer, token: int) -> bytes:
    """A token as the checkers see it: its bytes, or 0xFF + its name for a special token."""
    ll = tokenizer.ll
    data = ll.decode_bytes([token])
    return SPECIAL_MARK + data if ll.is_special_token(token) else data


def _lead(lead: str, problem: str | Problem) -> str | Problem:
    return problem.after(lead) if isinstance(problem, Problem) else lead + problem


class DocumentBuffer:
    """One sequence's output as its grammar's checker sees it."""

    __slots__ = ("__weakref__", "checker", "data", "decoded", "doomed", "ends", "scans", "state", "tokens", "verdict")

    def __init__(self, checker: DocumentChecker) -> None:
        self.checker = checker
        self.scans = checker.scans      # checked as the output grows, not only when it ends
        self.tokens: list[int] = []     # accepted tokens (an EOS among them adds no bytes)
        self.decoded = 0                # how many of them are in ``data``
        self.data = bytearray()
        self.ends: list[int] = []       # len(data) after each decoded token
        self.state = checker.new_state()
        self.doomed: str | None = None  # a sub-document that failed: no continuation can pass
        self.verdict: tuple[int, str | None] | None = None   # (len(data), final check) cached

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        del self.tokens[max(0, len(self.tokens) - n):]
        if self.decoded > len(self.tokens):   # rare (speculative decoding): scan again from the start
            self.decoded = 0
            self.data.clear()
            self.ends.clear()
            self.state = self.checker.new_state()
            self.doomed = None
        self.verdict = None

    def advance(self) -> str | None:
        """Turns new tokens into bytes and runs the early checks; the failure, if any."""
        if self.decoded < len(self.tokens):
            tok, eos = self.checker.tokenizer, self.checker.eos
            for t in self.tokens[self.decoded:]:
                if t not in eos:
                    self.data += token_bytes(tok, t)
                self.ends.append(len(self.data))
            self.decoded = len(self.tokens)
        if self.doomed is None:
            self.doomed = self.checker.scan(self.state, self.data)
        return self.doomed

    def final(self) -> str | None:
        """None when the output so far passes as a finished document, else why not."""
        problem = self.advance()
        if problem is not None:
            return problem
        if self.verdict is not None and self.verdict[0] == len(self.data):
            return self.verdict[1]
        verdict = self.checker.final(self.state, self.data)
        self.verdict = (len(self.data), verdict)
        return verdict

    def closed(self) -> bool:
        """Whether the document is complete whatever follows (only whitespace could): a verdict on
        it is final even where the grammar still allows more."""
        return self.checker.closed(self.state, self.data)

    def final_with(self, extra) -> str | None:
        """The final check of this output plus ``extra`` tokens (draft positions), state untouched."""
        probe = DocumentBuffer(self.checker)
        probe.tokens = self.tokens + [int(t) for t in extra]
        return probe.final()


class DocumentChecker:
    """Per grammar: where its documents are in the output and how each is checked."""

    closers: CloserTable | None = None   # set where rows must keep objects open (JsonDocumentChecker)

    def __init__(self, tokenizer, reasoning: tuple[bytes, bytes] = (b"", b"")) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.reasoning_start, self.reasoning_end = reasoning

    def new_state(self) -> Any:
        raise NotImplementedError

    def scan(self, state: Any, data: bytearray) -> str | None:
        raise NotImplementedError

    def final(self, state: Any, data: bytearray) -> str | None:
        raise NotImplementedError

    def closed(self, state: Any, data: bytearray) -> bool:
        return False

    def describe(self) -> dict:
        raise NotImplementedError

    def row_vetoes(self, state: Any, data: bytearray, row) -> list:
        return []

    @property
    def scans(self) -> bool:
        """Whether the output is scanned as it grows (early checks); if not, only the final check."""
        return True

    def body_start(self, data: bytearray) -> int:
        """Where the output after the reasoning starts (-1: the reasoning has not ended yet)."""
        if not self.reasoning_end:
            return 0
        at = data.find(self.reasoning_end, len(self.reasoning_start))
        return -1 if at < 0 else at + len(self.reasoning_end)


@dataclasses.dataclass
class _DocState:
    body: int = -1
    scanner: JsonScanner | None = None
    veto: str | Problem = ""   # why the row's last veto was needed (the validator's message, built when read)
    # the strings the value being written may still be (string_start, their UTF-8 bytes or None)
    choices: tuple[int, tuple[bytes, ...] | None] | None = None


class JsonDocumentChecker(DocumentChecker):
    """One JSON document (after the reasoning, if any) against one schema."""

    def __init__(self, validator: SchemaValidator, tokenizer, reasoning: tuple[bytes, bytes] = (b"", b"")) -> None:
        super().__init__(tokenizer, reasoning)
        self.validator = validator
        # Where the grammar does not enforce a sub-document whole, rows keep it open while closing it
        # would fail (closers.py).
        self.closers = closer_table(tokenizer) if validator.root_ctx is not None else None

    def new_state(self) -> _DocState:
        return _DocState()

    def describe(self) -> dict:
        """What rebuilds this checker elsewhere (``checker_from_description``)."""
        return {"kind": "json", "markers": [self.reasoning_start.hex(), self.reasoning_end.hex()],
                "schema": self.validator.schema, "relaxed": sorted(self.validator.relaxed)}

    @property
    def scans(self) -> bool:
        return self.validator.root_ctx is not None

    def scan(self, state: _DocState, data: bytearray) -> str | None:
        if state.body < 0:
            state.body = self.body_start(data)
            if state.body < 0:
                return None
        if self.validator.root_ctx is None:
            return None   # nothing below the root is worth an early check
        if state.scanner is None:
            root = self.validator.root_ctx
            state.scanner = JsonScanner(self._watch, (root, "", self.validator.unions(root)), start=state.body,
                                        settle=self._settle)
        for (ptrs, where, *_), start, end in state.scanner.feed(data):
            value, problem = parse(data[start:end])
            if problem is None:
                problem = self.validator.check_at(ptrs, value, where)
            if problem is not None:
                return f"the document cannot match the JSON schema: {problem}"
        return None

    def row_vetoes(self, state: _DocState, data: bytearray, row) -> list:
        """Token ids the row must not allow here although the grammar does: those that would close
        a pinned sub-document that does not pass as it stands (a required key missing, a oneOf with
        no or two branches, duplicate items, ...) and those that would write a whole empty
        object or array where one does not pass. Only what the row allows is checked."""
        closers = self.closers
        sc = state.scanner
        if closers is None or sc is None or sc.done:
            return []
        out = []
        if sc.stack:
            closing = self._closing(state, data)
            if closing is not None:
                ids = closers.closing(*closing)
                if closers.allows_any(row, ids):
                    out.append(ids)
            ends = self._value_end_fails(state, data, row)
            if ends is not None:
                out.append(ends)
            keys = self._key_vetoes(state, data, row)
            if keys is not None:
                out.append(keys)
            if sc.in_string:
                prefix = self._string_prefix_fails(state, data, row)
                if prefix is not None:
                    out.append(prefix)
        grows = self._integer_growth_fails(state, data, row)
        if grows is not None:
            out.append(grows)
        if self.validator.number_nodes and not sc.in_string:
            out += self._number_vetoes(state, data, row)
        lead = _whole_value_lead(sc)
        if lead is not None and sc.stack:
            opened = self._string_start_fails(state, data, row, lead)
            if opened is not None:
                out.append(opened)
        if lead is not None:
            for text, value in _WHOLE_VALUES:
                ids = closers.empty[lead + text]
                if ids.size and closers.allows_any(row, ids) and self._value_fails(state, data, value, lead):
                    out.append(ids)
                elif not lead and text in ("{}", "[]") and sc.stack \
                        and closers.allows_any(row, closers.empty[text + "+"]) \
                        and self._closing(state, data, text.encode()) is not None:
                    out.append(closers.empty[text + "+"])
        return out

    def _closing(self, state: _DocState, data: bytearray, value: bytes = b"") -> tuple[int, bool, bool] | None:
        """(k, inside a string, right after its backslash) when closing the k-th open container (1: the
        innermost) right here would end a pinned sub-document that does not pass; only where the
        output could close next (after a whole member, in an empty container, a number or a string
        value that may end, or after ``value`` written where a value starts). Right after a string's
        backslash, the string as it stands decides (as for a free string in ``_value_end_fails``)."""
        sc = state.scanner
        assert sc is not None
        top = sc.stack[-1]
        escaped = sc.in_string and sc.escape
        if escaped:
            data = data[:-1]
        if value:
            if not top.awaiting:
                return None
            tail = value
        elif sc.in_string:
            if top.is_object and top.expect_key:
                return None            # a key: nothing closes here
            tail = b'"'
        elif top.ready or sc.scalar_start >= 0:
            tail = b""
        else:
            return None
        for k, frame in enumerate(reversed(sc.stack[-_CLOSE_LEVELS:]), 1):
            tail += b"}" if frame.is_object else b"]"
            if frame.ctx is None or not (frame.ctx[0] or frame.ctx[2]) or len(data) - frame.start > _CLOSE_CHECK_BYTES:
                continue
            value, unread = parse(bytes(data[frame.start:]) + tail)
            if unread is not None:
                return None            # a literal or number not finished yet ("tru", "1."): not decided here
            problem = self._fails(frame.ctx, value)
            if problem is not None:
                state.veto = problem.after("closing it here: ")
                return k, sc.in_string, escaped
        return None

    def _watched_top(self, state: _DocState):
        """(scanner, innermost container, closers) where the container is watched and there are
        closers to check its tokens with; None elsewhere."""
        sc = state.scanner
        assert sc is not None
        top = sc.stack[-1]
        if self.closers is None or top.ctx is None:
            return None
        return sc, top, self.closers

    def _value_end_fails(self, state: _DocState, data: bytearray, row):
        """The tokens the row allows that would end the number or string value being written with a
        value that does not pass its pinned subschemas ('"', '",' but also '29",': each distinct
        addition is checked once). Where the row's tokens could end the value in more than
        ``_ENDINGS_CHECKED`` ways (a string the grammar leaves free), the value as it stands decides
        for all of them (see below)."""
        found = self._watched_top(state)
        if found is None:
            return None
        sc, top, closers = found
        if sc.in_string:
            start, kind, tail = sc.string_start, "escaped string" if sc.escape else "string", b'"'
            if top.is_object and top.expect_key:
                return None   # a key: _key_vetoes
            else:
                # a string's context is looked up when it ends (the scanner skips strings whole)
                ctx = self._watch(top.ctx, top.key if top.is_object else top.index)
                judge = self._member_judge(ctx, top, lambda: bytes(data[top.start:start]))
        elif sc.scalar_start >= 0:
            start, kind, tail = sc.scalar_start, "number", b""
            if self._numbers_decide(top):
                return None   # the rows' number check refuses what ends it outside its bounds (exact)
            judge = self._member_judge(top.child_ctx, top, lambda: bytes(data[top.start:start]))
        else:
            return None
        if judge is None or len(data) - start > _CLOSE_CHECK_BYTES:
            return None
        ids, which, prefixes = closers.ending(kind, row)
        if not ids.size:
            return None
        head = bytes(data[start:])
        failing = []
        candidates = np.flatnonzero(np.bincount(which, minlength=len(prefixes)))
        if candidates.size > _ENDINGS_CHECKED:
            # Too many ways to check each: the value as it stands decides. Where it fails, no token may
            # end it (one that adds and ends could fix it, rarely; the additions can come as tokens
            # of their own, and the quote after them is checked then); where it passes, the tokens
            # that add and end are left to the final check.
            value, problem = parse((head[:-1] if sc.escape else head) + tail)   # without a pending backslash
            if problem is not None:   # not a value as it stands ("1."): the grammar decides
                return None
            problem = judge(value)
            if problem is None:
                return None
            state.veto = _lead("ending the value here: ", problem)
            return ids
        for w in candidates:
            value, problem = parse(head + prefixes[w] + tail)
            if problem is not None:
                continue   # not a value yet ("1." then "e,"): the grammar decides
            problem = judge(value)
            if problem is not None:
                failing.append(w)
                state.veto = _lead("ending the value here: ", problem)
        if not failing:
            return None
        fails = np.zeros(len(prefixes), dtype=bool)
        fails[failing] = True
        return ids[fails[which]]

    def _string_choices(self, state: _DocState, data: bytearray, key, start: int, members) -> tuple[bytes, ...] | None:
        """The strings (UTF-8) the string value starting at ``start`` (the child ``key`` of the
        innermost container) may be and still pass: the few its subschemas and unions allow
        (``SchemaValidator.string_choices``) that pass what judges a value there (its dependent schemas
        on the members so far, ...); None when any string may. Kept per string."""
        if state.choices is not None and state.choices[0] == start:
            return state.choices[1]
        sc = state.scanner
        assert sc is not None
        top = sc.stack[-1]
        found: tuple[bytes, ...] | None = None
        ctx = self._watch(top.ctx, key) if top.ctx is not None else None
        if ctx is not None:
            allowed = self.validator.string_choices(top.ctx[0], key, ctx[2])
            if allowed is not None:
                judge = self._member_judge(ctx, top, members) if len(allowed) <= _CHOICES_JUDGED else None
                found = tuple(sorted(c.encode() for c in allowed if judge is None or judge(c) is None))
        state.choices = (start, found)
        return found

    def _string_prefix_fails(self, state: _DocState, data: bytearray, row):
        """Inside a string value that must be one of a few strings: the tokens the row allows that
        would write what none of them starts with, or end it as none of them (a mask: most of the
        vocabulary). Tokens holding a backslash are left to the grammar (an escape may write any
        character), and so is a string whose escapes so far do not decode."""
        found = self._watched_top(state)
        if found is None or (found[1].is_object and found[1].expect_key):
            return None
        sc, top, closers = found
        key = top.key if top.is_object else top.index
        start = sc.string_start
        choices = self._string_choices(state, data, key, start, lambda: bytes(data[top.start:start]))
        if choices is None or sc.escape:
            return None
        written = bytes(data[start + 1:])
        if b"\\" in written:
            try:
                written = json.loads(b'"' + written + b'"').encode()
            except ValueError:
                return None
        keep = []
        for choice in choices:
            if not choice.startswith(written):
                continue
            rest = choice[len(written):]
            plain = _plain_end(rest)
            keep += [closers.equal_to(rest[:i]) for i in range(1, plain + 1)]
            if plain == len(rest):
                keep.append(closers.starting_with(rest + b'"'))
        if not keep:
            return None   # nothing it may still be: the ending checks refuse what ends it
        vetoed = closers.keep_only(row, keep)
        if vetoed is not None:
            state.veto = f"writing a string here that none of {_shown(choices)} starts with"
        return vetoed

    def _string_start_fails(self, state: _DocState, data: bytearray, row, lead: str):
        """Where a value starts: the tokens the row allows that open a string value and write what no
        string it may be starts with (it must be one of a few), or write a whole string (opened and
        closed by the token) that does not pass what judges a value there."""
        found = self._watched_top(state)
        if found is None:
            return None
        _, top, closers = found
        ids, rests = closers.quoted[lead]
        allowed = closers.allowed(row, ids)
        if not allowed.size:
            return None
        key = top.key if top.is_object else top.index + (lead == ",")
        if key is None:
            return None
        members = lambda: bytes(data[top.start:]).rstrip(_WS).removesuffix(b":") + b":"
        choices = self._string_choices(state, data, key, -2 - len(data), members)
        judge = None
        if choices is None:
            ctx = self._watch(top.ctx, key)
            judge = self._member_judge(ctx, top, members) if ctx is not None else None
            if judge is None:
                return None
        verdicts: dict[bytes, bool] = {}
        vetoed = []
        for t, at in zip(allowed.tolist(), np.searchsorted(ids, allowed).tolist()):   # ids are sorted
            rest = rests[at]
            if b"\\" in rest:
                continue
            end = rest.find(b'"')
            if end < 0:
                if choices is not None and not any(c.startswith(rest) for c in choices):
                    vetoed.append(t)
                continue
            value = rest[:end]
            bad = verdicts.get(value)
            if bad is None:
                if choices is not None:
                    bad = value not in choices
                else:
                    try:
                        text = value.decode()
                    except UnicodeDecodeError:
                        continue
                    bad = judge(text) is not None   # type: ignore[misc]
                verdicts[value] = bad
            if bad:
                vetoed.append(t)
        if not vetoed:
            return None
        state.veto = f"opening a string here that none of {_shown(choices)} starts with" if choices is not None \
            else "writing a string here that does not pass"
        return np.array(vetoed, dtype=np.int64)

    def _numbers_decide(self, top) -> bool:
        """Whether the number being written in ``top`` is judged by its bounds alone, which the rows'
        number check enforces (no union, no dependent schema, nothing else pinned there)."""
        ctx = top.child_ctx
        if ctx is None or ctx[2] or (top.ctx is not None and top.ctx[2]) or not self.validator.number_nodes:
            return False
        if not ctx[0] or not ctx[0] <= self.validator.number_nodes.keys():
            return False
        return self.validator.number_rule(ctx[0]) is not None and not (
            top.is_object and top.ctx is not None and self.validator.dependents(top.ctx[0]))

    def _number_vetoes(self, state: _DocState, data: bytearray, row) -> list:
        """Where a number is being written, or may start, at a node whose bounds the grammar leaves to
        the rows (``numbers.NumberRule``): the tokens that would leave a number no continuation ends
        within them, or end one outside them."""
        sc = state.scanner
        closers = self.closers
        assert sc is not None and closers is not None
        if sc.scalar_start >= 0:
            text, where = bytes(data[sc.scalar_start:]), "in"
            ctx = sc.stack[-1].child_ctx if sc.stack else sc.root_ctx
        else:
            lead = _whole_value_lead(sc)
            if lead is None:
                return []
            text, where = b"", lead
            if sc.stack:
                top = sc.stack[-1]
                key = top.key if top.is_object else top.index + (lead == ",")
                ctx = self._watch(top.ctx, key) if top.ctx is not None and key is not None else None
            else:
                ctx = sc.root_ctx
        rule = self.validator.number_rule(ctx[0]) if ctx is not None else None
        if rule is None:
            return []
        found = rule.token_vetoes(text, closers.numbers[where])
        if found is None:
            return []   # a literal, or no number
        bad, ends_bad = found
        out: list = []
        vetoed = closers.allowed(row, bad)
        if vetoed.size:
            out.append(vetoed)
        if ends_bad and where == "in":
            words = row.view(np.uint32)
            enders = words & closers.numbers[where].ender_mask(words.shape[0])
            if enders.any():
                out.append(RowMask(enders))
        if out:
            state.veto = "writing a number here that cannot end within its bounds"
        return out

    def _integer_growth_fails(self, state: _DocState, data: bytearray, row):
        """The digit tokens the row allows that would take an integer being written past 2^53 to one
        that does not pass and that no integer constant of the schema starts with: complete mode's
        grammar widens such a constant to the integers between the doubles around it
        (``numbers.grammar_numbers``), so ``9007199254740992`` for ``9007199254740993`` is grammatical,
        and no digit can follow it there (a longer number leaves the range): a dead end. Only where
        something judges the value (a pinned subschema, its object's unions, the whole document at
        the root)."""
        big = self.validator.big_integers
        sc = state.scanner
        assert sc is not None
        closers = self.closers
        if not big or closers is None or sc.in_string or sc.scalar_start < 0:
            return None
        head = bytes(data[sc.scalar_start:])
        digits = head[1:] if head[:1] == b"-" else head
        if not digits.isdigit() or len(digits) + 8 < 16:   # not an integer, or far from 2^53 (a token adds few digits)
            return None
        if sc.stack:
            top = sc.stack[-1]
            if top.ctx is None:
                return None
            start = sc.scalar_start
            judge = self._member_judge(top.child_ctx, top, lambda: bytes(data[top.start:start]))
        else:
            judge = self.validator.check
        if judge is None:
            return None
        vetoed = []
        for t in closers.allowed(row, closers.digit_ids):
            text = head + closers.digits[int(t)]
            if abs(int(text)) < 1 << 53 or any(k.startswith(text) for k in big):
                continue
            problem = judge(int(text))
            if problem is not None:
                vetoed.append(int(t))
                state.veto = _lead("writing this integer: ", problem)
        return np.array(vetoed, dtype=np.int64) if vetoed else None

    def _member_judge(self, ctx, top, members_so_far):
        """What decides whether a value ending here passes: its pinned subschemas, and in an object,
        the branches of its unions the member leaves (none: it fails) and the dependent schemas
        (``validation.dependents``) its members trigger, on the object with this member
        (``members_so_far()``: its text up to the value); None when nothing would."""
        pinned = ctx is not None and bool(ctx[0] or ctx[2])
        dependents = self.validator.dependents(top.ctx[0]) if top.is_object else None
        unions = top.ctx[2] if top.is_object and isinstance(top.key, str) else ()
        if not pinned and not dependents and not unions:
            return None
        members = members_so_far() if dependents or unions else b""

        def judge(value):
            if pinned:
                failed = self._fails(ctx, value)
                if failed is not None:
                    return failed
            deps = dependents
            if unions:   # the branches this member leaves: none is a dead end; one pins its dependents
                left = self._narrowed(unions, top.key, value)
                if left is None:
                    return f"at {top.ctx[1] or 'the document root'}: no branch of its oneOf / anyOf " \
                           f"takes {json.dumps(top.key)} with this value"
                if left:
                    deps = {**(deps or {}), **self.validator.dependents(left)}
            if deps:
                obj, problem = parse(members + json.dumps(value).encode() + b"}")
                if problem is None and isinstance(obj, dict):
                    return self.validator.fails_dependents(deps, obj, obj, top.ctx[1])
            return None
        return judge

    def _narrowed(self, unions, key: str, value) -> frozenset[str] | None:
        """The pointers a member pins by leaving one branch of a union (empty: none), or None when it
        leaves a union no branch."""
        pinned: set[str] = set()
        for branches in unions:
            left = self.validator.narrow(branches, key, value)
            if not left:
                return None
            if len(left) == 1:
                pinned.update(p for p in left[0] if self.validator.subtree_relaxed(p))
        return frozenset(pinned)

    def _key_vetoes(self, state: _DocState, data: bytearray, row):
        """The tokens that would write a key whose presence makes its object fail for good (a
        dependent schema the members so far break: ``validation.dependents``): the whole key, or a
        start of it that only such keys have, where the schema names every key the object may have;
        and the comma after a member (also one a token writes after closing the member's value: '],')
        where every key the object may still take is such a key."""
        sc = state.scanner
        assert sc is not None
        top = sc.stack[-1]
        here = after = None
        if top.is_object and top.ctx is not None:
            if sc.in_string:
                if top.expect_key:
                    here = self._forbidden_keys(top, bytes(data[top.start:sc.string_start]))
            elif top.expect_key or top.ready:
                here = self._forbidden_keys(top, bytes(data[top.start:]))
        if len(sc.stack) > 1 and not sc.in_string and sc.scalar_start < 0 and top.ready:
            parent = sc.stack[-2]
            if parent.is_object and parent.ctx is not None:
                closed = bytes(data[parent.start:]) + (b"}" if top.is_object else b"]")
                after = self._forbidden_keys(parent, closed)
                after = after if after is not None and after[2] else None
        if here is None and after is None:
            return None
        prefix = bytes(data[sc.string_start + 1:]) if sc.in_string else b""
        vetoed = []
        closers = self.closers
        assert closers is not None
        for t in closers.allowed(row, self._key_candidates(prefix, sc.in_string, here)):
            text = token_bytes(self.tokenizer, int(t))
            lead = text.lstrip(_WS)
            comma_after_closing = lead[:1] in (b"}", b"]") and lead[1:].lstrip(_WS).startswith(b",")
            if (after is not None and comma_after_closing) or \
                    (here is not None and self._writes_forbidden_key(prefix + text, sc.in_string, top, here)):
                vetoed.append(int(t))
        if not vetoed:
            return None
        forbidden = (here or after)[0]   # type: ignore[index]
        state.veto = _lead("writing a key here: ", next(iter(forbidden.values())))
        return np.array(vetoed, dtype=np.int64)

    def _key_candidates(self, prefix: bytes, in_string: bool, here) -> np.ndarray:
        """The tokens ``_key_vetoes`` looks at (a superset of those it may veto): outside a string,
        those that may start a key (a quote, a comma, a closer then a comma); inside a key written
        up to ``prefix``, those that finish a forbidden key with its quote, or (where the schema
        names every key) write only part of one."""
        closers = self.closers
        assert closers is not None
        if not in_string:
            return closers.key_leads
        found = [closers.key_leads[:0]]
        forbidden, closed, _ = here if here is not None else ({}, None, False)
        for key in forbidden:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            found.append(closers.starting_with(rest + b'"'))
            if closed is not None:
                found += [closers.equal_to(rest[:i]) for i in range(1, len(rest) + 1)]
        return np.unique(np.concatenate(found))

    def _forbidden_keys(self, frame, members: bytes):
        """(forbidden keys -> why, the keys the object may have or None, whether no key it may still
        take is allowed) for an object frame whose members so far are ``members``, or None."""
        dependents = self.validator.dependents(frame.ctx[0])
        if not dependents:
            return None
        obj, problem = parse(members.rstrip(_WS).removesuffix(b",") + b"}")
        if problem is not None or not isinstance(obj, dict):
            return None
        forbidden = {}
        for key in dependents:
            if key not in obj:
                why = self.validator.fails_dependents(dependents, (key,), obj, frame.ctx[1])
                if why is not None:
                    forbidden[key.encode()] = why
        if not forbidden:
            return None
        names = self.validator.closed_keys(frame.ctx[0])
        closed = None if names is None else [k.encode() for k in names]
        no_more = closed is not None and all(k in forbidden or k.decode() in obj for k in closed)
        return forbidden, closed, no_more

    @staticmethod
    def _writes_forbidden_key(text: bytes, in_string: bool, top, found) -> bool:
        """Whether a token (``text``: inside a key, the key so far and the token) writes a forbidden
        key, or a start only forbidden keys have, or (``no_more``) a comma."""
        forbidden, closed, no_more = found
        if not in_string:
            text = text.lstrip(_WS)
            if not top.expect_key:       # after a member: a comma first
                if not text.startswith(b","):
                    return False
                if no_more:
                    return True
                text = text[1:].lstrip(_WS)
            if not text.startswith(b'"'):
                return False
            text = text[1:]
        if b"\\" in text:
            return False
        end = text.find(b'"')
        if end >= 0:
            return text[:end] in forbidden
        if closed is None:
            return False
        starting = [k for k in closed if k.startswith(text)]
        return bool(starting) and all(k in forbidden for k in starting)

    def _value_fails(self, state: _DocState, data: bytearray, value, lead: str = "") -> bool:
        """Whether a whole value written here (an empty object / array, a literal) could not pass its
        pinned subschemas; ``lead`` as ``_whole_value_lead`` says."""
        sc = state.scanner
        assert sc is not None
        if not sc.stack:
            ctx = sc.root_ctx
            problem = None if ctx is None else self._fails(ctx, value)
        else:
            top = sc.stack[-1]
            if top.ctx is None:
                return False
            key = top.key if top.is_object else top.index + (lead == ",")
            ctx = self._watch(top.ctx, key)
            judge = self._member_judge(ctx, top, lambda: bytes(data[top.start:]).rstrip(_WS).removesuffix(b":") + b":")
            problem = None if judge is None else judge(value)
        if problem is not None:
            state.veto = _lead(f"writing {json.dumps(value)} here: ", problem)
        return problem is not None

    def _watch(self, ctx, key):
        """A child's context: (pinned pointers worth checking, where it sits, the unions whose branches
        its members narrow), or None when nothing there is checked. A member of an object whose
        unions are still open is watched even where nothing below it is: its value may rule out
        branches (``_settle``); the child is under those unions in turn (``validation.inherit``):
        it must pass one of the branches' subschemas for it, whatever construct leads there."""
        ptrs, where = ctx[0], ctx[1]
        child = self.validator.watch(ptrs, key)
        if child is None and not ctx[2]:
            return None
        child = child or frozenset()
        unions = (self.validator.unions(child) if child else ()) + self.validator.inherit(ctx[2], key)
        return (child, f"{where}/{key}", unions)

    def _fails(self, ctx, value) -> Problem | None:
        """Why ``value`` in context ``ctx`` could not pass: a pinned subschema it fails, or a union it
        is under (its own, or one of a container it is in: ``_watch``) with no branch it passes."""
        problem = self.validator.fails_at(ctx[0], value, ctx[1]) if ctx[0] else None
        if problem is None and ctx[2] and self.validator.union_fails(ctx[2], value) is not None:
            where = ctx[1] or "the document root"
            problem = Problem(lambda: f"at {where}: {json.dumps(value)[:200]} passes no branch of a oneOf / anyOf "
                                      f"it is under")
        return problem

    def _settle(self, parent, key: str, data, start: int, end: int):
        """Once a member of an object under a ``oneOf`` / ``anyOf`` is complete, the branches it rules
        out go; when one branch is left (a discriminated union's tag does this at once), the object is
        pinned to it: later members and the object's end are checked against that branch too."""
        unions = parent[2]
        if not unions:
            return None
        value, problem = parse(data[start:end])
        if problem is not None:
            return None
        pinned: set[str] = set()
        left = []
        for branches in unions:
            possible = self.validator.narrow(branches, key, value)
            if len(possible) == 1:
                pinned.update(p for p in possible[0] if self.validator.subtree_relaxed(p))
            if possible:   # one branch left stays too: the object's end must pass it whole
                left.append(possible)
        return (parent[0] | pinned, parent[1], tuple(left))

    def closed(self, state: _DocState, data: bytearray) -> bool:
        """An object, array, string or literal at the root that has ended (a number may still grow)."""
        body = state.body if state.body >= 0 else self.body_start(data)
        tail = bytes(data[body:]).rstrip() if body >= 0 else b""
        return bool(tail) and tail[-1:] in (b"}", b"]", b'"', b"e", b"l") and parse(tail)[1] is None

    def final(self, state: _DocState, data: bytearray) -> str | None:
        body = state.body if state.body >= 0 else self.body_start(data)
        if body < 0:
            return "the reasoning has not ended, so there is no document yet"
        value, problem = parse(data[body:])
        if problem is None:
            problem = self.validator.check(value)
        return None if problem is None else f"the document does not match the JSON schema: {problem}"


@dataclasses.dataclass(frozen=True)
class TagSpan:
    """One tag of a structural tag as it appears in the output: begin, content, one of the ends."""
    begin: bytes                        # marked bytes (see token_bytes)
    ends: tuple[bytes, ...]
    json: bool                          # the content is a JSON value
    validator: SchemaValidator | None   # set for JSON arguments the grammar only relaxes
    name: str = ""


@dataclasses.dataclass
class _ToolState:
    body: int = -1
    pos: int = 0
    tag: TagSpan | None = None
    scanner: JsonScanner | None = None   # reading a tag's JSON content
    after_json: bool = False             # the JSON content ended; the end marker follows
    calls: int = 0


class ToolCallChecker(DocumentChecker):
    """Tags (tool calls) in free text: the JSON content of each tag that has a validator is
    checked when it closes; the content of the others is skipped."""

    def __init__(self, tags: list[TagSpan], tokenizer, reasoning: tuple[bytes, bytes] = (b"", b"")) -> None:
        super().__init__(tokenizer, reasoning)
        self.tags = sorted(tags, key=lambda t: -len(t.begin))   # longest begin wins a tie
        self.longest = max((len(t.begin) for t in tags), default=1)

    def new_state(self) -> _ToolState:
        return _ToolState()

    def describe(self) -> dict:
        """What rebuilds this checker elsewhere (``checker_from_description``)."""
        tags = [{"begin": t.begin.hex(), "ends": [e.hex() for e in t.ends], "json": t.json, "name": t.name,
                 "schema": None if t.validator is None else t.validator.schema,
                 "relaxed": None if t.validator is None else sorted(t.validator.relaxed)} for t in self.tags]
        return {"kind": "tools", "markers": [self.reasoning_start.hex(), self.reasoning_end.hex()], "tags": tags}

    def scan(self, st: _ToolState, data: bytearray) -> str | None:
        if st.body < 0:
            st.body = self.body_start(data)
            if st.body < 0:
                return None
            st.pos = st.body
        while True:
            if st.tag is None:
                found = self._next_begin(data, st.pos)
                if found is None:
                    st.pos = max(st.pos, len(data) - self.longest + 1)
                    return None
                at, tag = found
                st.tag, st.pos, st.after_json = tag, at + len(tag.begin), False
                st.scanner = JsonScanner(start=st.pos) if tag.json else None
            tag = st.tag
            if st.scanner is not None and not st.after_json:
                st.scanner.feed(data)
                if not st.scanner.done:
                    return None
                start, end = st.scanner.root_start, st.scanner.root_end
                st.calls += 1
                if tag.validator is not None:
                    value, problem = parse(data[start:end])
                    if problem is None:
                        problem = tag.validator.check(value)
                    if problem is not None:
                        return (f"the arguments of tool call {st.calls} ({tag.name}) do not match their "
                                f"JSON schema: {problem}")
                st.pos, st.after_json = end, True
            ends = [(data.find(e, st.pos), e) for e in tag.ends if e]
            ends = [(i, e) for i, e in ends if i >= 0]
            if tag.ends and not ends:
                return None
            if ends:
                i, e = min(ends, key=lambda x: (x[0], -len(x[1])))
                st.pos = i + len(e)
            st.tag, st.scanner = None, None

    def _next_begin(self, data: bytearray, pos: int) -> tuple[int, TagSpan] | None:
        best: tuple[int, TagSpan] | None = None
        for tag in self.tags:
            i = data.find(tag.begin, pos)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, tag)
        return best

    def final(self, st: _ToolState, data: bytearray) -> str | None:
        if st.tag is not None and st.scanner is not None and not st.after_json and st.tag.validator is not None:
            return "a tool call's arguments are not finished"
        return None


class CallArrayChecker(DocumentChecker):
    """The final check of a composed call array: each call's parameters against its tool's schema
    (the validator each piece was compiled with), as the whole grammar's final check does."""

    def __init__(self, validators: dict[Any, Any], tokenizer) -> None:
        super().__init__(tokenizer)
        self.validators = validators

    def new_state(self) -> None:
        return None

    @property
    def scans(self) -> bool:
        return False

    def scan(self, state, data: bytearray) -> str | None:
        return None

    def final(self, state, data: bytearray) -> str | None:
        try:
            calls = json.loads(bytes(data))
        except ValueError as exc:
            return f"the output is not a finished JSON array of tool calls: {exc}"
        if not isinstance(calls, list):
            return "the output is not a JSON array of tool calls"
        for i, call in enumerate(calls):
            validator = self.validators.get(call.get("name")) if isinstance(call, dict) else None
            if validator is None:
                continue
            problem = validator.check(call.get("parameters"))
            if problem is not None:
                return f"the parameters of tool call {i + 1} ({call['name']}) do not match their JSON schema: {problem}"
        return None

    def describe(self) -> dict:
        raise NotImplementedError("a composed grammar is composed again from its pieces, not serialized")


class TemplateChecker(CallArrayChecker):
    """The final check of a composed template: the value at each hole against its argument's schema
    (the validator each piece was compiled with; ``paths``: each hole's path of property names,
    None for every item of an array)."""

    def __init__(self, validators: dict[Any, Any], paths: tuple, tokenizer) -> None:
        super().__init__(validators, tokenizer)
        self.paths = [(path, name) for path, name in paths if name in validators]

    def final(self, state, data: bytearray) -> str | None:
        try:
            document = json.loads(bytes(data))
        except ValueError as exc:
            return f"the output is not a finished JSON document: {exc}"
        for path, name in self.paths:
            for where, value in _at(document, path):
                problem = self.validators[name].check(value)
                if problem is not None:
                    return f"the value at {where or '/'} (hole {name!r}) does not match its JSON schema: {problem}"
        return None


def _at(document: Any, path: tuple) -> list[tuple[str, Any]]:
    """The values at ``path`` in ``document`` with their JSON pointers (None: each item of an array)."""
    found = [("", document)]
    for step in path:
        nxt: list[tuple[str, Any]] = []
        for where, value in found:
            if step is None and isinstance(value, list):
                nxt.extend((f"{where}/{i}", v) for i, v in enumerate(value))
            elif step is not None and isinstance(value, dict) and step in value:
                nxt.append((f"{where}/{step.replace('~', '~0').replace('/', '~1')}", value[step]))
        found = nxt
    return found


def checker_from_description(desc: dict, tokenizer) -> DocumentChecker:
    """The checker ``describe`` described (its validators built again: they do not serialize)."""
    markers = (bytes.fromhex(desc["markers"][0]), bytes.fromhex(desc["markers"][1]))
    if desc["kind"] == "json":
        return JsonDocumentChecker(SchemaValidator(desc["schema"], frozenset(desc["relaxed"])), tokenizer, markers)
    if desc["kind"] == "tools":
        tags = [TagSpan(bytes.fromhex(t["begin"]), tuple(bytes.fromhex(e) for e in t["ends"]), t["json"],
                        None if t["relaxed"] is None else SchemaValidator(t["schema"], frozenset(t["relaxed"])),
                        t["name"]) for t in desc["tags"]]
        return ToolCallChecker(tags, tokenizer, markers)
    raise ValueError(f"unknown document checker kind {desc['kind']!r}")
