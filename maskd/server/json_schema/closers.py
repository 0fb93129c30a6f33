"""Which tokens close JSON containers, for rows that must keep an object open.

Complete mode's grammar does not enforce every keyword (it takes an object's keys in any order, so
it does not know which are required; it ignores ``not``, reads ``oneOf`` as ``anyOf``, ...); the
validator does. Where closing a pinned sub-document (see validation.py) right now would fail its
check, the tokens that would close it are taken out of its row (``step_checks``), so no document
is closed into a state no continuation can make valid.

A token closes the k-th open container (1: the innermost) when, scanning its bytes from the
document's state (inside a string or not), the nesting depth falls to -k. That depends only on the
token's bytes and on whether the scan starts inside a string, so the lowest depth each token
reaches is computed once per tokenizer, for the tokens holding ``}`` or ``]``; a step's veto is
then one comparison over those arrays.
"""
from __future__ import annotations

import bisect
import re
import threading

import numpy as np

_TABLES: dict[str, CloserTable] = {}
_LOCK = threading.Lock()


def _lowest(data: bytes, in_string: bool, escape: bool = False) -> int:
    """The lowest nesting depth (0 = where the scan starts) reached while scanning ``data`` (from
    inside a string, right after its backslash with ``escape``)."""
    depth = low = 0
    for c in data:
        if in_string:
            if escape:
                escape = False
            elif c == 0x5C:
                escape = True
            elif c == 0x22:
                in_string = False
            continue
        if c == 0x22:
            in_string = True
        elif c == 0x7B or c == 0x5B:
            depth += 1
        elif c == 0x7D or c == 0x5D:
            depth -= 1
            low = min(low, depth)
    return low


_WS = b" \t\r\n"
#: What a token may write before a whole value: nothing (a value starts here), the colon after a key,
#: the comma after an array's item.
WHOLE_LEADS = ("", ":", ",")

_NUMBER_CHARS = frozenset(b"0123456789.eE+-")
_NUMBER_ENDS = frozenset(b",}] \t\r\n")
_NUMBER_START = _NUMBER_CHARS | _NUMBER_ENDS


def _string_end(data: bytes, escape: bool = False) -> bytes | None:
    """What a token adds to a string before ending it (scanning from inside the string, right after
    its backslash with ``escape``), or None when it does not end it."""
    for i, c in enumerate(data):
        if escape:
            escape = False
        elif c == 0x5C:
            escape = True
        elif c == 0x22:
            return data[:i]
    return None


_NUMBER_FIRST = tuple(bytes([c]) for c in b"-0123456789")
_NUMBER_PART = re.compile(rb"-?[0-9]*(\.[0-9]*)?([eE][+-]?[0-9]*)?|[+-][0-9]*")


def _number_part(data: bytes) -> tuple[bytes, bool] | None:
    """(what a token adds to a number, whether it then ends it), or None where it cannot go on with
    one (after its number characters comes something that cannot follow a number, or they are no
    piece of a number)."""
    end = _number_end(data)
    part = data if end is None else end
    if end is None and not all(c in _NUMBER_CHARS for c in data):
        return None
    if part and _NUMBER_PART.fullmatch(part) is None:
        return None
    return part, end is not None


class NumberTokens:
    """Tokens that write (part of) a number, by kind: digits only (how many, their value, a leading 0,
    whether the token then ends the number) and the rest (what they add, whether they end it; those
    that only end it add nothing)."""

    def __init__(self, found: list[tuple[int, bytes, bool]]) -> None:
        digits = [(t, p, e) for t, p, e in found if p.isdigit()]
        self.digit_ids = np.array([t for t, _, _ in digits], dtype=np.int64)
        self.width = np.array([len(p) for _, p, _ in digits], dtype=np.int64)
        self.value = np.array([int(p) for _, p, _ in digits], dtype=np.int64)
        self.lead0 = np.array([len(p) > 1 and p[:1] == b"0" for _, p, _ in digits], dtype=bool)
        self.digit_ends = np.array([e for _, _, e in digits], dtype=bool)
        groups: dict[tuple[bytes, bool], list[int]] = {}
        for t, p, e in found:
            if p and not p.isdigit():
                groups.setdefault((p, e), []).append(t)
        self.other = [(p, e, np.array(ids, dtype=np.int64)) for (p, e), ids in groups.items()]
        self.ender_ids = np.array([t for t, p, _ in found if not p], dtype=np.int64)
        self._ender_mask: np.ndarray | None = None

    def ender_mask(self, words: int) -> np.ndarray:
        """The tokens that only end the number, as a packed mask of ``words`` words."""
        mask = self._ender_mask
        if mask is None or mask.shape[0] != words:
            mask = np.zeros(words, dtype=np.uint32)
            ids = self.ender_ids[(self.ender_ids >> 5) < words]
            np.bitwise_or.at(mask, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))
            self._ender_mask = mask
        return mask


def _number_end(data: bytes) -> bytes | None:
    """What a token adds to a number before ending it (digits, then a separator, bracket or
    whitespace), or None when it does not end it."""
    for i, c in enumerate(data):
        if c not in _NUMBER_CHARS:
            return data[:i] if c in _NUMBER_ENDS else None
    return None


