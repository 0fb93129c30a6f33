"""maskd bench: every mode runs at tiny sizes on the built-in sample and writes its figures.

Behaviour only (files, keys, counts, correctness checks): no assertion on a timing value.
"""
from __future__ import annotations

import json
import os
import pathlib

import pytest

from conftest import MASKBENCH, needs_maskbench
from maskd.cli import main
from maskd_tools.bench import common

SAMPLE = str(common.SAMPLE_DIR)


def _run(mode: str, tmp_path: pathlib.Path, *extra: str) -> tuple[dict, pathlib.Path]:
    out = tmp_path / mode
    side = tmp_path / f"{mode}-copy.json"
    rc = main(["bench", mode, "--data", SAMPLE, "--tokenizer", "deepseek-v4", "--out", str(out),
               "--json", str(side), "--threads", "2", *extra])
    assert rc == 0
    report = json.loads((out / f"{mode}.json").read_text())
    assert json.loads(side.read_text()) == report
    assert (out / f"{mode}.md").read_text().startswith(f"# maskd bench {mode}")
    assert report["mode"] == mode
    assert report["machine"]["logical_cpus"] >= 1
    return report, out


def _positive(stats: dict) -> None:
    assert stats["n"] > 0
    for key in ("mean", "p25", "p50", "p99", "p100"):
        assert stats[key] >= 0
    assert stats["p100"] > 0
    assert stats["p25"] <= stats["p50"] <= stats["p99"] <= stats["p100"]


def test_parser_lists_every_mode():
    from maskd.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--quick"])
    assert args.bench_mode == "serve" and args.forward_ms == 20.0 and args.batch_sizes == "1,16,64,256"
    for mode in ("engines", "wire", "profile", "e2e"):
        args = build_parser().parse_args(["bench", mode, "--limit", "3", "--json", "x.json"])
        assert args.limit == 3 and args.json_out == "x.json"
        assert args.out.endswith(f"bench-{mode}")


def test_spread_and_summarize():
    assert common.spread(range(10), 3) == [0, 4, 9]
    assert common.spread(range(10), 0) == []
    assert common.spread(range(4), None) == [0, 1, 2, 3]
    assert common.spread(range(4), 10) == [0, 1, 2, 3]
    s = common.summarize([0.001, 0.002, 0.003, 0.004])
    assert s["n"] == 4 and s["p100"] == pytest.approx(4.0) and s["mean"] == pytest.approx(2.5)
    assert common.summarize([]) == {"n": 0}


def test_engines(tmp_path):
    report, out = _run("engines", tmp_path, "--xgrammar-timeout", "30")
    assert report["schemas"] == 4 and report["tokens"] > 0
    for engine in ("llguidance", "xgrammar"):
        e = report["engines"][engine]
        assert e["completed"] == 4, e
        assert e["masks"] > 0
        assert e["false_rejects"] == 0 and e["eos_not_allowed"] == 0
        _positive(e["ttfm_ms"])
        _positive(e["tbm_ms"])
        assert e["ttfm_ms"]["p50"] >= e["compile_ms"]["p50"]
    assert report["common_schemas"] == 4
    assert set(report["xgrammar_over_llguidance"]) == {"ttfm_ms", "tbm_ms"}
    for png in ("engines_tbm_cdf.png", "engines_ttfm_cdf.png"):
        assert (out / png).stat().st_size > 1000


