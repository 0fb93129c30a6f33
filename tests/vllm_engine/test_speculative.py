"""maskd under vLLM's speculative decoding (ngram drafts) in a real vLLM CPU engine.

Each step's scheduled drafts travel with the maskd step; the server answers one row per draft
position plus the bonus one, so verification applies the exact mask at every position. Proof:
greedy outputs equal those of vLLM's own backend without drafts (the reference engine) byte for
byte, drafts were proposed and accepted, and sampled outputs obey their schemas.
"""
import concurrent.futures
import json

import jsonschema
import pytest
from harness import ENGINE_OPTIONS, server_metric, vllm_engine
from workloads import PERSON, RECORDS, check, parity_requests

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


@pytest.fixture(scope="module")
def engine(logs, maskd_server):
    with vllm_engine(logs, *ENGINE_OPTIONS, "--speculative-config", NGRAM,
                     env={"MASKD_TARGET": maskd_server.address}, name="maskd-ngram") as e:
        yield e


def run_all(engine, requests: dict, workers: int = 8) -> dict:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {k: pool.submit(engine.post, body) for k, body in requests.items()}
        return {k: f.result() for k, f in futures.items()}


def test_greedy_outputs_with_drafts_equal_vllms_own_backend_without(engine, reference, maskd_server):
    requests = parity_requests()
    requests["forced-repeats"] = {"prompt": "maskd rocks maskd rocks", "max_tokens": 64, "temperature": 0,
                                  "structured_outputs": {"regex": "(maskd rocks ){8}"}}
    drafts, accepted = engine.metric("vllm:spec_decode_num_draft_tokens_total"), \
        engine.metric("vllm:spec_decode_num_accepted_tokens_total")
    rows = server_metric(maskd_server, "maskd_rows_sent_total")
    ours, theirs = run_all(engine, requests), run_all(reference, requests)
    assert engine.metric("vllm:spec_decode_num_draft_tokens_total") > drafts, "ngram proposed no drafts"
    assert engine.metric("vllm:spec_decode_num_accepted_tokens_total") > accepted, "no draft was accepted"
    assert server_metric(maskd_server, "maskd_rows_sent_total") > rows
    for name, (status, reply) in ours.items():
        assert status == 200, reply
        mine, ref = reply["choices"][0], theirs[name][1]["choices"][0]
        if name != "forced-repeats":
            check(name, mine)
        assert (mine["text"], mine["finish_reason"]) == (ref["text"], ref["finish_reason"]), name


def test_sampled_outputs_under_drafts_obey_their_schemas(engine):
    example = json.dumps({"items": [{"id": 1, "ok": True}, {"id": 2, "ok": False}, {"id": 3, "ok": True}]},
                         separators=(",", ":"))
    requests = {}
    for i in range(12):    # half as response_format, half naming maskd (vLLM used to drop those unconstrained)
        schema = RECORDS if i % 2 else PERSON
        constraint = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}} \
            if i % 4 < 2 else {"vllm_xargs": {"maskd": json.dumps({"json": schema, "disable_any_whitespace": True})}}
        requests[f"{'records' if i % 2 else 'person'}-{i}"] = {
            "prompt": f"Like {example} or {{\"name\":\"ann\",\"age\":3,\"admin\":true}}, #{i}:",
            "max_tokens": 96, "temperature": 1.0, "seed": i, **constraint}
    for name, (status, reply) in run_all(engine, requests).items():
        assert status == 200, reply
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), RECORDS if name.startswith("records") else PERSON)
