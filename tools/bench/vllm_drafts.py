"""``maskd bench vllm --drafts K``: grammar drafts' tokens/s against the same engine without them.

Two engines on the same model (``--model``: ``real`` is what the figures are for; a random model's
acceptance means nothing), the same maskd server and the same requests, one after the other
(vllm.py starts them):

* ``no-drafts``: the first engine of ``--engines``: maskd (``vllm_xargs``) and, as a reference, that
  engine's own backend;
* ``drafts``: the same engine with ``--speculative-config`` naming ``maskd_client.vllm.GrammarDrafts``
  (``num_speculative_tokens`` K): every maskd request gets the server's drafts (the tokens its grammar
  forces, then what earlier sequences of its grammar wrote next), which vLLM verifies.

Every request is greedy (temperature 0: vLLM CPU's acceptance of sampled drafts is broken upstream,
vllm-project/vllm#55005), so both engines' outputs should be equal byte for byte (float32); the
report says per request whether they are.

Workloads: ``account`` (schema-driven JSON: completions of ``account_prompt(i)`` under ACCOUNT) and
``extraction`` (chat: extraction_prompts.py's prompts under their pydantic models' strict schemas;
request i the schema i mod 8 and its next text: 4 texts each, so phases past 16 requests repeat texts).

Learned counts: per engine, workload, concurrency and round the schemas get a title of their own (a
grammar new to the server and to vLLM; the output does not depend on it), then two phases of n
requests each (``--requests``, default the larger of 8 and 2 x concurrency): ``first``, requests
0..n-1, the grammar's first sequences (drafts from forced tokens, and from what these sequences
teach as they go); ``learned``, requests n..2n-1, after them.

Per engine, mode and phase: tokens/s (completion tokens over the phase's wall), ITL (a request's
engine step: the gap between its streamed chunks), tokens per streamed chunk (tokens per engine step
of a request), vLLM's spec-decode counters (tokens per verification step: 1 + accepted / steps with
drafts), the maskd server's step time and drafts proposed and accepted by source (its /metrics), and
per request its text, tokens and seconds (at concurrency 1: after how many requests the counts pay).
"""
from __future__ import annotations

import json
import statistics
import urllib.request
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from maskd_tools.bench import common, vllm_http, vllm_workloads

if TYPE_CHECKING:
    from maskd_tools.vllm_serve import VllmServer

NO_DRAFTS, DRAFTS = "no-drafts", "drafts"
PHASES = ("first", "learned")
SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted": "vllm:spec_decode_num_accepted_tokens_total"}
SOURCES = ("forced", "learned")
DEFAULT_MAX_TOKENS = {"account": 96, "extraction": 200}      # the real-model tests'


def speculative_args(k: int) -> tuple[str, str]:
    """``vllm serve``'s arguments for maskd's grammar drafts, ``k`` per step."""
    from maskd_client.vllm.drafts import GRAMMAR_DRAFTS

    return ("--speculative-config", json.dumps({"method": "custom_class", "model": GRAMMAR_DRAFTS,
                                                "num_speculative_tokens": k}))


def measure(engine: VllmServer, server: common.ServerHandle, label: str, modes: Sequence[str], args,
            workloads: Sequence[str], concurrency: Sequence[int], rounds: int,
            log: Callable[[str], None]) -> list[dict[str, Any]]:
    """One engine (``label``: NO_DRAFTS or DRAFTS) serving every round, workload, concurrency and
    phase, each mode in turn: the runs."""
    compact = args.whitespace == "compact"
    runs: list[dict[str, Any]] = []
    for workload in workloads:   # warm-up (a grammar of its own): every batch shape a round will see
        for c in concurrency:
            for mode in modes:
                run_phase(engine, server, mode, workload, c, c, 0, f"{label}-warm-up", compact, args.max_tokens)
    for r in range(rounds):
        for workload in workloads:
            for c in concurrency:
                n = args.requests or max(8, 2 * c)
                order = list(modes[r % len(modes):]) + list(modes[:r % len(modes)])
                for phase, start in zip(PHASES, (0, n)):
                    for mode in order:
                        res = run_phase(engine, server, mode, workload, c, n, start, f"{label}-{r}-{c}", compact,
                                        args.max_tokens)
                        res.update(engine=label, mode=mode, workload=workload, concurrency=c, round=r, phase=phase)
                        runs.append(res)
                        log(f"maskd bench vllm: {label} {mode} {workload} c={c} round {r} {phase}: "
                            f"{res['tokens_per_s']:.1f} tok/s, {_fmt(res['tokens_per_verification'])} "
                            f"tokens per verification step, valid {res['valid']}/{res['requests']}")
    return runs


