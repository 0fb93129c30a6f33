"""``maskd cluster up | status | down``.

``up`` starts or joins a Ray cluster (a local head by default, ``--address`` for an existing one),
starts the directory, the shared grammar cache and N worker actors (detached, named in a Ray
namespace) and prints the directory's HOST:PORT on its last line. ``status`` and ``down`` find them
again through the state file ``up`` writes (``$MASKD_STATE_DIR`` or ``~/.maskd``), ``--address`` or
``--directory``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

from maskd.server.config import add_flags, from_flags
from maskd_cluster import NAMESPACE

LOOPBACK = "127.0.0.1"
RAY_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_HELP_ADDRESS = "Ray cluster to join (e.g. auto, HOST:6379, ray://HOST:10001); default: a local one"


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="maskd workers on Ray: up, status, down")
    csub = p.add_subparsers(dest="cluster_command", required=True)

    from maskd_cluster.launcher import ClusterConfig

    up = csub.add_parser("up", help="start (or scale) a maskd cluster; prints the directory HOST:PORT last",
                         description="Starts the directory, the shared grammar cache and the worker actors "
                                     "(server flags as for `maskd serve`, applied to every worker).")
    up.add_argument("--address", default=None, help=_HELP_ADDRESS)
    up.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray head this command starts")
    up.add_argument("--worker-resource", action="append", default=[], metavar="NAME[=AMOUNT]",
                    help="custom Ray resource that pins workers to a CPU node pool (repeatable)")
    up.add_argument("--foreground", action="store_true",
                    help="stay running once the cluster is up (a container's main process): exit 0 on "
                         "SIGTERM, exit 1 when the Ray cluster or the directory stops answering")
    add_flags(up, ClusterConfig(), skip=("host",))   # workers bind --worker-host
    up.set_defaults(func=cmd_up)

    st = csub.add_parser("status", help="workers, sequences per worker, compiles and cache sizes")
    st.add_argument("--directory", default=None, help="HOST:PORT of the directory (no Ray needed)")
    st.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                    help="how long the directory may take to answer")
    st.add_argument("--address", default=None, help=_HELP_ADDRESS)
    st.add_argument("--namespace", default=NAMESPACE)
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=cmd_status)

    down = csub.add_parser("down", help="drain and remove the maskd cluster (and a local Ray head `up` started)")
    down.add_argument("--address", default=None, help=_HELP_ADDRESS)
    down.add_argument("--namespace", default=NAMESPACE)
    down.add_argument("--grace", type=float, default=10.0, help="seconds open streams get to finish")
    down.add_argument("--keep-ray", action="store_true", help="leave a local Ray head running")
    down.set_defaults(func=cmd_down)


# -- state between commands -------------------------------------------------------------------------
def _state_path(namespace: str) -> pathlib.Path:
    root = pathlib.Path(os.environ.get("MASKD_STATE_DIR") or pathlib.Path.home() / ".maskd")
    return root / f"cluster-{namespace}.json"


def _load_state(namespace: str) -> dict:
    try:
        return json.loads(_state_path(namespace).read_text())
    except (OSError, ValueError):
        return {}


def _reachable(address: str | None, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to HOST:PORT opens (a Ray GCS that is gone hangs ray.init)."""
    import socket

    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _live_state(namespace: str) -> dict:
    """The state `up` wrote, or {} (and the file removed) when its Ray cluster is gone."""
    state = _load_state(namespace)
    if state and not _reachable(state.get("ray_address")):
        print(f"maskd cluster: the Ray cluster at {state.get('ray_address')} recorded in "
              f"{_state_path(namespace)} is gone; forgetting it", file=sys.stderr)
        try:
            _state_path(namespace).unlink()
        except OSError:
            pass
        return {}
    return state


def _save_state(namespace: str, state: dict) -> None:
    path = _state_path(namespace)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=2))


