"""Caps per tenant and for the server: Session streams and live sequences.

Counters only (thread-safe); a refusal is a message naming the cap, which the caller sends as
RESOURCE_EXHAUSTED. Per-session and per-request caps live where those are checked (the session).
Per-tenant caps apply to authenticated tenants; a server without auth has one anonymous tenant,
bounded by the server-wide caps alone.
"""
from __future__ import annotations

import collections
import threading

from maskd.server.config import Limits


class Quotas:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._streams: collections.Counter[str] = collections.Counter()
        self._sequences: collections.Counter[str] = collections.Counter()
        self.streams = 0
        self.sequences = 0

    def open_stream(self, tenant: str) -> str | None:
        """Takes a stream slot; returns why not (naming the cap) or None."""
        lim = self.limits
        with self._lock:
            if self.streams >= lim.max_streams:
                return f"the server has {self.streams} streams open; the limit is {lim.max_streams} (--max-streams)"
            if tenant and self._streams[tenant] >= lim.max_streams_per_tenant:
                return (f"this tenant has {self._streams[tenant]} streams open; the limit is "
                        f"{lim.max_streams_per_tenant} (--max-streams-per-tenant)")
            self.streams += 1
            self._streams[tenant] += 1
            return None

    def close_stream(self, tenant: str) -> None:
        with self._lock:
            self.streams -= 1
            self._streams[tenant] -= 1
            if self._streams[tenant] <= 0:
                del self._streams[tenant]

    def open_sequence(self, tenant: str) -> str | None:
        """Takes a live-sequence slot; returns why not (naming the cap) or None."""
        lim = self.limits
        with self._lock:
            if self.sequences >= lim.max_sequences:
                return (f"the server holds {self.sequences} live sequences; the limit is {lim.max_sequences} "
                        "(--max-sequences)")
            if tenant and self._sequences[tenant] >= lim.max_sequences_per_tenant:
                return (f"this tenant holds {self._sequences[tenant]} live sequences; the limit is "
                        f"{lim.max_sequences_per_tenant} (--max-sequences-per-tenant)")
            self.sequences += 1
            self._sequences[tenant] += 1
            return None

    def close_sequences(self, tenant: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            self.sequences -= n
            self._sequences[tenant] -= n
            if self._sequences[tenant] <= 0:
                del self._sequences[tenant]