def report(k: int, reference: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison's part of the report: its runs, their summary and the concurrency-1 series."""
    return {"num_speculative_tokens": k, "reference": reference, "runs": runs, "summary": summarize(runs),
            "series": series(runs)}


def request(workload: str, i: int, tag: str, max_tokens: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(body without its constraint, schema titled ``tag``) of request i of a drafts workload."""
    limit = max_tokens or DEFAULT_MAX_TOKENS[workload]
    if workload == "account":
        return ({"prompt": vllm_workloads.account_prompt(i), "max_tokens": limit},
                {**vllm_workloads.ACCOUNT, "title": f"account {tag}"})
    from maskd_tools.bench.extraction_prompts import PROMPTS, messages, strict_schema

    p = PROMPTS[i % len(PROMPTS)]
    texts = p.texts()
    return ({"messages": messages(p, texts[(i // len(PROMPTS)) % len(texts)]), "max_tokens": limit},
            {**strict_schema(p.model), "title": f"{p.model.__name__} {tag}"})


def run_phase(engine: VllmServer, server: common.ServerHandle, mode: str, workload: str, concurrency: int, n: int,
              start: int, tag: str, compact: bool, max_tokens: int | None) -> dict[str, Any]:
    """Requests ``start``..``start + n - 1``, ``concurrency`` at a time, greedy: their figures."""
    asked = [request(workload, start + i, tag, max_tokens) for i in range(n)]

    def body(i: int) -> dict[str, Any]:
        text, schema = asked[i]
        return {**text, "temperature": 0, "seed": start + i, **vllm_http.constraint(mode, schema, compact)}

    engine_before, maskd_before = scrape(engine.url + "/metrics"), _maskd_metrics(server)
    done, wall = vllm_http.send(engine.url, body, concurrency, n)
    engine_after, maskd_after = scrape(engine.url + "/metrics"), _maskd_metrics(server)
    results = [done[i] for i in range(n)]
    tokens = sum(r["tokens"] for r in results)
    chunks = sum(1 + len(r["gaps"]) for r in results if r["ttft"] is not None)
    spec = {k: _delta(engine_before, engine_after, name) for k, name in SPEC_COUNTERS.items()}
    steps = _delta(maskd_before, maskd_after, "maskd_step_seconds_count")
    return {"requests": n, "first_request": start, "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall, "tokens_per_chunk": tokens / chunks if chunks else None,
            "tokens_per_verification": 1 + spec["accepted"] / spec["drafts"] if spec["drafts"] else None,
            "spec": spec,
            "maskd": {"steps": steps,
                      "step_ms_mean": 1e3 * _delta(maskd_before, maskd_after, "maskd_step_seconds_sum") / steps
                      if steps else None,
                      "proposed": {s: _delta(maskd_before, maskd_after, f'maskd_drafts_proposed_total{{source="{s}"}}')
                                   for s in SOURCES},
                      "accepted": {s: _delta(maskd_before, maskd_after, f'maskd_drafts_accepted_total{{source="{s}"}}')
                                   for s in SOURCES}},
            "ttft_ms": common.summarize(r["ttft"] for r in results if r["ttft"] is not None),
            "itl_ms": common.summarize(g for r in results for g in r["gaps"]),
            "valid": sum(_valid(schema, r["text"]) for (_, schema), r in zip(asked, results)),
            "finish": vllm_http.count(r["finish"] for r in results),
            "errors": [r["error"] for r in results if r["error"]],
            "texts": [r["text"] for r in results],
            "per_request": [{"tokens": r["tokens"], "seconds": r["elapsed"], "chunks": 1 + len(r["gaps"])}
                            for r in results]}


def scrape(url: str) -> dict[str, float]:
    """A Prometheus endpoint's samples, by name with labels, and each name's sum over its labels."""
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = out.get(key, 0.0) + v
        name = key.split("{", 1)[0]
        if name != key:
            out[name] = out.get(name, 0.0) + v
    return out


def _maskd_metrics(server: common.ServerHandle) -> dict[str, float]:
    return scrape(server.metrics_url) if server.metrics_url else {}


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _valid(schema: dict, text: str) -> bool:
    try:
        return vllm_workloads.validator(schema).is_valid(json.loads(text))
    except ValueError:
        return False


def _runs(runs: Sequence[dict], workload: str, c: int, phase: str, engine: str, mode: str) -> list[dict]:
    """One cell's runs, by round."""
    return sorted((r for r in runs if (r["workload"], r["concurrency"], r["phase"], r["engine"], r["mode"])
                   == (workload, c, phase, engine, mode)), key=lambda r: r["round"])


def _same(a: Sequence[dict], b: Sequence[dict]) -> tuple[int, int]:
    """(requests whose texts are equal, requests compared) over the rounds both have."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra["texts"], rb["texts"])]
    return sum(x == y for x, y in pairs), len(pairs)


def summarize(runs: Sequence[dict]) -> list[dict[str, Any]]:
    """Per workload, concurrency and phase: both engines' maskd tokens/s (medians over rounds), the
    ratio (median of the rounds' ratios), the reference's, the drafts' acceptance, equal outputs."""
    rows = []
    cells = list(dict.fromkeys((r["workload"], r["concurrency"], r["phase"]) for r in runs))
    for workload, c, phase in cells:
        base = _runs(runs, workload, c, phase, NO_DRAFTS, "maskd")
        drafted = _runs(runs, workload, c, phase, DRAFTS, "maskd")
        refs = [r for r in runs if (r["workload"], r["concurrency"], r["phase"], r["engine"]) ==
                (workload, c, phase, NO_DRAFTS) and r["mode"] != "maskd"]
        refs.sort(key=lambda r: r["round"])
        spec = {k: sum(r["spec"][k] for r in drafted) for k in SPEC_COUNTERS}
        proposed = {s: sum(r["maskd"]["proposed"][s] for r in drafted) for s in SOURCES}
        accepted = {s: sum(r["maskd"]["accepted"][s] for r in drafted) for s in SOURCES}
        tokens, chunks = (sum(r["completion_tokens"] for r in drafted),
                          sum(x["chunks"] for r in drafted for x in r["per_request"]))
        equal, compared = _same(base, drafted)
        ref_equal, ref_compared = _same(base, refs)
        rows.append({
            "workload": workload, "concurrency": c, "phase": phase, "rounds": len(drafted),
            "requests": drafted[0]["requests"] if drafted else (base[0]["requests"] if base else 0),
            "no_drafts_tokens_per_s": _median(r["tokens_per_s"] for r in base),
            "drafts_tokens_per_s": _median(r["tokens_per_s"] for r in drafted),
            "ratio": _median(d["tokens_per_s"] / b["tokens_per_s"] for b, d in zip(base, drafted)),
            "ratios": [d["tokens_per_s"] / b["tokens_per_s"] for b, d in zip(base, drafted)],
            "reference": refs[0]["mode"] if refs else None,
            "reference_tokens_per_s": _median(r["tokens_per_s"] for r in refs),
            "tokens_per_verification": 1 + spec["accepted"] / spec["drafts"] if spec["drafts"] else None,
            "tokens_per_chunk": tokens / chunks if chunks else None,
            "spec": spec, "maskd_drafts_proposed": proposed, "maskd_drafts_accepted": accepted,
            "no_drafts_itl_p50_ms": _median(r["itl_ms"].get("p50") for r in base),
            "drafts_itl_p50_ms": _median(r["itl_ms"].get("p50") for r in drafted),
            "no_drafts_maskd_step_ms": _median(r["maskd"]["step_ms_mean"] for r in base),
            "drafts_maskd_step_ms": _median(r["maskd"]["step_ms_mean"] for r in drafted),
            "identical": [equal, compared], "reference_identical": [ref_equal, ref_compared],
            "valid": [sum(r["valid"] for r in base + drafted), sum(r["requests"] for r in base + drafted)],
            "errors": sum(len(r["errors"]) for r in base + drafted + refs)})
    return rows


def series(runs: Sequence[dict]) -> list[dict[str, Any]]:
    """At concurrency 1, request by request over both phases of a fresh grammar: each engine's
    tokens/s of that request (median over rounds) and their ratio: after how many requests the
    learned counts pay."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in runs if r["concurrency"] == 1):
        per: dict[str, dict[int, list[float]]] = {NO_DRAFTS: {}, DRAFTS: {}}
        for r in runs:
            if (r["workload"], r["concurrency"], r["mode"]) != (workload, 1, "maskd"):
                continue
            for k, x in enumerate(r["per_request"]):
                if x["seconds"]:
                    per[r["engine"]].setdefault(r["first_request"] + k, []).append(x["tokens"] / x["seconds"])
        for i in sorted(set(per[NO_DRAFTS]) & set(per[DRAFTS])):
            base, drafted = statistics.median(per[NO_DRAFTS][i]), statistics.median(per[DRAFTS][i])
            out.append({"workload": workload, "request": i, "no_drafts_tokens_per_s": base,
                        "drafts_tokens_per_s": drafted, "ratio": drafted / base if base else None})
    return out


def markdown(drafts: dict[str, Any]) -> list[str]:
    """The report's section: the summary table and the concurrency-1 series."""
    rows = drafts["summary"]
    ref = drafts["reference"]
    lines = [f"## Grammar drafts ({drafts['num_speculative_tokens']} per step), greedy", "",
             "The same engine without drafts and with maskd's grammar drafts (`custom_class` "
             "`maskd_client.vllm.GrammarDrafts`); medians over rounds; first: a fresh grammar's first requests, "
             "learned: the next ones. Tokens per verification step: vLLM's counters (1 + accepted / steps with "
             "drafts); per engine step: tokens per streamed chunk of a request.", "",
             common.md_table(["workload", "in flight", "phase", "requests", "maskd tok/s", "maskd + drafts tok/s",
                              "ratio", f"vLLM {ref} tok/s",
                              "tokens / verification step", "tokens / engine step", "ITL p50 ms (without / with)",
                              "maskd step ms (without / with)", "identical outputs", "valid", "errors"],
                             [[r["workload"], r["concurrency"], r["phase"], r["requests"],
                               _fmt(r["no_drafts_tokens_per_s"], 1), _fmt(r["drafts_tokens_per_s"], 1),
                               _fmt(r["ratio"]), _fmt(r["reference_tokens_per_s"], 1),
                               _fmt(r["tokens_per_verification"]), _fmt(r["tokens_per_chunk"]),
                               f"{_fmt(r['no_drafts_itl_p50_ms'], 1)} / {_fmt(r['drafts_itl_p50_ms'], 1)}",
                               f"{_fmt(r['no_drafts_maskd_step_ms'])} / {_fmt(r['drafts_maskd_step_ms'])}",
                               "{}/{}".format(*r["identical"]), "{}/{}".format(*r["valid"]), r["errors"]]
                              for r in rows]), ""]
    for workload in dict.fromkeys(s["workload"] for s in drafts["series"]):
        ratios = [s for s in drafts["series"] if s["workload"] == workload]
        lines += [f"At 1 in flight, {workload}, request by request (tokens/s with drafts / without): "
                  + ", ".join(f"{s['request']}: {_fmt(s['ratio'])}" for s in ratios), ""]
    return lines


def _median(values) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"
