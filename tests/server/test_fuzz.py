"""Property-based fuzzing of a real server over the wire: Step messages, RegisterGrammar requests
and raw bytes. Whatever arrives, every message gets an answer with the right shape (or the call a
clear status), the server stays up, and a well-behaved client next to the fuzzer is never hurt.

Each fuzzer runs for --fuzz-seconds (default $MASKD_FUZZ_SECONDS, else 20) or its example budget
(which grows with the flag), whichever ends first: under a minute for the three in `make test`,
longer with the flag.
"""
import queue
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from maskd.rowcodec import RowBlockDecoder
from maskd.server import Limits, MaskServer, ServerConfig
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc

C = grpc.StatusCode
VOCAB = 100277
SETTINGS = settings(max_examples=2000, deadline=None, derandomize=False, database=None,
                    suppress_health_check=list(HealthCheck))


def budget(fuzz_seconds: float) -> settings:
    """The example budget grows with --fuzz-seconds (2,000 at the default 20 s, ~100 per second
    beyond), so that a longer run really runs longer; the deadline in each fuzzer still bounds it."""
    return settings(SETTINGS, max_examples=max(2000, int(100 * fuzz_seconds)))


GOOD_SPECS = [GrammarSpec.from_dict(d).to_proto() for d in (
    {"regex": "[0-9]{1,4}"}, {"choice": ["yes", "no"]}, {"json_schema": {"type": "boolean"}},
    {"lark": 'start: "a"+'}, {"ebnf": 'root ::= "x" | "y"'})]

# Stands for the id of a grammar registered (compiled) before the fuzzer starts, so that entries
# reach READY however slowly the fuzzed specs compile.
REGISTERED = "registered-before-the-fuzzer"
ints = st.one_of(st.integers(0, 200), st.integers(-5, VOCAB + 5), st.integers(-(2 ** 31), 2 ** 31 - 1))
texts = st.text(max_size=40)


@st.composite
def grammar_specs(draw):
    if draw(st.booleans()):
        return draw(st.sampled_from(GOOD_SPECS))
    kind = draw(st.sampled_from(["json_schema", "regex", "lark", "ebnf", "structural_tag", "choice", "none"]))
    msg = pb.GrammarSpec()
    if kind == "choice":
        msg.choice.items.extend(draw(st.lists(texts, max_size=3)))
    elif kind != "none":
        setattr(msg, kind, draw(st.one_of(texts, st.sampled_from(['{"type": "object"}', "[", "{}", "start: x"]))))
    msg.options.whitespace = draw(st.integers(0, 4))
    if draw(st.booleans()):
        msg.options.reasoning_start, msg.options.reasoning_end = draw(texts), draw(texts)
    return msg


@st.composite
def seq_steps(draw):
    e = pb.SeqStep(seq_id=draw(st.sampled_from(["a", "b", "c", "", "x" * 300])), step=draw(st.integers(0, 6)),
                   tokens=draw(st.lists(ints, max_size=6)), draft_tokens=draw(st.lists(ints, max_size=4)),
                   rollback=draw(st.integers(0, 3)), close=draw(st.booleans()) and draw(st.booleans()),
                   history_offset=draw(st.sampled_from([0, 0, 0, 1, 7])))
    which = draw(st.sampled_from(["none", "none", "spec", "id"]))
    if which == "spec":
        e.spec.CopyFrom(draw(grammar_specs()))
    elif which == "id":
        e.grammar_id = draw(st.sampled_from(["", "g-nope", "g-" + "0" * 32, REGISTERED, REGISTERED]))
    return e


