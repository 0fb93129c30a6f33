"""Consistent hashing with virtual nodes over stable worker ids.

Each member owns ``vnodes`` points on a 64-bit ring; a key belongs to the member of the first
point at or after the key's hash. Adding or removing a member moves only the keys whose
point changes owner: those of the member that left (or that the new member takes). The
directory and the client compute the same ring from the same member ids.
"""
from __future__ import annotations

import bisect
import hashlib
from typing import Iterable, Sequence

RING_HASH = "blake2b-64"
DEFAULT_VNODES = 128


def hash64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, members: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        self._members: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for m in members:
            self._members.add(m)
        self._rebuild()

    @property
    def members(self) -> list[str]:
        return sorted(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member: str) -> bool:
        return member in self._members

    def add(self, member: str) -> bool:
        if member in self._members:
            return False
        self._members.add(member)
        self._rebuild()
        return True

    def remove(self, member: str) -> bool:
        if member not in self._members:
            return False
        self._members.discard(member)
        self._rebuild()
        return True

    def owner(self, key: str) -> str | None:
        if not self._points:
            return None
        i = bisect.bisect_left(self._points, hash64(key))
        return self._owners[i if i < len(self._points) else 0]

    def owners(self, keys: Sequence[str]) -> list[str | None]:
        return [self.owner(k) for k in keys]

    def _rebuild(self) -> None:
        # Ties between points (astronomically rare) are broken by member id, so every
        # process builds the identical ring.
        points = sorted((hash64(f"{m}#{v}"), m) for m in self._members for v in range(self.vnodes))
        self._points = [p for p, _ in points]
        self._owners = [m for _, m in points]
