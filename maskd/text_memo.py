"""What was computed from a text that came over the wire, kept by the text (the last texts seen,
bounded by characters): requests send the same texts again and again (a tool set, its tools'
parameters, a response format), and reading a large one again costs milliseconds where a lookup
costs the string's hash."""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

V = TypeVar("V")


class TextMemo(Generic[V]):
    """A bounded, thread-safe memo from texts to values: at most ``max_chars`` characters, counted as
    each ``put`` says (the text's length, and the value's where it holds text of its own); the least
    recently used text goes first."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._items: collections.OrderedDict[str, tuple[V, int]] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __contains__(self, text: str) -> bool:
        """Whether ``text`` is kept (its recency unchanged)."""
        with self._lock:
            return text in self._items

    @property
    def chars(self) -> int:
        """The characters kept, as the puts counted them."""
        return self._chars

    def get(self, text: str) -> V | None:
        with self._lock:
            return self._found(text)

    def get_many(self, texts: Sequence[str]) -> list[V | None]:
        """``get`` of each, under one lock."""
        with self._lock:
            return [self._found(t) for t in texts]

    def get_or_make(self, text: str, make: Callable[[str], V], extra_chars: Callable[[V], int] | None = None) -> V:
        """The value kept for ``text``, else ``make(text)``, kept (counted as the text's length plus
        ``extra_chars(value)``); what ``make`` raises is raised, and nothing is kept."""
        found = self.get(text)
        if found is None:
            found = make(text)
            self.put(text, found, len(text) + (extra_chars(found) if extra_chars else 0))
        return found

    def put(self, text: str, value: V, chars: int | None = None) -> None:
        """Keep ``value`` for ``text`` (``chars``: what it counts, the text's length by default); a
        text already kept keeps its value, and one larger than the whole memo is not kept (it would
        push out everything else and then itself)."""
        size = len(text) if chars is None else chars
        if size > self.max_chars:
            return
        with self._lock:
            if text in self._items:
                return
            self._items[text] = (value, size)
            self._chars += size
            while self._chars > self.max_chars and self._items:
                _, (_, dropped) = self._items.popitem(last=False)
                self._chars -= dropped

    def _found(self, text: str) -> V | None:
        item = self._items.get(text)
        if item is None:
            return None
        self._items.move_to_end(text)
        return item[0]
