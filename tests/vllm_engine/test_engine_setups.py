"""How an engine is set up: maskd installed but not configured; tensor parallelism with a batch
that mixes maskd, vLLM's own backend and unconstrained requests; a reasoning parser."""
import concurrent.futures
import json
import re

import jsonschema
import pytest
from harness import EAGER, ENGINE_OPTIONS, THINK_END, server_metric, vllm_engine
from workloads import PERSON

THINK_END_ID = 128822      # "</think>" in the deepseek-v4 vocabulary


def run_all(engine, requests: dict, path: str = "/v1/completions", workers: int = 16) -> dict:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {k: pool.submit(engine.post, body, path) for k, body in requests.items()}
        return {k: f.result() for k, f in futures.items()}


def test_an_engine_with_maskd_installed_and_not_configured_serves_every_request(reference):
    # The reference engine is that engine (conftest: no MASKD_TARGET). Requests that finish out of
    # order compact vLLM's batch: with maskd's old logits processor that step raised (MASKD_TARGET
    # unset) and every request in flight got HTTP 500.
    requests = {f"plain-{i}": {"prompt": f"Request {i}:", "max_tokens": 4 + (i * 7) % 60, "temperature": 0.7,
                               "seed": i} for i in range(64)}
    requests.update({f"guidance-{i}": {"prompt": f"JSON {i}:", "max_tokens": 64, "temperature": 0.7, "seed": i,
                                       "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "p", "schema": PERSON}}}
                     for i in range(8)})
    replies = run_all(reference, requests)
    for name, (status, reply) in replies.items():
        assert status == 200, (name, reply)
        if name.startswith("guidance"):
            jsonschema.validate(json.loads(reply["choices"][0]["text"]), PERSON)
    status, reply = reference.post({"prompt": "x", "max_tokens": 4, "vllm_xargs": {"maskd": '{"regex": "a+"}'}})
    assert status == 400 and "MASKD_TARGET" in json.dumps(reply), reply
    assert reference.alive() and reference.complete({"prompt": "still", "max_tokens": 4})


@pytest.fixture(scope="module")
def tp_engine(logs, maskd_server):
    env = {"MASKD_TARGET": maskd_server.address, "MASKD_VLLM_REQUESTS": "xargs",
           "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with vllm_engine(logs, *ENGINE_OPTIONS, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                     "--reasoning-parser", "deepseek_r1", env=env, name="maskd-tp2") as e:
        yield e


def test_tensor_parallel_mixed_batch_compiles_each_grammar_once(tp_engine, maskd_server):
    # prompts that end with </think>: the reasoning parser lets the grammar start at once
    tp_person = {**PERSON, "title": "tp-person"}         # grammars no other test compiled
    tp_code = "[a-z]{2}-tp-[0-9]"
    requests = {}
    for i in range(4):
        requests[f"maskd-json-{i}"] = {"vllm_xargs": {"maskd": json.dumps({"json": tp_person,
                                                                           "disable_any_whitespace": True})}}
        requests[f"maskd-regex-{i}"] = {"vllm_xargs": {"maskd": json.dumps({"regex": tp_code})}}
        requests[f"guidance-{i}"] = {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "p", "schema": PERSON}}}
        requests[f"plain-{i}"] = {"max_tokens": 8 + 16 * i}
    for i, body in enumerate(requests.values()):
        body.update({"prompt": f"Case {i} {THINK_END}", "temperature": 0.8, "seed": i})
        body.setdefault("max_tokens", 64)
    compiles = server_metric(maskd_server, "maskd_compile_seconds_count")
    for name, (status, reply) in run_all(tp_engine, requests).items():
        assert status == 200, (name, reply)
        text = reply["choices"][0]["text"]
        if name.startswith(("maskd-json", "guidance")):
            jsonschema.validate(json.loads(text), PERSON)
        elif name.startswith("maskd-regex"):
            assert re.fullmatch(tp_code, text), text
    # two ranks, eight maskd requests, two new grammars: two compiles on the server
    assert server_metric(maskd_server, "maskd_compile_seconds_count") - compiles == 2


def test_a_reasoning_parser_keeps_the_grammar_off_the_thinking(tp_engine):
    body = {"messages": [{"role": "user", "content": "Think, then answer in JSON."}], "max_tokens": 120,
            "temperature": 1.0, "logit_bias": {str(THINK_END_ID): 9.0},
            "vllm_xargs": {"maskd": json.dumps({"json": PERSON, "disable_any_whitespace": True})}}
    thought = 0
    for seed in range(4):
        status, reply = tp_engine.post({**body, "seed": seed}, "/v1/chat/completions")
        assert status == 200, reply
        message = reply["choices"][0]["message"]
        jsonschema.validate(json.loads(message["content"]), PERSON)
        reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
        thought += bool(reasoning.strip()) and not reasoning.lstrip().startswith("{")
    assert thought, "no output had a free thinking part before its JSON"


def test_bench_vllm_runs_end_to_end(tmp_path):
    """``maskd bench vllm`` at its smallest: one engine, one workload, every mode, a report; with
    ``--drafts``, grammar drafts' comparison too: that engine serves the drafts' workload without
    drafts, then one more engine (the only one added) with maskd's drafts."""
    import subprocess
    import sys

    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "maskd.cli", "bench", "vllm", "--engines", "guidance",
                           "--workloads", "free-text", "--concurrency", "2", "--requests", "2", "--rounds", "1",
                           "--max-tokens", "16", "--maskd-cpus", "", "--vllm-omp-cpus", "auto", "--out", str(out),
                           "--drafts", "2", "--drafts-workloads", "account", *(f"--vllm-arg={a}" for a in EAGER)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "vllm.json").read_text())
    assert {r["mode"] for r in report["summary"]} == {"unconstrained", "guidance", "maskd"}
    assert all(r["errors"] == 0 and r["tokens_per_s"] > 0 for r in report["summary"])
    text = (out / "vllm.md").read_text()
    assert text.count("| guidance | free-text | 2 |") == 3
    drafts = report["drafts"]
    assert {(r["engine"], r["mode"]) for r in drafts["runs"]} == {("no-drafts", "maskd"), ("no-drafts", "guidance"),
                                                                  ("drafts", "maskd")}
    assert all(not r["errors"] and r["completion_tokens"] > 0 for r in drafts["runs"])
    assert sum(r["spec"]["draft_tokens"] for r in drafts["runs"] if r["engine"] == "drafts") > 0
    assert not any(r["spec"]["draft_tokens"] for r in drafts["runs"] if r["engine"] == "no-drafts")
    assert [(r["phase"], r["requests"], r["identical"][1]) for r in drafts["summary"]] == [("first", 2, 2),
                                                                                         ("learned", 2, 2)]
    assert "## Grammar drafts (2 per step), greedy" in text and "| account | 2 | first | 2 |" in text