def _connect(address: str | None, namespace: str, *, start_local: bool = False,
             num_cpus: float | None = None) -> bool:
    """Connects this process to Ray; returns True when it started a local head. A cluster on this
    machine alone (no --address) lives on loopback: Ray, the directory and the workers bind and
    advertise 127.0.0.1."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(namespace=namespace, logging_level="WARNING", log_to_driver=False)
    if address:
        ray.init(address=address, **kwargs)
        return False
    try:
        ray.init(address="auto", **kwargs)   # a local head that is already running
        return False
    except ConnectionError:
        if not start_local:
            raise
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--disable-usage-stats",
           "--dashboard-host", LOOPBACK]
    if num_cpus is not None:
        cmd += ["--num-cpus", str(max(1, round(num_cpus)))]   # `ray start` takes a whole number
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"maskd cluster: cannot start a local Ray head:\n{done.stdout}{done.stderr}")
    ray.init(address="auto", **kwargs)
    return True


def _local_ray_env(address: str | None) -> None:
    """A Ray cluster on this machine alone binds and advertises loopback only. Ray's switch for that
    is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (single-node mode: the node IP is 127.0.0.1); it is read
    once, when Ray is imported, so this runs first. An explicit --address keeps Ray's own choice."""
    if not address:
        os.environ.setdefault(RAY_SINGLE_NODE_ENV, "0")


def _token_auth_env() -> None:
    """A head started with token auth (the default of `ray start` in recent Ray) refuses an
    explicit address unless RAY_AUTH_MODE says token ("auto" finds that out itself). As Ray does
    for "auto": a token on this machine and no mode set means token mode. Ray reads the mode
    once, so this runs before Ray is imported."""
    if not os.environ.get("RAY_AUTH_MODE") and (pathlib.Path.home() / ".ray" / "auth_token").exists():
        os.environ["RAY_AUTH_MODE"] = "token"


def _parse_resources(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, _, amount = item.partition("=")
        if not name:
            sys.exit(f"maskd cluster: bad --worker-resource {item!r}; use NAME or NAME=AMOUNT")
        try:
            out[name] = float(amount) if amount else 0.01
        except ValueError:
            sys.exit(f"maskd cluster: bad amount in --worker-resource {item!r}")
    return out


# -- commands -------------------------------------------------------------------------------------
def cmd_up(args) -> int:
    _local_ray_env(args.address)
    _token_auth_env()
    import ray

    from maskd.server.config import ConfigError
    from maskd_cluster import launcher

    cfg = from_flags(launcher.ClusterConfig, args)
    cfg = dataclasses.replace(cfg, worker_resources=_parse_resources(args.worker_resource), detached=True,
                              log_level=getattr(args, "log_level", None))
    try:
        cfg.check()
    except ConfigError as exc:
        sys.exit(f"maskd cluster up: {exc}")
    state = _live_state(cfg.namespace)
    address = args.address or (state.get("ray_address") if state.get("started_head") else None)
    started = _connect(address, cfg.namespace, start_local=True, num_cpus=args.num_cpus)
    from tqdm import tqdm
    # On stderr and only on a terminal: the directory address stays the last line of stdout.
    with tqdm(total=cfg.workers, desc="workers ready", unit="worker", file=sys.stderr, disable=None,
              leave=False, dynamic_ncols=True) as ready:
        try:
            directory = launcher.up(cfg, on_ready=lambda wid: ready.update(1))
        except (TimeoutError, RuntimeError, ConfigError) as exc:
            sys.exit(f"maskd cluster up: {exc}")
    ray_address = ray.get_runtime_context().gcs_address
    _save_state(cfg.namespace, {"ray_address": ray_address, "directory": directory, "namespace": cfg.namespace,
                                "started_head": started or bool(state.get("started_head"))})
    print(f"maskd cluster: {cfg.workers} workers in Ray namespace {cfg.namespace!r} on Ray at {ray_address}")
    print(directory, flush=True)
    if args.foreground:
        return _stay(ray_address, directory)
    return 0


def _stay(ray_address: str, directory: str, every_s: float = 5.0) -> int:
    """Keeps `cluster up` running as a container's main process: the actors are detached, so a
    SIGTERM ends only this process (exit 0); a Ray cluster or directory that stops answering ends
    it with 1, so that the container restarts and brings the cluster up again."""
    import signal
    import threading

    from maskd_client.health import SERVING, check
    from maskd_client.types import MaskClientError

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    misses = 0
    while not stop.wait(every_s):
        if not _reachable(ray_address):
            print(f"maskd cluster: the Ray cluster at {ray_address} is gone", file=sys.stderr)
            return 1
        try:
            healthy = check(directory, connect_timeout_s=every_s) == SERVING
        except MaskClientError:
            healthy = False
        misses = 0 if healthy else misses + 1
        if misses >= 3:
            print(f"maskd cluster: the directory at {directory} has not answered for {3 * every_s:g} s",
                  file=sys.stderr)
            return 1
    return 0


def cmd_status(args) -> int:
    state = _live_state(args.namespace)
    directory = args.directory or (None if args.address else state.get("directory"))
    report = None
    if args.directory:   # asked for this directory: say why it does not answer, never fall back to Ray
        from maskd_client.health import check
        from maskd_client.types import MaskClientError
        try:
            check(args.directory, connect_timeout_s=args.timeout)
        except MaskClientError as exc:
            sys.exit(f"maskd cluster status: no maskd directory at {args.directory}: {exc}")
    if directory:
        report = _status_over_grpc(directory, args.timeout)
        if report is None and args.directory:
            sys.exit(f"maskd cluster status: {args.directory} answers, but not as a maskd directory")
    if report is None:
        _local_ray_env(args.address)
        _token_auth_env()
        from maskd_cluster import launcher
        try:
            _connect(args.address or state.get("ray_address"), args.namespace)
            report = launcher.status(args.namespace)
        except (ConnectionError, ValueError) as exc:
            sys.exit(f"maskd cluster status: no maskd cluster found in namespace {args.namespace!r}: {exc}")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_status(report))
    return 0


