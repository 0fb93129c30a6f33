"""An incremental scanner over the bytes of one JSON value, fed as tokens arrive.

It follows only the structure (objects, arrays, keys, where each value starts and ends) and
trusts the grammar for the rest: the bytes it sees were allowed by a JSON grammar. It reports
two things: when a value it was asked to watch is complete (``watch`` gives each container's
children a context; a child whose context is not None is reported with its byte range), and
where the root value ends. Strings are skipped with one regex search, not byte by byte.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_STRING_STOP = re.compile(rb'["\\]')
_SCALAR_END = re.compile(rb'[^0-9A-Za-z.+\-]')   # a number, true, false or null ends here
_WS = b" \t\r\n"

# watch(parent context, key or index) -> the child's context, or None (not watched)
Watch = Callable[[Any, "str | int"], Any]
# settle(parent context, key, buffer, start, end) -> the parent's new context, or None (as it was),
# once a watched member of an object is complete: what a member says may pin its siblings' schemas.
Settle = Callable[[Any, str, "bytes | bytearray", int, int], Any]


class _Frame:
    __slots__ = ("awaiting", "before_colon", "child_ctx", "child_start", "ctx", "expect_key", "index", "is_object",
                 "key", "keys", "ready", "start")

    def __init__(self, is_object: bool, ctx: Any, start: int) -> None:
        self.is_object = is_object
        self.start = start            # offset of its opening bracket
        self.ready = True             # a closing bracket may come next (empty, or after a whole member)
        self.awaiting = not is_object  # a value may start next (after "[", "," in an array, ":")
        self.ctx = ctx                # this container's context (None: children are not watched)
        self.key: str | None = None   # object: the key of the value being read
        self.keys: list[str] = []     # object: every key read so far
        self.index = 0                # array: the index of the value being read
        self.expect_key = is_object
        self.before_colon = False     # object: a key was read, its colon not yet
        self.child_start = -1
        self.child_ctx: Any = None


class JsonScanner:
    """Feed it consecutive chunks; ``feed`` returns the watched values completed in that chunk as
    (context, start, end) byte offsets, and ``root_end`` is set once the root value is complete
    (for a number at the root: once a byte after it arrives)."""

    def __init__(self, watch: Watch | None = None, root_ctx: Any = None, start: int = 0,
                 settle: Settle | None = None) -> None:
        self.watch = watch
        self.settle = settle
        self.root_ctx = root_ctx
        self.stack: list[_Frame] = []
        self.pos = start             # offset of the next byte to scan in the buffer ``feed`` is given
        self.in_string = False
        self.escape = False
        self.string_start = -1
        self.scalar_start = -1
        self.root_start = -1
        self.root_end = -1

    @property
    def done(self) -> bool:
        return self.root_end >= 0

    def feed(self, data: bytes | bytearray) -> list[tuple[Any, int, int]]:
        """Scans ``data[self.pos:]``; offsets are positions in ``data`` (the whole buffer so far)."""
        events: list[tuple[Any, int, int]] = []
        i, n = self.pos, len(data)
        while i < n and self.root_end < 0:
            if self.in_string:
                if self.escape:
                    self.escape = False
                    i += 1
                    continue
                m = _STRING_STOP.search(data, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if data[i] == 0x5C:   # backslash
                    self.escape = True
                    i += 1
                    continue
                self.in_string = False
                self._string_end(data, i + 1, events)
                i += 1
                continue
            if self.scalar_start >= 0:
                m = _SCALAR_END.search(data, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                start, self.scalar_start = self.scalar_start, -1
                self._value_end(data, start, i, events)
                continue   # the byte that ended it is structural or whitespace
            c = data[i]
            if c in _WS:
                i += 1
            elif c == 0x22:   # "
                self.in_string = True
                self.string_start = i
                if self.stack:
                    self.stack[-1].ready = False
                i += 1
            elif c == 0x7B or c == 0x5B:   # { [
                self._value_start(i)
                frame = _Frame(c == 0x7B, self._child_ctx_of_current(), i)
                self.stack.append(frame)
                i += 1
            elif c == 0x7D or c == 0x5D:   # } ]
                self.stack.pop()
                start = self.stack[-1].child_start if self.stack else self.root_start
                self._value_end(data, start, i + 1, events)
                i += 1
            elif c == 0x3A:   # :
                self.stack[-1].expect_key = self.stack[-1].before_colon = False
                self.stack[-1].awaiting = True
                i += 1
            elif c == 0x2C:   # ,
                top = self.stack[-1]
                top.ready = False
                if top.is_object:
                    top.expect_key = True
                else:
                    top.index += 1
                    top.awaiting = True
                i += 1
            else:   # a number, true, false or null
                self._value_start(i)
                self.scalar_start = i
                i += 1
        self.pos = i
        return events

    # -- internals ------------------------------------------------------------------------------------
    def _child_ctx_of_current(self) -> Any:
        """Context of the container that just started (as a child of the top frame, or the root)."""
        if not self.stack:
            return self.root_ctx
        return self.stack[-1].child_ctx

    def _value_start(self, offset: int) -> None:
        if not self.stack:
            self.root_start = offset
            return
        top = self.stack[-1]
        top.ready = top.awaiting = False
        top.child_start = offset
        if top.ctx is None or self.watch is None or (top.is_object and top.key is None):
            top.child_ctx = None
        else:
            top.child_ctx = self.watch(top.ctx, top.key if top.is_object and top.key is not None else top.index)

    def _string_end(self, data, end: int, events) -> None:
        start = self.string_start
        top = self.stack[-1] if self.stack else None
        if top is not None and top.is_object and top.expect_key:
            try:
                top.key = json.loads(bytes(data[start:end]))
                top.keys.append(top.key)
            except ValueError:
                top.key = None
            top.before_colon = True
            return
        self._value_start(start)
        self._value_end(data, start, end, events)

    def _value_end(self, data, start: int, end: int, events) -> None:
        if not self.stack:
            self.root_end = end
            return
        top = self.stack[-1]
        top.ready = True
        if top.child_ctx is not None:
            events.append((top.child_ctx, start, end))
            if self.settle is not None and top.is_object and top.key is not None:
                settled = self.settle(top.ctx, top.key, data, start, end)
                if settled is not None:
                    top.ctx = settled
        top.child_ctx = None

