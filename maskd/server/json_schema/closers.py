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
        for t in range(tokenizer.vocab_size):
            if ll.is_special_token(t):
                continue
            data = ll.decode_bytes([t])
            texts.append((data, t))
            if data.isdigit():
                digits[t] = data
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

    @staticmethod
    def clear(row: np.ndarray, ids: np.ndarray) -> None:
        """Clears the bits of ``ids`` in one packed row."""
        ids = ids[(ids >> 5) < row.shape[0]]
        if ids.size:
            words = row.view(np.uint32)
            np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


def closer_table(tokenizer) -> CloserTable:
    """The tokenizer's table, built once per process (a pass over the vocabulary: off the step
    path, when a grammar that needs it is loaded)."""
    key = tokenizer.fingerprint
    with _LOCK:
        table = _TABLES.get(key)
        if table is None:
            table = _TABLES[key] = CloserTable(tokenizer)
        return table
