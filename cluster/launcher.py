"""Starting, inspecting and stopping a maskd cluster on a Ray cluster this process is connected to.

All actors are named in one Ray namespace, so a later process (``maskd cluster status`` /
``down``) finds them: ``maskd-directory``, ``maskd-grammar-store`` and ``maskd-worker-<i>``
(worker id ``worker-<i>``, stable across restarts).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

from maskd.server.config import ConfigError, ServerConfig, setting
from maskd_client.routing import DEFAULT_VNODES
from maskd_cluster import DIRECTORY_NAME, NAMESPACE, STORE_NAME, WORKER_PREFIX, worker_actor_name, worker_id

log = logging.getLogger("maskd_cluster.launcher")
# Handles of actors that are not detached: Ray ends such an actor once no handle to it is left,
# so this process keeps them until down().
_HELD: dict[str, dict[str, object]] = {}


def _worker_server_defaults() -> ServerConfig:
    """What a worker serves unless told otherwise: a free port, fill threads = its CPUs."""
    return ServerConfig(port=0, threads=None)


@dataclasses.dataclass
class ClusterConfig:
    """A maskd cluster: the directory, the shared grammar cache and N workers serving ``server``."""

    workers: int = setting(2, help="number of maskd worker actors")
    namespace: str = setting(NAMESPACE, help="Ray namespace of the cluster's actors")
    server: ServerConfig = setting(help="", factory=_worker_server_defaults)
    # placement
    worker_cpus: float = setting(1.0, help="CPUs each worker actor asks Ray for (its fill threads by default)")
    worker_resources: dict[str, float] = setting(help="custom Ray resources per worker", cli=False, factory=dict)
    worker_host: str | None = setting(None, help="address workers bind and advertise (default: the node's IP)")
    max_restarts: int = setting(-1, help="worker restarts after failures (-1: no limit)")
    # directory and shared cache
    directory_port: int = setting(0, help="directory gRPC port (0: a free one)")
    directory_here: bool = setting(False, help="run the directory on this process's Ray node (the Helm chart's "
                                               "head pod, which the directory Service selects)")
    directory_host: str | None = setting(None, help="address the directory advertises (default: the node's IP)")
    directory_bind_host: str | None = setting(None, help="address the directory's port binds (default: the address "
                                                         "it advertises; the Helm chart binds 0.0.0.0 in its pod)")
    vnodes: int = setting(DEFAULT_VNODES, help="ring points per worker")
    poll_s: float = setting(0.5, flag="--poll", help="seconds between the directory's checks of the workers")
    shared_cache_entries: int = setting(4096, help="compiled grammars the cluster cache keeps")
    shared_cache_bytes: int = setting(1 << 30, help="bytes the cluster cache keeps")
    detached: bool = setting(True, cli=False, help="actors outlive this process (the CLI); tests use False")
    ready_timeout_s: float = setting(120.0, flag="--timeout", help="seconds to wait for the workers")
    log_level: str | None = setting(None, cli=False, help="the workers' log level")

    def check(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, not {self.workers}")
        if self.worker_cpus <= 0:
            raise ConfigError(f"--worker-cpus must be > 0, not {self.worker_cpus}")
        self.server.check()

    def worker_server_config(self) -> ServerConfig:
        """What each worker serves (threads resolved to its CPUs when unset)."""
        threads = self.server.threads or max(1, math.ceil(self.worker_cpus))
        return dataclasses.replace(self.server, threads=threads)


def _ray():
    import ray
    if not ray.is_initialized():
        raise RuntimeError("not connected to Ray: call ray.init(...) first")
    return ray


def _lifetime(cfg: ClusterConfig):
    return "detached" if cfg.detached else None


def worker_names(namespace: str = NAMESPACE) -> list[str]:
    ray = _ray()
    names = []
    for item in ray.util.list_named_actors(all_namespaces=True):
        if item["namespace"] == namespace and item["name"].startswith(WORKER_PREFIX):
            names.append(item["name"])
    return sorted(names, key=lambda n: int(n[len(WORKER_PREFIX):]) if n[len(WORKER_PREFIX):].isdigit() else 1 << 30)


def get_directory(namespace: str = NAMESPACE):
    return _ray().get_actor(DIRECTORY_NAME, namespace=namespace)


def get_store(namespace: str = NAMESPACE):
    return _ray().get_actor(STORE_NAME, namespace=namespace)


def get_worker(wid: str, namespace: str = NAMESPACE):
    return _ray().get_actor(worker_actor_name(wid), namespace=namespace)


def up(cfg: ClusterConfig, on_ready: Callable[[str], None] | None = None) -> str:
    """Starts (or completes, or scales) the cluster; returns the directory's HOST:PORT once
    `cfg.workers` workers are live. ``on_ready(worker_id)`` is called as each worker serves."""
    ray = _ray()
    from maskd_cluster.directory import DirectoryActor
    from maskd_cluster.store import GrammarStore
    from maskd_cluster.worker import Worker

    ns = cfg.namespace
    common = dict(namespace=ns, get_if_exists=True, lifetime=_lifetime(cfg), max_restarts=-1)
    store = ray.remote(GrammarStore).options(name=STORE_NAME, num_cpus=0, max_concurrency=1000, **common).remote(
        max_entries=cfg.shared_cache_entries, max_bytes=cfg.shared_cache_bytes,
        claim_s=cfg.server.limits.compile_timeout_s)
    ray.get(store.ready.remote(), timeout=cfg.ready_timeout_s)
    placement = {}
    if cfg.directory_here:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                          soft=False)
    directory = ray.remote(DirectoryActor).options(name=DIRECTORY_NAME, num_cpus=0, max_concurrency=16, **common,
                                              **placement).remote(
        ns, host=cfg.directory_host, bind_host=cfg.directory_bind_host, port=cfg.directory_port, vnodes=cfg.vnodes,
        poll_s=cfg.poll_s)
    # Keep the handle that created an actor: one from get_if_exists does not keep it alive.
    held = _HELD.setdefault(ns, {}) if not cfg.detached else {}
    held.setdefault(STORE_NAME, store)
    held.setdefault(DIRECTORY_NAME, directory)
    address = ray.get(directory.address.remote(), timeout=cfg.ready_timeout_s)

    cfg.check()
    existing = set(worker_names(ns))
    server_config = cfg.worker_server_config()
    started = {}
    for i in range(cfg.workers):
        wid = worker_id(i)
        name = worker_actor_name(wid)
        if name in existing:
            handle = ray.get_actor(name, namespace=ns)
            held.setdefault(name, handle)
        else:
            handle = ray.remote(Worker).options(
                name=name, namespace=ns, lifetime=_lifetime(cfg), num_cpus=cfg.worker_cpus,
                resources=dict(cfg.worker_resources) or None, max_restarts=cfg.max_restarts, max_concurrency=4,
            ).remote(wid, server_config, ns, host=cfg.worker_host, log_level=cfg.log_level)
            held[name] = handle
        started[wid] = handle
        ray.get(directory.add_worker.remote(wid, handle))
    for name in existing:  # scale down: workers past the requested count drain and go
        index = name[len(WORKER_PREFIX):]
        if index.isdigit() and int(index) >= cfg.workers:
            stop_worker(worker_id(int(index)), ns, grace_s=cfg.server.drain_grace_s)
    # A worker whose constructor fails (bad tokenizer, import error) is reported now, not at the timeout.
    from ray.exceptions import GetTimeoutError, RayActorError
    for wid, handle in started.items():
        try:
            ray.get(handle.address.remote(), timeout=cfg.ready_timeout_s)
            if on_ready is not None:
                on_ready(wid)
        except RayActorError as exc:
            raise RuntimeError(f"maskd worker {wid} failed to start: {exc}") from exc
        except GetTimeoutError:
            break
    if not ray.get(directory.wait_live.remote(cfg.workers, cfg.ready_timeout_s),
                   timeout=cfg.ready_timeout_s + 10):
        raise TimeoutError(f"{cfg.workers} maskd workers not live after {cfg.ready_timeout_s:g} s "
                           f"(each asks for {cfg.worker_cpus:g} CPU"
                           f"{' and ' + str(cfg.worker_resources) if cfg.worker_resources else ''}; "
                           f"Ray has {ray.available_resources()} free): {status(ns)['workers']}")
    return address


def stop_worker(wid: str, namespace: str = NAMESPACE, *, grace_s: float = 10.0) -> None:
    """Drains one worker (off the ring first, then its streams get `grace_s`) and removes it."""
    ray = _ray()
    try:
        handle = get_worker(wid, namespace)
    except ValueError:
        return
    try:
        ray.get(handle.drain.remote(grace_s), timeout=grace_s + 15)
    except Exception as exc:
        log.warning("worker %s did not drain: %s", wid, exc)
    ray.kill(handle, no_restart=True)
    _HELD.get(namespace, {}).pop(worker_actor_name(wid), None)
    try:
        ray.get(get_directory(namespace).forget_worker.remote(wid), timeout=10)
    except Exception:
        pass


def status(namespace: str = NAMESPACE) -> dict:
    ray = _ray()
    return ray.get(get_directory(namespace).status.remote(True), timeout=30)


def down(namespace: str = NAMESPACE, *, grace_s: float = 10.0) -> list[str]:
    """Drains every worker, then removes workers, the shared cache and the directory."""
    ray = _ray()
    stopped = []
    for name in worker_names(namespace):
        wid = worker_id(int(name[len(WORKER_PREFIX):])) if name[len(WORKER_PREFIX):].isdigit() else name
        stop_worker(wid, namespace, grace_s=grace_s)
        stopped.append(wid)
    for name in (DIRECTORY_NAME, STORE_NAME):
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        if name == DIRECTORY_NAME:
            try:
                ray.get(handle.stop.remote(), timeout=10)
            except Exception:
                pass
        ray.kill(handle, no_restart=True)
    _HELD.pop(namespace, None)
    try:
        from ray.experimental.internal_kv import _internal_kv_del

        from maskd_cluster.directory import _kv_key
        _internal_kv_del(_kv_key(namespace))
    except Exception:
        pass
    return stopped


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2):
    """Polls `predicate` until it returns a truthy value; returns it (or the last falsy one)."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value