def test_serve(tmp_path):
    report, out = _run("serve", tmp_path, "--batch-sizes", "1,4", "--steps", "4", "--warmup", "1",
                       "--forward-ms", "2", "--memory-sequences", "12")
    assert [b["batch"] for b in report["batches"]] == [1, 4]
    assert report["violations"] == 0 and report["rows_differing_from_in_process"] == 0
    assert report["failed"] is False
    for b in report["batches"]:
        svc, pipe = b["service"], b["pipelined"]
        assert svc["steps"] == 4 and pipe["steps"] == 4
        for key in ("service_ms", "inprocess_fill_ms", "server_seconds_ms", "round_trip_ms"):
            _positive(svc[key])
        assert svc["service_ms"]["p50"] > 0 and svc["p50_service_over_fill"] > 0
        assert isinstance(svc["p50_service_minus_fill_ms"], float)
        assert svc["masks_checked"] > 0 and svc["token_violations"] == 0
        for key in ("p50", "p99", "p100"):
            assert pipe["mask_wait_ms"][key] >= 0
        assert 0.0 <= pipe["waited_share"] <= 1.0
        assert pipe["masks_checked"] > 0 and pipe["token_violations"] == 0
    mem = report["memory"]
    assert mem["live_sequences"] == 12 and mem["rss_after_mib"] > 0
    assert "rss_per_1000_sequences_mib" in mem
    assert (out / "serve.png").stat().st_size > 1000


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--pin 1+1 needs two CPUs")


@needs_two_cpus
def test_serve_pinned_puts_the_server_apart_and_restores_this_process(tmp_path):
    before = os.sched_getaffinity(0)
    report, _ = _run("serve", tmp_path, "--batch-sizes", "4", "--steps", "3", "--warmup", "1",
                     "--forward-ms", "2", "--memory-sequences", "0", "--pin", "1+1")
    cpus = sorted(before)
    assert report["placement"] == {"server_cpus": cpus[:1], "worker_cpus": cpus[1:2]}
    assert report["server"]["kind"] == "subprocess" and report["server"]["threads"] == 1
    assert report["baseline_threads"] == 1
    assert report["violations"] == 0 and report["rows_differing_from_in_process"] == 0
    assert os.sched_getaffinity(0) == before
    assert "b64_p50_service_within_1ms_of_consume_plus_fill" not in report["targets"]


def test_placement_parse_and_errors():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        p = common.Placement.parse("1+1")
        assert (p.server_cpus, p.worker_cpus) == (tuple(cpus[:1]), tuple(cpus[1:2]))
    for bad in ("1", "a+b", "0+1", "1+0", f"{len(cpus)}+1", "1+1+1"):
        with pytest.raises(ValueError, match="--pin"):
            common.Placement.parse(bad)


@pytest.mark.parametrize("pin", ["nonsense", "64+64"])
def test_bad_pin_is_a_clear_error(tmp_path, pin, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "e2e", "--data", SAMPLE, "--tokenizer", "cl100k", "--out", str(tmp_path), "--pin", pin])
    assert "--pin" in str(exc.value.code)


@pytest.mark.parametrize("mode, flags, message", [
    ("e2e", ["--modes", "unstructured,warp"], "unknown mode"),
    ("e2e", ["--batch-sizes", "64,x"], "--batch-sizes"),
    ("e2e", ["--forward-ms", "-20"], "--forward-ms"),
    ("serve", ["--batch-sizes", ""], "--batch-sizes"),
    ("wire", ["--batch-sizes", "0"], "--batch-sizes"),
])
def test_garbage_bench_flags_are_clear_errors(tmp_path, mode, flags, message):
    with pytest.raises(SystemExit) as exc:
        main(["bench", mode, "--data", SAMPLE, "--tokenizer", "cl100k", "--out", str(tmp_path), "--pin", "none",
              *flags] if mode != "wire" else ["bench", mode, "--data", SAMPLE, "--tokenizer", "cl100k",
                                              "--out", str(tmp_path), *flags])
    assert message in str(exc.value.code)


