"""``maskd soak`` and ``maskd chaos``: long runs of a checked decode loop.

soak
    N minutes of open/step/close through a ``maskd serve`` child (or ``--target``), every row
    compared bit for bit with in-process llguidance and every instance token checked; the server's
    resident memory sampled every few seconds. Flat memory: the least-squares slope over the run
    and the mean of the last third against the second.
chaos
    The same loop while the server is killed (SIGKILL) and restarted on its port every
    ``--kill-every`` seconds (``--mode server``), or while a cluster worker actor is killed every
    ``--kill-every`` seconds on a local Ray (``--mode cluster``). The client restores what each
    loss took; the run passes when no sequence failed and every row still equals in-process
    llguidance's (so every output equals the undisturbed run's).

Both write ``<mode>.json`` and ``<mode>.md`` into ``--out`` and exit non-zero when a check failed.
The servers they start run strict JSON-schema mode: the mirror is llguidance's own grammar, which
complete mode's rows no longer equal where they check a number's bounds (decision 0025).
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from maskd_tools.bench import common


def add_parser(sub) -> None:
    for mode, text in (("soak", "minutes of checked open/step/close, server memory sampled"),
                       ("chaos", "the checked loop while servers or cluster workers are killed")):
        p = sub.add_parser(mode, help=text, description=text)
        p.add_argument("--minutes", type=float, default=30.0 if mode == "soak" else 10.0, help="how long to run")
        p.add_argument("--data", default=str(common.default_data_dir()), help="folder of MaskBench files")
        p.add_argument("--tokenizer", default="deepseek-v4", help="tokenizer spec (as for maskd serve)")
        p.add_argument("--limit", type=int, default=200, help="MaskBench files to use, evenly spaced")
        p.add_argument("--batch", type=int, default=32, help="sequences per step")
        p.add_argument("--threads", type=int, default=1, help="the server's mask-fill threads")
        p.add_argument("--seed", type=int, default=0, help="shuffles the instances")
        p.add_argument("--out", default=os.path.join("out", mode), help="folder for the JSON and markdown report")
        if mode == "soak":
            p.add_argument("--target", default=None, help="HOST:PORT of a running server (default: start one)")
            p.add_argument("--sample-every", type=float, default=10.0, help="seconds between memory readings")
            p.set_defaults(func=cmd_soak)
        else:
            p.add_argument("--mode", choices=("server", "cluster"), default="server",
                           help="kill the server process, or a worker actor of a local Ray cluster")
            p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
            p.add_argument("--workers", type=int, default=2, help="cluster mode: worker actors")
            p.set_defaults(func=cmd_chaos)


# -- servers ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the servers' JSON-schema mode: the one whose rows in-process llguidance computes too
STRICT = "strict"


def serve(tokenizer: str, threads: int, port: int, log_path: pathlib.Path) -> subprocess.Popen:
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "maskd.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), "--tokenizer", tokenizer, "--threads", str(threads),
                                 "--json-schema-mode", STRICT],
                                stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if "maskd serving on" not in line:
        proc.kill()
        raise SystemExit(f"maskd serve did not start (see {log_path})")
    return proc


def _replay(args, client, log):
    from maskd.server.tokenizers import load_tokenizer
    from maskd_tools.replay import Replay, load_instances

    tok = load_tokenizer(args.tokenizer)
    try:
        pool = load_instances(args.data, tok, args.limit, args.seed)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"maskd: {exc}") from None
    if not pool:
        raise SystemExit(f"no valid MaskBench instance in {args.data}")
    log(f"{len(pool)} instances, batch {args.batch}")
    return Replay(client, tok, pool, args.batch)


def _report(args, mode: str, report: dict, lines: list[str]) -> int:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["machine"] = common.machine_info()
    report["command"] = common.command_line()
    (out / f"{mode}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / f"{mode}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if report["passed"] else 1


def _checks(counts) -> dict:
    return {"steps": counts.steps, "rows_checked": counts.rows_checked, "rows_differing": counts.rows_differing,
            "token_violations": counts.token_violations, "failed_sequences": counts.failed,
            "completed_sequences": counts.completed, "waiting_answers": counts.waiting,
            "failure_reasons": counts.reasons}


# -- soak --------------------------------------------------------------------------------------------
def cmd_soak(args) -> int:
    import psutil

    from maskd_client import MaskClient

    log = lambda msg: print(msg, flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = None
    target = args.target
    if target is None:
        port = free_port()
        proc = serve(args.tokenizer, args.threads, port, out / "server.log")
        target = f"127.0.0.1:{port}"
    readings: list[tuple[float, float]] = []
    try:
        with MaskClient(target, timeout_s=300) as mc:
            replay = _replay(args, mc, log)
            t0 = time.monotonic()
            next_sample = t0
            end = t0 + args.minutes * 60
            while time.monotonic() < end:
                replay.step()
                if proc is not None and time.monotonic() >= next_sample:
                    rss = psutil.Process(proc.pid).memory_info().rss / 2**20
                    readings.append((time.monotonic() - t0, rss))
                    next_sample += args.sample_every
                    if len(readings) % 30 == 1:
                        c = replay.counts
                        log(f"  {readings[-1][0] / 60:5.1f} min: {c.steps} steps, {c.rows_checked} rows checked, "
                            f"{c.rows_differing} differing, {c.failed} failed, RSS {rss:.1f} MiB")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    c = replay.counts
    memory = _memory(readings)
    passed = c.rows_differing == 0 and c.failed == 0 and c.steps > 0 and memory.get("flat", True)
    report = {"mode": "soak", "minutes": args.minutes, "batch": args.batch, "tokenizer": args.tokenizer,
              "data": args.data, **_checks(c), "memory": memory, "passed": passed}
    lines = [f"# maskd soak: {args.minutes:g} minutes, batch {args.batch}, {args.tokenizer}", "",
             f"- steps {c.steps:,}; rows checked against in-process llguidance {c.rows_checked:,}; "
             f"rows differing **{c.rows_differing}**; failed sequences **{c.failed}**; completed {c.completed:,}; "
             f"instance tokens a row rejected {c.token_violations} (llguidance's own false rejects)",
             f"- server RSS: {memory.get('first_mib')} MiB at the start, {memory.get('last_mib')} MiB at the end, "
             f"max {memory.get('max_mib')}; slope {memory.get('slope_mib_per_hour')} MiB/hour; last third "
             f"{memory.get('last_third_mib')} vs second third {memory.get('second_third_mib')} MiB: "
             f"**{_verdict(memory)}**",
             f"- {'PASSED' if passed else 'FAILED'}"]
    return _report(args, "soak", report, lines)


def _verdict(memory: dict) -> str:
    if "flat" not in memory:
        return f"{memory.get('readings', 0)} readings: too few to tell"
    return "flat" if memory["flat"] else "GROWING"


def _memory(readings: list[tuple[float, float]]) -> dict:
    if len(readings) < 6:
        return {"readings": len(readings)}
    t = np.array([r[0] for r in readings])
    m = np.array([r[1] for r in readings])
    third = len(m) // 3
    second, last = float(m[third:2 * third].mean()), float(m[2 * third:].mean())
    slope = float(np.polyfit(t / 3600, m, 1)[0])
    return {"readings": len(readings), "first_mib": round(float(m[0]), 1), "last_mib": round(float(m[-1]), 1),
            "max_mib": round(float(m.max()), 1), "second_third_mib": round(second, 1),
            "last_third_mib": round(last, 1), "slope_mib_per_hour": round(slope, 1),
            # flat: the last third within 5 % (or 20 MiB) of the second
            "flat": last - second <= max(20.0, 0.05 * second),
            "series_mib": [[round(a, 1), round(b, 1)] for a, b in readings]}


# -- chaos -------------------------------------------------------------------------------------------
def cmd_chaos(args) -> int:
    return _chaos_cluster(args) if args.mode == "cluster" else _chaos_server(args)


def _chaos_server(args) -> int:

    log = lambda msg: print(msg, flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [serve(args.tokenizer, args.threads, port, out / "server.log")]
    kills: list[float] = []
    stop = threading.Event()

    def killer() -> None:
        while not stop.wait(args.kill_every):
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(30)
            kills.append(time.monotonic())
            procs.append(serve(args.tokenizer, args.threads, port, out / "server.log"))

    try:
        counts, recoveries = _replay_under_fire(args, f"127.0.0.1:{port}", killer, stop, log)
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(30)
    return _chaos_report(args, counts, len(kills), recoveries, "server processes (SIGKILL, restarted "
                         "on the same port)")


def _chaos_cluster(args) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # one machine: loopback only
    import ray

    from maskd.server import ServerConfig
    from maskd_cluster import launcher

    log = lambda msg: print(msg, flush=True)
    ray.init(address="local", num_cpus=max(2, args.workers), include_dashboard=False, log_to_driver=False,
             namespace="maskd-chaos", logging_level="WARNING")
    kills: list[str] = []
    stop = threading.Event()
    try:
        cfg = launcher.ClusterConfig(workers=args.workers, namespace="maskd-chaos", worker_cpus=0.5,
                                     detached=False, poll_s=0.25, ready_timeout_s=300,
                                     server=ServerConfig(port=0, tokenizer=args.tokenizer, threads=args.threads,
                                                         compile_threads=1, json_schema_mode=STRICT))
        directory = launcher.up(cfg)

        def killer() -> None:
            k = 0
            while not stop.wait(args.kill_every):
                wid = f"worker-{k % args.workers}"
                ray.kill(launcher.get_worker(wid, "maskd-chaos"), no_restart=False)   # Ray restarts it
                kills.append(wid)
                k += 1

        counts, recoveries = _replay_under_fire(args, "directory:" + directory, killer, stop, log)
    finally:
        stop.set()
        try:
            launcher.down("maskd-chaos", grace_s=1.0)
        finally:
            ray.shutdown()
    return _chaos_report(args, counts, len(kills), recoveries, "Ray worker actors (ray.kill; Ray restarts "
                         "them)")


def _replay_under_fire(args, target: str, killer, stop: threading.Event, log):
    """Replays MaskBench against ``target`` for ``args.minutes`` while ``killer`` (a thread) kills
    what serves it; returns (counts, the client's recoveries)."""
    from maskd_client import MaskClient

    with MaskClient(target, timeout_s=300, retries=12, recovery_timeout_s=120) as mc:
        replay = _replay(args, mc, log)
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        end = time.monotonic() + args.minutes * 60
        while time.monotonic() < end:
            replay.step()
        stop.set()
        thread.join(60)
        return replay.counts, mc.recoveries


def _chaos_report(args, c, kills: int, recoveries: int, what: str) -> int:
    passed = c.failed == 0 and c.rows_differing == 0 and kills > 0 and c.steps > 0
    report = {"mode": "chaos", "target": args.mode, "minutes": args.minutes, "kill_every_s": args.kill_every,
              "kills": kills, "client_recoveries": recoveries, "batch": args.batch, "tokenizer": args.tokenizer,
              **_checks(c), "passed": passed}
    lines = [f"# maskd chaos ({args.mode}): {args.minutes:g} minutes, a kill every {args.kill_every:g} s, "
             f"batch {args.batch}, {args.tokenizer}", "",
             f"- killed {kills} {what}; client recoveries {recoveries}",
             f"- steps {c.steps:,}; rows checked against in-process llguidance {c.rows_checked:,}; rows differing "
             f"**{c.rows_differing}**; failed sequences **{c.failed}**; completed {c.completed:,}",
             "- every row equal to the engine's in this process means every output equals the undisturbed run's",
             f"- {'PASSED' if passed else 'FAILED'}"]
    return _report(args, "chaos", report, lines)