def _status_over_grpc(directory: str, timeout_s: float = 15.0) -> dict | None:
    from maskd_client.routing import DirectoryClient, DirectoryError
    try:
        with DirectoryClient(directory, timeout_s=max(timeout_s, 5.0)) as dc:
            reply = dc.list_workers(stats=True)
    except DirectoryError:
        return None
    workers = []
    for w in reply.workers:
        s = w.stats
        workers.append({"worker_id": w.worker_id, "address": w.address, "live": w.live,
                        "incarnation": w.incarnation, "restarts": w.restarts, "node_id": w.node_id,
                        "sequences": s.sequences, "streams": s.streams, "cache_entries": s.cache_entries,
                        "compiles": s.compiles, "shared_hits": s.shared_hits, "shared_misses": s.shared_misses})
    c = reply.cache
    return {"directory": directory, "epoch": reply.epoch, "ring_vnodes": reply.ring_vnodes, "workers": workers,
            "cache": {"entries": c.entries, "bytes": c.bytes, "hits": c.hits, "misses": c.misses,
                      "publishes": c.publishes, "waits": c.waits}}


def format_status(report: dict) -> str:
    workers = report.get("workers", [])
    live = sum(1 for w in workers if w.get("live"))
    lines = [f"directory {report.get('directory')}  workers {live} live / {len(workers)}  "
             f"ring epoch {report.get('epoch')} ({report.get('ring_vnodes')} vnodes per worker)"]
    header = ("WORKER", "LIVE", "ADDRESS", "SEQS", "STREAMS", "GRAMMARS", "COMPILES", "SHARED HIT/MISS", "RESTARTS")
    rows = [header]
    for w in workers:
        rows.append((w["worker_id"], "yes" if w.get("live") else "no", w.get("address") or "-",
                     str(w.get("sequences", 0)), str(w.get("streams", 0)), str(w.get("cache_entries", 0)),
                     str(w.get("compiles", 0)), f"{w.get('shared_hits', 0)}/{w.get('shared_misses', 0)}",
                     str(w.get("restarts", 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    c = report.get("cache") or {}
    lines.append(f"shared grammar cache: {c.get('entries', 0)} grammars, {c.get('bytes', 0)} bytes, "
                 f"hits {c.get('hits', 0)}, misses {c.get('misses', 0)}, waits {c.get('waits', 0)}, "
                 f"publishes {c.get('publishes', 0)}; compiles cluster-wide "
                 f"{sum(w.get('compiles', 0) for w in workers)}")
    return "\n".join(lines)


def cmd_down(args) -> int:
    _local_ray_env(args.address)
    _token_auth_env()
    import ray

    from maskd_cluster import launcher

    state = _live_state(args.namespace)
    try:
        _connect(args.address or state.get("ray_address"), args.namespace)
    except ConnectionError as exc:
        sys.exit(f"maskd cluster down: no Ray cluster to connect to: {exc}")
    stopped = launcher.down(args.namespace, grace_s=args.grace)
    print(f"maskd cluster: drained and removed {len(stopped)} workers, the directory and the grammar cache "
          f"(namespace {args.namespace!r})")
    if state.get("started_head") and not args.keep_ray and not args.address:
        ray.shutdown()
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop"], capture_output=True)
        print("maskd cluster: stopped the local Ray head `maskd cluster up` started")
    try:
        _state_path(args.namespace).unlink()
    except OSError:
        pass
    return 0
