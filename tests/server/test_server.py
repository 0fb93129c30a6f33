"""The real gRPC server on a loopback port: protocol behaviour and every kind of bad input."""
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import allowed_ids
from maskd.rowcodec import RowBlockDecoder
from maskd.server import Limits, MaskServer, ServerConfig
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import SESSION_METADATA_KEY

C = grpc.StatusCode
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    limits = Limits(max_message_bytes=1 << 20, max_grammar_bytes=4096)
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1,
                                  metrics_port=0, limits=limits)).start()
    yield srv
    srv.stop(grace=1.0)


class Reply:
    """A StepResponse with its rows decoded (the row dictionary is per stream)."""

    def __init__(self, msg, dense):
        self.msg, self.dense = msg, dense

    def __getattr__(self, name):
        return getattr(self.msg, name)


class Stream:
    """One session stream driven message by message."""

    def __init__(self, stub, session=None):
        self._q = []
        self._cv = threading.Condition()
        self._closed = False
        md = ((SESSION_METADATA_KEY, session),) if session else ()
        self.call = stub.Session(self._requests(), metadata=md)
        self.decoder = None


    def _requests(self):
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    return
                item = self._q.pop(0)
            yield item

    def send(self, *seqs, forced=False):
        return self.send_request(pb.StepRequest(seqs=list(seqs), want_forced_tokens=forced))

    def send_request(self, request):
        with self._cv:
            self._q.append(request)
            self._cv.notify()
        reply = next(self.call)
        if self.decoder is None:
            self.decoder = RowBlockDecoder(reply.words_per_row, 100277)
        return Reply(reply, self.decoder.decode(reply.row_block, reply.num_rows))

    def close(self):
        with self._cv:
            self._closed = True
            self._cv.notify()
        try:
            for _ in self.call:
                pass
        except grpc.RpcError:
            pass


def step(seq_id, n, tokens=(), spec=None, **kw):
    s = pb.SeqStep(seq_id=seq_id, step=n, tokens=list(tokens), **kw)
    if spec is not None:
        s.spec.CopyFrom(GrammarSpec.from_dict(spec).to_proto())
    return s


def rows(reply, result):
    return reply.dense[result.first_row]


def test_info(stub, cl100k):
    info = stub.Info(pb.InfoRequest())
    assert info.backend == "llguidance" and info.tokenizer == "cl100k"
    assert info.vocab_size == 100277 and info.logits_width == 100277
    assert info.words_per_row == (100277 + 31) // 32
    assert info.tokenizer_fingerprint == cl100k.fingerprint
    assert list(info.eos_token_ids) == [100257]
    assert info.row_dictionary_size == 256 and pb.ROW_ENCODING_DICT_REF in info.row_encodings


def test_health_serving(server):
    with grpc.insecure_channel(server.address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "maskd.v1.MaskService"):
            assert h.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_register_ok_and_compile_error(stub):
    ok = stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=GrammarSpec.from_dict({"regex": "[0-9]+"}).to_proto(),
                                                        wait=True))
    assert ok.state == pb.GRAMMAR_STATE_READY and ok.grammar_id.startswith("g-")
    again = stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=GrammarSpec.from_dict({"regex": "[0-9]+"}).to_proto()))
    assert again.grammar_id == ok.grammar_id
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterGrammar(pb.RegisterGrammarRequest(
            spec=GrammarSpec.from_dict({"lark": "start: nothing_here"}).to_proto(), wait=True))
    assert err.value.code() == C.INVALID_ARGUMENT
    assert "does not compile" in err.value.details() and "unknown name" in err.value.details()


@pytest.mark.parametrize("req,code,text", [
    (pb.RegisterGrammarRequest(), C.INVALID_ARGUMENT, "needs a spec"),
    (pb.RegisterGrammarRequest(spec=pb.GrammarSpec()), C.INVALID_ARGUMENT, "names no kind"),
    (pb.RegisterGrammarRequest(spec=pb.GrammarSpec(json_schema="{oops")), C.INVALID_ARGUMENT, "not valid JSON"),
    (pb.RegisterGrammarRequest(spec=pb.GrammarSpec(regex="[0-9]+", options=pb.GrammarOptions(whitespace=42))),
     C.INVALID_ARGUMENT, "whitespace"),
    (pb.RegisterGrammarRequest(spec=pb.GrammarSpec(regex="a" * 5000)), C.RESOURCE_EXHAUSTED, "limit is 4096"),
    (pb.RegisterGrammarRequest(spec=pb.GrammarSpec(regex="a"), backend="outlines"), C.INVALID_ARGUMENT,
     "not 'outlines'"),
    (pb.RegisterGrammarRequest(spec=pb.GrammarSpec(regex="a"), tokenizer_fingerprint="00" * 32),
     C.FAILED_PRECONDITION, "does not match"),
])
def test_register_garbage(stub, req, code, text):
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterGrammar(req)
    assert err.value.code() == code
    assert text in err.value.details()