@pytest.mark.parametrize("flags, message", [
    (["--engines", "guidance,outlines"], "--engines"),
    (["--workloads", "poetry"], "--workloads"),
    (["--concurrency", "0"], "--concurrency"),
    (["--rounds", "-1"], "--rounds"),
    (["--maskd-cpus", "one"], "--maskd-cpus"),
    (["--burst", "-1"], "--burst"),
    (["--profile", "-5"], "--profile"),
    (["--workloads", "maskbench", "--data", "/nonexistent/maskbench"], "no MaskBench folder"),
    (["--workloads", "tools", "--tool-set", "0"], "--tool-set"),
    (["--workloads", "tools", "--data", "/nonexistent/maskbench"], "no MaskBench"),
    (["--drafts", "-1"], "--drafts"),
    (["--quality", "--quality-samples", "-1"], "--quality-samples"),
    (["--quality", "--engines", "xgrammar,guidance"], "--quality runs in an engine with vLLM's guidance"),
    (["--drafts", "4", "--drafts-workloads", "records"], "--drafts-workloads"),
    (["--workloads", "account"], "--workloads"),         # a drafts workload in the engines' comparison
    (["--workloads", ""], "nothing to measure"),
    (["--workloads", "", "--drafts", "2", "--profile", "3"], "--profile"),
])
def test_garbage_bench_vllm_flags_are_clear_errors(tmp_path, flags, message):
    # refused before any engine or server starts
    with pytest.raises(SystemExit) as exc:
        main(["bench", "vllm", "--data", SAMPLE, "--tokenizer", "cl100k", "--out", str(tmp_path), *flags])
    assert message in str(exc.value.code)


def test_bench_vllm_whitespace_is_compact_or_flexible(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "vllm", "--data", SAMPLE, "--out", str(tmp_path), "--whitespace", "loose"])
    assert exc.value.code == 2
    assert "--whitespace" in capsys.readouterr().err


def test_bench_vllm_summary_of_a_mode_whose_every_request_failed_reports_its_errors():
    from maskd_tools.bench import vllm

    def run(mode: str, r: int, ok: bool) -> dict:
        latency = {"n": 1, "p50": 100.0 + r, "p99": 200.0 + r} if ok else {"n": 0}
        return {"engine": "guidance", "workload": "tools", "concurrency": 1, "round": r, "mode": mode,
                "tokens_per_s": 50.0 if ok else 0.0, "ttft_ms": latency, "itl_ms": latency,
                "valid": int(ok), "structured": int(mode != "unconstrained"),
                "errors": [] if ok else ["EngineDeadError", "EngineDeadError"]}

    runs = [run(mode, r, mode != "maskd") for r in range(2) for mode in ("unconstrained", "maskd")]
    rows = {row["mode"]: row for row in vllm._summarize(runs)}
    assert rows["maskd"]["errors"] == 4 and rows["maskd"]["ttft_p50_ms"] is None and rows["maskd"]["ratio"] == 0
    assert rows["unconstrained"]["ttft_p50_ms"] == 100.5 and rows["unconstrained"]["ttft_p99_ms"] == 201.0
    table = vllm._markdown({"command": "maskd bench vllm", "machine": common.machine_info(), "placement": {},
                            "model": "m", "maskd_tokenizer": "t", "summary": list(rows.values()),
                            "schemas": {"tools": 1}, "refused_by_backend": {}, "burst_summary": [], "profiles": []})
    assert "| guidance | tools | 1 | maskd | 0 | 0.00 | - / - | - / - | 0/2 | 4 |" in table


def test_e2e(tmp_path):
    pin = "1+1" if len(os.sched_getaffinity(0)) >= 2 else "none"
    report, out = _run("e2e", tmp_path, "--batch-sizes", "3,8", "--forward-ms", "2", "--steps", "16",
                       "--warmup", "2", "--pin", pin)
    assert report["failed"] is False and report["violations"] == 0
    assert [(x["batch"], x["forward_ms"]) for x in report["results"]] == [(3, 2.0), (8, 2.0)]
    for x in report["results"]:
        runs = x["runs"]
        assert list(runs) == ["unstructured", "inprocess-critical", "inprocess-overlapped", "maskd"]
        assert runs["unstructured"]["ratio_to_unstructured"] == 1.0
        for mode, r in runs.items():
            assert r["steps"] == 16 and r["tokens_per_s"] > 0 and r["ratio_to_unstructured"] > 0
            _positive(r["host_work_ms"])
            # every slot samples one token per step (maskd: but rows still WAITING for a compile)
            assert r["tokens"] == 16 * x["batch"] - r.get("waiting_rows", 0)
            if mode != "unstructured":
                assert r["masks_checked"] == r["tokens"] and r["token_violations"] == 0
        assert runs["maskd"]["failed_rows"] == 0
        assert len({r["instances_completed"] for r in runs.values()}) == 1   # the same replay in every mode
    # slots were refilled, so opening and closing ran inside the loop
    assert sum(x["runs"]["maskd"]["instances_completed"] for x in report["results"]) > 0
    assert "b256_f20_maskd_at_least_097_of_unstructured" not in report["targets"]
    assert (out / "e2e.png").stat().st_size > 1000
    assert "inprocess-overlapped" in (out / "e2e.md").read_text()


