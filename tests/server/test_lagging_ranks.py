"""Tensor-parallel ranks on one session, at the protocol level: a rank that lags behind the others
(or retries) gets, for each older step, the answer every rank got; closes by one rank do not cut
off the last steps of another; readiness is decided once per (sequence, step)."""
import threading
import time

import grpc
import numpy as np
import pytest
from test_server import Stream, step

from maskd.server import Limits, MaskServer, ServerConfig
from maskd.server.row_buffers import ROW_BUFFERS
from maskd.server.sequence import CLOSED_STEPS, RECENT_STEPS
from maskd.v1 import maskd_pb2 as pb

C = grpc.StatusCode
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1, metrics_port=0,
                                  limits=Limits(max_message_bytes=1 << 20))).start()
    yield srv
    srv.stop(grace=1.0)


def answer(reply, i=0):
    """(status, code, reason, accepting, forced tokens, rows) of entry i: what ranks must agree on."""
    r = reply.results[i]
    rows = reply.dense[r.first_row:r.first_row + r.num_rows] if r.num_rows else np.zeros((0, 0), np.int32)
    return r.status, r.code, r.reason, r.accepting, list(r.forced_tokens), r.drafts_valid, rows.tobytes()


def ready(stream, seq_id, spec):
    """Opens and polls (empty steps) until READY; returns the replies of steps 0..n."""
    replies = [stream.send(step(seq_id, 0, spec=spec), forced=True)]
    while replies[-1].results[0].status == pb.SEQ_STATUS_WAITING:
        time.sleep(0.01)
        replies.append(stream.send(step(seq_id, len(replies)), forced=True))
    assert replies[-1].results[0].status == pb.SEQ_STATUS_READY, replies[-1].results[0].reason
    return replies


def test_a_lagging_rank_gets_every_older_answer(stub, cl100k):
    a, b = Stream(stub, session="lag-1"), Stream(stub, session="lag-1")
    spec = {"json_schema": SCHEMA}
    replies = ready(a, "s", spec)
    n = len(replies) - 1
    parts = [cl100k.encode(t) for t in ('{"ok"', ': true', ', "n": ', "12")]
    for k, toks in enumerate(parts):
        replies.append(a.send(step("s", n + 1 + k, toks), forced=True))
    last = n + len(parts)
    assert last - RECENT_STEPS + 1 > 0
    # rank b starts late: its steps older than the window are refused, the last ones answered
    for k in range(last - RECENT_STEPS + 1, last + 1):
        toks = parts[k - n - 1] if k > n else []
        got = b.send(step("s", k, toks, spec=spec if k == 0 else None), forced=True)
        assert answer(got) == answer(replies[k]), k
    old = b.send(step("s", last - RECENT_STEPS, parts[last - RECENT_STEPS - n - 1]))
    assert old.results[0].status == pb.SEQ_STATUS_ERROR and old.results[0].code == C.FAILED_PRECONDITION.value[0]
    assert f"last {RECENT_STEPS} steps" in old.results[0].reason
    # a retry of an older step with other tokens is a divergence and changes nothing
    bad = b.send(step("s", last - 1, cl100k.encode(": false")))
    assert bad.results[0].code == C.ABORTED.value[0] and "divergence" in bad.results[0].reason
    # the sequence moves on from where rank a left it, for both ranks alike
    ra = a.send(step("s", last + 1, cl100k.encode("}")))
    rb = b.send(step("s", last + 1, cl100k.encode("}")))
    assert ra.results[0].status == pb.SEQ_STATUS_FINISHED
    assert answer(ra) == answer(rb)
    a.close()
    b.close()


def test_the_last_steps_outlive_another_ranks_close(stub, server, cl100k):
    a, b = Stream(stub, session="lag-2"), Stream(stub, session="lag-2")
    spec = {"regex": "[a-z]{1,8}"}
    replies = ready(a, "c", spec)
    n = len(replies) - 1
    replies.append(a.send(step("c", n + 1, cl100k.encode("ab"))))
    replies.append(a.send(step("c", n + 2, cl100k.encode("c"))))
    live = server.service.live_sequences()
    closed = a.send(pb.SeqStep(seq_id="c", step=n + 2, close=True))
    assert closed.results[0].status == pb.SEQ_STATUS_CLOSED
    assert server.service.live_sequences() == live - 1          # the matcher is gone
    # rank b's last CLOSED_STEPS steps still get the answers, then its close is a plain CLOSED
    for k in range(n + 3 - CLOSED_STEPS, n + 3):
        toks = {n + 1: cl100k.encode("ab"), n + 2: cl100k.encode("c")}.get(k, [])
        got = b.send(step("c", k, toks))
        assert answer(got) == answer(replies[k]), k
    assert b.send(step("c", n + 3 - CLOSED_STEPS - 1)).results[0].code == C.NOT_FOUND.value[0]
    assert b.send(step("c", n + 3, cl100k.encode("d"))).results[0].code == C.NOT_FOUND.value[0]
    again = b.send(pb.SeqStep(seq_id="c", step=n + 2, close=True))
    assert again.results[0].status == pb.SEQ_STATUS_CLOSED
    # the same id opened again is a new sequence (a reused id, or a rank that had not opened it yet)
    fresh = ready(b, "c", spec)
    assert answer(fresh[-1])[-1] == answer(replies[n])[-1]
    r = b.send(step("c", len(fresh), cl100k.encode("zz")))
    assert r.results[0].status == pb.SEQ_STATUS_READY
    a.close()
    b.close()