def test_steps_rows_and_finish(stub, cl100k):
    s = Stream(stub)
    r = s.send(step("a", 0, spec={"regex": "[0-9]{1,2}"}))
    while r.results[0].status == pb.SEQ_STATUS_WAITING:
        r = s.send(step("a", r.results[0].step + 1))
    res = r.results[0]
    assert res.status == pb.SEQ_STATUS_READY and res.num_rows == 1
    first = allowed_ids(rows(r, res))
    assert first and all(cl100k.decode([i]).isdigit() for i in first)
    n = res.step
    r = s.send(step("a", n + 1, cl100k.encode("42")))
    assert r.results[0].status == pb.SEQ_STATUS_FINISHED and r.results[0].accepting
    assert allowed_ids(rows(r, r.results[0])) == {100257}
    s.close()


def wait_ready(s, seq_id, spec):
    r = s.send(step(seq_id, 0, spec=spec))
    n = 0
    while r.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        time.sleep(0.01)
        r = s.send(step(seq_id, n))
    assert r.results[0].status == pb.SEQ_STATUS_READY, r.results[0].reason
    return n


def test_repeat_is_idempotent_and_divergence_is_refused(stub, cl100k):
    s = Stream(stub)
    n = wait_ready(s, "x", {"json_schema": SCHEMA})
    toks = cl100k.encode('{"ok"')
    r1 = s.send(step("x", n + 1, toks))
    r2 = s.send(step("x", n + 1, toks))  # repeat: same rows, no advance
    assert r1.results[0].status == r2.results[0].status == pb.SEQ_STATUS_READY
    assert np.array_equal(r1.dense[0], r2.dense[0])
    r3 = s.send(step("x", n + 1, cl100k.encode('{"no"')))
    assert r3.results[0].status == pb.SEQ_STATUS_ERROR and r3.results[0].code == C.ABORTED.value[0]
    assert "divergence" in r3.results[0].reason
    r4 = s.send(step("x", n + 2, cl100k.encode(': true}')))  # the sequence is intact
    assert r4.results[0].status == pb.SEQ_STATUS_FINISHED
    s.close()


def test_rejected_token_fails_only_that_sequence(stub, cl100k):
    s = Stream(stub)
    na = wait_ready(s, "good", {"regex": "[a-z]+"})
    nb = wait_ready(s, "bad", {"regex": "[a-z]+"})
    r = s.send(step("good", na + 1, cl100k.encode("abc")), step("bad", nb + 1, cl100k.encode("123")))
    good, bad = r.results
    assert good.status == pb.SEQ_STATUS_READY and r.num_rows == 1 and good.first_row == 0
    assert bad.status == pb.SEQ_STATUS_FAILED and "token rejected" in bad.reason
    # The failed sequence keeps answering FAILED; the good one carries on.
    r = s.send(step("good", na + 2, cl100k.encode("d")), step("bad", nb + 2, cl100k.encode("x")))
    assert r.results[0].status == pb.SEQ_STATUS_READY and r.results[1].status == pb.SEQ_STATUS_FAILED
    s.close()


