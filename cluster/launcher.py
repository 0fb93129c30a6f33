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

from maskd.server import ServerConfig as _S
from maskd_cluster import DIRECTORY_NAME, NAMESPACE, STORE_NAME, WORKER_PREFIX, worker_actor_name, worker_id
from maskd_cluster.hashring import DEFAULT_VNODES

log = logging.getLogger("maskd_cluster.launcher")
# Handles of actors that are not detached: Ray ends such an actor once no handle to it is left,
# so this process keeps them until down().
_HELD: dict[str, dict[str, object]] = {}


_SERVED = ("tokenizer", "backend", "logits_width", "compile_threads", "compile_timeout_s", "cache_entries",
           "max_streams", "max_message_bytes", "max_grammar_bytes", "port", "metrics_port", "tls_cert", "tls_key",
           "row_dict_size")


@dataclasses.dataclass
class ClusterConfig:
    workers: int = 2
    namespace: str = NAMESPACE
    # what every worker serves: the maskd.server.ServerConfig fields named in _SERVED, same defaults
    tokenizer: str = _S.tokenizer
    backend: str = _S.backend
    logits_width: int | None = _S.logits_width
    threads: int | None = None              # mask-fill threads per worker; default: its CPUs, at least 1
    compile_threads: int = _S.compile_threads
    compile_timeout_s: float = _S.compile_timeout_s
    cache_entries: int = _S.cache_entries
    max_streams: int = _S.max_streams
    max_message_bytes: int = _S.max_message_bytes
    max_grammar_bytes: int = _S.max_grammar_bytes
    port: int = 0                           # gRPC port per worker; 0 a free one
    metrics_port: int | None = None         # per worker: None off, 0 a free port
    tls_cert: str | None = None             # PEM paths on the worker nodes
    tls_key: str | None = None
    row_dict_size: int = _S.row_dict_size
    auth_token_env: str | None = "MASKD_AUTH_TOKEN"  # read on the worker's node, never shipped through Ray
    # placement
    worker_cpus: float = 1.0
    worker_resources: dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. {"maskd_cpu": 0.01}
    worker_host: str | None = None          # bind and advertise address; default the node's IP
    max_restarts: int = -1                  # -1: restart forever
    drain_grace_s: float = 10.0
    # directory and shared cache
    directory_port: int = 0
    directory_host: str | None = None       # advertised host; default the node's IP
    vnodes: int = DEFAULT_VNODES
    poll_s: float = 0.5
    shared_cache_entries: int = 4096
    shared_cache_bytes: int = 1 << 30
    detached: bool = True                   # outlive this process (the CLI); tests use False
    ready_timeout_s: float = 120.0

    def server_config(self) -> dict:
        """What each worker passes to ServerConfig (auth_token_env: read on the worker's node)."""
        return {**{name: getattr(self, name) for name in _SERVED},
                "threads": self.threads or max(1, math.ceil(self.worker_cpus)),
                "auth_token_env": self.auth_token_env}


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


def up(cfg: ClusterConfig) -> str:
    """Starts (or completes, or scales) the cluster; returns the directory's HOST:PORT once
    `cfg.workers` workers are live."""
    ray = _ray()
    from maskd_cluster.directory import Directory
    from maskd_cluster.store import GrammarStore
    from maskd_cluster.worker import Worker

    ns = cfg.namespace
    common = dict(namespace=ns, get_if_exists=True, lifetime=_lifetime(cfg), max_restarts=-1)
    store = ray.remote(GrammarStore).options(name=STORE_NAME, num_cpus=0, max_concurrency=1000, **common).remote(
        max_entries=cfg.shared_cache_entries, max_bytes=cfg.shared_cache_bytes, claim_s=cfg.compile_timeout_s)
    ray.get(store.ready.remote(), timeout=cfg.ready_timeout_s)
    directory = ray.remote(Directory).options(name=DIRECTORY_NAME, num_cpus=0, max_concurrency=16, **common).remote(
        ns, host=cfg.directory_host, port=cfg.directory_port, vnodes=cfg.vnodes, poll_s=cfg.poll_s)
    # Keep the handle that created an actor: one from get_if_exists does not keep it alive.
    held = _HELD.setdefault(ns, {}) if not cfg.detached else {}
    held.setdefault(STORE_NAME, store)
    held.setdefault(DIRECTORY_NAME, directory)
    address = ray.get(directory.address.remote(), timeout=cfg.ready_timeout_s)

    existing = set(worker_names(ns))
    server_config = cfg.server_config()
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
            ).remote(wid, server_config, ns, host=cfg.worker_host, drain_grace_s=cfg.drain_grace_s)
            held[name] = handle
        started[wid] = handle
        ray.get(directory.add_worker.remote(wid, handle))
    for name in existing:  # scale down: workers past the requested count drain and go
        index = name[len(WORKER_PREFIX):]
        if index.isdigit() and int(index) >= cfg.workers:
            stop_worker(worker_id(int(index)), ns, grace_s=cfg.drain_grace_s)
    # A worker whose constructor fails (bad tokenizer, import error) is reported now, not at the timeout.
    from ray.exceptions import GetTimeoutError, RayActorError
    for wid, handle in started.items():
        try:
            ray.get(handle.address.remote(), timeout=cfg.ready_timeout_s)
        except RayActorError as exc:
            raise RuntimeError(f"maskd worker {wid} failed to start: {exc}") from exc
        except GetTimeoutError:
            break
    if not ray.get(directory.wait_live.remote(cfg.workers, cfg.ready_timeout_s),
                   timeout=cfg.ready_timeout_s + 10):
        raise TimeoutError(f"{cfg.workers} maskd workers not live after {cfg.ready_timeout_s:g} s "
                           f"(each asks for {cfg.worker_cpus:g} CPU{' and ' + str(cfg.worker_resources) if cfg.worker_resources else ''}; "
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
