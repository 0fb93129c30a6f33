"""maskd as vLLM's logits processor: loaded through the real entry point by both model runners'
loaders, driven with vLLM's own request-state and batch-update objects against a real server.

The model runner itself needs a GPU; where it would run a kernel (staged writes, post_update
after sampling) the test writes the same tensors directly: the prompt and each sampled token into
``all_token_ids`` and the lengths into ``total_len``.
"""
import json
import os
import threading

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # vLLM's platform on a machine without a GPU

import numpy as np
import pytest
import torch
from sglang_drive import llguidance_rows
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.logits_processor.state import BatchUpdateBuilder
from vllm.v1.worker.gpu import buffer_utils
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    build_custom_logits_processors,
    build_custom_logits_processors_params_validator,
)
from vllm.v1.worker.gpu.states import RequestState

from maskd.server import MaskServer, ServerConfig
from maskd.server.tokenizers import load_tokenizer
from maskd_client.vllm import MaskdLogitsProcessor, MaskdV1LogitsProcessor
from conftest import hold_compiles

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
DOC = '{"ok": true}'
SLOTS = 8


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1)).start()
    yield srv
    srv.stop(grace=0.5)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("cl100k")


@pytest.fixture(scope="module")
def vllm_config():
    return VllmConfig()


@pytest.fixture
def target(server, monkeypatch):
    monkeypatch.setenv("MASKD_TARGET", server.address)
    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    return server.address


def request_state(tok):
    # vLLM's CPU platform reports UVA, but torch cannot pin memory without an accelerator: take
    # vLLM's own fallback for platforms without pinned memory (NonUvaBuffer, explicit copies).
    buffer_utils.is_uva_available = lambda: False
    return RequestState(max_num_reqs=SLOTS, max_model_len=256, max_num_batched_tokens=256, num_speculative_steps=0,
                        vocab_size=tok.ll.vocab_size, device=torch.device("cpu"), use_dense_all_token_ids=True)