def test_readiness_is_decided_once_per_step_for_a_lagging_rank(stub, server, cl100k):
    a, b = Stream(stub, session="lag-3"), Stream(stub, session="lag-3")
    spec = {"regex": "q[0-9]{2}"}
    gate = threading.Event()
    compile_now = server.cache._compile                # compiles wait for the gate

    def held(entry):
        gate.wait()
        compile_now(entry)

    server.cache._compile = held                      # held until the test ends: the compile thread
    try:                                              # may look the method up after the first reply
        first = a.send(step("w", 0, spec=spec))
        assert first.results[0].status == pb.SEQ_STATUS_WAITING
        k = 0
        while True:                                    # rank a polls faster than rank b follows
            k += 1
            if k == 3 * RECENT_STEPS:
                gate.set()
            r = a.send(step("w", k))
            if r.results[0].status == pb.SEQ_STATUS_READY:
                break
            assert k < 500
            time.sleep(0.005)
    finally:
        gate.set()
        server.cache._compile = compile_now
    assert k > RECENT_STEPS
    # rank b asks from its open on, once the grammar is ready: every poll gets the answer rank a got
    for j in range(k + 1):
        got = b.send(step("w", j, spec=spec if j == 0 else None))
        expected = pb.SEQ_STATUS_READY if j == k else pb.SEQ_STATUS_WAITING
        assert got.results[0].status == expected, j
    assert np.array_equal(got.dense[0], r.dense[0])
    a.close()
    b.close()


def test_drafts_and_opening_repeats(stub, cl100k):
    a, b = Stream(stub, session="lag-4"), Stream(stub, session="lag-4")
    spec = {"regex": "[0-9]{1,6}"}
    replies = ready(a, "d", spec)
    n = len(replies) - 1
    drafts = cl100k.encode("12") + cl100k.encode("x")
    r1 = a.send(step("d", n + 1, cl100k.encode("7"), draft_tokens=drafts))
    r2 = a.send(step("d", n + 2, cl100k.encode("1")))
    assert r1.results[0].num_rows == 1 + len(drafts)
    got = b.send(step("d", n + 1, cl100k.encode("7"), draft_tokens=drafts))
    assert answer(got) == answer(r1)
    assert b.send(step("d", n + 1, cl100k.encode("7"))).results[0].code == C.ABORTED.value[0]   # drafts differ
    if n + 2 < RECENT_STEPS:   # an opening repeat of an older step with another grammar is refused, as at the last step
        other = b.send(step("d", 0, spec={"regex": "[a-z]"}))
        assert other.results[0].code == C.ALREADY_EXISTS.value[0]
    got = b.send(step("d", n + 2, cl100k.encode("1")))
    assert answer(got) == answer(r2)
    a.close()
    b.close()


def test_garbage_old_steps_lose_nothing(stub, cl100k):
    a, b = Stream(stub, session="lag-5"), Stream(stub, session="lag-5")
    replies = ready(a, "g", {"regex": "[a-z]+"})
    n = len(replies) - 1
    a.send(step("g", n + 1, cl100k.encode("ab")))
    a.send(step("g", n + 2, cl100k.encode("c")))
    for entry in (step("g", n + 1, [100277 + 3]), step("g", n + 1, [-4]), step("g", n + 1, rollback=50),
                  step("g", n + 1, cl100k.encode("ab"), history_offset=3),
                  step("g", n, cl100k.encode("ab"), spec={"regex": "[a-z]+"}, history_offset=2)):
        r = b.send(entry)
        assert r.results[0].status == pb.SEQ_STATUS_ERROR, entry
    r = a.send(step("g", n + 3, cl100k.encode("d")))
    assert r.results[0].status == pb.SEQ_STATUS_READY
    a.close()
    b.close()


def test_a_lagging_rank_gets_its_rows_when_their_buffer_comes_round_again(stub, cl100k):
    """Answers kept in a row buffer that this very step takes again (the ring came round): their
    rows are copied out before the buffer is reused, never from rows this step already wrote."""
    specs = {"p": {"regex": "a[0-9]"}, "q": {"regex": "b[a-z]"}, "r": {"regex": "x{0,40}"}}
    warm = Stream(stub, session="lag-ring-warm")
    for sid, spec in specs.items():
        ready(warm, sid, spec)
    warm.close()
    a, b = Stream(stub, session="lag-ring"), Stream(stub, session="lag-ring")
    first = a.send(*(step(sid, 0, spec=spec) for sid, spec in specs.items()))   # one buffer
    assert [r.status for r in first.results] == [pb.SEQ_STATUS_READY] * 3
    x = cl100k.encode("x")
    for k in range(1, ROW_BUFFERS):                    # the other buffers, one step each
        assert a.send(step("r", k, x)).results[0].status == pb.SEQ_STATUS_READY
    # rank b: a step that fills (takes the first buffer again) and repeats of p's and q's opens
    got = b.send(step("s", 0, spec=specs["r"]), step("p", 0, spec=specs["p"]), step("q", 0, spec=specs["q"]))
    assert [r.status for r in got.results] == [pb.SEQ_STATUS_READY] * 3
    for i in (0, 1):
        assert answer(got, i + 1) == answer(first, i), "pq"[i]
    assert answer(got, 0)[-1] == answer(first, 2)[-1]
    a.close()
    b.close()
