"""``maskd bench burst``: does a burst of compiles reach the step path?

A simulated GPU worker decodes B sequences through a ``maskd serve`` child process (``--pin 1+1``:
the server, its compile workers included, on one core, the worker on another), one step per
forward pass of ``--forward-ms`` (slept: the GIL is free, as while a GPU runs), exactly as
``maskd bench serve``'s pipelined phase. After ``--steps-before`` steps, another process (another
session, on the worker's core) registers ``--fresh`` MaskBench schemas the server has never seen,
``--concurrency`` at a time, each waiting for its compile; the worker decodes on until the burst is
over and ``--steps-after`` more. Each step's wait for its rows (zero when the reply came during
the forward pass) is filed by when it began: before, during or after the burst.

Beside it, the same loop in process, the way an engine that compiles in its own process does:
llguidance matchers in this process replay the same instances (consume + fill of the batch is the
step's own time, on the worker's core), while threads of this process compile the same fresh
schemas, ``--concurrency`` at a time.

``--profile``: py-spy samples the server (every thread, ``--idle``) for the burst's first
seconds; the report lists where its threads spent them, by function, own and inclusive.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import subprocess
import time

import numpy as np

from maskd_tools.bench import common


def check_args(args) -> None:
    for flag in ("batch", "fresh", "concurrency", "steps_before", "steps_after", "decode_schemas"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"maskd bench burst: --{flag.replace('_', '-')} must be at least 1")
    if args.forward_ms <= 0:
        raise SystemExit("maskd bench burst: --forward-ms must be positive")


def _register_burst(address: str, specs: list, concurrency: int, cpus, go, done_queue) -> None:
    """In a child process: registers every spec (waiting for each compile), ``concurrency`` at a time,
    once ``go`` is set; puts (start, end, [seconds per register], [errors]) on the queue."""
    if cpus:
        common.pin_process(os.getpid(), cpus)
    from maskd_client import MaskClient, MaskClientError

    with MaskClient(address, want_forced_tokens=False, timeout_s=600) as mc:
        mc.info()
        done_queue.put("ready")
        go.wait()
        took, errors = [], []

        def one(spec) -> None:
            t0 = time.monotonic()
            try:
                mc.register(spec, wait=True)
            except MaskClientError as exc:
                errors.append(str(exc)[:200])
            took.append(time.monotonic() - t0)

        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(one, specs))
        done_queue.put((start, time.monotonic(), took, errors))


WARMUP_STEPS = 5


class _Schedule:
    """A loop's burst: it starts once the warm-up and ``before`` steps are done; the loop ends
    ``after`` steps after the burst ended."""

    def __init__(self, before: int, after: int) -> None:
        self.steps, self.before, self.after = 0, before, after
        self.started = False
        self._left: int | None = None

    @property
    def measuring(self) -> bool:
        return self.steps >= WARMUP_STEPS

    def step_done(self) -> bool:
        """Counts a step; True the first time the burst is due."""
        self.steps += 1
        if not self.started and self.steps >= WARMUP_STEPS + self.before:
            self.started = True
            return True
        return False

    def burst_ended(self) -> None:
        self._left = self.after

    @property
    def over(self) -> bool:
        """Counts down the steps after the burst; True when the loop is done."""
        if self._left is None:
            return False
        self._left -= 1
        return self._left <= 0


class _Phases:
    """Step waits filed by when the step's wait began, relative to the burst."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []   # (monotonic time, seconds)

    def add(self, t: float, seconds: float) -> None:
        self.samples.append((t, seconds))

    def split(self, start: float | None, end: float | None) -> dict:
        before = [s for t, s in self.samples if start is None or t < start]
        during = [s for t, s in self.samples if start is not None and end is not None and start <= t <= end]
        after = [s for t, s in self.samples if end is not None and t > end]
        out = {}
        for name, xs in (("before", before), ("during", during), ("after", after)):
            arr = np.asarray(xs, dtype=np.float64)
            out[name] = {"steps": len(xs), "ms": common.summarize(arr),
                         "waited_share": round(float((arr > 0).mean()), 4) if len(xs) else None}
        return out


