"""``maskd bench profile``: py-spy over a maskd server answering batch-256 steps.

A ``maskd serve`` child process serves one session stream driven from this process by the
serve mode's simulated worker (B sequences replaying MaskBench valid instances, refilled as
they finish): back-to-back synchronous steps by default (the server is never idle), or
``--pipelined`` with a slept forward pass. After a warm-up, ``py-spy record --format raw``
samples the server for ``--duration`` seconds; the report lists the top entries by own time
(the innermost Python frame of each sample: native code such as llguidance's fill shows up as
the Python line that called it), by function and by line, and the inclusive share of the
step path's main functions. The raw samples are kept (``profile.raw.txt``) for flame graphs.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import threading
import time

from maskd_tools.bench import common

QUICK_LIMIT = 48
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")

# Functions whose inclusive share tells where a step's time goes (py-spy's qualified names).
_ENGINE = "maskd/server/engines/llguidance_engine.py"
KEY_FUNCTIONS = ("MaskServicer.Session (maskd/server/service.py)", "Session.step (maskd/server/session.py)",
                 "Session._route (maskd/server/session.py)", "Session._advance (maskd/server/session.py)",
                 "Session._fill (maskd/server/session.py)", f"LLGuidanceEngine.fill_batch ({_ENGINE})",
                 f"LLGuidanceEngine.consume_batch ({_ENGINE})", f"LLGuidanceEngine.new_matcher ({_ENGINE})",
                 "Session._open_entry (maskd/server/session.py)", "Session._admit (maskd/server/session.py)",
                 "RowBlockEncoder.encode (maskd/rowcodec.py)", "MaskServicer._reply (maskd/server/service.py)",
                 "Metrics.observe_step (maskd/server/metrics.py)", "_send_response (grpc/_server.py)")
# The gRPC thread that serves a Session stream, and its frames while it waits for the next message.
STREAM_FRAME = "_stream_response_in_pool"
WAIT_FRAME = "_RequestIterator"


def py_spy_path() -> str | None:
    exe = shutil.which("py-spy")
    if exe:
        return exe
    cand = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return cand if os.path.exists(cand) else None


def parse_raw(text: str) -> tuple[list[tuple[list[str], int]], int]:
    """py-spy raw (collapsed stacks: 'f1;f2;...;leaf count') -> ([(frames, count)], total)."""
    stacks, total = [], 0
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        frames = [f for f in stack.split(";") if f]
        if frames:
            stacks.append((frames, n))
            total += n
    return stacks, total


def _short(frame: str, with_line: bool) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    file = m.group("file")
    for marker in ("site-packages/", "/work/main/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    if "maskd/" in file and not file.startswith("maskd/"):
        file = file[file.index("maskd/"):]
    if file.startswith("client/"):
        file = "maskd_client/" + file[len("client/"):]
    if with_line and m.group("line"):
        return f"{m.group('func')} ({file}:{m.group('line')})"
    return f"{m.group('func')} ({file})"


def top_entries(stacks, total: int, top: int) -> dict:
    own_fn, own_line, incl = collections.Counter(), collections.Counter(), collections.Counter()
    for frames, n in stacks:
        leaf = frames[-1]
        own_fn[_short(leaf, False)] += n
        own_line[_short(leaf, True)] += n
        for f in {_short(f, False) for f in frames}:
            incl[f] += n

    def rows(counter, k):
        return [{"entry": e, "samples": c, "share": round(c / max(1, total), 4)} for e, c in counter.most_common(k)]

    return {"samples": total, "own_by_function": rows(own_fn, top), "own_by_line": rows(own_line, top),
            "inclusive_by_function": rows(incl, top),
            "key_functions": {k: round(incl.get(k, 0) / max(1, total), 4) for k in KEY_FUNCTIONS}}


def step_path(stacks) -> tuple[list, int, int]:
    """Samples of the stream-serving thread: (busy stacks, busy samples, samples waiting for a request).

    Recorded with ``--idle``, so time a step spends in native code with the GIL released (the
    parallel fill, which waits on llguidance's threads) counts like Python time: the shares are
    of the step path's wall time, excluding the time it waits for the client's next message.
    """
    busy, n_busy, n_wait = [], 0, 0
    for frames, n in stacks:
        if not any(STREAM_FRAME in f for f in frames):
            continue
        if any(WAIT_FRAME in f for f in frames):
            n_wait += n
            continue
        busy.append((frames, n))
        n_busy += n
    return busy, n_busy, n_wait


def run(args, log=print) -> dict:

    from maskd.server.tokenizers import load_tokenizer
    from maskd_tools.bench.serve import _Batch, _client

    spy = py_spy_path()
    if spy is None:
        raise SystemExit("maskd bench profile needs py-spy (pip install py-spy; it is in the dev extra)")
    limit = args.limit if args.limit is not None else (QUICK_LIMIT if args.quick else None)
    duration = args.duration if args.duration is not None else (8.0 if args.quick else 20.0)
    out = common.Output(args.out, "profile", args.json_out)
    tok = load_tokenizer(args.tokenizer)
    schemas = [s for s in common.load_schemas(args.data, tok, limit) if s.instances]
    materializer = common.Materializer(args.batch, (tok.logits_width + 31) // 32)
    srv = common.subprocess_server(args.tokenizer, args.threads, log_path=out.path("server.log"))
    steps = {"server": [], "round_trip": [], "service": []}
    stop = threading.Event()
    errors: list[BaseException] = []
    try:
        with _client(srv.address) as mc:
            errors_c = common.register_all(mc, schemas)
        pool = common.instance_pool(schemas, errors_c, args.seed, "profile")
        recording = threading.Event()

        def drive():
            try:
                with _client(srv.address) as mc:
                    b = _Batch(mc, pool, args.batch, tok.eos_token_ids[0], "prof", 0)
                    while not stop.is_set():
                        req, _ = b.request()
                        t0 = time.perf_counter()
                        if args.pipelined:   # send, forward pass, then the reply
                            fut = mc.step_async(req)
                            time.sleep(args.forward_ms / 1e3)
                            res = fut.result()
                        else:
                            res = mc.step(req)
                        rows = materializer(res.bitmask)
                        if recording.is_set():
                            steps["service"].append(time.perf_counter() - t0)
                            steps["server"].append(res.server_seconds)
                            steps["round_trip"].append(res.round_trip_seconds)
                        b.sample(res, rows)
            except BaseException as exc:
                errors.append(exc)

        driver = threading.Thread(target=drive, daemon=True, name="bench-profile-driver")
        driver.start()
        time.sleep(3.0 if args.quick else 5.0)  # warm-up: the batch fills, first refills happen
        raw_path = out.path("profile.raw.txt")
        cmd = [spy, "record", "--pid", str(srv.pid), "--duration", str(round(duration)), "--rate",
               str(args.rate), "--format", "raw", "--output", str(raw_path), "--nonblocking", "--idle"]
        if args.gil:
            cmd.append("--gil")
        log(f"profile: {len(pool)} instances, batch {args.batch}, server pid {srv.pid}: {' '.join(cmd)}")
        recording.set()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 120)
        recording.clear()
        stop.set()
        driver.join(60)
        if proc.returncode != 0 or not raw_path.exists():
            raise SystemExit(f"py-spy failed ({proc.returncode}): {proc.stderr[-2000:]}")
    finally:
        stop.set()
        srv.close()
    if errors:
        raise errors[0]
    stacks, total = parse_raw(raw_path.read_text())
    busy, n_busy, n_wait = step_path(stacks)
    tops = top_entries(busy, n_busy, args.top)
    tops["samples_all_threads"] = total
    tops["samples_waiting_for_request"] = n_wait
    report = {
        "mode": "profile",
        "args": common.args_dict(args, limit=limit, duration=duration),
        "machine": common.machine_info(),
        "data": str(args.data),
        "tokenizer": tok.spec,
        "batch": args.batch,
        "threads": args.threads,
        "driver": "pipelined" if args.pipelined else "back-to-back synchronous steps",
        "py_spy": " ".join(cmd),
        "steps_recorded": len(steps["service"]),
        "service_ms": common.summarize(steps["service"]),
        "server_seconds_ms": common.summarize(steps["server"]),
        "round_trip_ms": common.summarize(steps["round_trip"]),
        **tops,
    }
    out.write(report, _markdown(report))
    log(f"  {n_busy} step-path samples, {len(steps['service'])} steps; top own time: "
        + "; ".join(f"{e['entry']} {e['share']:.1%}" for e in tops["own_by_function"][:5]))
    return report


def _markdown(r: dict) -> str:
    lines = ["# maskd bench profile\n",
             f"py-spy (`--idle`, raw) over a `maskd serve` child ({r['threads']} fill threads, tokenizer "
             f"`{r['tokenizer']}`) answering batch-{r['batch']} steps ({r['driver']}) for {r['args']['duration']:g} s: "
             f"{r['steps_recorded']} steps, step service p50 {r['service_ms'].get('p50')} ms, server_seconds p50 "
             f"{r['server_seconds_ms'].get('p50')} ms.\n",
             f"Shares are of the step path's wall time: the {r['samples']:,} samples of the thread serving the "
             f"session stream while it was not waiting for the next request "
             f"({r['samples_waiting_for_request']:,} samples waiting were left out). Own time is the innermost "
             "Python frame: native work with the GIL released (llguidance's parallel fill) appears as the "
             "Python line that called it.\n",
             f"Machine: {common.machine_line(r['machine'])}.\n",
             f"Command: `{r['py_spy']}`\n",
             "## Own time by function\n",
             common.md_table(["share", "samples", "function"],
                             [[f"{e['share']:.1%}", e["samples"], f"`{e['entry']}`"] for e in r["own_by_function"]]),
             "## Own time by line\n",
             common.md_table(["share", "samples", "line"],
                             [[f"{e['share']:.1%}", e["samples"], f"`{e['entry']}`"] for e in r["own_by_line"]]),
             "## Inclusive share of the step path's functions\n",
             common.md_table(["function", "inclusive share"],
                             [[f"`{k}`", f"{v:.1%}"] for k, v in r["key_functions"].items()])]
    return "\n".join(lines)