@st.composite
def columnar_fields(draw):
    """A request's columnar part: none, packed arrays of random handles/steps/tokens (some name live
    sequences: handles are small integers), or garbage bytes in each field."""
    kind = draw(st.sampled_from(["none", "none", "packed", "packed", "garbage"]))
    if kind == "none":
        return {}
    if kind == "garbage":
        return {f: draw(st.binary(max_size=30)) for f in ("handles", "steps", "token_counts", "tokens")}
    n = draw(st.integers(0, 6))
    counts = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    if draw(st.integers(0, 5)) == 0 and n:   # counts that disagree with the tokens
        counts[0] += 1
        tokens = draw(st.lists(ints, min_size=sum(counts) - 1, max_size=sum(counts) - 1))
    else:
        tokens = draw(st.lists(ints, min_size=sum(counts), max_size=sum(counts)))
    return {"handles": np.array(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)), "<u4").tobytes(),
            "steps": np.array(draw(st.lists(st.integers(0, 8), min_size=n, max_size=n)), "<u4").tobytes(),
            "token_counts": np.array(counts, "<u4").tobytes(),
            "tokens": np.array(tokens, "<i8").astype("<i4").tobytes()}


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=2,
                                  limits=Limits(max_message_bytes=1 << 20, compile_timeout_s=10.0))).start()
    yield srv
    srv.stop(grace=0.5)