def _server_loop(srv, tok, decode_pool, fresh_specs, args, placement, log, profile_out) -> dict:
    from maskd_tools.bench.serve import _Batch, _client

    materializer = common.Materializer(args.batch, (tok.logits_width + 31) // 32)
    ctx = multiprocessing.get_context("spawn")
    go, q = ctx.Event(), ctx.Queue()
    burster = ctx.Process(target=_register_burst, daemon=True,
                          args=(srv.address, fresh_specs, args.concurrency,
                                list(placement.worker_cpus) if placement else None, go, q))
    burster.start()
    waits = _Phases()
    burst: tuple | None = None
    profile: dict | None = None
    spy = None
    try:
        if q.get(timeout=120) != "ready":
            raise RuntimeError("the burst's client did not start")
        forward_s = args.forward_ms / 1e3
        with _client(srv.address) as mc:
            b = _Batch(mc, decode_pool, args.batch, tok.eos_token_ids[0], "burst", 0)
            req, _ = b.request()
            fut = mc.step_async(req, out=materializer.out(args.batch))
            schedule = _Schedule(args.steps_before, args.steps_after)
            while True:
                time.sleep(forward_s)
                done = fut.done()
                t0 = time.monotonic()
                res = fut.result()
                t1 = time.monotonic()
                if schedule.measuring:
                    waits.add(t0, 0.0 if done else t1 - t0)
                rows = materializer(res.bitmask)
                b.sample(res, rows)
                req, _ = b.request()
                fut = mc.step_async(req, out=materializer.out(args.batch))
                if schedule.step_done():
                    if args.profile:
                        spy = _start_py_spy(srv.pid, args.profile, profile_out)
                    go.set()
                if schedule.started and burst is None and not q.empty():
                    burst = q.get()
                    schedule.burst_ended()
                if schedule.over:
                    break
                if schedule.started and burst is None and not burster.is_alive():
                    raise RuntimeError("the burst's client ended without a result")
            fut.result()
            counts = b.counts()
    finally:
        go.set()
        burster.join(30)
        if burster.is_alive():
            burster.kill()
        if spy is not None:
            profile = _finish_py_spy(spy, profile_out)
    assert burst is not None
    start, end, took, errors = burst
    phases = waits.split(start, end)
    log(f"  maskd: wait p99 before {phases['before']['ms'].get('p99')} ms, during "
        f"{phases['during']['ms'].get('p99')} ms (max {phases['during']['ms'].get('p100')}), burst "
        f"{end - start:.2f} s for {len(took)} registers ({len(errors)} refused)")
    return {"wait": phases, "burst_seconds": round(end - start, 3),
            "register_ms": common.summarize(took), "registers": len(took), "register_errors": len(errors),
            "register_error_examples": errors[:3], "profile": profile, **counts}


def _in_process_loop(tok, decode_pool, fresh_texts, args, log) -> dict:
    """B llguidance matchers replaying the same instances in this process (consume + fill of the
    batch per step), while ``--concurrency`` threads of this process compile the fresh schemas."""
    import llguidance

    engine = common.InProcessEngine(tok, 1, args.batch)
    slots = []   # [instance, tokens applied]
    cursor = 0

    def refill(i: int) -> None:
        nonlocal cursor
        inst = decode_pool[cursor % len(decode_pool)]
        cursor += 1
        engine.open(i, inst.schema)
        if i < len(slots):
            slots[i] = [inst, 0]
        else:
            slots.append([inst, 0])

    for i in range(args.batch):
        refill(i)
    step_times = _Phases()
    start = end = None
    compiled = [0]

    def compile_one(text: str) -> None:
        try:
            llguidance.LLMatcher(engine.ll, common.llguidance_grammar(text), log_level=0).is_error()
        except Exception:   # a schema llguidance refuses: its compile's time counted all the same
            pass
        compiled[0] += 1

    ex = concurrent.futures.ThreadPoolExecutor(args.concurrency)
    futures: list = []
    schedule = _Schedule(args.steps_before, args.steps_after)
    try:
        while True:
            t0 = time.monotonic()
            engine.consume((i, s[0].tokens[s[1]]) for i, s in enumerate(slots) if s[1] < len(s[0].tokens))
            engine.fill()
            t1 = time.monotonic()
            if schedule.measuring:
                step_times.add(t0, t1 - t0)
            for i, s in enumerate(slots):
                s[1] += 1
                if s[1] > len(s[0].tokens):
                    refill(i)
            if schedule.step_done():
                start = time.monotonic()
                futures = [ex.submit(compile_one, t) for t in fresh_texts]
            if futures and end is None and all(f.done() for f in futures):
                end = time.monotonic()
                schedule.burst_ended()
            if schedule.over:
                break
            time.sleep(max(0.0, args.forward_ms / 1e3 - (time.monotonic() - t0)))
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    phases = step_times.split(start, end)
    log(f"  in process: step p99 before {phases['before']['ms'].get('p99')} ms, during "
        f"{phases['during']['ms'].get('p99')} ms, {compiled[0]} compiles in {(end or 0) - (start or 0):.2f} s")
    return {"step": phases, "burst_seconds": round((end or 0) - (start or 0), 3), "compiles": compiled[0]}


def _start_py_spy(pid: int, seconds: float, out: common.Output):
    from maskd_tools.bench.profile import py_spy_path
    spy = py_spy_path()
    if spy is None:
        raise SystemExit("maskd bench burst --profile needs py-spy (pip install py-spy; it is in the dev extra)")
    raw = out.path("burst-profile.raw.txt")
    cmd = [spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", "250",
           "--format", "raw", "--idle", "--threads", "--output", str(raw), "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), cmd, raw


def _finish_py_spy(spy, out: common.Output) -> dict:
    from maskd_tools.bench.profile import parse_raw, top_entries
    proc, cmd, raw = spy
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"error": "py-spy did not finish", "command": " ".join(cmd)}
    if not raw.exists():
        return {"error": f"py-spy wrote nothing: {err[-500:]}", "command": " ".join(cmd)}
    stacks, total = parse_raw(raw.read_text())
    threads: dict[str, int] = {}
    for frames, n in stacks:
        name = frames[0].split(" (", 1)[0] if frames else "?"
        threads[name] = threads.get(name, 0) + n
    busy = [(f, n) for f, n in stacks if not _idle_leaf(f[-1])]
    entries = top_entries(busy, sum(n for _, n in busy), 20)
    return {"command": " ".join(cmd), "raw": str(raw), "samples": total,
            "busy_samples": sum(n for _, n in busy), "own_by_function": entries["own_by_function"],
            "inclusive_by_function": entries["inclusive_by_function"][:20]}


_IDLE_LEAVES = ("wait (threading.py", "_wait_once", "select (", "poll (", "read_exact", "_next (grpc",
                "acquire (", "sleep (", "_RequestIterator")


def _idle_leaf(frame: str) -> bool:
    return any(x in frame for x in _IDLE_LEAVES)


def run(args, log=print) -> dict:
    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec

    limit = args.limit if args.limit is not None else (args.decode_schemas + args.fresh if args.quick else None)
    out = common.Output(args.out, "burst", args.json_out)
    t_start = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    schemas = common.load_schemas(args.data, tok, limit)
    decode_schemas = [s for s in schemas if s.instances][:args.decode_schemas]
    decode_texts = {s.text for s in decode_schemas}
    fresh = [s for s in schemas if s.text not in decode_texts][:args.fresh]
    if not fresh:
        raise SystemExit(f"maskd bench burst: {args.data} has no schema beside the {len(decode_schemas)} decoded ones")
    if len(fresh) < args.fresh:
        log(f"burst: only {len(fresh)} schemas beside the decoded ones (asked for {args.fresh})")
    fresh_specs = [GrammarSpec.from_dict(s.spec).to_proto() for s in fresh]
    placement = common.placement_from(args)
    srv = common.subprocess_server(args.tokenizer, len(placement.server_cpus) if placement else args.threads,
                                   log_path=out.path("server.log"),
                                   cpus=placement.server_cpus if placement else None,
                                   json_schema_mode=args.json_schema_mode)
    try:
        with common.pinned_here(placement.worker_cpus if placement else None):
            from maskd_tools.bench.serve import _client
            with _client(srv.address) as mc:
                errors = common.register_all(mc, decode_schemas)
            pool = common.instance_pool(decode_schemas, errors, 0, "burst")
            log(f"burst: B={args.batch} behind {args.forward_ms:g} ms, {len(fresh)} fresh schemas "
                f"{args.concurrency} at a time, server {args.json_schema_mode} mode"
                + (", " + placement.describe() if placement else ""))
            served = _server_loop(srv, tok, pool, fresh_specs, args, placement, log, out)
    finally:
        srv.close()
    with common.pinned_here(placement.worker_cpus if placement else None):
        in_process = _in_process_loop(tok, pool, [s.text for s in fresh], args, log)
    report = {
        "mode": "burst",
        "args": common.args_dict(args, limit=limit),
        "machine": common.machine_info(),
        "placement": placement.as_dict() if placement else None,
        "tokenizer": tok.spec,
        "decode_schemas": len(decode_schemas),
        "fresh_schemas": len(fresh),
        "maskd": served,
        "in_process": in_process,
        "violations": served["token_violations"] + served["eos_violations"] + served["failed"],
        "failed": bool(served["token_violations"] or served["eos_violations"] or served["failed"]),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    during = served["wait"]["during"]["ms"]
    report["targets"] = {"burst_wait_p99_at_most_2ms": {"p99_ms": during.get("p99"),
                                                        "met": during.get("p99") is not None
                                                        and during["p99"] <= 2.0,
                                                        "pinned": placement is not None}}
    out.write(report, _markdown(report))
    return report


def _markdown(r: dict) -> str:
    m, ip = r["maskd"], r["in_process"]
    rows = []
    for name in ("before", "during", "after"):
        w, s = m["wait"][name], ip["step"][name]
        rows.append([name, w["steps"], w["ms"].get("p50"), w["ms"].get("p99"), w["ms"].get("p100"),
                     w["waited_share"], s["ms"].get("p50"), s["ms"].get("p99"), s["ms"].get("p100")])
    lines = [f"# maskd bench burst\n\n{common.machine_line(r['machine'])}\n",
             f"`{common.command_line()}`\n",
             f"B={r['args']['batch']} behind {r['args']['forward_ms']} ms; {r['fresh_schemas']} fresh schemas, "
             f"{r['args']['concurrency']} at a time; placement {r['placement']}.\n",
             common.md_table(["phase", "steps", "maskd wait p50 ms", "p99", "max", "steps that waited",
                              "in-process step p50 ms", "p99", "max"], rows),
             f"\nBurst through maskd: {m['burst_seconds']} s ({m['registers']} registers, {m['register_errors']} "
             f"refused; register p50 {m['register_ms'].get('p50')} ms); in process {ip['burst_seconds']} s.\n",
             *common.targets_markdown(r.get("targets"))]
    prof = m.get("profile")
    if prof and "own_by_function" in prof:
        lines.append(f"\nServer profile during the burst (`{prof['command']}`), busy samples by own time:\n")
        lines.append(common.md_table(["entry", "samples", "share"],
                                     [[e["entry"], e["samples"], e["share"]] for e in prof["own_by_function"]]))
    return "\n".join(lines) + "\n"
