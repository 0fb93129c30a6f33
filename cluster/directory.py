"""The cluster directory: live workers and which worker owns a sequence.

``DirectoryState`` is the membership and the hash ring (no Ray, no gRPC). ``DirectoryService``
serves it as the Directory gRPC service on a real port, so GPU workers that do not run Ray can
ask. ``DirectoryActor`` is the Ray actor that hosts both and keeps membership equal to Ray's view of
the live worker actors: workers push their address when they (re)start, a monitor thread asks
every worker actor for its stats each ``poll_s`` (an actor Ray reports dead, or that does not
answer twice in a row, leaves the ring; one that answers again rejoins), and a client that
cannot reach a worker names it as a suspect in ``Lookup``, which probes it at once.

Membership is by stable worker id, so when a worker leaves only its sequences move, and when
it comes back (a restart, same id) the ring is the one before it left.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from maskd.v1 import directory_pb2 as dpb
from maskd.v1 import directory_pb2_grpc as dpb_grpc
from maskd_client.routing import DEFAULT_VNODES, RING_HASH, HashRing
from maskd_cluster import STORE_NAME, WORKER_PREFIX

log = logging.getLogger("maskd_cluster.directory")
SERVICE_NAME = "maskd.v1.Directory"
WORKER_SERVICE = "maskd.v1.MaskService"


def _worker_order(worker_id: str):
    m = re.search(r"(\d+)$", worker_id)
    return (worker_id[: m.start()] if m else worker_id, int(m.group(1)) if m else -1, worker_id)


@dataclasses.dataclass
class WorkerRecord:
    worker_id: str
    handle: Any = None
    address: str = ""
    incarnation: int = 0
    node_id: str = ""
    live: bool = False
    restarts: int = 0
    misses: int = 0
    bad_address: str = ""           # an address a probe found unreachable
    drained_incarnation: int = 0    # an incarnation that drained: never back on the ring
    stats: dict = dataclasses.field(default_factory=dict)
    since: float = 0.0


class DirectoryState:
    """Membership + ring. Thread-safe; callbacks are called outside the lock."""

    def __init__(self, vnodes: int = DEFAULT_VNODES, *, misses_to_down: int = 2, on_incarnation_gone=None) -> None:
        self.vnodes = vnodes
        self.misses_to_down = misses_to_down
        self.ring = HashRing(vnodes=vnodes)
        self.workers: dict[str, WorkerRecord] = {}
        self.epoch = 1
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._on_incarnation_gone = on_incarnation_gone  # (worker_id, incarnation) -> None

    # -- membership events --------------------------------------------------------------------
    def add(self, worker_id: str, handle: Any = None) -> None:
        with self.lock:
            rec = self.workers.setdefault(worker_id, WorkerRecord(worker_id))
            if handle is not None:
                rec.handle = handle

    def forget(self, worker_id: str) -> None:
        with self.lock:
            if self.workers.pop(worker_id, None) is not None:
                self._set_ring(worker_id, False)

    def seen(self, worker_id: str, address: str, incarnation: int, *, node_id: str = "", handle: Any = None,
             draining: bool = False, stats: dict | None = None) -> None:
        """The worker answered (a push at start, or a poll) from `address` in `incarnation`."""
        gone = None
        with self.lock:
            rec = self.workers.setdefault(worker_id, WorkerRecord(worker_id))
            if handle is not None:
                rec.handle = handle
            rec.misses = 0
            if stats is not None:
                rec.stats = stats
            if incarnation != rec.incarnation:
                if rec.incarnation:
                    rec.restarts += 1
                    gone = (worker_id, rec.incarnation)
                rec.incarnation = incarnation
                rec.address = address
                rec.node_id = node_id or rec.node_id
                if rec.bad_address != address:
                    rec.bad_address = ""
            live = not draining and rec.drained_incarnation != incarnation and rec.bad_address != rec.address
            self._set_ring(worker_id, live)
        if gone and self._on_incarnation_gone:
            self._on_incarnation_gone(*gone)

    def miss(self, worker_id: str, *, dead: bool, why: str = "", incarnation: int | None = None) -> None:
        """The worker did not answer a poll (`dead`: Ray says the actor died). A poll sent to an
        earlier incarnation than the one now known says nothing about the current one."""
        gone = None
        with self.lock:
            rec = self.workers.get(worker_id)
            if rec is None or (incarnation is not None and incarnation != rec.incarnation):
                return
            rec.misses += 1
            if rec.live and (dead or rec.misses >= self.misses_to_down):
                log.warning("worker %s at %s is down: %s", worker_id, rec.address, why or "no answer")
                self._set_ring(worker_id, False)
                gone = (worker_id, rec.incarnation)
        if gone and self._on_incarnation_gone:
            self._on_incarnation_gone(*gone)

    def unreachable(self, worker_id: str, address: str) -> None:
        """A probe of `address` failed: off the ring until it answers there again or moves."""
        with self.lock:
            rec = self.workers.get(worker_id)
            if rec is None or rec.address != address:
                return
            rec.bad_address = address
            if rec.live:
                log.warning("worker %s at %s is unreachable", worker_id, address)
            self._set_ring(worker_id, False)

    def reachable(self, worker_id: str, address: str) -> None:
        with self.lock:
            rec = self.workers.get(worker_id)
            if rec is None or rec.address != address or rec.bad_address != address:
                return
            rec.bad_address = ""
            self._set_ring(worker_id, rec.drained_incarnation != rec.incarnation and bool(rec.address))

    def drained(self, worker_id: str, incarnation: int) -> None:
        with self.lock:
            rec = self.workers.get(worker_id)
            if rec is None:
                return
            rec.drained_incarnation = incarnation
            if rec.incarnation == incarnation:
                self._set_ring(worker_id, False)

    def _set_ring(self, worker_id: str, live: bool) -> None:
        rec = self.workers.get(worker_id)
        if rec is not None and rec.live != live:
            rec.live = live
            rec.since = time.time()
        changed = self.ring.add(worker_id) if live else self.ring.remove(worker_id)
        if changed:
            self.epoch += 1
            self.changed.notify_all()

    # -- queries --------------------------------------------------------------------------------
    def records(self) -> list[WorkerRecord]:
        with self.lock:
            return sorted((dataclasses.replace(r) for r in self.workers.values()),
                          key=lambda r: _worker_order(r.worker_id))

    def live(self) -> list[WorkerRecord]:
        return [r for r in self.records() if r.live]

    def record_at(self, address: str) -> WorkerRecord | None:
        with self.lock:
            for r in self.workers.values():
                if r.address == address:
                    return dataclasses.replace(r)
        return None

    def lookup(self, keys: Sequence[str]) -> tuple[list[WorkerRecord], list[int], int]:
        """(live workers, per key an index into them, epoch); empty workers when none is live."""
        with self.lock:
            live = sorted((dataclasses.replace(r) for r in self.workers.values() if r.live),
                          key=lambda r: _worker_order(r.worker_id))
            index = {r.worker_id: i for i, r in enumerate(live)}
            owners = [index[o] for o in self.ring.owners(keys)] if live else []
            return live, owners, self.epoch

    def wait_live(self, n: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while len(self.ring) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, 0.5))
            return True


def worker_proto(rec: WorkerRecord, with_stats: bool = False) -> dpb.Worker:
    w = dpb.Worker(worker_id=rec.worker_id, address=rec.address, live=rec.live, incarnation=rec.incarnation,
                   restarts=rec.restarts, node_id=rec.node_id)
    if with_stats and rec.stats:
        s = rec.stats
        w.stats.CopyFrom(dpb.WorkerStats(
            sequences=s.get("sequences", 0), streams=s.get("streams", 0), cache_entries=s.get("cache_entries", 0),
            compiles=s.get("compiles", 0), shared_hits=s.get("shared_hits", 0),
            shared_misses=s.get("shared_misses", 0)))
    return w


def probe(address: str, timeout_s: float = 1.0) -> bool:
    """gRPC health check of a worker's MaskService."""
    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                                          timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class DirectoryService(dpb_grpc.DirectoryServicer):
    def __init__(self, state: DirectoryState, *, refresh_stats=None, cache_stats=None,
                 probe_timeout_s: float = 1.0) -> None:
        self.state = state
        self.refresh_stats = refresh_stats    # () -> None: fresh per-worker stats (optional)
        self.cache_stats = cache_stats        # () -> dict | None
        self.probe_timeout_s = probe_timeout_s

    def ListWorkers(self, request, context):
        if request.stats and self.refresh_stats is not None:
            self.refresh_stats()
        reply = dpb.ListWorkersResponse(epoch=self.state.epoch, ring_vnodes=self.state.vnodes, ring_hash=RING_HASH)
        for rec in self.state.records():
            reply.workers.append(worker_proto(rec, request.stats))
        if request.stats and self.cache_stats is not None:
            stats = self.cache_stats()
            if stats:
                reply.cache.CopyFrom(dpb.SharedCacheStats(
                    entries=stats.get("entries", 0), bytes=stats.get("bytes", 0), hits=stats.get("hits", 0),
                    misses=stats.get("misses", 0), publishes=stats.get("publishes", 0),
                    waits=stats.get("waits", 0)))
        return reply

    def Lookup(self, request, context):
        self.check_suspects(request.suspect_addresses)
        live, owners, epoch = self.state.lookup(list(request.keys))
        if not live:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "no live maskd workers: they are starting or restarting (see `maskd cluster status`)")
        return dpb.LookupResponse(workers=[worker_proto(r) for r in live], owner=owners, epoch=epoch)

    def check_suspects(self, addresses: Iterable[str]) -> None:
        for address in set(addresses):
            rec = self.state.record_at(address)
            if rec is None or not rec.live:
                continue
            if probe(address, self.probe_timeout_s):
                continue
            self.state.unreachable(rec.worker_id, address)