def test_e2e_grammar_drafts(tmp_path):
    """maskd-drafts: several tokens per slot and step where drafts are accepted, every one of them
    checked against its position's row (0 violations), its cost model stated in the report."""
    report, out = _run("e2e", tmp_path, "--batch-sizes", "4", "--forward-ms", "2", "--steps", "24", "--warmup", "2",
                       "--pin", "none", "--modes", "unstructured,maskd-drafts", "--drafts", "3")
    assert report["failed"] is False and report["violations"] == 0
    r = report["results"][0]["runs"]["maskd-drafts"]
    assert r["drafts"] > 0 and r["failed_rows"] == 0
    assert r["masks_checked"] == r["tokens"] > 0 and r["token_violations"] == 0
    assert r["tokens_per_slot_step"] > 1.0          # the sample's schemas force keys and punctuation
    text = (out / "e2e.md").read_text()
    assert "Grammar drafts" in text and "max(1, (B + D) / max(B, S))" in text


def test_e2e_opportunistic_masking(tmp_path):
    """maskd-opportunistic: the server lets no off-grammar token through, sends a row for about the
    share of samples that were off the grammar, and every token sampled again with a row is in it."""
    report, out = _run("e2e", tmp_path, "--batch-sizes", "4", "--forward-ms", "2", "--steps", "40", "--warmup", "2",
                       "--pin", "none", "--modes", "unstructured,maskd-opportunistic", "--off-grammar", "0.25")
    assert report["failed"] is False and report["violations"] == 0
    r = report["results"][0]["runs"]["maskd-opportunistic"]
    assert r["off_grammar_allowed"] == 0 and r["failed_rows"] == 0
    assert r["tokens_checked"] > 0 and 0 < r["resampled"] == r["masks_checked"] < r["tokens_checked"]
    assert 0.05 < r["share_needing_a_row"] < 0.6
    assert "Opportunistic masking" in (out / "e2e.md").read_text()
    with pytest.raises(SystemExit, match="--off-grammar"):
        _run("e2e", tmp_path, "--modes", "unstructured,maskd-opportunistic", "--off-grammar", "1.5")


def test_wire(tmp_path):
    report, out = _run("wire", tmp_path, "--batch-sizes", "1,4")
    assert report["dense_row_bytes"] == 16160
    assert report["bytes_per_row_dense_mean"] == 16160
    for alt in ("sent", "dense_zstd", "adaptive", "adaptive_zstd", "block", "message"):
        assert report[f"bytes_per_row_{alt}_mean"] > 0
    assert report["token_violations"] == 0 and report["shadow_mismatched_steps"] == 0
    assert not report["failed"]
    for b in report["batches"]:
        assert b["rows"] > 0 and b["steps"] > 0
        # zstd on top of the block only helps; the row block is part of the reply
        assert b["bytes_per_row_sent_mean"] <= b["bytes_per_row_block_mean"]
        assert b["bytes_per_row_sent_mean"] < b["bytes_per_row_message_mean"]
        assert b["bytes_per_row_adaptive_mean"] < b["bytes_per_row_dense_mean"]
        assert sum(b["block_share"].values()) == pytest.approx(1.0, abs=1e-3)
        server_d = next(x for x in b["dictionary_sizes"] if x["dict_size"] == b["dict_size"])
        assert server_d["bytes_per_row_mean"] == b["bytes_per_row_sent_mean"]
    assert (out / "wire.png").stat().st_size > 1000
    assert "Row dictionary size" in (out / "wire.md").read_text()


