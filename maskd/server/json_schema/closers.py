"""Which tokens close JSON containers, for rows that must keep an object open.

Complete mode may let the grammar take an object's keys in any order, which means the grammar no
longer knows which keys are required; the validator does. While a pinned object (see
validation.py) misses a required key, the tokens that would close it are taken out of its row
(``step_checks``), so no document is closed into a state no continuation can make valid.

A token closes the k-th open container (1: the innermost) when, scanning its bytes from the
document's state (inside a string or not), the nesting depth falls to -k. That depends only on the
token's bytes and on whether the scan starts inside a string, so the lowest depth each token
reaches is computed once per tokenizer, for the tokens holding ``}`` or ``]``; a step's veto is
then one comparison over those arrays.
"""
from __future__ import annotations

import threading

import numpy as np

_TABLES: dict[str, CloserTable] = {}
_LOCK = threading.Lock()


def _lowest(data: bytes, in_string: bool) -> int:
    """The lowest nesting depth (0 = where the scan starts) reached while scanning ``data``."""
    depth = low = 0
    escape = False
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


class CloserTable:
    """Per tokenizer: the tokens holding a closing bracket and the lowest depth each one reaches."""

    def __init__(self, tokenizer) -> None:
        ll = tokenizer.ll
        ids, outside, inside = [], [], []
        for t in range(tokenizer.vocab_size):
            if ll.is_special_token(t):
                continue
            data = ll.decode_bytes([t])
            if b"}" not in data and b"]" not in data:
                continue
            ids.append(t)
            outside.append(max(-127, _lowest(data, False)))
            inside.append(max(-127, _lowest(data, True)))
        self.ids = np.array(ids, dtype=np.int64)
        self.outside = np.array(outside, dtype=np.int8)
        self.inside = np.array(inside, dtype=np.int8)

    def closing(self, level: int, in_string: bool) -> np.ndarray:
        """Ids of the tokens that close the ``level``-th open container (or one further out)."""
        lowest = self.inside if in_string else self.outside
        return self.ids[lowest <= -level]

    def veto(self, row: np.ndarray, level: int, in_string: bool) -> None:
        """Clears, in one packed row, the bits of the tokens that close the ``level``-th container."""
        ids = self.closing(level, in_string)
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