class DirectoryActor:
    """Ray actor (threaded): hosts DirectoryState and the Directory gRPC service."""

    def __init__(self, namespace: str, *, host: str | None = None, bind_host: str | None = None, port: int = 0,
                 vnodes: int = DEFAULT_VNODES, poll_s: float = 0.5, ping_timeout_s: float = 2.0,
                 misses_to_down: int = 2) -> None:
        import ray

        self.namespace = namespace
        self.poll_s = poll_s
        self.ping_timeout_s = ping_timeout_s
        self.state = DirectoryState(vnodes, misses_to_down=misses_to_down,
                                    on_incarnation_gone=self._release_claims)
        self._store: Any = None
        self._stop = threading.Event()
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16,
                                                                         thread_name_prefix="maskd-directory"))
        dpb_grpc.add_DirectoryServicer_to_server(
            DirectoryService(self.state, refresh_stats=self.refresh, cache_stats=self.cache_stats), self._server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.host = host or ray.util.get_node_ip_address()
        bind_host = bind_host or self.host    # bind where it is reached (loopback on one machine)
        port = port or _remembered_port(namespace)
        bound = 0
        try:
            bound = self._server.add_insecure_port(f"{bind_host}:{port}")
        except RuntimeError:
            bound = 0
        if not bound and port:
            bound = self._server.add_insecure_port(f"{bind_host}:0")  # the old port is taken
        if not bound:
            raise OSError(f"maskd directory cannot bind {bind_host}:{port}")
        _remember_port(namespace, bound)
        self.port = bound
        self._server.start()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._rediscover()
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="maskd-directory-monitor")
        self._monitor.start()
        log.info("maskd directory serving on %s:%d", self.host, self.port)

    # -- remote methods -------------------------------------------------------------------------
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add_worker(self, worker_id: str, handle) -> None:
        self.state.add(worker_id, handle)

    def forget_worker(self, worker_id: str) -> None:
        self.state.forget(worker_id)

    def register(self, worker_id: str, address: str, incarnation: int, node_id: str, handle) -> None:
        self.state.seen(worker_id, address, incarnation, node_id=node_id, handle=handle)

    def deregister(self, worker_id: str, incarnation: int) -> None:
        self.state.drained(worker_id, incarnation)

    def wait_live(self, n: int, timeout_s: float = 60.0) -> bool:
        return self.state.wait_live(n, timeout_s)

    def lookup(self, keys: list[str]) -> dict[str, str]:
        """key -> worker id (for tests and tools; clients use the gRPC Lookup)."""
        live, owners, _ = self.state.lookup(keys)
        return {k: live[i].worker_id for k, i in zip(keys, owners)}

    def status(self, fresh: bool = True) -> dict:
        if fresh:
            self.refresh()
        return {
            "directory": self.address(),
            "epoch": self.state.epoch,
            "ring_vnodes": self.state.vnodes,
            "workers": [{"worker_id": r.worker_id, "address": r.address, "live": r.live,
                         "incarnation": r.incarnation, "restarts": r.restarts, "node_id": r.node_id,
                         **{k: v for k, v in r.stats.items() if k not in ("worker_id", "address", "incarnation",
                                                                          "node_id")}}
                        for r in self.state.records()],
            "cache": self.cache_stats() or {},
        }

    def stop(self) -> None:
        self._stop.set()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server.stop(1.0).wait()

    # -- Ray's view of the workers ------------------------------------------------------------
    def refresh(self) -> None:
        """Asks every worker actor for its stats now; answers and failures update membership."""
        import ray
        from ray.exceptions import ActorDiedError

        targets = [(r.worker_id, r.handle, r.incarnation) for r in self.state.records() if r.handle is not None]
        if not targets:
            return
        refs = {}
        for wid, handle, incarnation in targets:
            try:
                refs[handle.stats.remote()] = (wid, incarnation)
            except Exception as exc:  # a handle of an actor Ray has given up on
                self.state.miss(wid, dead=True, why=str(exc), incarnation=incarnation)
        if not refs:
            return
        ready_list, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.ping_timeout_s)
        ready = set(ready_list)
        for ref, (wid, incarnation) in refs.items():
            if ref not in ready:
                self.state.miss(wid, dead=False, why=f"no answer in {self.ping_timeout_s:g} s",
                                incarnation=incarnation)
                continue
            try:
                st = ray.get(ref, timeout=0)
            except ActorDiedError as exc:   # dead for good, or restarting as a new incarnation
                self.state.miss(wid, dead=True, why=type(exc).__name__, incarnation=incarnation)
                continue
            except Exception as exc:        # ActorUnavailableError and the like: transient
                self.state.miss(wid, dead=False, why=f"{type(exc).__name__}: {exc}", incarnation=incarnation)
                continue
            self.state.seen(wid, st["address"], st["incarnation"], node_id=st.get("node_id", ""),
                            draining=st.get("draining", False), stats=st)
            rec = self.state.record_at(st["address"])
            if rec is not None and rec.bad_address == st["address"] and probe(st["address"]):
                self.state.reachable(wid, st["address"])

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
            except Exception:
                log.exception("directory monitor")

    def _rediscover(self) -> None:
        """A restarted directory finds the worker actors of its namespace by name."""
        import ray
        try:
            named = ray.util.list_named_actors(all_namespaces=True)
        except Exception:
            return
        for item in named:
            name, ns = (item["name"], item["namespace"]) if isinstance(item, dict) else (item, self.namespace)
            if ns != self.namespace or not name.startswith(WORKER_PREFIX):
                continue
            try:
                handle = ray.get_actor(name, namespace=ns)
            except ValueError:
                continue
            self.state.add("worker-" + name[len(WORKER_PREFIX):], handle)

    # -- the shared cache -----------------------------------------------------------------------
    def _store_handle(self):
        if self._store is None:
            import ray
            try:
                self._store = ray.get_actor(STORE_NAME, namespace=self.namespace)
            except ValueError:
                return None
        return self._store

    def cache_stats(self) -> dict | None:
        import ray
        store = self._store_handle()
        if store is None:
            return None
        try:
            return ray.get(store.stats.remote(), timeout=2.0)
        except Exception:
            return None

    def _release_claims(self, worker_id: str, incarnation: int) -> None:
        store = self._store_handle()
        if store is not None:
            store.release.remote(f"{worker_id}/{incarnation}")


# The directory's port survives a restart of its actor (clients keep the address they were given).
def _kv_key(namespace: str) -> bytes:
    return f"maskd:{namespace}:directory-port".encode()


def _remembered_port(namespace: str) -> int:
    try:
        from ray.experimental.internal_kv import _internal_kv_get
        value = _internal_kv_get(_kv_key(namespace))
        return int(value) if value else 0
    except Exception:
        return 0


def _remember_port(namespace: str, port: int) -> None:
    try:
        from ray.experimental.internal_kv import _internal_kv_put
        _internal_kv_put(_kv_key(namespace), str(port).encode(), overwrite=True)
    except Exception:
        pass