def test_profile_parse():
    from maskd_tools.bench.profile import parse_raw, step_path, top_entries

    raw = ("_stream_response_in_pool (grpc/_server.py:843);MaskServicer.Session (/x/maskd/server/service.py:84);"
           "Session.step (/x/maskd/server/session.py:85);"
           "LLGuidanceEngine.fill_batch (/x/maskd/server/engines/llguidance_engine.py:158) 6\n"
           "_stream_response_in_pool (grpc/_server.py:843);MaskServicer.Session (/x/maskd/server/service.py:82);"
           "_RequestIterator.__next__ (grpc/_server.py:500);Condition.wait (threading.py:327) 5\n"
           "_serve (grpc/_server.py:1000) 9\n"
           "_stream_response_in_pool (grpc/_server.py:843);_send_response (grpc/_server.py:732) 2\n")
    stacks, total = parse_raw(raw)
    assert total == 22
    busy, n_busy, n_wait = step_path(stacks)
    assert (n_busy, n_wait) == (8, 5)
    tops = top_entries(busy, n_busy, 5)
    assert tops["own_by_function"][0]["entry"] == \
        "LLGuidanceEngine.fill_batch (maskd/server/engines/llguidance_engine.py)"
    assert tops["own_by_function"][0]["share"] == pytest.approx(0.75)
    assert tops["key_functions"]["MaskServicer.Session (maskd/server/service.py)"] == pytest.approx(0.75)


def test_profile(tmp_path):
    from maskd_tools.bench.profile import py_spy_path

    if py_spy_path() is None:
        pytest.skip("py-spy is not installed")
    try:
        report, out = _run("profile", tmp_path, "--batch", "4", "--duration", "1", "--quick")
    except SystemExit as exc:  # e.g. a container that forbids ptrace
        if "py-spy failed" in str(exc):
            pytest.skip(str(exc))
        raise
    assert report["samples_all_threads"] > 0
    assert report["steps_recorded"] > 0
    assert (out / "profile.raw.txt").exists()