@pytest.mark.parametrize("make,code,text", [
    (lambda n: step("s", n + 5), C.FAILED_PRECONDITION, "out of order"),
    (lambda n: step("s", n + 1, [100277 + 5]), C.INVALID_ARGUMENT, "outside the vocabulary"),
    (lambda n: step("s", n + 1, [-1]), C.INVALID_ARGUMENT, "outside the vocabulary"),
    (lambda n: step("s", n + 1, [1], draft_tokens=list(range(40))), C.INVALID_ARGUMENT, "draft tokens"),
    (lambda n: step("nobody", 3), C.NOT_FOUND, "unknown sequence"),
    (lambda n: step("s", n + 1, spec={"regex": "[0-9]"}), C.ALREADY_EXISTS, "already open"),
    (lambda n: step("s", n, spec={"regex": "[a-z]"}), C.ALREADY_EXISTS, "already open"),
    (lambda n: step("s", n + 1, rollback=99), C.OUT_OF_RANGE, "roll back"),
    (lambda n: pb.SeqStep(seq_id="new", step=0, grammar_id="g-nope"), C.NOT_FOUND, "unknown grammar id"),
    (lambda n: step("new2", 0, spec={"regex": "a" * 5000}), C.RESOURCE_EXHAUSTED, "limit is 4096"),
    (lambda n: pb.SeqStep(seq_id="new3", step=0, spec=pb.GrammarSpec()), C.INVALID_ARGUMENT, "names no kind"),
    (lambda n: step("s", n + 1, close=False, rollback=0, tokens=[]) , None, None),
])
def test_bad_steps_get_a_status_and_lose_nothing(stub, cl100k, make, code, text):
    s = Stream(stub)
    n = wait_ready(s, "s", {"regex": "[0-9]{1,4}"})
    r = s.send(make(n))
    res = r.results[0]
    if code is None:
        assert res.status == pb.SEQ_STATUS_READY
        n += 1
    else:
        assert res.status == pb.SEQ_STATUS_ERROR, res
        assert res.code == code.value[0], res.reason
        assert text in res.reason
    # The stream and the sequence still work.
    r = s.send(step("s", n + 1, cl100k.encode("7")))
    assert r.results[0].status == pb.SEQ_STATUS_READY, r.results[0].reason
    s.close()


def test_same_sequence_twice_in_one_step(stub):
    s = Stream(stub)
    n = wait_ready(s, "d", {"regex": "[0-9]+"})
    r = s.send(step("d", n + 1, [15]), step("d", n + 1, [15]))
    assert r.results[0].status == pb.SEQ_STATUS_READY
    assert r.results[1].status == pb.SEQ_STATUS_ERROR and "twice" in r.results[1].reason
    s.close()


def test_close_frees_and_closed_is_unknown(stub, server):
    s = Stream(stub)
    n = wait_ready(s, "c", {"regex": "[0-9]+"})
    r = s.send(pb.SeqStep(seq_id="c", step=n, close=True))
    assert r.results[0].status == pb.SEQ_STATUS_CLOSED and r.num_rows == 0
    r = s.send(step("c", n + 1, [15]))
    assert r.results[0].code == C.NOT_FOUND.value[0]
    r = s.send(pb.SeqStep(seq_id="c", step=n, close=True))   # a second close (another rank's) is answered
    assert r.results[0].status == pb.SEQ_STATUS_CLOSED
    r = s.send(pb.SeqStep(seq_id="never-opened", step=0, close=True))
    assert r.results[0].code == C.NOT_FOUND.value[0]
    s.close()


def test_dropped_stream_frees_its_sequences(stub, server):
    before = server.service.live_sequences()
    s = Stream(stub)
    for i in range(5):
        s.send(step(f"drop{i}", 0, spec={"regex": "[0-9]+"}))
    assert server.service.live_sequences() == before + 5
    s.call.cancel()
    deadline = time.time() + 5
    while server.service.live_sequences() != before and time.time() < deadline:
        time.sleep(0.02)
    assert server.service.live_sequences() == before


def test_tensor_parallel_ranks_share_a_session(stub, cl100k):
    a, b = Stream(stub, session="tp-group"), Stream(stub, session="tp-group")
    ra = a.send(step("t", 0, spec={"json_schema": SCHEMA}))
    rb = b.send(step("t", 0, spec={"json_schema": SCHEMA}))
    assert ra.results[0].status == rb.results[0].status  # readiness decided once per step
    n = 0
    while ra.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        ra = a.send(step("t", n))
        rb = b.send(step("t", n))
        assert rb.results[0].status == ra.results[0].status
    toks = cl100k.encode('{"ok": ')
    ra = a.send(step("t", n + 1, toks))
    rb = b.send(step("t", n + 1, toks))
    assert np.array_equal(ra.dense[0], rb.dense[0])
    a.close()
    rb = b.send(step("t", n + 2, cl100k.encode("true")))  # rank b keeps the session alive
    assert rb.results[0].status == pb.SEQ_STATUS_READY
    b.close()


