"""vllm_timeline: each request's TTFT phases from the stamps of vLLM's processes and the client."""
from __future__ import annotations

import pytest

from maskd_tools.bench import vllm_timeline as tl

# Two requests in flight at once: "cmpl-a" (maskd's: admitted on thread 7, its register 0.004 s)
# and "cmpl-b" (unconstrained: no admission), their stamps interleaved as vLLM's processes write them.
STAMPS = [
    (10.000, "add_request", "cmpl-a-0 111"),
    (10.001, "admit", "111 7"),
    (10.0015, "add_request", "cmpl-b-0 222"),
    (10.002, "register", "7"),
    (10.003, "engine_core", "cmpl-b-0-x1"),
    (10.004, "scheduled", "cmpl-b-0-x1"),
    (10.006, "registered", "7"),
    (10.007, "admitted", "111 7"),
    (10.0075, "admit", "111 9"),          # vLLM's own validation finds it admitted: not its admission
    (10.0076, "admitted", "111 9"),
    (10.009, "engine_core", "cmpl-a-0-y2"),
    (10.012, "first_output", "cmpl-b-0-x1"),
    (10.013, "scheduled", "cmpl-a-0-y2,cmpl-c-0-z3"),
    (10.025, "first_output", "cmpl-a-0-y2"),
]


def test_each_request_gets_its_own_phases_in_milliseconds():
    requests = [{"id": "cmpl-a", "t0": 9.998, "ttft": 0.028}, {"id": "cmpl-b", "t0": 9.9995, "ttft": 0.0135}]
    a, b = tl.phases(STAMPS, requests)
    assert a == pytest.approx({
        "HTTP request to vLLM's add_request": 2.0, "maskd admission (spec read, register)": 7.0,
        "  of which the register": 4.0, "to the engine core": 2.0, "waiting to be scheduled": 4.0,
        "first step (forward, bitmask, sample)": 12.0, "first token to the client": 1.0, "TTFT": 28.0})
    assert b == pytest.approx({
        "HTTP request to vLLM's add_request": 2.0, "maskd admission (spec read, register)": 0.0,
        "  of which the register": 0.0, "to the engine core": 1.5, "waiting to be scheduled": 1.0,
        "first step (forward, bitmask, sample)": 8.0, "first token to the client": 1.0, "TTFT": 13.5})
    summary = tl.summarize([a, b])
    assert summary["requests"] == 2 and summary["TTFT"] == pytest.approx(20.75)


def test_a_request_without_all_its_stamps_or_an_answer_is_left_out():
    assert tl.phases(STAMPS[:-1], [{"id": "cmpl-a", "t0": 9.998, "ttft": 0.028}]) == []   # no first output
    assert tl.phases(STAMPS, [{"id": "cmpl-a", "t0": 9.998, "ttft": None}]) == []          # it failed
    assert tl.phases(STAMPS, [{"id": None, "t0": None, "ttft": None}]) == []
    assert tl.summarize([]) == {"requests": 0}


def test_stamps_are_read_from_every_process_in_time_order(tmp_path):
    prefix = tmp_path / "timeline-vllm"
    (tmp_path / "timeline-vllm.101").write_text("10.5 engine_core cmpl-a-0-y2\n10.2 add_request cmpl-a-0 111\n")
    (tmp_path / "timeline-vllm.102").write_text("10.3 bitmask \n")
    (tmp_path / "other.103").write_text("9.0 add_request cmpl-z-0 1\n")
    assert tl.read(prefix) == [(10.2, "add_request", "cmpl-a-0 111"), (10.3, "bitmask", ""),
                               (10.5, "engine_core", "cmpl-a-0-y2")]


def test_the_plugin_does_nothing_unless_the_bench_asks(monkeypatch):
    # vLLM runs every general plugin in each of its processes: without the bench's variable this one
    # neither imports vLLM nor wraps anything
    monkeypatch.delenv(tl.ENV, raising=False)
    assert tl.register() is None


def test_bench_vllm_reports_each_phase_as_the_median_of_its_rounds():
    from maskd_tools.bench import common, vllm

    def run(r: int) -> dict:
        latency = {"n": 1, "p50": 20.0 + r, "p99": 30.0}
        return {"engine": "guidance", "workload": "tools", "concurrency": 1, "round": r, "mode": "maskd",
                "tokens_per_s": 50.0, "ttft_ms": latency, "itl_ms": latency, "valid": 1, "structured": 1,
                "errors": [], "timeline": {"requests": 24, **{label: 1.0 + r for label, _, _ in tl.PHASES},
                                           "TTFT": 20.0 + r}}

    (row,) = vllm._summarize([run(0), run(1), run(5)])
    assert row["timeline"]["maskd admission (spec read, register)"] == 2.0 and row["timeline"]["TTFT"] == 21.0
    table = vllm._markdown({"command": "maskd bench vllm", "machine": common.machine_info(), "placement": {},
                            "model": "m", "maskd_tools": "t", "maskd_tokenizer": "t", "summary": [row],
                            "schemas": {"tools": 1}, "refused_by_backend": {}, "burst_summary": [], "profiles": []})
    assert "| phase | guidance tools c=1 maskd |" in table
    assert "| maskd admission (spec read, register) | 2.0 |" in table and "| requests timed | 24 |" in table
