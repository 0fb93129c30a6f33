"""``maskd bench tools``: time until the first row of an OpenAI tool-calling request (issue 19).

Tools: MaskBench-dev's BFCL and Glaive parameter schemas (the objects llguidance compiles alone,
as docs/decisions/0013-tool-call-pieces.md measured them), each wrapped as an OpenAI function
tool (name, description, parameters); every request is ``{"tools": [...], "tool_choice":
"required"}``, the JSON array of calls ``maskd.tool_specs`` builds. Per tool count and round, on a
set drawn afresh:

* in process, one whole compile of the set's schema and its first mask: llguidance (the grammar a
  server builds, whitespace bound included) and xgrammar (``GrammarCompiler``, its cache off);
* through a maskd server on 127.0.0.1 (``--json-schema-mode``, default complete, as served;
  ``--server``: embedded in this process, default, or ``maskd serve`` in a process of its own, as
  a vLLM API server and engine core meet it): the spec built from the request,
  ``MaskClient.register`` (waits for the compile), open and the first step, until its row is back,
  for four requests:

  - ``cold``: tools the server has never seen (composed from their pieces, compiled at once in the
    compile workers);
  - ``same``: the same request again (a cache hit: nothing to compile or compose; what any request
    of that size costs the client, the wire and the first step, so the floor under ``shuffled``);
  - ``reordered``: the same tools in another order: a new array (its text and grammar id are new),
    composed from the pieces and the router (one for every set of names) the server has;
  - ``shuffled``: all of the cold set's tools but one, in another order, plus one never seen: a
    new array, which the server composes from the pieces it has (one per tool's parameters), the
    new tool's and its router (issue 19's target: <= 5 ms at 200 tools; issue 46's: within the
    ``same`` request's + 2 ms).

  The cold set's register returns once its pieces are compiled, so no compile of them runs
  beside ``same`` and ``shuffled``.

  And each round, the server's floor: the same four steps for a one-line grammar the server holds
  (``{"regex": "[0-9]+"}``): no request is ready sooner through this server on this machine.

Every tool of a set is new: its name and its parameters' description carry the set's tag, so no
cache (of whole grammars, or of pieces later) has seen it before.
"""
from __future__ import annotations

import gc
import json
import pathlib
import random
import re
import time
from collections.abc import Callable
from typing import Any

from maskd_tools.bench import common

PREFIXES = ("BFCL", "Glaiveai2K")
SCENARIOS = ("cold", "same", "reordered", "shuffled")
SCENARIO_TITLES = {"cold": "maskd, cold", "same": "maskd, same set (cache hit)",
                   "reordered": "maskd, same tools in another order",
                   "shuffled": "maskd, all but one known, shuffled"}
DEFAULT_TOOLS, QUICK_TOOLS = "10,50,200", "10,50"
DEFAULT_ROUNDS, QUICK_ROUNDS = 5, 2
TARGET_MS = 5.0
SAME_SET_MARGIN_MS = 2.0     # issue 46: shuffled within the same set's cache hit + 2 ms
STEPS = ("spec", "register", "first_step")   # where a first row's time goes, as first_row() times it
FLOOR_REQUEST = {"regex": "[0-9]+"}    # a grammar of one line, held by the server: nothing to build or compose
FLOOR_TITLE = 'a one-line grammar the server holds (`{"regex": "[0-9]+"}`)'
SERVER_KINDS = {"embedded": "MaskServer embedded in the bench's process",
                "subprocess": "`maskd serve` in a process of its own"}
BASELINE_NOTE = ("'shuffled' (all tools but one known, in another order, one new) is a new array composed from "
                 "the known tools' pieces, the new tool's piece and the router the server holds (one for every "
                 "set of names; before per-tool pieces it was compiled whole); issue 19's target: a 200-tool "
                 "request ready in <= 5 ms; issue 46's: within the same set's cache hit + 2 ms")