def test_waiting_while_compiling_then_ready(server, stub, cl100k):
    gate = threading.Event()
    compile_now = server.cache._compile     # occupy the only compile thread: compiles wait for the gate

    def held(entry):
        gate.wait()
        compile_now(entry)

    server.cache._compile = held
    try:
        s = Stream(stub)
        spec = {"regex": "w[0-9]{3}"}
        r = s.send(step("w", 0, spec=spec))
        assert r.results[0].status == pb.SEQ_STATUS_WAITING and r.num_rows == 0
        w = cl100k.encode("w")
        r = s.send(step("w", 1, w))  # tokens while waiting (a restored history) queue; no rows
        assert r.results[0].status == pb.SEQ_STATUS_WAITING and r.num_rows == 0
    finally:
        gate.set()
        server.cache._compile = compile_now
    time.sleep(0.2)
    r2 = s.send(step("w", 1, w))  # a repeat of a WAITING step stays WAITING, even once compiled
    assert r2.results[0].status == pb.SEQ_STATUS_WAITING
    deadline = time.time() + 5
    n = 1
    while time.time() < deadline:
        n += 1
        r = s.send(step("w", n))
        if r.results[0].status == pb.SEQ_STATUS_READY:
            break
        time.sleep(0.01)
    assert r.results[0].status == pb.SEQ_STATUS_READY
    ids = allowed_ids(rows(r, r.results[0]))  # "w" was applied: digits follow
    assert ids and all(cl100k.decode([i]).isdigit() for i in ids)
    s.close()


def test_compile_error_fails_the_sequence(stub):
    s = Stream(stub)
    r = s.send(step("e", 0, spec={"lark": "start: undefined_rule"}))
    n = 0
    while r.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        time.sleep(0.01)
        r = s.send(step("e", n))
    assert r.results[0].status == pb.SEQ_STATUS_FAILED and "does not compile" in r.results[0].reason
    s.close()


def test_speculative_draft_rows(stub, cl100k):
    s = Stream(stub)
    n = wait_ready(s, "sp", {"regex": "[0-9]{1,3}"})
    d = cl100k.encode("1") + cl100k.encode("2") + cl100k.encode("x")
    r = s.send(step("sp", n + 1, draft_tokens=d))
    res = r.results[0]
    assert res.num_rows == 4 and res.drafts_valid == 2 and r.num_rows == 4
    assert not r.dense[3].any()
    r2 = s.send(step("sp", n + 2, cl100k.encode("1") + cl100k.encode("2")))
    assert np.array_equal(r2.dense[0], r.dense[2])  # matcher was left where accepted tokens put it
    s.close()


def test_forced_tokens(stub, cl100k):
    s = Stream(stub)
    r = s.send(step("f", 0, spec={"regex": "hello world[0-9]"}), forced=True)
    n = 0
    while r.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        time.sleep(0.01)
        r = s.send(step("f", n), forced=True)
    assert cl100k.decode(list(r.results[0].forced_tokens)).startswith("hello")
    s.close()


def test_too_many_rows_in_one_step(stub):
    s = Stream(stub)
    seqs = [step(f"m{i}", 0, spec={"regex": "[0-9]"}, draft_tokens=[15] * 16) for i in range(500)]
    r = s.send(*seqs)
    assert all(x.status == pb.SEQ_STATUS_ERROR and x.code == C.RESOURCE_EXHAUSTED.value[0] for x in r.results)
    r = s.send(step("m", 0, spec={"regex": "[0-9]"}))
    assert r.results[0].status in (pb.SEQ_STATUS_WAITING, pb.SEQ_STATUS_READY)
    s.close()


def test_oversized_message_is_refused_and_server_keeps_serving(stub, server):
    s = Stream(stub)
    big = [step(f"big{i}", 0, spec={"regex": "[0-9]"}, tokens=[100000] * 4000) for i in range(120)]
    with pytest.raises(grpc.RpcError) as err:
        s.send(*big)
    assert err.value.code() == C.RESOURCE_EXHAUSTED
    assert stub.Info(pb.InfoRequest()).backend == "llguidance"