class Runner:
    """The parts of Model Runner V2 around a logits processor: slots, tokens, the step order."""

    def __init__(self, proc, req_states, vocab):
        self.proc, self.rs, self.vocab = proc, req_states, vocab

    def add(self, req_id, prompt, params, prompt_len=None):
        """A new request (or one resumed after preemption: ``prompt`` then ends with its output so
        far and ``prompt_len`` is the user's prompt alone)."""
        rs = self.rs
        rs.add_request(req_id=req_id, prompt_len=len(prompt) if prompt_len is None else prompt_len,
                       all_token_ids=prompt, num_computed_tokens=0, max_tokens=64)
        slot = rs.req_id_to_index[req_id]
        for staged in (rs.all_token_ids, rs.total_len, rs.num_computed_tokens):   # what the kernel writes
            staged.clear_staged_writes()
        rs.all_token_ids.gpu[slot, :len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
        rs.total_len.gpu[slot] = len(prompt)
        return slot, self.proc.add_request(slot, params)

    def sampled(self, slot, token):   # post_update after sampling
        n = int(self.rs.total_len.gpu[slot])
        self.rs.all_token_ids.gpu[slot, n] = token
        self.rs.total_len.gpu[slot] = n + 1

    def step(self, slots):
        self.proc.apply_staged_writes()                  # before the forward pass
        logits = torch.zeros(len(slots), self.vocab)     # the forward pass
        idx = torch.tensor(slots, dtype=torch.long)
        ctx = LogitsContext(expanded_idx_mapping=idx, idx_mapping=idx, idx_mapping_np=np.array(slots),
                            expanded_local_pos=torch.zeros(len(slots), dtype=torch.long),
                            input_ids=torch.zeros(len(slots), dtype=torch.long),
                            pos=torch.zeros(len(slots), dtype=torch.long),
                            seq_lens_upper_bound_np=np.zeros(len(slots), dtype=np.int32))
        return self.proc.apply(logits, ctx)


def allowed_set(logits_row):
    return set(torch.nonzero(logits_row == 0).flatten().tolist())


def row_set(words_row, vocab):
    bits = np.unpackbits(np.ascontiguousarray(words_row).view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_model_runner_v2_loads_the_entry_point(vllm_config, tok):
    procs = build_custom_logits_processors(vllm_config, request_state(tok), False, ())
    assert [type(p) for p in procs] == [MaskdLogitsProcessor]


def test_v1_loader_gets_the_v1_class_from_the_same_entry_point(vllm_config):
    procs = build_logitsprocs(vllm_config, torch.device("cpu"), False, False, ())
    mine = [p for p in procs.all if isinstance(p, MaskdV1LogitsProcessor)]
    assert len(mine) == 1 and mine[0] in procs.non_argmax_invariant


def test_validate_params_at_admission(vllm_config, target, monkeypatch):
    validate = build_custom_logits_processors_params_validator(())
    validate(SamplingParams(extra_args={"maskd": {"json": SCHEMA}}))
    openai = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    validate(SamplingParams(extra_args={"maskd": openai}))
    validate(SamplingParams(extra_args={"maskd": json.dumps(openai)}))          # vllm_xargs over HTTP: JSON text
    validate(SamplingParams())                                            # not a maskd request
    for bad in ({"json": SCHEMA, "regex": "a"}, {"json_schema": {"name": "r", "strict": True}}, "regex", 7,
                {"type": "yaml"}, "{not json", json.dumps({"type": "json_schema", "json_schema": {"name": "r"}})):
        with pytest.raises(VLLMValidationError, match='extra_args\\["maskd"\\]'):
            validate(SamplingParams(extra_args={"maskd": bad}))
    monkeypatch.delenv("MASKD_TARGET")
    with pytest.raises(VLLMValidationError, match="MASKD_TARGET"):
        validate(SamplingParams(extra_args={"maskd": {"regex": "a"}}))
    validate(SamplingParams())                                            # still fine without maskd


def test_v2_decode_rows_equal_in_process_llguidance(vllm_config, target, tok):
    rs = request_state(tok)
    proc = build_custom_logits_processors(vllm_config, rs, False, ())[0]
    run = Runner(proc, rs, tok.ll.vocab_size)
    prompt = tok.encode("Answer in JSON:")
    shapes = [{"json": SCHEMA},                                                                  # vLLM
              {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},  # OpenAI
              {"json_schema": json.dumps(SCHEMA)}]                                              # SGLang
    slots = {}
    for i, shape in enumerate(shapes):
        slots[i], used = run.add(f"r{i}", prompt, SamplingParams(extra_args={"maskd": shape}))
        assert used
    plain, used = run.add("plain", prompt, SamplingParams())
    assert not used
    toks = tok.encode(DOC)
    expected = llguidance_rows(tok, json.dumps(SCHEMA), toks)
    order = [plain, *slots.values()]
    for pos in range(len(toks) + 1):
        logits = run.step(order)
        assert allowed_set(logits[0]) == set(range(tok.ll.vocab_size))       # the plain request untouched
        want = row_set(expected[pos], tok.ll.vocab_size)
        for k in range(1, len(order)):
            assert allowed_set(logits[k]) == want, (k, pos)
        if pos < len(toks):
            for s in slots.values():
                run.sampled(s, toks[pos])
    eos = tok.eos_token_ids[0]
    for s in slots.values():
        run.sampled(s, eos)
    logits = run.step(order)           # async scheduling may still schedule a finished request: EOS only
    for k in range(1, len(order)):
        assert allowed_set(logits[k]) == {eos}
    assert proc.failed == {}
    proc.close()


def test_v2_slot_reuse_resumed_requests_and_failures(vllm_config, target, tok, server):
    rs = request_state(tok)
    proc = MaskdLogitsProcessor(vllm_config, rs)
    run = Runner(proc, rs, tok.ll.vocab_size)
    prompt = tok.encode("go")
    live = server.service.live_sequences()
    a, _ = run.add("a", prompt, SamplingParams(extra_args={"maskd": {"regex": "[a-z]{2,6}"}}))
    run.step([a])
    run.sampled(a, tok.encode("x")[0])
    run.sampled(a, tok.encode("7")[0])      # two tokens in one step (not a decode step): beyond the window
    run.step([a])
    assert "tokens appeared in one step" in next(iter(proc.failed.values()))
    # the slot is reused by a request resumed after preemption: its output so far opens with it
    rs.remove_request("a")
    output = tok.encode("ab")
    b, _ = run.add("b", prompt + output, SamplingParams(extra_args={"maskd": {"regex": "[a-z]{2,6}"}}),
                   prompt_len=len(prompt))
    assert b == a                            # the slot is recycled
    logits = run.step([b])
    want = row_set(regex_row(tok, "[a-z]{2,6}", output), tok.ll.vocab_size)
    assert allowed_set(logits[0]) == want
    run.sampled(b, tok.encode("9")[0])      # a token the grammar rejects (vLLM sampled it unmasked)
    logits = run.step([b])
    assert allowed_set(logits[0]) == {tok.eos_token_ids[0]} and len(proc.failed) == 2
    proc.close()
    assert server.service.live_sequences() <= live + 1


def regex_row(tok, regex, prefix):
    import llguidance
    import llguidance.torch as lt
    m = llguidance.LLMatcher(tok.ll, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0)
    assert m.consume_tokens(prefix)
    out = lt.allocate_token_bitmask(1, tok.ll.vocab_size)
    lt.fill_next_token_bitmask(m, out, 0)
    return out.numpy()[0]


def test_v2_a_compiling_grammar_holds_the_batch_and_never_gets_all_allowed(vllm_config, target, tok, server):
    rs = request_state(tok)
    proc = MaskdLogitsProcessor(vllm_config, rs)
    run = Runner(proc, rs, tok.ll.vocab_size)
    gate = threading.Event()
    hold_compiles(server.cache, gate)                  # compiles wait for the gate
    threading.Timer(0.3, gate.set).start()
    s, _ = run.add("w", tok.encode("hi"), SamplingParams(extra_args={"maskd": {"regex": "z[0-9]{3}"}}))
    logits = run.step([s])
    assert allowed_set(logits[0]) == row_set(regex_row(tok, "z[0-9]{3}", []), tok.ll.vocab_size)
    assert proc.batch.polls > 0
    proc.close()


def test_v1_batch_updates_add_move_remove(vllm_config, target, tok):
    proc = MaskdV1LogitsProcessor(vllm_config, torch.device("cpu"), False)
    builder = BatchUpdateBuilder()
    out_a, out_b = [], []
    params = SamplingParams(extra_args={"maskd": {"choice": ["yes", "no"]}})
    builder.added.append((0, params, tok.encode("q"), out_a))
    builder.added.append((1, SamplingParams(), tok.encode("q"), []))
    builder.added.append((2, SamplingParams(extra_args={"maskd": {"regex": "[0-9]+"}}), tok.encode("q"), out_b))
    proc.update_state(builder.get_and_reset(3))
    logits = proc.apply(torch.zeros(3, tok.ll.vocab_size))
    yes, no = tok.encode("yes")[0], tok.encode("no")[0]
    assert {yes, no} <= allowed_set(logits[0]) and tok.encode("x")[0] not in allowed_set(logits[0])
    assert allowed_set(logits[1]) == set(range(tok.ll.vocab_size))
    assert tok.encode("7")[0] in allowed_set(logits[2])
    out_a.append(yes)
    out_b.append(tok.encode("7")[0])
    # request 1 finishes; request 2 moves into its place (the persistent batch condenses)
    builder.removed_append(1)
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality
    builder.moved.append((2, 1, MoveDirectionality.UNIDIRECTIONAL))
    proc.update_state(builder.get_and_reset(2))
    logits = proc.apply(torch.zeros(2, tok.ll.vocab_size))
    assert allowed_set(logits[0]) == {tok.eos_token_ids[0]}          # "yes" is complete
    assert tok.encode("7")[0] in allowed_set(logits[1]) and tok.eos_token_ids[0] in allowed_set(logits[1])
    proc.close()


def test_speculative_decoding_is_refused_at_start(tok):
    class Spec:
        num_speculative_tokens = 3

    class Config:
        speculative_config = Spec()

    with pytest.raises(ValueError, match="speculative decoding"):
        MaskdLogitsProcessor(Config(), request_state(tok))