def _timings(node, path=""):
    """Every (path, value) under keys ending in _ms, through nested dicts and lists."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _timings(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _timings(v, f"{path}[{i}]")
    elif "_ms" in path:
        yield path, node


@needs_maskbench
@pytest.mark.parametrize("server, counts", [("embedded", [3, 5]), ("subprocess", [3])])
def test_tools(tmp_path, server, counts):
    out, side = tmp_path / "tools", tmp_path / "tools-copy.json"
    rc = main(["bench", "tools", "--data", str(MASKBENCH), "--tools", ",".join(map(str, counts)), "--rounds", "1",
               "--server", server, "--out", str(out), "--json", str(side)])
    assert rc == 0
    report = json.loads((out / "tools.json").read_text())
    assert json.loads(side.read_text()) == report
    assert report["mode"] == "tools" and report["failed"] is False and report["errors"] == []
    assert report["server"]["kind"] == server and report["args"]["server"] == server
    assert report["tool_pool"] > 200 and report["request"]["tool_choice"] == "required"
    assert "composed" in report["note"]
    assert [x["tools"] for x in report["results"]] == counts
    for x in report["results"]:
        assert set(x["in_process"]) == {"llguidance", "xgrammar"}
        assert set(x["server"]) == {"cold", "same", "reordered", "shuffled"}
        for engine in x["in_process"].values():
            assert set(engine) == {"compile_ms", "first_row_ms"}
        for scenario in x["server"].values():
            assert set(scenario) == {"first_row_ms", "spec_ms", "register_ms", "first_step_ms"}
            assert scenario["first_row_ms"]["n"] == 1
    floor = report["floor"]    # a one-line grammar's first row, once per round: rounds x counts samples
    assert floor["request"] == {"regex": "[0-9]+"}
    assert {k: floor[k]["n"] for k in ("first_row_ms", "spec_ms", "register_ms", "first_step_ms")} == dict.fromkeys(
        ("first_row_ms", "spec_ms", "register_ms", "first_step_ms"), len(counts))
    timings = [(p, v) for p, v in _timings([report["results"], floor]) if not p.endswith(".n")]
    assert len(timings) > 100
    assert all(isinstance(v, float) and v > 0 for _, v in timings), [t for t in timings if not t[1] > 0]
    md = (out / "tools.md").read_text()
    assert md.startswith("# maskd bench tools") and "all but one known, shuffled" in md and "composed" in md
    assert "same tools in another order" in md and "The server's floor, a one-line grammar the server holds" in md
    assert ("in a process of its own" in md) == (server == "subprocess")
    assert (out / "tools.png").stat().st_size > 1000


@pytest.mark.parametrize("flags, message", [
    (["--tools", "0"], "--tools"),
    (["--tools", "10,x"], "--tools"),
    (["--rounds", "-1"], "--rounds"),
    (["--rounds", "0"], "--rounds"),
    (["--threads", "0"], "--threads"),
    (["--data", "/nonexistent/maskbench"], "--data"),
    (["--data", SAMPLE], "--data"),      # a MaskBench folder without BFCL / Glaive files
])
def test_garbage_bench_tools_flags_are_clear_errors(tmp_path, flags, message):
    # refused before any data, tokenizer or server loads
    with pytest.raises(SystemExit) as exc:
        main(["bench", "tools", "--data", SAMPLE, "--out", str(tmp_path), *flags])
    assert message in str(exc.value.code)


def test_bench_vllm_tool_sets_replace_one_tool_each_in_an_order_of_their_own():
    from maskd.specs import GrammarSpec
    from maskd_tools.bench import vllm_workloads

    pool = [(f"t{i}", {"type": "object", "properties": {f"p{i}": {"type": "integer"}}}) for i in range(8)]
    base = vllm_workloads.base_tool_set(pool, 5)
    sets = vllm_workloads.tool_sets(pool, 5, 6, "r0")
    base_names = set(GrammarSpec.create("json_schema", base).parts.names)
    assert len(base_names) == 5
    for schema in sets:
        names = GrammarSpec.create("json_schema", schema).parts.names    # vLLM's call array: composed by maskd
        assert len(names) == 5 and len(base_names - set(names)) == 1 and len(set(names) - base_names) == 1
    assert len({json.dumps(s) for s in sets}) == 6
    assert vllm_workloads.tool_sets(pool, 5, 6, "r1") != sets           # another tag: other new tools


def test_bench_vllm_drafts_requests_title_a_fresh_grammar_and_keep_the_texts():
    from maskd_tools.bench import vllm_drafts
    from maskd_tools.bench.extraction_prompts import PROMPTS

    body, schema = vllm_drafts.request("account", 3, "drafts-0-1", None)
    assert body == {"prompt": vllm_drafts.vllm_workloads.account_prompt(3), "max_tokens": 96}
    assert schema["title"] == "account drafts-0-1" and schema["required"][0] == "id"
    texts = [vllm_drafts.request("extraction", i, "t", 50)[0]["messages"][0]["content"] for i in range(32)]
    assert len(set(texts)) == 32 and texts[0].endswith(PROMPTS[0].text)     # 8 schemas x 4 texts
    _, contact = vllm_drafts.request("extraction", 3, "t", None)
    assert contact["title"] == "Contact t" and contact["$defs"]["Address"]["additionalProperties"] is False


def _drafts_run(engine: str, mode: str, phase: str, rnd: int, tps: float, texts: list[str], accepted: float = 0.0,
                drafts: float = 0.0) -> dict:
    n = len(texts)
    return {"engine": engine, "mode": mode, "workload": "account", "concurrency": 1, "phase": phase, "round": rnd,
            "requests": n, "first_request": 0 if phase == "first" else n, "tokens_per_s": tps,
            "completion_tokens": 10 * n, "spec": {"drafts": drafts, "draft_tokens": 4 * drafts, "accepted": accepted},
            "maskd": {"step_ms_mean": 1.0, "proposed": {"forced": 3.0, "learned": 1.0},
                      "accepted": {"forced": 2.0, "learned": 1.0}},
            "itl_ms": {"p50": 50.0}, "valid": n, "errors": [], "texts": texts,
            "per_request": [{"tokens": 10, "seconds": 10 / tps, "chunks": 10 if engine == "no-drafts" else 4}] * n}


def test_bench_vllm_drafts_summary_compares_the_same_requests_of_both_engines():
    from maskd_tools.bench import vllm_drafts

    runs = []
    for r in range(2):
        for phase in ("first", "learned"):
            runs += [_drafts_run("no-drafts", "maskd", phase, r, 10.0, ["a", "b"]),
                     _drafts_run("no-drafts", "guidance", phase, r, 9.0, ["a", "x"]),
                     _drafts_run("drafts", "maskd", phase, r, 15.0 + r + (phase == "learned"),
                                 ["a", "b" if r == 0 else "c"], accepted=30.0, drafts=10.0)]
    rows = vllm_drafts.summarize(runs)
    assert [(x["phase"], x["requests"]) for x in rows] == [("first", 2), ("learned", 2)]
    first = rows[0]
    assert first["ratio"] == pytest.approx(1.55) and first["ratios"] == [pytest.approx(1.5), pytest.approx(1.6)]
    assert first["no_drafts_tokens_per_s"] == 10.0 and first["reference_tokens_per_s"] == 9.0
    assert first["tokens_per_verification"] == pytest.approx(4.0) and first["tokens_per_chunk"] == pytest.approx(2.5)
    assert first["identical"] == [3, 4] and first["reference_identical"] == [2, 4]
    assert first["maskd_drafts_proposed"] == {"forced": 6.0, "learned": 2.0}
    series = vllm_drafts.series(runs)
    assert [s["request"] for s in series] == [0, 1, 2, 3]
    assert series[0]["ratio"] == pytest.approx(1.55) and series[2]["ratio"] == pytest.approx(1.65)
    text = "\n".join(vllm_drafts.markdown({"num_speculative_tokens": 4, "reference": "guidance", "summary": rows,
                                           "series": series}))
    assert "| account | 1 | first | 2 | 10.0 | 15.5 | 1.55 | 9.0 | 4.00 | 2.50 |" in text
    assert "request by request" in text and "3: 1.65" in text


@needs_two_cpus
def test_burst(tmp_path):
    before = os.sched_getaffinity(0)
    report, out = _run("burst", tmp_path, "--batch", "4", "--decode-schemas", "1", "--fresh", "2",
                       "--concurrency", "2", "--steps-before", "3", "--steps-after", "2", "--forward-ms", "2",
                       "--pin", "1+1")
    assert os.sched_getaffinity(0) == before
    assert report["fresh_schemas"] == 2 and report["decode_schemas"] == 1
    m, ip = report["maskd"], report["in_process"]
    assert m["registers"] == 2 and m["register_errors"] == 0 and m["burst_seconds"] > 0
    assert m["wait"]["before"]["steps"] == 3 and m["wait"]["during"]["steps"] + m["wait"]["after"]["steps"] >= 2
    assert m["token_violations"] == 0 and m["masks_checked"] > 0 and report["violations"] == 0
    assert ip["compiles"] == 2 and ip["step"]["before"]["steps"] == 3
    _positive(ip["step"]["before"]["ms"])
    assert "burst_wait_p99_at_most_2ms" in report["targets"]
    assert "| during |" in (out / "burst.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--batch", "0"], "--batch"),
    (["--fresh", "-1"], "--fresh"),
    (["--forward-ms", "0"], "--forward-ms"),
])
def test_garbage_bench_burst_flags_are_clear_errors(tmp_path, flags, message):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "burst", "--data", SAMPLE, "--tokenizer", "cl100k", "--out", str(tmp_path), *flags])
    assert message in str(exc.value.code)
