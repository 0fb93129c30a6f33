"""Content-addressed grammar cache with asynchronous, bounded, time-limited compilation.

Compiles never run on a stream's thread: ``lookup`` returns at once with the entry's
state, and a sequence whose grammar is still compiling is reported as waiting. Compile
errors are cached like results. An optional shared store (the cluster cache) is asked
before compiling and told what was compiled.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Protocol

from maskd.server.engines import CompiledGrammar, Engine, GrammarCompileError
from maskd.server.metrics import Metrics
from maskd.specs import GrammarSpec
from maskd.v1.contract import GrammarState

log = logging.getLogger("maskd.server.grammar_cache")


@dataclasses.dataclass
class CacheEntry:
    grammar_id: str
    spec: GrammarSpec
    state: GrammarState = GrammarState.COMPILING
    compiled: CompiledGrammar | None = None
    error: str = ""
    compile_seconds: float = 0.0
    deadline: float = 0.0
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class SharedGrammarStore(Protocol):
    """What a cluster-wide cache offers a server (maskd_cluster implements it on Ray)."""

    def get(self, grammar_id: str) -> tuple[bytes | None, str | None] | None:
        """(serialized, None) for a compiled grammar, (None, error) for a cached failure, None if unknown."""

    def put(self, grammar_id: str, serialized: bytes | None, error: str | None) -> None: ...


class GrammarCache:
    def __init__(self, engine: Engine, *, max_entries: int = 1024, compile_threads: int = 2,
                 compile_timeout_s: float = 30.0, metrics: Metrics | None = None,
                 shared: SharedGrammarStore | None = None) -> None:
        self.engine = engine
        self.max_entries = max_entries
        self.compile_timeout_s = compile_timeout_s
        self.metrics = metrics
        self.shared = shared
        self._entries: collections.OrderedDict[str, CacheEntry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=compile_threads,
                                                           thread_name_prefix="maskd-compile")
        self.compiles = 0  # compiles this cache ran itself

    def grammar_id(self, spec: GrammarSpec) -> str:
        return spec.grammar_id(self.engine.tokenizer.fingerprint, self.engine.name, self.engine.version,
                               json_schema_mode=self.engine.json_schema_mode)

    def lookup(self, spec: GrammarSpec) -> CacheEntry:
        """The entry for a spec, starting its compile if it is new. Never blocks on a compile."""
        gid = self.grammar_id(spec)
        with self._lock:
            entry = self._entries.get(gid)
            if entry is not None:
                self._entries.move_to_end(gid)
                self._count("hit")
                self._check_deadline(entry)
                return entry
            self._count("miss")
            entry = CacheEntry(gid, spec, deadline=time.monotonic() + self.compile_timeout_s)
            self._entries[gid] = entry
            self._evict()
        self._pool.submit(self._compile, entry)
        return entry

    def get(self, grammar_id: str) -> CacheEntry | None:
        with self._lock:
            entry = self._entries.get(grammar_id)
            if entry is not None:
                self._entries.move_to_end(grammar_id)
                self._check_deadline(entry)
            return entry

    def wait(self, entry: CacheEntry) -> CacheEntry:
        """Blocks until the entry is ready, failed, or past its compile time limit."""
        entry.done.wait(max(0.0, entry.deadline - time.monotonic()))
        with self._lock:
            self._check_deadline(entry)
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ----------------------------------------------------------------------------
    def _count(self, what: str) -> None:
        if self.metrics is not None:
            (self.metrics.cache_hits if what == "hit" else self.metrics.cache_misses).labels("local").inc()

    def _count_error(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(kind).inc()

    def _check_deadline(self, entry: CacheEntry) -> None:
        if entry.state is GrammarState.COMPILING and time.monotonic() > entry.deadline:
            log.warning("grammar %s (%s) exceeded the %g s compile limit", entry.grammar_id, entry.spec.kind,
                        self.compile_timeout_s)
            self._count_error("compile_timeout")
            self._finish(entry, None, f"grammar compile exceeded the {self.compile_timeout_s:g} s limit",
                         self.compile_timeout_s)

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries:
            gid, entry = next(iter(self._entries.items()))
            if entry.state is GrammarState.COMPILING:
                self._entries.move_to_end(gid)  # never evict an entry a compile will fill
                if all(e.state is GrammarState.COMPILING for e in self._entries.values()):
                    break
                continue
            del self._entries[gid]
        if self.metrics is not None:
            self.metrics.cache_size.set(len(self._entries))

    def _finish(self, entry: CacheEntry, compiled: CompiledGrammar | None, error: str, seconds: float) -> None:
        if entry.done.is_set():
            return
        entry.compiled = compiled
        entry.error = error
        entry.compile_seconds = seconds
        entry.state = GrammarState.READY if compiled is not None else GrammarState.FAILED
        entry.done.set()

    def _compile(self, entry: CacheEntry) -> None:
        t0 = time.perf_counter()
        if self.shared is not None:
            found = self._from_shared(entry)
            if found:
                return
        try:
            compiled = self.engine.compile(entry.spec)
            error = ""
        except GrammarCompileError as exc:
            compiled, error = None, str(exc)
            log.info("grammar %s (%s) does not compile: %s", entry.grammar_id, entry.spec.kind, error[:300])
            self._count_error("compile_error")
        except Exception as exc:  # an engine bug must not kill the pool thread silently
            compiled, error = None, f"internal compile error: {type(exc).__name__}: {exc}"
            log.exception("grammar %s (%s): internal compile error", entry.grammar_id, entry.spec.kind)
            self._count_error("compile_internal")
        seconds = time.perf_counter() - t0
        self.compiles += 1
        if self.metrics is not None:
            self.metrics.compile_seconds.labels(self.engine.name).observe(seconds)
        with self._lock:
            self._finish(entry, compiled, error, seconds)
        if self.shared is not None and entry.compiled is compiled:
            try:
                self.shared.put(entry.grammar_id, self.engine.serialize(compiled) if compiled else None,
                                error or None)
            except Exception:  # the shared store is an optimization; compiling locally still works
                log.warning("cannot publish grammar %s to the shared cache", entry.grammar_id, exc_info=True)
                self._count_error("shared_cache_put")

    def _from_shared(self, entry: CacheEntry) -> bool:
        assert self.shared is not None
        try:
            found = self.shared.get(entry.grammar_id)
        except Exception:
            found = None
            log.warning("shared grammar cache lookup of %s failed; compiling here", entry.grammar_id, exc_info=True)
            self._count_error("shared_cache_get")
        if self.metrics is not None:
            (self.metrics.cache_hits if found else self.metrics.cache_misses).labels("shared").inc()
        if not found:
            return False
        data, error = found
        compiled = self.engine.deserialize(entry.spec, data) if data is not None else None
        with self._lock:
            self._finish(entry, compiled, error or "", 0.0)
        return True
