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
from harness import ENGINE_OPTIONS, vllm_engine
from workloads import PERSON, RECORDS, greedy_parity_with_drafts

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
    greedy_parity_with_drafts(engine, reference, maskd_server, repeats=8)


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