class CloserTable:
    """Per tokenizer: the tokens holding a closing bracket and the lowest depth each one reaches."""

    def __init__(self, tokenizer) -> None:
        ll = tokenizer.ll
        ids, outside, inside, escaped = [], [], [], []
        texts: list[tuple[bytes, int]] = []
        key_leads: list[int] = []
        digits: dict[int, bytes] = {}
        empty: dict[str, list[int]] = {lead + k: [] for lead in WHOLE_LEADS
                                       for k in ("{}", "[]", "{}+", "[]+", "null", "true", "false", '""')}
        enders: dict[str, tuple[list[int], list[bytes]]] = {"string": ([], []), "escaped string": ([], []),
                                                             "number": ([], [])}
        quoted: dict[str, tuple[list[int], list[bytes]]] = {lead: ([], []) for lead in WHOLE_LEADS}
        numbers: dict[str, list[tuple[int, bytes, bool]]] = {lead: [] for lead in (*WHOLE_LEADS, "in")}
        backslash: list[int] = []
        for t in range(tokenizer.vocab_size):
            if ll.is_special_token(t):
                continue
            data = ll.decode_bytes([t])
            texts.append((data, t))
            if data.isdigit():
                digits[t] = data
            if b"\\" in data:
                backslash.append(t)
            if data.lstrip(_WS)[:1] in (b'"', b",", b"}", b"]"):
                key_leads.append(t)
            if b'"' in data:
                prefix = _string_end(data)
                if prefix is not None:
                    enders["string"][0].append(t)
                    enders["string"][1].append(prefix)
                prefix = _string_end(data, escape=True)
                if prefix is not None:
                    enders["escaped string"][0].append(t)
                    enders["escaped string"][1].append(prefix)
            part = _number_part(data)
            if part is not None:
                numbers["in"].append((t, *part))
            if data[:1] and data[0] in _NUMBER_START:
                prefix = _number_end(data)
                if prefix is not None:
                    enders["number"][0].append(t)
                    enders["number"][1].append(prefix)
            head = data.lstrip(_WS)
            for lead in WHOLE_LEADS:
                if lead:
                    if not head.startswith(lead.encode()):
                        continue
                    value = head[1:].lstrip(_WS)
                else:
                    value = head
                for literal in (b"null", b"true", b"false"):
                    if (value.startswith(literal) and not value[len(literal):len(literal) + 1].isalnum()) \
                            or (value and literal.startswith(value)):
                        empty[lead + literal.decode()].append(t)   # writes the literal, or starts it
                if value[:2] == b'""':
                    empty[lead + '""'].append(t)   # an empty string, opened and closed by one token
                if value[:1] == b'"':
                    quoted[lead][0].append(t)      # opens a string value: what follows its quote
                    quoted[lead][1].append(value[1:])
                if value[:1] in _NUMBER_FIRST:
                    part = _number_part(value)
                    if part is not None and part[0]:
                        numbers[lead].append((t, *part))   # starts a number
                if value[:2] in (b"{}", b"[]"):
                    empty[lead + value[:2].decode()].append(t)
                    if _lowest(value[2:], False) < 0:
                        empty[lead + value[:2].decode() + "+"].append(t)   # and closes the container it is in
            if b"}" not in data and b"]" not in data:
                continue
            ids.append(t)
            outside.append(max(-127, _lowest(data, False)))
            inside.append(max(-127, _lowest(data, True)))
            escaped.append(max(-127, _lowest(data, True, escape=True)))
        # For the rows' key checks: the tokens' texts sorted (those that start with given bytes are one
        # range), and the tokens that may start a key outside a string (a quote, a comma, or a closer
        # and a comma after whitespace).
        texts.sort()
        self.texts = [text for text, _ in texts]
        self.text_ids = np.array([t for _, t in texts], dtype=np.int64)
        self.key_leads = np.array(key_leads, dtype=np.int64)
        # Tokens of digits only (a number that goes on): ids, and each one's text.
        self.digits = digits
        self.digit_ids = np.array(sorted(digits), dtype=np.int64)
        self.ids = np.array(ids, dtype=np.int64)
        self.outside = np.array(outside, dtype=np.int8)
        self.inside = np.array(inside, dtype=np.int8)
        self.escaped = np.array(escaped, dtype=np.int8)   # scanned from right after a string's backslash
        # Tokens that write a whole value where a value starts: an empty object / array ("{}", " []",
        # "{}}", ...; "{}+" / "[]+": those that also close the container the value is in) or a literal
        # (" null", or its start: "n", "nu": only the literal can follow) or an empty string ('""', opened
        # and closed by one token); keys with a lead (":{}", ",null") are the tokens that write the colon
        # after a key, or the comma after an item, first.
        self.empty = {k: np.array(v, dtype=np.int64) for k, v in empty.items()}
        # Tokens that open a string where a value starts (after the lead), with the bytes after that
        # quote ('"n' writes n, '":"' the whole string ":"); tokens holding a backslash (an escape
        # may write any character).
        self.quoted = {lead: (np.array(ids, dtype=np.int64), rest) for lead, (ids, rest) in quoted.items()}
        # Tokens that go on with the number being written ("in") or start one where a value starts
        # (after the lead): what they add to it, and whether they end it.
        self.numbers = {where: NumberTokens(found) for where, found in numbers.items()}
        self.backslash_ids = np.array(backslash, dtype=np.int64)
        # Tokens that end the string / number being written, with what each adds to it first
        # ('29",' ends a string with 29; "escaped string": scanned from right after a backslash, 'n",'
        # adds n): ids, and per id the index of its prefix in ``prefixes``.
        self.enders: dict[str, tuple[np.ndarray, np.ndarray, list[bytes]]] = {}
        for kind, (tids, prefixes) in enders.items():
            unique = sorted(set(prefixes) | {b""})   # index 0: the empty prefix
            index = {p: i for i, p in enumerate(unique)}
            self.enders[kind] = (np.array(tids, dtype=np.int64),
                                 np.array([index[p] for p in prefixes], dtype=np.int32), unique)

    def ending(self, kind: str, row: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """The tokens the row allows that end the ``kind`` value being written, the index of each
        one's prefix, and the prefixes (index 0 is the empty one: the value ends as it stands)."""
        ids, which, prefixes = self.enders[kind]
        inside = (ids >> 5) < row.shape[0]
        keep, which = ids[inside], which[inside]
        words = row.view(np.uint32)[keep >> 5]
        allowed = ((words >> (keep & 31).astype(np.uint32)) & 1).astype(bool)
        return keep[allowed], which[allowed], prefixes

    def starting_with(self, head: bytes) -> np.ndarray:
        """Ids of the tokens whose text starts with ``head``."""
        lo = bisect.bisect_left(self.texts, head)
        hi = bisect.bisect_left(self.texts, head + b"\xff" * 8) if head else len(self.texts)
        return self.text_ids[lo:hi]

    def equal_to(self, text: bytes) -> np.ndarray:
        """Ids of the tokens whose text is ``text``."""
        lo = bisect.bisect_left(self.texts, text)
        hi = bisect.bisect_right(self.texts, text)
        return self.text_ids[lo:hi]

    def allowed(self, row: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The ``ids`` the packed row allows."""
        ids = ids[(ids >> 5) < row.shape[0]]
        words = row.view(np.uint32)[ids >> 5]
        return ids[((words >> (ids & 31).astype(np.uint32)) & 1).astype(bool)]

    def closing(self, level: int, in_string: bool, escaped: bool = False) -> np.ndarray:
        """Ids of the tokens that close the ``level``-th open container (or one further out), from
        inside a string or not, right after a string's backslash with ``escaped``."""
        lowest = self.escaped if escaped else self.inside if in_string else self.outside
        return self.ids[lowest <= -level]

    @staticmethod
    def allows_any(row: np.ndarray, ids: np.ndarray) -> bool:
        """Whether the packed row allows one of ``ids``."""
        ids = ids[(ids >> 5) < row.shape[0]]
        words = row.view(np.uint32)[ids >> 5]
        return bool(((words >> (ids & 31).astype(np.uint32)) & 1).any())

    def keep_only(self, row: np.ndarray, keep: list[np.ndarray]) -> RowMask | None:
        """The tokens the packed row allows other than ``keep`` (and those holding a backslash), as
        a mask: a string whose value must be one of a few left most of the vocabulary to refuse."""
        mask = np.zeros(row.shape[0], dtype=np.uint32)
        ids = np.concatenate([self.backslash_ids, *keep])
        ids = ids[(ids >> 5) < row.shape[0]]
        np.bitwise_or.at(mask, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))
        out = row.view(np.uint32) & ~mask
        return RowMask(out) if out.any() else None

    @staticmethod
    def clear(row: np.ndarray, ids: np.ndarray | RowMask) -> None:
        """Clears the bits of ``ids`` in one packed row."""
        words = row.view(np.uint32)
        if isinstance(ids, RowMask):
            words &= ~ids.mask
            return
        inside = ids[(ids >> 5) < row.shape[0]]
        if inside.size:
            np.bitwise_and.at(words, inside >> 5, ~(np.uint32(1) << (inside & 31).astype(np.uint32)))


class RowMask:
    """Tokens to take out of one packed row, as a packed mask of the row's shape (``ids`` lists them)."""
    __slots__ = ("mask",)

    def __init__(self, mask: np.ndarray) -> None:
        self.mask = mask

    def ids(self) -> np.ndarray:
        bits = np.unpackbits(self.mask.view(np.uint8), bitorder="little")
        return np.flatnonzero(bits).astype(np.int64)

    def tolist(self) -> list[int]:
        return self.ids().tolist()


def closer_table(tokenizer) -> CloserTable:
    """The tokenizer's table, built once per process (a pass over the vocabulary: off the step
    path, when a grammar that needs it is loaded)."""
    key = tokenizer.fingerprint
    with _LOCK:
        table = _TABLES.get(key)
        if table is None:
            table = _TABLES[key] = CloserTable(tokenizer)
        return table
