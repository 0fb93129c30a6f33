"""The cluster-wide grammar cache: a grammar is compiled once per cluster.

``GrammarStore`` is an asyncio Ray actor holding grammar id -> (serialized compiled grammar, or
the compile error), bounded by entries and bytes (LRU). Its ``get`` is single-flight across
the cluster: the first worker to miss a grammar gets a claim and compiles; the others wait for
its ``put`` (up to their compile time limit) instead of compiling the same grammar again. A
claim dies with its worker (the directory releases it) or at its deadline, and then one of the
waiters compiles.

The payload is opaque bytes from ``Engine.serialize`` (for llguidance the validated grammar
string; for xgrammar ``CompiledGrammar.serialize_json``), so the store carries any backend.

It also keeps the grammar drafts' counts of the cluster (``exchange_draft_counts``): each
worker's server sends what its sequences of a grammar wrote and takes back what every worker's
did, so drafts of a grammar are learned from the whole cluster (maskd.server.drafts). Bounded like
a server's own counts (grammars least recently exchanged go first).

``RayGrammarStore`` is the worker-side adapter implementing maskd.server.grammar_cache.SharedGrammarStore
and maskd.server.drafts.SharedDraftCounts.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time

from maskd.server.drafts import GrammarCounts

log = logging.getLogger("maskd_cluster.store")


@dataclasses.dataclass
class _Claim:
    requester: str
    deadline: float
    event: asyncio.Event


class GrammarStore:
    """Ray actor (asyncio): create with ``ray.remote(GrammarStore).options(...)``."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 1 << 30, claim_s: float = 30.0,
                 max_draft_grammars: int = 512, max_draft_contexts: int = 8192) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.claim_s = claim_s
        self._entries: collections.OrderedDict[str, tuple[bytes | None, str | None]] = collections.OrderedDict()
        self._bytes = 0
        self._claims: dict[str, _Claim] = {}
        self._publishes: collections.Counter[str] = collections.Counter()
        self.hits = self.misses = self.waits = self.publishes = self.evictions = 0
        self.max_draft_grammars = max_draft_grammars
        self.max_draft_contexts = max_draft_contexts
        self._draft_counts: collections.OrderedDict[str, GrammarCounts] = collections.OrderedDict()
        self.draft_exchanges = 0

    async def get(self, grammar_id: str, requester: str, wait_s: float = 30.0):
        """(data, error) when known; None when the caller should compile (it then holds the claim)."""
        give_up = time.monotonic() + max(0.0, wait_s)
        waited = False
        while True:
            found = self._entries.get(grammar_id)
            if found is not None:
                self._entries.move_to_end(grammar_id)
                self.hits += 1
                return found
            now = time.monotonic()
            claim = self._claims.get(grammar_id)
            if claim is None or claim.requester == requester or now >= claim.deadline or now >= give_up:
                break
            if not waited:
                self.waits += 1
                waited = True
            try:
                await asyncio.wait_for(claim.event.wait(), timeout=min(claim.deadline, give_up) - now)
            except asyncio.TimeoutError:
                pass
        self.misses += 1
        self._claims[grammar_id] = _Claim(requester, time.monotonic() + self.claim_s, asyncio.Event())
        return None

    async def get_many(self, grammar_ids: list[str], requester: str, wait_s: float = 30.0) -> list:
        """``get`` of each (the tool pieces of an array), in one call."""
        give_up = time.monotonic() + max(0.0, wait_s)
        return [await self.get(g, requester, max(0.0, give_up - time.monotonic())) for g in grammar_ids]

    async def put_many(self, items: list, requester: str = "") -> None:
        for grammar_id, data, error in items:
            await self.put(grammar_id, data, error, requester)

    async def put(self, grammar_id: str, data: bytes | None, error: str | None, requester: str = "") -> None:
        if data is None and not error:  # nothing to share; let a waiter compile
            claim = self._claims.pop(grammar_id, None)
            if claim is not None:
                claim.event.set()
            return
        old = self._entries.pop(grammar_id, None)
        if old is not None:
            self._bytes -= _size(old)
        value = (data, error or None)
        self._entries[grammar_id] = value
        self._bytes += _size(value)
        self._publishes[grammar_id] += 1
        self.publishes += 1
        claim = self._claims.pop(grammar_id, None)
        if claim is not None:
            claim.event.set()
        self._evict()

    async def exchange_draft_counts(self, learned: dict, wanted: list) -> dict:
        """Adds a server's newly learned counts (key -> rows of GrammarCounts.rows) to the cluster's;
        returns the cluster's counts of the ``wanted`` keys it holds."""
        self.draft_exchanges += 1
        for key, rows in learned.items():
            counts = self._draft_counts.get(key)
            if counts is None:
                counts = self._draft_counts[key] = GrammarCounts(self.max_draft_contexts)
            self._draft_counts.move_to_end(key)
            counts.merge(rows)
        while len(self._draft_counts) > self.max_draft_grammars:
            self._draft_counts.popitem(last=False)
        out = {}
        for key in wanted:
            counts = self._draft_counts.get(key)
            if counts is not None:
                self._draft_counts.move_to_end(key)
                out[key] = counts.rows()
        return out

    async def release(self, requester_prefix: str) -> int:
        """Drops the claims of a worker that is gone, so that a waiter compiles now."""
        gone = [g for g, c in self._claims.items() if c.requester.startswith(requester_prefix)]
        for g in gone:
            self._claims.pop(g).event.set()
        return len(gone)

    async def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self._bytes, "hits": self.hits, "misses": self.misses,
                "waits": self.waits, "publishes": self.publishes, "evictions": self.evictions,
                "claims": len(self._claims), "draft_grammars": len(self._draft_counts),
                "draft_exchanges": self.draft_exchanges}

    async def publish_count(self, grammar_id: str) -> int:
        """How many times workers published this grammar (the number of compiles cluster-wide)."""
        return self._publishes.get(grammar_id, 0)

    async def ready(self) -> bool:
        return True

    def _evict(self) -> None:
        while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
            gid, value = self._entries.popitem(last=False)
            self._bytes -= _size(value)
            self._publishes.pop(gid, None)
            self.evictions += 1


def _size(value: tuple[bytes | None, str | None]) -> int:
    data, error = value
    return (len(data) if data else 0) + (len(error) if error else 0) + 64


class RayGrammarStore:
    """SharedGrammarStore for a worker: calls the GrammarStore actor (from compile threads)."""

    def __init__(self, handle, requester: str, *, wait_s: float = 30.0, call_timeout_s: float = 10.0) -> None:
        self.handle = handle
        self.requester = requester
        self.wait_s = wait_s
        self.call_timeout_s = call_timeout_s

    def get(self, grammar_id: str):
        import ray
        return ray.get(self.handle.get.remote(grammar_id, self.requester, self.wait_s),
                       timeout=self.wait_s + self.call_timeout_s)

    def put(self, grammar_id: str, serialized: bytes | None, error: str | None) -> None:
        # Fire and forget: the compiled grammar is already in use here; publishing helps the others.
        self.handle.put.remote(grammar_id, serialized, error, self.requester)

    def get_many(self, grammar_ids: list[str]) -> list:
        import ray
        return ray.get(self.handle.get_many.remote(grammar_ids, self.requester, self.wait_s),
                       timeout=self.wait_s + self.call_timeout_s)

    def put_many(self, items: list) -> None:
        self.handle.put_many.remote(items, self.requester)

    def exchange_draft_counts(self, learned: dict, wanted: list) -> dict:
        import ray
        return ray.get(self.handle.exchange_draft_counts.remote(learned, wanted), timeout=self.call_timeout_s)
