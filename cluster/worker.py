"""The maskd worker: a Ray actor that hosts a maskd gRPC server on its node.

GPU workers connect to the worker's own address (node IP and a free port), so a step travels
one network hop and never through a proxy. The actor's id ("worker-0", ...) is stable across
restarts (Ray re-runs ``__init__`` with the same arguments); every start has a new incarnation
and address, which the worker pushes to the directory. A restarted worker has no matchers:
clients restore their sequences (see maskd_client.cluster). ``drain`` (and a graceful actor
exit) takes the worker off the ring, refuses new streams and gives open ones a grace period.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import warnings

import ray

from maskd_cluster import DIRECTORY_NAME, STORE_NAME
from maskd_cluster.store import RayGrammarStore

log = logging.getLogger("maskd_cluster.worker")


def _sample(registry, name: str, labels: dict | None = None) -> int:
    value = registry.get_sample_value(name, labels or {})
    return int(value) if value is not None else 0


class Worker:
    """Ray actor: create through maskd_cluster.launcher (``ray.remote(Worker).options(...)``)."""

    def __init__(self, worker_id: str, server_config, namespace: str, *, host: str | None = None,
                 log_level: str | None = None) -> None:
        import dataclasses

        from maskd.server import MaskServer
        from maskd.server.logs import configure

        configure(log_level)

        self.worker_id = worker_id
        self.namespace = namespace
        self.incarnation = secrets.randbits(62) or 1
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        with warnings.catch_warnings():   # the property warns about an API it uses internally
            warnings.simplefilter("ignore")
            self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.started_at = time.time()
        # The bearer token is read here, on the worker's node (auth_token_env), never shipped through Ray.
        config = dataclasses.replace(server_config, host=host or ray.util.get_node_ip_address())
        shared = None
        try:
            store = ray.get_actor(STORE_NAME, namespace=namespace)
            shared = RayGrammarStore(store, f"{worker_id}/{self.incarnation}",
                                     wait_s=config.limits.compile_timeout_s)
        except ValueError:
            log.warning("no shared grammar store %r in namespace %r: compiling locally only", STORE_NAME, namespace)
        self.server = MaskServer(config, shared_cache=shared).start()
        self._drained = threading.Event()
        log.info("maskd %s (incarnation %x%s) serving on %s", worker_id, self.incarnation,
                 ", restarted" if self.restarted else "", self.server.address)
        self._announce()

    # -- directory ----------------------------------------------------------------------------
    def _directory(self):
        try:
            return ray.get_actor(DIRECTORY_NAME, namespace=self.namespace)
        except ValueError:
            return None

    def _announce(self) -> None:
        directory = self._directory()
        if directory is None:
            return
        me = ray.get_runtime_context().current_actor
        # Fire and forget: the directory also finds us by polling; never block our start on it.
        directory.register.remote(self.worker_id, self.server.address, self.incarnation, self.node_id, me)

    # -- remote methods -------------------------------------------------------------------------
    def address(self) -> str:
        return self.server.address

    def stats(self) -> dict:
        srv = self.server
        reg = srv.metrics.registry
        return {
            "worker_id": self.worker_id,
            "address": srv.address,
            "incarnation": self.incarnation,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "restarted": self.restarted,
            "draining": srv.service.draining.is_set(),
            "sequences": srv.service.live_sequences(),
            "streams": _sample(reg, "maskd_open_streams"),
            "cache_entries": len(srv.cache),
            "compiles": srv.cache.compiles,
            "shared_hits": _sample(reg, "maskd_grammar_cache_hits_total", {"cache": "shared"}),
            "shared_misses": _sample(reg, "maskd_grammar_cache_misses_total", {"cache": "shared"}),
            "metrics_port": srv.metrics_port,
        }

    def drain(self, grace_s: float | None = None) -> dict:
        """Leaves the ring, refuses new streams, gives open ones `grace_s`, then stops serving."""
        if self._drained.is_set():
            return self.stats()
        self._drained.set()
        directory = self._directory()
        if directory is not None:
            try:
                ray.get(directory.deregister.remote(self.worker_id, self.incarnation), timeout=5.0)
            except Exception as exc:  # the directory also notices the drain by polling
                log.warning("%s: cannot tell the directory about the drain: %s", self.worker_id, exc)
        grace = self.server.config.drain_grace_s if grace_s is None else grace_s
        self.server.stop(grace=grace)
        return self.stats()

    def __ray_shutdown__(self) -> None:
        """A graceful actor exit drains first (ray.kill is a hard kill and skips this)."""
        try:
            self.drain()
        except Exception:
            pass
