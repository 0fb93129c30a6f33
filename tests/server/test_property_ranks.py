"""Tensor-parallel ranks in any interleaving (hypothesis): several streams on one session send
the steps of several sequences in random batches and orders, each rank at its own pace (a rank
may lead, lag by up to the kept window, or repeat what another already applied). Every rank
gets the same answer for every (sequence, step), and that answer is the one a single rank
stepping the sequence alone gets: repeats, the kept answers and the session's ring of row
buffers never mix rows up."""
import itertools
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import Stream, step

from maskd.server import Limits, MaskServer, ServerConfig
from maskd.server.session import RECENT_STEPS
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc

# (grammar, a text it accepts): each token of the text is one step
SCRIPTS = [("[xy]{0,40}", "xyxxyyxyxyyyxxyxyxyyxx"),
           ("a[0-9]{0,30}", "a0123456789987654321"),
           ("[a-z ]{0,60}", "the quick brown fox jumps over the lazy dog"),
           ("(ab|cd)+e?", "abcdcdababcde")]
_sessions = itertools.count()


@pytest.fixture(scope="module", params=["fixed ring", "growing ring"])
def server(request):
    """A ring that cannot grow (kept rows are packed out with the row codec), or one that grows
    while buffers come round with kept rows."""
    grow = request.param == "growing ring"
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1,
                                  limits=Limits(max_row_buffers_per_session=18 if grow else 6))).start()
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.MaskServiceStub(ch)


@pytest.fixture(scope="module")
def scripts(stub, cl100k):
    """Each grammar with its steps' tokens and the answers of a single rank stepping it alone."""
    out = []
    for k, (regex, text) in enumerate(SCRIPTS):
        tokens = cl100k.encode(text)
        spec = {"regex": regex}
        warm = Stream(stub, session=f"warm-{k}")
        n, r = 0, warm.send(step("s", 0, spec=spec))
        while r.results[0].status == pb.SEQ_STATUS_WAITING:                # compiling: poll
            n += 1
            time.sleep(0.01)
            r = warm.send(step("s", n))
        warm.close()
        alone = Stream(stub, session=f"alone-{k}")          # compiled now: one answer per step
        answers = [answer(alone.send(step("s", 0, spec=spec)))]
        for n, t in enumerate(tokens, start=1):
            answers.append(answer(alone.send(step("s", n, [t]))))
        alone.close()
        assert all(a[0] in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FINISHED) for a in answers), regex
        out.append((spec, tokens, answers))
    return out


def answer(reply, i=0):
    r = reply.results[i]
    rows = reply.dense[r.first_row:r.first_row + r.num_rows].tobytes() if r.num_rows else b""
    return r.status, r.code, r.reason, r.accepting, list(r.forced_tokens), rows


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), n_ranks=st.integers(2, 3), picks=st.lists(st.integers(0, len(SCRIPTS) - 1),
                                                                   min_size=2, max_size=5))
def test_every_rank_gets_the_answer_a_single_rank_gets(stub, scripts, data, n_ranks, picks):
    session = f"ranks-{next(_sessions)}"
    ranks = [Stream(stub, session=session) for _ in range(n_ranks)]
    seqs = {f"s{i}": scripts[p] for i, p in enumerate(picks)}
    cursor = [dict.fromkeys(seqs, 0) for _ in ranks]      # the next step each rank sends
    applied = dict.fromkeys(seqs, -1)                    # the last step the server applied
    try:
        for _ in range(data.draw(st.integers(5, 40), label="requests")):
            r = data.draw(st.integers(0, n_ranks - 1), label="rank")
            can = [sid for sid in seqs if cursor[r][sid] < len(seqs[sid][2])
                   and cursor[r][sid] > applied[sid] - RECENT_STEPS]          # still answered
            if not can:
                continue
            chosen = data.draw(st.lists(st.sampled_from(can), min_size=1, max_size=len(can), unique=True),
                               label="sequences")
            msgs = []
            for sid in chosen:
                spec, tokens, _ = seqs[sid]
                n = cursor[r][sid]
                msgs.append(step(sid, n, spec=spec) if n == 0 else step(sid, n, [tokens[n - 1]]))
            reply = ranks[r].send(*msgs)
            for i, sid in enumerate(chosen):
                n = cursor[r][sid]
                got = answer(reply, i)
                assert got == seqs[sid][2][n], (sid, n, r, got[:3])
                cursor[r][sid] = n + 1
                applied[sid] = max(applied[sid], n)
    finally:
        for s in ranks:
            s.close()