def test_undecodable_message_is_refused_and_server_keeps_serving(server, stub):
    with grpc.insecure_channel(server.address) as ch:
        raw = ch.stream_stream("/maskd.v1.MaskService/Session", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            list(raw(iter([b"\xff\xff\xff\xff garbage"])))
        assert err.value.code() in (C.INTERNAL, C.INVALID_ARGUMENT, C.UNKNOWN)
        unary = ch.unary_unary("/maskd.v1.MaskService/RegisterGrammar", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError):
            unary(b"\x0a\xff\xff\xff\xff\x0f")
    assert stub.Info(pb.InfoRequest()).vocab_size == 100277


def test_metrics_endpoint(server, stub):
    s = Stream(stub)
    wait_ready(s, "metric", {"regex": "[0-9]+"})
    s.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    for name in ("maskd_step_seconds_bucket", "maskd_mask_fill_seconds_bucket", "maskd_compile_seconds_bucket",
                 "maskd_grammar_cache_hits_total", "maskd_grammar_cache_misses_total", "maskd_live_sequences",
                 "maskd_waiting_sequences", "maskd_row_bytes_bucket", "maskd_errors_total"):
        assert name in text, name


def test_a_slow_step_is_logged_with_its_phases_and_counted(server, stub, caplog, monkeypatch):
    """A step held up (here: behind the session's lock, as behind another rank's step) is logged
    with where its time went and counted in maskd_slow_steps; fast steps are not logged."""
    s = Stream(stub, session="slow-steps")
    wait_ready(s, "slow", {"regex": "[0-9]+"})
    session = next(x for x in server.service.sessions.sessions() if x.key == "slow-steps")
    before = server.service.slow_steps.count
    caplog.set_level("WARNING", logger="maskd.server.slow_steps")
    monkeypatch.setattr(server.service.slow_steps, "threshold_s", 0.15)    # over any step here but this one
    server.service.slow_steps._last_log = -float("inf")
    released = threading.Event()

    def hold_the_lock():
        with session.lock:
            released.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    while not session.lock.locked():
        time.sleep(0.001)
    threading.Timer(0.5, released.set).start()       # the step waits what is left of 0.5 s after its send
    reply = s.send(step("slow", 100, tokens=[15]))    # any step: this one is refused as out of order
    holder.join()
    assert reply.server_seconds >= 0.25
    assert server.service.slow_steps.count == before + 1
    [line] = [r.getMessage() for r in caplog.records if r.name == "maskd.server.slow_steps"]
    assert line.startswith("slow step: ") and "for 1 entries (lock " in line and "answer " in line
    lock_ms = float(line.split("(lock ")[1].split(",")[0])
    assert lock_ms >= 250 and "the process was off its core most of the time" in line, line
    assert "CPU: the step's thread " in line and "garbage collection " in line, line
    for phase in ("route", "consume", "fill"):
        assert f", {phase} " in line, line
    s.send(step("slow", 1, tokens=[15]))                # a fast step: not logged
    assert len([r for r in caplog.records if r.name == "maskd.server.slow_steps"]) == 1
    s.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    assert f"maskd_slow_steps_total {float(server.service.slow_steps.count)}" in text


def test_a_step_that_fails_where_no_phase_catches_refuses_every_entry_and_the_stream_lives(server, stub,
                                                                                            monkeypatch):
    """A bug no phase caught (here: the advance phase raises): every entry of that step, SeqStep and
    columnar, is answered ERROR with INTERNAL and the reason; the stream and the session serve on."""
    from test_columnar import open_ready

    from maskd.server.session import Session

    s = Stream(stub, session="uncaught")
    handle, n, _ = open_ready(s, "u", {"regex": "[0-9]+"})

    def broken(self, moving, answers, refusals):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Session, "_advance", broken)
    req = pb.StepRequest(seqs=[pb.SeqStep(seq_id="v", step=0, spec=pb.GrammarSpec(regex="[a-z]+"))],
                         handles=np.array([handle, 12345], "<u4").tobytes(),
                         steps=np.array([n + 1, 1], "<u4").tobytes(),
                         token_counts=np.ones(2, "<u4").tobytes(), tokens=np.array([15, 15], "<i4").tobytes())
    reply = s.send_request(req)
    assert [(x.seq_id, x.status, x.code) for x in reply.results] == [("v", pb.SEQ_STATUS_ERROR, C.INTERNAL.value[0])]
    assert "internal error: RuntimeError: a bug" in reply.results[0].reason
    assert list(reply.statuses) == [pb.SEQ_STATUS_ERROR] * 2 and reply.num_rows == 0
    assert [(p.index, p.code) for p in reply.problems] == [(0, C.INTERNAL.value[0]), (1, C.INTERNAL.value[0])]
    monkeypatch.undo()
    again = s.send(step("u", n + 1, tokens=[15]))      # the refused step changed nothing: it applies now
    assert again.results[0].status == pb.SEQ_STATUS_READY
    s.close()