def bystander_works(address, n=3):
    """A well-behaved client's sequence still answers right."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.MaskServiceStub(ch)
        gid = stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=GOOD_SPECS[0], wait=True)).grammar_id
        reqs = [pb.StepRequest(seqs=[pb.SeqStep(seq_id="by", step=0, grammar_id=gid)])]
        reqs += [pb.StepRequest(seqs=[pb.SeqStep(seq_id="by", step=i + 1, tokens=[15])]) for i in range(n)]
        replies = list(stub.Session(iter(reqs), timeout=30))
    return all(r.results[0].status == pb.SEQ_STATUS_READY for r in replies)


def test_fuzzed_step_messages_always_get_well_formed_answers(server, fuzz_seconds):
    deadline = time.monotonic() + fuzz_seconds
    ch = grpc.insecure_channel(server.address)
    q: queue.SimpleQueue = queue.SimpleQueue()
    call = pb_grpc.MaskServiceStub(ch).Session(iter(q.get, None))
    decoder = RowBlockDecoder((VOCAB + 31) // 32, VOCAB)
    seen = {"messages": 0, "statuses": set(), "columnar": set()}
    registered = pb_grpc.MaskServiceStub(ch).RegisterGrammar(
        pb.RegisterGrammarRequest(spec=GOOD_SPECS[0], wait=True), timeout=120).grammar_id

    # The first examples: one entry surely READY, one columnar entry surely refused (an unknown
    # handle), so the coverage checks at the end never depend on what the random ones hit.
    @budget(fuzz_seconds)
    @given(st.lists(seq_steps(), max_size=8), st.booleans(), columnar_fields())
    @example([pb.SeqStep(seq_id="ready", step=0, grammar_id=REGISTERED)], False, {})
    @example([], False, {"handles": np.array([4000], "<u4").tobytes(), "steps": np.array([1], "<u4").tobytes(),
                         "token_counts": np.array([0], "<u4").tobytes(), "tokens": b""})
    def one_message(entries, forced, columns):
        if time.monotonic() > deadline:
            return
        for e in entries:
            if e.grammar_id == REGISTERED:
                e.grammar_id = registered
        q.put(pb.StepRequest(seqs=entries, want_forced_tokens=forced, **columns))
        reply = next(call)
        seen["messages"] += 1
        assert len(reply.results) == len(entries)
        rows = decoder.decode(reply.row_block, reply.num_rows)
        n_plain = len(columns.get("handles", b"")) // 4
        assert len(reply.statuses) == n_plain           # one answer per columnar entry, well formed or not
        for status in reply.statuses:
            assert status & 0x0F in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_WAITING, pb.SEQ_STATUS_FAILED,
                                     pb.SEQ_STATUS_FINISHED, pb.SEQ_STATUS_ERROR)
            seen["columnar"].add(status & 0x0F)
        for problem in reply.problems:
            assert 0 <= problem.index < n_plain and problem.reason and problem.code != C.UNKNOWN.value[0]
        for e, r in zip(entries, reply.results):
            assert r.seq_id == e.seq_id and r.step == e.step
            seen["statuses"].add(r.status)
            assert r.status in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_WAITING, pb.SEQ_STATUS_FAILED,
                                pb.SEQ_STATUS_FINISHED, pb.SEQ_STATUS_CLOSED, pb.SEQ_STATUS_ERROR)
            if r.status in (pb.SEQ_STATUS_ERROR, pb.SEQ_STATUS_FAILED):
                assert r.code and r.reason and r.code != C.UNKNOWN.value[0]
            if r.status in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FINISHED):
                assert r.num_rows >= 1 and r.first_row + r.num_rows <= len(rows)
                assert not (rows[r.first_row] & ~_width_mask()).any()

    try:
        one_message()
    finally:
        q.put(None)
        ch.close()
    print(f"step fuzzer: {seen['messages']} messages")
    assert seen["messages"] > 50
    assert {pb.SEQ_STATUS_ERROR, pb.SEQ_STATUS_READY} <= seen["statuses"]
    assert pb.SEQ_STATUS_ERROR in seen["columnar"]   # unknown handles and malformed arrays answer per entry
    assert bystander_works(server.address)


def _width_mask() -> np.ndarray:
    mask = np.full((VOCAB + 31) // 32, -1, dtype=np.int32)
    mask[-1] = (1 << (VOCAB % 32)) - 1
    return mask


def test_fuzzed_register_grammar_gets_a_clear_status(server, fuzz_seconds):
    deadline = time.monotonic() + fuzz_seconds
    ch = grpc.insecure_channel(server.address)
    stub = pb_grpc.MaskServiceStub(ch)
    count = [0]

    @budget(fuzz_seconds)
    @given(grammar_specs(), st.booleans(), st.sampled_from(["", "llguidance", "nope"]),
           st.sampled_from(["", "00" * 32]))
    def one_call(spec, wait, backend, fingerprint):
        if time.monotonic() > deadline:
            return
        count[0] += 1
        try:
            reply = stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=spec, wait=wait, backend=backend,
                                                                   tokenizer_fingerprint=fingerprint), timeout=60)
            assert reply.grammar_id.startswith("g-")
        except grpc.RpcError as exc:
            assert exc.code() in (C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION), exc.details()
            assert exc.details()

    try:
        one_call()
    finally:
        ch.close()
    print(f"RegisterGrammar fuzzer: {count[0]} calls")
    assert count[0] > 50
    assert bystander_works(server.address)


def test_raw_bytes_on_every_method_never_end_the_server(server, fuzz_seconds):
    deadline = time.monotonic() + fuzz_seconds
    ch = grpc.insecure_channel(server.address)
    methods = {name: ch.unary_unary(f"/maskd.v1.MaskService/{name}", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b) for name in ("Info", "RegisterGrammar")}
    session = ch.stream_stream("/maskd.v1.MaskService/Session", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    count = [0]

    @budget(fuzz_seconds)
    @given(st.sampled_from(["Info", "RegisterGrammar", "Session"]), st.lists(st.binary(max_size=200), min_size=1,
                                                                               max_size=3))
    def one_call(method, payloads):
        if time.monotonic() > deadline:
            return
        count[0] += 1
        try:
            if method == "Session":
                for reply in session(iter(payloads), timeout=30):
                    pb.StepResponse.FromString(reply)
            else:
                methods[method](payloads[0], timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in (C.INVALID_ARGUMENT, C.INTERNAL, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION), \
                (exc.code(), exc.details())

    try:
        one_call()
    finally:
        ch.close()
    print(f"raw-bytes fuzzer: {count[0]} calls")
    assert count[0] > 50
    assert bystander_works(server.address)
