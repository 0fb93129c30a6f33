"""Content-addressed grammar cache with asynchronous, isolated, fair, time-limited compilation.

Compiles never run on a stream's thread, nor take its core: the compile threads run at the
server's compile_nice (19 by default, the lowest; as do the worker processes), so the step path has
the core whenever it wants it.
``lookup`` returns at once with the entry's state, and a
sequence whose grammar is still compiling is reported as waiting. Compiles are queued per tenant
and taken round-robin, with at most ``max_running_per_tenant`` of one tenant's compiles running at
once, so one tenant's slow grammars never hold every compile thread. Each compile runs in a worker
process first (``compile_pool``): a crash or a runaway compile costs only that grammar. Compile
errors and crashes are cached like results; a timeout is not (the next lookup compiles again).
The cache is bounded by entries and by bytes. An optional shared store (the cluster cache) is
asked before compiling and told what was compiled.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Protocol

from maskd.server.compile_pool import (
    SERVER_STACK_BYTES,
    CompileCrashed,
    CompilePool,
    CompileTimeout,
    PendingCompiles,
    wall_limit,
)
from maskd.server.engines import CompiledGrammar, Engine, GrammarCompileError
from maskd.server.metrics import Metrics
from maskd.server.priority import lower_priority
from maskd.specs import GrammarSpec
from maskd.v1.contract import Code, GrammarState

log = logging.getLogger("maskd.server.grammar_cache")
_ENTRY_OVERHEAD = 1024   # bytes counted per entry beyond its serialized grammar
_PIECE_IDS_KEPT = 1 << 16   # tool pieces' grammar ids kept by text (a hash of each every request is ms)
_IDS_KEPT_FROM, _IDS_KEPT_CHARS = 4096, 32 << 20   # ids of specs this large kept, up to this much text


class QueueFull(RuntimeError):
    """No room in the compile queue; the message names the cap (RESOURCE_EXHAUSTED)."""


@dataclasses.dataclass
class CacheEntry:
    grammar_id: str
    spec: GrammarSpec
    tenant: str = ""
    state: GrammarState = GrammarState.COMPILING
    compiled: CompiledGrammar | None = None
    error: str = ""
    error_code: Code = Code.INVALID_ARGUMENT   # RESOURCE_EXHAUSTED: it needed more than the time limit
    compile_seconds: float = 0.0
    started: float = 0.0            # monotonic time the compile began (0: still queued)
    size: int = 0                   # bytes counted against the cache's limit
    drafting: bool = False          # a sequence asked for grammar drafts: its sequences teach the drafter
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    pieces: _PendingPieces | None = None   # a composed array's pieces, started at its lookup


@dataclasses.dataclass
class _PendingPieces:
    """A composed array's pieces between ``_start_pieces`` and ``_end_pieces``: all of them in
    order, those this compile owns, and what was sent to the compile workers for them (None:
    nothing yet, or no pool; an exception: sending failed)."""
    entries: list[CacheEntry]
    mine: list[CacheEntry]
    sent: PendingCompiles | BaseException | None
    t0: float


class SharedGrammarStore(Protocol):
    """What a cluster-wide cache offers a server (maskd_cluster implements it on Ray)."""

    def get(self, grammar_id: str) -> tuple[bytes | None, str | None] | None:
        """(serialized, None) for a compiled grammar, (None, error) for a cached failure, None if unknown."""

    def put(self, grammar_id: str, serialized: bytes | None, error: str | None) -> None: ...

    def get_many(self, grammar_ids: list[str]) -> list[tuple[bytes | None, str | None] | None]:
        """``get`` of each, in one call (the tool pieces of an array)."""

    def put_many(self, items: list[tuple[str, bytes | None, str | None]]) -> None:
        """``put`` of each (grammar id, serialized, error), in one call."""


class GrammarCache:
    def __init__(self, engine: Engine, *, max_entries: int = 1024, max_bytes: int = 1 << 30,
                 compile_threads: int = 2, compile_timeout_s: float = 30.0, metrics: Metrics | None = None,
                 shared: SharedGrammarStore | None = None, pool: CompilePool | None = None,
                 max_queued_per_tenant: int = 256, max_queued: int = 4096,
                 max_running_per_tenant: int | None = None, nice: int = 0) -> None:
        self.engine = engine
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.compile_timeout_s = compile_timeout_s
        self.metrics = metrics
        self.shared = shared
        self.pool = pool
        self.max_queued_per_tenant = max_queued_per_tenant
        self.max_queued = max_queued
        self.max_running_per_tenant = max_running_per_tenant or max(1, compile_threads - 1)
        self.nice = nice   # the compile threads' CPU priority (the server's compile_nice)
        self._entries: collections.OrderedDict[str, CacheEntry] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queues: dict[str, collections.deque[CacheEntry]] = {}
        self._running: collections.Counter[str] = collections.Counter()
        self._served: dict[str, int] = {}     # tenant -> when it was last served (a counter)
        self._piece_ids: dict[tuple, str] = {}
        self._big_ids: collections.OrderedDict[GrammarSpec, str] = collections.OrderedDict()
        self._big_chars = 0
        self._ids_lock = threading.Lock()
        self._serves = 0
        self._closed = False
        self.compiles = 0  # compiles this cache ran itself
        self._threads = []
        old = threading.stack_size(SERVER_STACK_BYTES)   # what a compile worker survived, these survive
        try:
            for i in range(max(1, compile_threads)):
                t = threading.Thread(target=self._worker, daemon=True, name=f"maskd-compile-{i}")
                t.start()
                self._threads.append(t)
        finally:
            threading.stack_size(old)

    def grammar_id(self, spec: GrammarSpec) -> str:
        """The spec's content id; those of large specs are kept, as a register and the opens after it
        send the same spec again and again. A call array's or template's is its parts' hash (kept on
        the parts, which the wire's same set looks up): keeping it by the spec would hash the array's
        whole text, 0.1 ms for a new one of 200 tools."""
        if len(spec.text) < _IDS_KEPT_FROM or spec.parts is not None:
            return self._grammar_id(spec)
        with self._ids_lock:
            gid = self._big_ids.get(spec)
            if gid is not None:
                self._big_ids.move_to_end(spec)
                return gid
        gid = self._grammar_id(spec)
        with self._ids_lock:
            self._big_ids[spec] = gid
            self._big_chars += len(spec.text)
            while self._big_chars > _IDS_KEPT_CHARS:
                old, _ = self._big_ids.popitem(last=False)
                self._big_chars -= len(old.text)
        return gid

    def _grammar_id(self, spec: GrammarSpec) -> str:
        return spec.grammar_id(self.engine.tokenizer.fingerprint, self.engine.name, self.engine.version,
                               json_schema_mode=self.engine.json_schema_mode)

    # -- lookups ----------------------------------------------------------------------------------
    def lookup(self, spec: GrammarSpec, tenant: str = "", start_pieces: bool = False) -> CacheEntry:
        """The entry for a spec, queueing its compile if it is new. Never blocks on a compile;
        raises QueueFull when the tenant's (or the server's) compile queue is full. With
        ``start_pieces`` (a register's thread, not a stream's: the step path does no compile's work),
        a new composed array's new pieces go to a compile worker at once where one is idle."""
        gid = self.grammar_id(spec)
        with self._lock:
            entry = self._entries.get(gid)
            if entry is not None:
                self._entries.move_to_end(gid)
                self._count("hit")
                self._check_deadline(entry)
                return entry
            queued = len(self._queues.get(tenant, ()))
            if queued >= self.max_queued_per_tenant:
                self._count_error("compile_queue_full")
                raise QueueFull(f"{queued} grammars of this tenant wait to compile; the limit is "
                                f"{self.max_queued_per_tenant} (max-compiles-queued-per-tenant)")
            total = sum(len(q) for q in self._queues.values())
            if total >= self.max_queued:
                self._count_error("compile_queue_full")
                raise QueueFull(f"{total} grammars wait to compile on this server; the limit is "
                                f"{self.max_queued} (max-compiles-queued)")
            self._count("miss")
            log.debug("grammar %s (%s, tenant %r): queued", gid, spec.kind, tenant)
            entry = CacheEntry(gid, spec, tenant)
            self._entries[gid] = entry
            parts = (self.engine.composed_parts(spec) if start_pieces and self.pool is not None and self.shared is None
                     else None)
            if parts is None:
                self._enqueue(entry)
                self._evict()
                return entry
        # A composed array's new pieces go to an idle compile worker now, while the array waits for a
        # compile thread (the queue's hop, and the thread's own work before it would send them).
        entry.pieces = self._start_pieces(spec, parts.pieces, tenant, wait=False)
        with self._lock:
            if self._closed:
                self._finish(entry, None, "the server is shutting down", 0.0)
            else:
                self._enqueue(entry)
            self._evict()
        return entry

    def get(self, grammar_id: str) -> CacheEntry | None:
        with self._lock:
            entry = self._entries.get(grammar_id)
            if entry is not None:
                self._entries.move_to_end(grammar_id)
                self._check_deadline(entry)
            return entry

    def wait(self, entry: CacheEntry, timeout_s: float | None = None) -> CacheEntry:
        """Blocks until the entry is ready or failed, at most ``timeout_s`` (default: three compile time
        limits and at least a minute, as it may wait in the queue, or for a compile worker, first)."""
        entry.done.wait(timeout_s if timeout_s is not None else max(60.0, 3 * self.compile_timeout_s))
        with self._lock:
            self._check_deadline(entry)
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def compiling(self) -> int:
        """Grammars queued or being compiled (tool pieces compiled after their array included)."""
        with self._lock:
            return sum(e.state is GrammarState.COMPILING for e in self._entries.values())

    def queued(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for q in self._queues.values():
                for entry in q:
                    self._finish(entry, None, "the server is shutting down", 0.0)
            self._queues.clear()
            self._work.notify_all()

    # -- scheduling (under the lock) --------------------------------------------------------------
    def _enqueue(self, entry: CacheEntry) -> None:
        self._queues.setdefault(entry.tenant, collections.deque()).append(entry)
        self._work.notify()

    def _next(self) -> CacheEntry | None:
        """The oldest queued grammar of the tenant with the fewest compiles running, the least
        recently served first (a tenant new to the queue goes before one that was just served)."""
        ready = [t for t, q in self._queues.items() if self._running[t] < self.max_running_per_tenant]
        if not ready:
            return None
        tenant = min(ready, key=lambda t: (self._running[t], self._served.get(t, -1)))
        q = self._queues[tenant]
        entry = q.popleft()
        if not q:
            del self._queues[tenant]
        self._serves += 1
        self._served[tenant] = self._serves
        return entry

    def _worker(self) -> None:
        lower_priority(self.nice, thread=True)   # loading a compiled grammar (matcher, document checks) yields the core
        while True:
            with self._lock:
                entry = self._next()
                while entry is None:
                    if self._closed:
                        return
                    self._work.wait()
                    entry = self._next()
                self._running[entry.tenant] += 1
                entry.started = time.monotonic()
                log.debug("grammar %s: compile starts", entry.grammar_id)
            try:
                self._compile(entry)
            finally:
                with self._lock:
                    self._running[entry.tenant] -= 1
                    if not self._running[entry.tenant]:
                        del self._running[entry.tenant]
                    self._work.notify_all()

    # -- compiling (on a compile thread) ----------------------------------------------------------
    def _compile(self, entry: CacheEntry) -> None:
        t0 = time.perf_counter()
        if not self._composed(entry, t0):
            self._compile_whole(entry, t0)

    def _compile_whole(self, entry: CacheEntry, t0: float) -> None:
        if self.shared is not None and self._from_shared(entry):
            return
        data: bytes | None = None
        cache_failure = True
        try:
            if self.pool is not None:
                data = self.pool.compile(entry.spec, self.compile_timeout_s)
                compiled: CompiledGrammar | None = self.engine.deserialize(entry.spec, data)
            else:
                compiled = self.engine.compile(entry.spec)
            error = ""
        except CompileTimeout as exc:
            compiled, error, cache_failure = None, str(exc), False
            log.warning("grammar %s (%s, tenant %r): %s", entry.grammar_id, entry.spec.kind, entry.tenant, error)
            self._count_error("compile_timeout")
        except CompileCrashed as exc:
            compiled, error = None, str(exc)
            self._count_error("compile_crash")
        except GrammarCompileError as exc:
            compiled, error = None, str(exc)
            log.info("grammar %s (%s) does not compile: %s", entry.grammar_id, entry.spec.kind, error[:300])
            self._count_error("compile_error")
        except Exception as exc:  # an engine bug must not kill the compile thread silently
            compiled, error = None, f"internal compile error: {type(exc).__name__}: {exc}"
            log.exception("grammar %s (%s): internal compile error", entry.grammar_id, entry.spec.kind)
            self._count_error("compile_internal")
        seconds = time.perf_counter() - t0
        self.compiles += 1
        log.debug("grammar %s: compiled in %.3f s%s", entry.grammar_id, seconds, f" ({error[:200]})" if error else "")
        if self.metrics is not None:
            self.metrics.compile_seconds.labels(self.engine.name).observe(seconds)
        if compiled is not None and data is None:
            try:
                data = self.engine.serialize(compiled)
            except NotImplementedError:
                data = b""
        with self._lock:
            if not cache_failure:
                entry.error_code = Code.RESOURCE_EXHAUSTED
            self._finish(entry, compiled, error, seconds, size=len(data or b""))
            if not cache_failure and self._entries.get(entry.grammar_id) is entry:
                self._remove(entry)   # a timeout may pass: the next lookup compiles again
        if self.shared is not None and cache_failure:
            try:
                self.shared.put(entry.grammar_id, data if compiled is not None else None, error or None)
            except Exception:  # the shared store is an optimization; compiling locally still works
                log.warning("cannot publish grammar %s to the shared cache", entry.grammar_id, exc_info=True)
                self._count_error("shared_cache_put")

    # -- tool-call arrays composed from per-tool pieces (engines/tool_calls.py) ---------------------
    def _composed(self, entry: CacheEntry, t0: float) -> bool:
        """A ``tool_choice: "required"`` array made of its tools' pieces, each a grammar of this cache
        (compiled once, here or by another replica through the shared store), and a router built
        here while the compile workers compile the pieces it lacks. False where the engine does not
        compose, or a piece does not compile alone or only as a relaxation: the array is then
        compiled whole (which names the error, if any). An array of new tools composes too: its
        pieces, in the compile workers at once, are ready sooner than one whole compile (200 tools
        98-103 against 192-293 ms; docs/decisions/0013-tool-call-pieces.md)."""
        parts = self.engine.composed_parts(entry.spec)
        if parts is None:
            return False
        pending, entry.pieces = entry.pieces, None
        if pending is None:
            pending = self._start_pieces(entry.spec, parts.pieces, entry.tenant)
        try:
            # On this thread, while the workers compile: a router built on a thread of its own beside
            # this one's Python waited for the GIL at each of llguidance's phases (1.9-2.1 ms for a
            # 0.8 ms build; docs/decisions/0016-tool-call-router.md).
            router: object = self.engine.router(entry.spec, parts)
        except Exception as exc:
            router = exc
        pieces = self._end_pieces(pending)
        compiled = None
        grammars = [p.compiled for p in pieces if p.compiled is not None]
        if not isinstance(router, Exception) and len(grammars) == len(pieces):
            compiled = self.engine.compose(entry.spec, parts, grammars, router)
        if compiled is None:
            if isinstance(router, Exception):
                log.warning("grammar %s: the tool-call router does not compile (%s); compiling the array whole",
                            entry.grammar_id, router)
            return False
        seconds = time.perf_counter() - t0
        self.compiles += 1
        if self.metrics is not None:
            self.metrics.compile_seconds.labels(self.engine.name).observe(seconds)
            self.metrics.tool_pieces.labels("composed").inc()
        with self._lock:
            self._finish(entry, compiled, "", seconds)
        return True

    def _piece_id(self, spec: GrammarSpec, text: str) -> str:
        """The id of the piece of ``text`` in ``spec``'s array (kept: the same tools come again)."""
        key = (text, spec.whitespace, spec.max_whitespace, spec.reasoning_end)
        gid = self._piece_ids.get(key)
        if gid is None:
            gid = self._grammar_id(self.engine.piece_spec(spec, text))
            with self._ids_lock:
                self._piece_ids[key] = gid
                if len(self._piece_ids) > _PIECE_IDS_KEPT:
                    del self._piece_ids[next(iter(self._piece_ids))]
        return gid

    def _start_pieces(self, spec: GrammarSpec, texts: tuple[str, ...], tenant: str,
                      wait: bool = True) -> _PendingPieces:
        """The pieces of ``spec``'s tools (their parameters ``texts``), in order: found in this
        cache or the shared store; those neither has sent to the compile workers now, together (not
        queued behind the array that needs them; with ``wait`` False only where a worker is idle,
        else by ``_end_pieces``); others' compiles waited for in ``_end_pieces``."""
        ids = [self._piece_id(spec, t) for t in texts]
        entries: list[CacheEntry] = []
        mine: list[CacheEntry] = []
        with self._lock:
            for gid, text in zip(ids, texts):
                entry = self._entries.get(gid)
                if entry is None:
                    entry = CacheEntry(gid, self.engine.piece_spec(spec, text), tenant, started=time.monotonic())
                    self._entries[gid] = entry
                    mine.append(entry)
                else:
                    self._entries.move_to_end(gid)
                    if entry.state is GrammarState.COMPILING and not entry.started:   # queued: taken from the queue
                        queue = self._queues.get(entry.tenant)
                        if queue is not None and entry in queue:
                            queue.remove(entry)
                            if not queue:
                                del self._queues[entry.tenant]
                            entry.started = time.monotonic()
                            mine.append(entry)
                entries.append(entry)
            self._evict()
        if mine and self.shared is not None:
            mine = self._pieces_from_shared(mine)
        if self.metrics is not None:
            self.metrics.tool_pieces.labels("cached").inc(len(entries) - len(mine))
            self.metrics.tool_pieces.labels("compiled").inc(len(mine))
        pending = _PendingPieces(entries, mine, None, time.perf_counter())
        if mine and self.pool is not None:
            self._send_pieces(pending, wait)
        return pending

    def _send_pieces(self, pending: _PendingPieces, wait: bool = True) -> None:
        assert self.pool is not None
        try:
            pending.sent = self.pool.compile_many([e.spec for e in pending.mine], self.compile_timeout_s, wait=wait)
        except Exception as exc:
            pending.sent = exc

    def _end_pieces(self, pending: _PendingPieces) -> list[CacheEntry]:
        """The pieces ``_start_pieces`` found or sent, each finished: the workers' answers loaded
        (a batch a worker does not survive is compiled again one piece at a time, so that only the
        piece at fault fails; a failure finishes every piece sent, as other requests may wait for
        them and the next lookup compiles them again), others' compiles waited for."""
        if pending.mine:
            try:
                self._load_pieces(pending)
            except Exception as exc:
                log.exception("compiling %d tool pieces failed", len(pending.mine))
                with self._lock:
                    for entry in pending.mine:
                        if not entry.done.is_set():
                            self._finish(entry, None, f"internal compile error: {type(exc).__name__}: {exc}", 0.0)
                            if self._entries.get(entry.grammar_id) is entry:
                                self._remove(entry)
        return [self.wait(e) if e.state is GrammarState.COMPILING else e for e in pending.entries]

    def _load_pieces(self, pending: _PendingPieces) -> None:
        """The workers' pieces loaded (a piece's matcher is built when a call first needs it: a
        request names 200 tools and calls one or two of them) and published to the shared store;
        compiled here one by one without a pool."""
        entries = pending.mine
        if self.pool is None:
            for entry in entries:
                self._compile(entry)
            return
        if pending.sent is None:      # no worker was idle when they were found
            self._send_pieces(pending)
        if isinstance(pending.sent, BaseException):
            raise pending.sent
        assert isinstance(pending.sent, PendingCompiles)
        results = pending.sent.results()
        seconds = (time.perf_counter() - pending.t0) / len(entries)
        published = []
        for entry, result in zip(entries, results):
            if isinstance(result, (CompileCrashed, CompileTimeout)):
                self._compile(entry)
                continue
            if isinstance(result, GrammarCompileError):
                compiled, error, data = None, str(result), None
                self._count_error("compile_error")
            else:
                data = result
                try:
                    compiled, error = self.engine.deserialize(entry.spec, data, lazy=True), ""
                except GrammarCompileError as exc:
                    compiled, error, data = None, str(exc), None
            with self._lock:
                self._finish(entry, compiled, error, seconds, size=len(data or b""))
            published.append((entry.grammar_id, data, error or None))
        if self.shared is not None and published:
            try:
                self.shared.put_many(published)
            except Exception:  # the shared store is an optimization
                log.warning("cannot publish %d tool pieces to the shared cache", len(published), exc_info=True)
                self._count_error("shared_cache_put")
        self.compiles += len(published)   # counted once published: the cluster's store has them

    def _pieces_from_shared(self, entries: list[CacheEntry]) -> list[CacheEntry]:
        """Loads the pieces the shared store has (one call); returns those it has not."""
        assert self.shared is not None
        try:
            found = self.shared.get_many([e.grammar_id for e in entries])
        except Exception:
            log.warning("shared grammar cache lookup of %d pieces failed; compiling here", len(entries), exc_info=True)
            self._count_error("shared_cache_get")
            return entries
        missing = []
        for entry, hit in zip(entries, found):
            if self.metrics is not None:
                (self.metrics.cache_hits if hit else self.metrics.cache_misses).labels("shared").inc()
            if not hit:
                missing.append(entry)
                continue
            data, error = hit
            try:
                compiled = self.engine.deserialize(entry.spec, data, lazy=True) if data is not None else None
            except GrammarCompileError as exc:
                compiled, error = None, f"cannot load the shared cache's grammar: {exc}"
            with self._lock:
                self._finish(entry, compiled, error or "", 0.0, size=len(data or b""))
        return missing

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
        try:
            compiled = self.engine.deserialize(entry.spec, data) if data is not None else None
        except GrammarCompileError as exc:
            compiled, error = None, f"cannot load the shared cache's grammar: {exc}"
        with self._lock:
            self._finish(entry, compiled, error or "", 0.0, size=len(data or b""))
        return True

    # -- bookkeeping (under the lock) -------------------------------------------------------------
    def _count(self, what: str) -> None:
        if self.metrics is not None:
            (self.metrics.cache_hits if what == "hit" else self.metrics.cache_misses).labels("local").inc()

    def _count_error(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(kind).inc()

    def _check_deadline(self, entry: CacheEntry) -> None:
        """A backstop: a compile past its limit by far (the worker pool stops the compile itself, at its
        CPU-time limit or at the wall-clock backstop)."""
        if entry.state is GrammarState.COMPILING and entry.started and \
                time.monotonic() > entry.started + wall_limit(self.compile_timeout_s) + 10.0:
            log.warning("grammar %s (%s) exceeded the %g s compile limit", entry.grammar_id, entry.spec.kind,
                        self.compile_timeout_s)
            self._count_error("compile_timeout")
            entry.error_code = Code.RESOURCE_EXHAUSTED
            self._finish(entry, None, f"grammar compile exceeded the {self.compile_timeout_s:g} s limit",
                         self.compile_timeout_s)
            if self._entries.get(entry.grammar_id) is entry:
                self._remove(entry)

    def _finish(self, entry: CacheEntry, compiled: CompiledGrammar | None, error: str, seconds: float,
                size: int = 0) -> None:
        if entry.done.is_set():
            return
        entry.compiled = compiled
        entry.error = error
        entry.compile_seconds = seconds
        entry.state = GrammarState.READY if compiled is not None else GrammarState.FAILED
        if self._entries.get(entry.grammar_id) is entry:
            new_size = size + len(entry.spec.text) + _ENTRY_OVERHEAD
            self._bytes += new_size - entry.size
            entry.size = new_size
            self._evict()
        entry.done.set()

    def _remove(self, entry: CacheEntry) -> None:
        del self._entries[entry.grammar_id]
        self._bytes -= entry.size

    def _evict(self) -> None:
        """Least recently used first, never an entry a compile will still fill."""
        if len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            for gid in list(self._entries):
                if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
                    break
                entry = self._entries[gid]
                if entry.state is not GrammarState.COMPILING:
                    self._remove(entry)
        if self.metrics is not None:
            self.metrics.cache_size.set(len(self._entries))
            self.metrics.cache_bytes.set(self._bytes)
