"""Where a template's output stands, byte by byte (issue 19: templates with named holes composed
like tool-call arrays, ``tool_calls.ComposedMatcher``).

``HoleScanner`` does for a template what ``CallScanner`` does for a call array: it follows the
JSON the output writes, and where an object opens at a hole's path (property names from the root,
every item of an array) it says which hole, and where that object closes. It reads keys only in
the containers a hole lies under; inside a hole it counts depth alone.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from maskd.server.engines.tool_calls import (
    _AFTER,
    _BACKSLASH,
    _CLOSES,
    _COLON,
    _COLON_NEXT,
    _COMMA,
    _KEY,
    _OPENS,
    _QUOTE,
    _VALUE,
    _WS,
    ComposedScanner,
)

_BRACE = 0x7B
# A frame's container: the root's place, an object, an array.
_ROOT, _OBJECT, _ARRAY = 0, 1, 2
_ITEM = None     # a path's step into an array's items (maskd.template_specs)


class HoleNode:
    """A place on the way to holes: the places below it by property name (None: an array's
    items), and the hole's name where it is one."""
    __slots__ = ("children", "hole")

    def __init__(self) -> None:
        self.children: dict[str | None, HoleNode] = {}
        self.hole: str | None = None


def hole_tree(paths: Iterable[tuple[tuple[str | None, ...], str]]) -> HoleNode:
    root = HoleNode()
    for path, name in paths:
        node = root
        for step in path:
            node = node.children.setdefault(step, HoleNode())
        node.hole = name
    return root


class HoleScanner(ComposedScanner):
    """Depth, strings, the containers on the way to holes (each frame: its node or None where no
    hole lies below, its kind, what an object expects next, its current key), and whether (and
    which) hole's object is open: ``params``, the depth just inside it (0 outside one), ``name``."""
    __slots__ = ("buf", "depth", "esc", "frames", "in_str", "name", "params")

    def __init__(self, tree: HoleNode) -> None:
        self.frames: list[tuple[HoleNode | None, int, int, Any]] = [(tree, _ROOT, _VALUE, None)]
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.buf: bytearray | None = None    # the key being read, where one is read
        self.params = 0
        self.name: str | None = None

    def copy(self) -> HoleScanner:
        c = HoleScanner.__new__(HoleScanner)
        c.frames = list(self.frames)
        c.depth, c.in_str, c.esc, c.params, c.name = self.depth, self.in_str, self.esc, self.params, self.name
        c.buf = None if self.buf is None else bytearray(self.buf)
        return c

    @property
    def entering(self) -> bool:
        """Whether a token from here may open a hole: outside the holes, in a container a hole lies under."""
        return not self.params and self.frames[-1][0] is not None

    def feed(self, data: bytes, events: list | None = None) -> None:
        """Reads ``data``; appends ``("in", offset of the "{", hole)`` where a hole's object opens
        and ``("out", offset after the "}")`` where it closes."""
        frames = self.frames
        for i, c in enumerate(data):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == _BACKSLASH:
                    self.esc = True
                elif c == _QUOTE:
                    self.in_str = False
                    if self.buf is not None:
                        self._key_done()
                    continue
                if self.buf is not None:
                    self.buf.append(c)
                continue
            if self.params:
                if c == _QUOTE:
                    self.in_str = True
                elif c in _OPENS:
                    self.depth += 1
                elif c in _CLOSES:
                    self.depth -= 1
                    if self.depth < self.params:
                        self.params, self.name = 0, None
                        if events is not None:
                            events.append(("out", i + 1, None))
                continue
            node, kind, expect, key = frames[-1]
            if c == _QUOTE:
                self.in_str = True
                if node is not None:
                    if kind == _OBJECT and expect == _KEY:
                        self.buf = bytearray()
                    elif expect == _VALUE and kind != _ARRAY:
                        frames[-1] = (node, kind, _AFTER, key)
            elif c in _OPENS:
                child = None
                if node is not None:
                    if kind == _ARRAY:
                        child = node.children.get(_ITEM)
                    elif kind == _OBJECT:
                        child = node.children.get(key) if expect == _VALUE else None
                    else:
                        child = node
                    if kind != _ARRAY:
                        frames[-1] = (node, kind, _AFTER, key)
                self.depth += 1
                if child is not None and child.hole is not None:
                    if c == _BRACE:
                        self.params, self.name = self.depth, child.hole
                        if events is not None:
                            events.append(("in", i, child.hole))
                        continue
                    child = None    # an array where the hole's object goes (its router refuses it)
                frames.append((child, _OBJECT, _KEY, None) if c == _BRACE else (child, _ARRAY, _VALUE, None))
            elif c in _CLOSES:
                if len(frames) > 1:
                    frames.pop()
                self.depth -= 1
            elif node is not None and kind == _OBJECT:
                if c == _COLON:
                    frames[-1] = (node, kind, _VALUE, key)
                elif c == _COMMA:
                    frames[-1] = (node, kind, _KEY, None)
                elif c not in _WS and expect == _VALUE:
                    frames[-1] = (node, kind, _AFTER, key)    # a number or a literal

    def _key_done(self) -> None:
        assert self.buf is not None
        try:
            key = json.loads(b'"' + bytes(self.buf) + b'"')
        except ValueError:
            key = None
        node, kind, _, _ = self.frames[-1]
        self.frames[-1] = (node, kind, _COLON_NEXT, key)
        self.buf = None
