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
from maskd.server.sequence import CLOSED_STEPS, RECENT_STEPS
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


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), picks=st.lists(st.integers(0, len(SCRIPTS) - 1), min_size=2, max_size=4))
def test_ranks_after_another_ranks_close(stub, scripts, data, picks):
    """Rank a steps and closes sequences; rank b lags. After a sequence's close, b's repeats of its
    last CLOSED_STEPS steps get the single-rank answers (certainly while their rows are in the ring:
    filled fewer than 6 requests ago; later they may be NOT_FOUND, never different), older or newer
    steps are NOT_FOUND, and a second close is CLOSED. (b's opening step after the close would open a new
    sequence, as the contract says: test_lagging_ranks covers that.)"""
    session = f"closes-{next(_sessions)}"
    a, b = Stream(stub, session=session), Stream(stub, session=session)
    seqs = {f"s{i}": scripts[p] for i, p in enumerate(picks)}
    lead = dict.fromkeys(seqs, 0)                        # rank a's next step
    lag = dict.fromkeys(seqs, 0)                         # rank b's next step
    closed_at: dict[str, tuple[int, int]] = {}           # sid -> (request index of the close, last step)
    filled_at: dict[tuple[str, int], int] = {}           # (sid, step) -> request index that filled its rows
    sent = 0

    def msg(sid, n):
        spec, tokens, _ = seqs[sid]
        return step(sid, n, spec=spec) if n == 0 else step(sid, n, [tokens[n - 1]])

    try:
        for _ in range(data.draw(st.integers(5, 40), label="requests")):
            if data.draw(st.booleans(), label="rank a"):
                open_ = [sid for sid in seqs if sid not in closed_at and lead[sid] < len(seqs[sid][2])]
                if not open_:
                    continue
                sid = data.draw(st.sampled_from(open_), label="sequence")
                if lead[sid] > 0 and data.draw(st.integers(0, 3), label="close") == 0:
                    reply = a.send(pb.SeqStep(seq_id=sid, step=lead[sid] - 1, close=True))
                    assert reply.results[0].status == pb.SEQ_STATUS_CLOSED
                    closed_at[sid] = (sent, lead[sid] - 1)
                else:
                    n = lead[sid]
                    reply = a.send(msg(sid, n))
                    if n >= lag[sid]:
                        assert answer(reply) == seqs[sid][2][n], (sid, n)
                        lead[sid] = n + 1
                        filled_at[sid, n] = sent
                sent += 1
                continue
            sid = data.draw(st.sampled_from(list(seqs)), label="sequence b")
            n = lag[sid]
            if sid not in closed_at:
                if n >= lead[sid] or n <= lead[sid] - 1 - RECENT_STEPS:
                    continue                             # b may lag, not lead; and only within the window
                got = answer(b.send(msg(sid, n)))
                assert got == seqs[sid][2][n], (sid, n)
                lag[sid] = n + 1
                sent += 1
                continue
            _, last = closed_at[sid]
            if data.draw(st.booleans(), label="close again"):
                assert b.send(pb.SeqStep(seq_id=sid, step=n, close=True)).results[0].status == pb.SEQ_STATUS_CLOSED
                sent += 1
                continue
            if n == 0 or n >= len(seqs[sid][2]):
                continue                                 # an opening step for a closed id opens a new
            got = answer(b.send(msg(sid, n)))            # sequence (the contract), it is no repeat
            lag[sid] = n + 1
            # rows filled fewer than 6 requests ago are still in the ring (6 buffers): the answer is
            # certain; later ones may be gone (NOT_FOUND), never different
            held = sent - filled_at.get((sid, n), sent) <= 5
            sent += 1
            if last - CLOSED_STEPS < n <= last and (held or got[0] != pb.SEQ_STATUS_ERROR):
                assert got == seqs[sid][2][n], (sid, n, last, got[:3])
            else:
                assert got[0] == pb.SEQ_STATUS_ERROR and got[1] == grpc.StatusCode.NOT_FOUND.value[0], \
                    (sid, n, last, got[:3])
    finally:
        a.close()
        b.close()