def add_arguments(p) -> None:
    p.add_argument("--data", default=str(common.DEFAULT_MASKBENCH),
                   help="the MaskBench-dev folder whose BFCL_* and Glaiveai2K_* files give the tools "
                        "(default ../shared/maskbench-dev next to the repository)")
    p.add_argument("--tokenizer", default="deepseek-v4", help="tokenizer spec (as for maskd serve)")
    p.add_argument("--tools", default=None, help=f"comma-separated tool counts (default {DEFAULT_TOOLS}; "
                                                 f"--quick {QUICK_TOOLS})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"fresh tool sets per count (default {DEFAULT_ROUNDS}; --quick {QUICK_ROUNDS})")
    p.add_argument("--seed", type=int, default=0, help="draws the tool sets")
    p.add_argument("--json-schema-mode", default="complete", choices=("complete", "strict"),
                   help="the server's JSON-schema mode (default complete, the server's own default)")
    p.add_argument("--threads", type=int, default=2, help="server mask-fill threads and xgrammar compile threads")
    p.add_argument("--server", default="embedded", choices=("embedded", "subprocess"),
                   help="the maskd server: embedded in this process (default; it shares the client's "
                        "interpreter) or `maskd serve` in a process of its own")
    p.add_argument("--json", dest="json_out", default=None, help="also write the JSON report here")
    p.add_argument("--out", default="out/bench-tools",
                   help="output folder for tools.json, tools.md and tools.png (default: out/bench-tools)")
    p.add_argument("--quick", action="store_true", help=f"--tools {QUICK_TOOLS} --rounds {QUICK_ROUNDS} "
                                                        "unless given")
    p.set_defaults(limit=None)


def check_args(args) -> None:
    """Refuses garbage flags, naming them, before any data or tokenizer loads; settles the sizes."""
    prog = "maskd bench tools"
    counts = common.positive_list(args.tools or (QUICK_TOOLS if args.quick else DEFAULT_TOOLS), int, "--tools", prog)
    args.tools = list(dict.fromkeys(counts))   # a count given twice runs once
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS
    for flag, value in (("--rounds", args.rounds), ("--threads", args.threads)):
        if value < 1:
            raise SystemExit(f"{prog}: {flag} {value}: must be at least 1")
    folder = pathlib.Path(args.data)
    if not folder.is_dir():
        raise SystemExit(f"{prog}: --data {folder}: no such folder; give MaskBench-dev's folder "
                         f"(../shared/maskbench-dev) with --data")
    if not any(p.name.startswith(PREFIXES) for p in folder.glob("*.json")):
        raise SystemExit(f"{prog}: --data {folder} holds no {' / '.join(PREFIXES)} files (MaskBench-dev's "
                         "function-calling schemas); give MaskBench-dev's folder with --data")


# -- tools -----------------------------------------------------------------------------------
def tool_pool(folder: pathlib.Path, tok) -> list[tuple[str, dict]]:
    """(file stem, parameters schema) of the BFCL / Glaive files whose schema is an object that
    llguidance compiles alone and that a call array takes as it is (no $defs, no inner refs)."""
    import llguidance

    from maskd.specs import SpecError
    from maskd.tool_specs import tool_call_schema

    pool = []
    for path in sorted(folder.glob("*.json")):
        if not path.name.startswith(PREFIXES):
            continue
        schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
        if not isinstance(schema, dict) or schema.get("type") != "object" or "$defs" in schema:
            continue
        try:
            tool_call_schema([_tool(path.stem, schema, "check")], "required")
        except SpecError:
            continue
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        if not llguidance.LLMatcher(tok.ll, grammar, log_level=0).is_error():
            pool.append((path.stem, schema))
    return pool


def _tool(stem: str, schema: dict, tag: str) -> dict:
    """An OpenAI function tool; ``tag`` in its name and in its parameters' description makes it new."""
    description = schema.get("description") if isinstance(schema.get("description"), str) else None
    description = description or f"MaskBench-dev {stem}"
    return {"type": "function", "function": {"name": f"{stem}_{tag}", "description": description,
                                             "parameters": {**schema, "description": f"{description} [{tag}]"}}}


def request(tools: list[dict]) -> dict:
    return {"tools": tools, "tool_choice": "required"}


def draw(pool: list[tuple[str, dict]], n: int, tag: str,
         rng: random.Random) -> tuple[list[dict], list[dict], list[dict]]:
    """A cold set of n new tools; the same tools in another order; and the shuffled set: all of it
    but one, in another order, plus one more new tool."""
    picked = rng.sample(pool, n + 1)
    cold = [_tool(stem, schema, tag) for stem, schema in picked[:n]]
    reordered = cold[:]
    while n > 1 and reordered == cold:
        rng.shuffle(reordered)
    known = cold[:]
    del known[rng.randrange(n)]
    shuffled = known + [_tool(*picked[n], tag + "x")]
    rng.shuffle(shuffled)
    return cold, reordered, shuffled


# -- in process ------------------------------------------------------------------------------
class _LLGuidance:
    def __init__(self, tok) -> None:
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        self.ll, self.llg, self.fill = tok.ll, llguidance, fill_next_token_bitmask
        self.bm = allocate_token_bitmask(1, tok.logits_width)

    def first_row(self, text: str) -> tuple[float, float]:
        """(compile, compile + first mask) seconds of the grammar a server builds for ``text``."""
        t0 = time.perf_counter()
        m = self.llg.LLMatcher(self.ll, common.llguidance_grammar(text), log_level=0)
        t1 = time.perf_counter()
        if m.is_error():
            raise RuntimeError(f"llguidance: {m.get_error()}")
        self.fill(m, self.bm, 0)
        return t1 - t0, time.perf_counter() - t0


class _XGrammar:
    def __init__(self, tok, threads: int) -> None:
        import xgrammar as xgr

        from maskd_tools.bench.engines import xgrammar_tokenizer_info

        info = xgrammar_tokenizer_info(tok)
        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.bm = xgr.allocate_token_bitmask(1, info.vocab_size)

    def first_row(self, text: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        m = self.xgr.GrammarMatcher(self.compiler.compile_json_schema(text))
        t1 = time.perf_counter()
        m.fill_next_token_bitmask(self.bm)
        return t1 - t0, time.perf_counter() - t0


# -- through the server ----------------------------------------------------------------------
def _server(args) -> common.ServerHandle:
    if args.server == "subprocess":
        return common.subprocess_server(args.tokenizer, args.threads, json_schema_mode=args.json_schema_mode)
    from maskd.server import MaskServer, ServerConfig

    server = MaskServer(ServerConfig(port=0, tokenizer=args.tokenizer, threads=args.threads,
                                     json_schema_mode=args.json_schema_mode)).start()
    return common.ServerHandle(server.address, "embedded", server=server)


def first_row(mc, req: dict, sid: str) -> dict[str, float]:
    """Seconds until the request's first row through the server: the spec built from the request,
    register (waits for the compile), open + the first step (again while it answers WAITING). The
    open names the grammar id register gave, as vLLM's engine core opens a request admission
    registered."""
    from maskd.specs import GrammarSpec
    from maskd_client import MaskClientError, SeqStatus

    t0 = time.perf_counter()
    spec = GrammarSpec.from_request(req).to_proto()
    t1 = time.perf_counter()
    grammar_id = mc.register(spec, wait=True)
    t2 = time.perf_counter()
    mc.open(sid, spec, grammar_id=grammar_id)
    res = mc.step({sid: []})
    while res.status[0] == SeqStatus.WAITING and time.perf_counter() - t2 < 60:
        res = mc.step({sid: []})
    t3 = time.perf_counter()
    status = SeqStatus(int(res.status[0]))
    mc.close(sid)
    if status != SeqStatus.READY:
        raise MaskClientError(f"the first step answered {status.name}, not READY")
    return {"spec": t1 - t0, "register": t2 - t1, "first_step": t3 - t2, "first_row": t3 - t0}


# -- the run ---------------------------------------------------------------------------------
def run(args, log: Callable[[str], None] = print) -> dict:
    from maskd.server.tokenizers import load_tokenizer
    from maskd.specs import GrammarSpec
    from maskd_client import MaskClient, MaskClientError

    prog = "maskd bench tools"
    t_start = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    pool = tool_pool(pathlib.Path(args.data), tok)
    if max(args.tools) + 1 > len(pool):
        raise SystemExit(f"{prog}: --tools {max(args.tools)}: --data {args.data} has {len(pool)} usable parameter "
                         f"schemas; a set of N tools needs N + 1 (one new tool for 'shuffled')")
    out = common.Output(args.out, "tools", args.json_out)
    llg, xg = _LLGuidance(tok), _XGrammar(tok, args.threads)
    srv = _server(args)
    samples: dict[int, dict[str, list[dict[str, float]]]] = {}
    floor: list[dict[str, float]] = []
    errors: list[str] = []
    grammar_bytes: dict[int, list[int]] = {}
    try:
        with MaskClient(srv.address, want_forced_tokens=False, timeout_s=600) as mc:
            info = mc.info()
            warm = request([_tool(s, p, "warm") for s, p in pool[:3]])   # stream and first-call costs
            first_row(mc, warm, "warm")
            first_row(mc, FLOOR_REQUEST, "warm-floor")
            llg.first_row(GrammarSpec.from_request(warm).text)
            xg.first_row(GrammarSpec.from_request(warm).text)
            log(f"tools: {len(pool)} parameter schemas from {args.data}; server {srv.address} "
                f"({args.json_schema_mode} mode, {args.threads} threads); counts {args.tools}, {args.rounds} rounds")
            for n in args.tools:
                per = samples[n] = {k: [] for k in ("llguidance", "xgrammar", *SCENARIOS)}
                for r in range(args.rounds):
                    gc.collect()
                    tag = f"n{n}r{r}"
                    cold, reordered, shuffled = draw(pool, n, tag, random.Random(f"{args.seed}-{n}-{r}"))
                    text = GrammarSpec.from_request(request(cold)).text
                    grammar_bytes.setdefault(n, []).append(len(text.encode()))
                    for name, engine in (("llguidance", llg), ("xgrammar", xg)):
                        try:
                            c, f = engine.first_row(text)
                        except Exception as exc:   # an engine that refuses the set: recorded, the run goes on
                            errors.append(f"{n} tools, round {r}, {name} in process: {exc}")
                            continue
                        per[name].append({"compile": c, "first_row": f})
                    for scenario, tools in (("cold", cold), ("same", cold), ("reordered", reordered),
                                            ("shuffled", shuffled)):
                        try:
                            per[scenario].append(first_row(mc, request(tools), f"{tag}-{scenario}"))
                        except MaskClientError as exc:
                            errors.append(f"{n} tools, round {r}, {scenario}: {exc}")
                    try:
                        floor.append(first_row(mc, FLOOR_REQUEST, f"{tag}-floor"))
                    except MaskClientError as exc:
                        errors.append(f"{n} tools, round {r}, the floor: {exc}")
                    log(f"  {n} tools, round {r}: " + ", ".join(
                        f"{k} {per[k][-1]['first_row'] * 1e3:.1f} ms" for k in per if len(per[k]) == r + 1))
            mc.flush_closes()
    finally:
        srv.close()
    results = [{"tools": n, "rounds": args.rounds,
                "grammar_bytes": int(sorted(grammar_bytes[n])[len(grammar_bytes[n]) // 2]),
                "in_process": {e: {"compile_ms": _stats(per[e], "compile"), "first_row_ms": _stats(per[e], "first_row")}
                               for e in ("llguidance", "xgrammar")},
                "server": {s: {f"{k}_ms": _stats(per[s], k) for k in ("first_row", *STEPS)}
                           for s in SCENARIOS}}
               for n, per in samples.items()]
    report: dict[str, Any] = {
        "mode": "tools",
        "args": common.args_dict(args),
        "machine": common.machine_info(),
        "data": str(args.data),
        "tokenizer": tok.spec,
        "vocab_size": tok.vocab_size,
        "tool_pool": len(pool),
        "request": {"tool_choice": "required", "parallel_tool_calls": None},
        "server": {"kind": srv.kind, "address": srv.address, "threads": args.threads,
                   "json_schema_mode": args.json_schema_mode, "backend": info.backend,
                   "backend_version": info.backend_version},
        "note": BASELINE_NOTE,
        "results": results,
        "floor": {"request": FLOOR_REQUEST, **{f"{k}_ms": _stats(floor, k) for k in ("first_row", *STEPS)}},
        "errors": errors,
        "failed": bool(errors),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    report["targets"] = _targets(results, report["floor"]["first_row_ms"])
    _plot(out, report)
    out.write(report, _markdown(report))
    return report


def _stats(samples: list[dict[str, float]], key: str) -> dict:
    return common.summarize([s[key] for s in samples])


def _targets(results: list[dict], floor: dict) -> dict:
    """Issue 19's (a 200-tool request, all but one known, shuffled, ready in 5 ms; below this
    machine's floor: docs/decisions/0017-tool-request-floor.md) and issue 46's restatement of it
    against the machine (within the same set's cache hit + 2 ms)."""
    for x in results:
        if x["tools"] == 200 and x["server"]["shuffled"]["first_row_ms"]["n"]:
            p50 = x["server"]["shuffled"]["first_row_ms"]["p50"]
            found = {"p50_ms": p50, "met": p50 <= TARGET_MS}
            targets = {"n200_all_but_one_known_shuffled_first_row_at_most_5ms": found}
            same = x["server"]["same"]["first_row_ms"]
            if same.get("n"):   # the cache hit of the same size: what no composing takes off
                found["same_set_cache_hit_p50_ms"] = same["p50"]
                targets["n200_shuffled_first_row_within_2ms_of_the_same_sets"] = {
                    "p50_ms": p50, "same_set_p50_ms": same["p50"], "over_ms": p50 - same["p50"],
                    "met": p50 - same["p50"] <= SAME_SET_MARGIN_MS}
            if floor.get("n"):      # any request's first row through this server
                found["server_floor_p50_ms"] = floor["p50"]
            return targets
    return {}


def _cell(stats: dict) -> str:
    if not stats.get("n"):
        return "-"
    digits = 1 if stats["p50"] >= 1 else 2
    return f"{stats['p50']:.{digits}f} / {stats['p90']:.{digits}f}"


def _markdown(r: dict) -> str:
    s, rounds = r["server"], r["args"]["rounds"]
    lines = ["# maskd bench tools\n",
             f"OpenAI tool-calling requests (`tool_choice: \"required\"`: a JSON array of calls) of N tools drawn from "
             f"{r['tool_pool']} BFCL / Glaive parameter schemas of `{r['data']}`, tokenizer `{r['tokenizer']}` "
             f"({r['vocab_size']:,} tokens); {rounds} round{'s' if rounds != 1 else ''} per count, each on tools never "
             "seen before. "
             f"Server: {SERVER_KINDS[s['kind']]} on 127.0.0.1, {s['backend']} {s['backend_version']}, "
             f"{s['json_schema_mode']} JSON-schema mode, {s['threads']} threads.\n",
             f"Machine: {common.machine_line(r['machine'])}.\n",
             "\n## Time until the first row, ms (median / p90)\n\n",
             "In process: one whole compile of the set's schema and its first mask. Through maskd: the spec built from "
             "the request, `MaskClient.register` (waits for the compile), open and the first step.\n\n"]
    rows = [[x["tools"], x["grammar_bytes"],
             *[_cell(x["in_process"][e]["first_row_ms"]) for e in ("llguidance", "xgrammar")],
             *[_cell(x["server"][sc]["first_row_ms"]) for sc in SCENARIOS]] for x in r["results"]]
    lines.append(common.md_table(["tools", "schema bytes", "llguidance in process", "xgrammar in process",
                                  *[SCENARIO_TITLES[sc] for sc in SCENARIOS]], rows))
    lines.append("\n## Where maskd's time goes, ms (median)\n\n")
    rows = [[x["tools"], sc, *[x["server"][sc][f"{k}_ms"].get("p50", "-") for k in STEPS]]
            for x in r["results"] for sc in SCENARIOS]
    lines.append(common.md_table(["tools", "request", "spec from the request", "register", "open + first step"], rows))
    f = r["floor"]
    spec, reg, step = (f[f"{k}_ms"].get("p50", "-") for k in STEPS)
    lines.append(f"\nThe server's floor, {FLOOR_TITLE}, the same four steps: first row {_cell(f['first_row_ms'])} ms "
                 f"(spec {spec}, register {reg}, open + first step {step} ms, medians): no request is ready sooner "
                 "through this server on this machine.\n")
    lines.append(f"\nNote: {BASELINE_NOTE}.\n")
    if r["errors"]:
        lines.append("\nErrors:\n\n" + "\n".join(f"- {e}" for e in r["errors"]) + "\n")
    lines += common.targets_markdown(r.get("targets"))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def _plot(out: common.Output, r: dict) -> None:
    plt = common.pyplot()
    series = {"llguidance in process": lambda x: x["in_process"]["llguidance"]["first_row_ms"],
              "xgrammar in process": lambda x: x["in_process"]["xgrammar"]["first_row_ms"],
              **{SCENARIO_TITLES[sc]: (lambda x, sc=sc: x["server"][sc]["first_row_ms"]) for sc in SCENARIOS}}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(series)
    for i, (label, get) in enumerate(series.items()):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(r["results"]))]
        ax.bar(xs, [get(x).get("p50", 0) for x in r["results"]], width, label=label)
    ax.axhline(TARGET_MS, color="grey", linestyle="--", linewidth=1, label=f"issue 19's target ({TARGET_MS:g} ms)")
    ax.set_xticks(range(len(r["results"])), [str(x["tools"]) for x in r["results"]])
    ax.set_xlabel("tools in the request")
    ax.set_ylabel("time until the first row, ms (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.path("tools.png"), dpi=110)
    plt.close(fig)
