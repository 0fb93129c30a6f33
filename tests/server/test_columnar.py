"""Columnar plain steps (contract revision 3) through a real server: packed handles, steps, token
counts and tokens in; packed statuses, problems, forced tokens and one row block out. The answers
equal those of the same steps sent as SeqStep entries, rows follow entry order, and every kind of
malformed column is refused without touching anything else."""
import grpc
import numpy as np
import pytest
from test_server import Stream, step

from maskd.server import Limits, MaskServer, ServerConfig
from maskd.server.sequence import CLOSED_STEPS, RECENT_STEPS
from maskd.v1 import maskd_pb2 as pb

C = grpc.StatusCode
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}
DIGITS = {"regex": "[0-9]{1,6}"}
LETTERS = {"regex": "[a-z]{1,12}"}


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1,
                                  limits=Limits(max_message_bytes=1 << 20))).start()
    yield srv
    srv.stop(grace=1.0)


def columnar(entries, *, forced=False, seqs=()):
    """A StepRequest of columnar entries [(handle, step, tokens)] (after any SeqStep entries)."""
    req = pb.StepRequest(seqs=list(seqs), want_forced_tokens=forced)
    req.handles = np.array([h for h, _, _ in entries], "<u4").tobytes()
    req.steps = np.array([s for _, s, _ in entries], "<u4").tobytes()
    req.token_counts = np.array([len(t) for _, _, t in entries], "<u4").tobytes()
    req.tokens = np.array([x for _, _, t in entries for x in t], "<i4").tobytes()
    return req


def statuses(reply):
    packed = np.frombuffer(reply.statuses, np.uint8)
    return (packed & 0x0F).tolist(), ((packed & 0x10) > 0).tolist()


def plain_rows(reply):
    """The rows of the columnar entries, by entry index (None for entries without rows)."""
    st, _ = statuses(reply)
    first = sum(r.num_rows for r in reply.results)
    out, k = [], first
    for s in st:
        if s in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FINISHED):
            out.append(reply.dense[k])
            k += 1
        else:
            out.append(None)
    assert k == reply.num_rows
    return out


def open_ready(stream, seq_id, spec):
    """Opens with a SeqStep and polls until READY; returns (handle, step, reply)."""
    r = stream.send(step(seq_id, 0, spec=spec))
    handle, n = r.results[0].handle, 0
    assert handle > 0
    while r.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        r = stream.send(step(seq_id, n))
    assert r.results[0].status == pb.SEQ_STATUS_READY, r.results[0].reason
    return handle, n, r


def test_columnar_steps_answer_what_seqstep_entries_answer(stub, cl100k):
    rich, col = Stream(stub), Stream(stub)
    texts = ['{"ok"', ': true', ', "n": ', "12", "}"]
    specs = {"j": {"json_schema": SCHEMA}, "d": DIGITS}
    handles, start_rich, start_col = {}, {}, {}
    for sid, spec in specs.items():
        _, start_rich[sid], _ = open_ready(rich, sid, spec)
        handles[sid], start_col[sid], _ = open_ready(col, sid, spec)
    n = max(*start_rich.values(), *start_col.values())
    for sid in specs:           # bring every sequence to step n (empty steps)
        for k in range(start_rich[sid] + 1, n + 1):
            rich.send(step(sid, k))
        for k in range(start_col[sid] + 1, n + 1):
            col.send_request(columnar([(handles[sid], k, [])]))
    for k, text in enumerate(texts):
        toks = {"j": cl100k.encode(text), "d": cl100k.encode("7") if k < 3 else []}
        r = rich.send(*[step(sid, n + 1 + k, toks[sid]) for sid in specs], forced=True)
        c = col.send_request(columnar([(handles[sid], n + 1 + k, toks[sid]) for sid in specs], forced=True))
        st, acc = statuses(c)
        assert st == [x.status for x in r.results] and acc == [x.accepting for x in r.results]
        counts = np.frombuffer(c.forced_counts, "<u4").tolist()
        assert counts == [len(x.forced_tokens) for x in r.results]
        assert np.frombuffer(c.forced_tokens, "<i4").tolist() == [t for x in r.results for t in x.forced_tokens]
        for i, row in enumerate(plain_rows(c)):
            assert np.array_equal(row, r.dense[r.results[i].first_row])
    assert st[0] == pb.SEQ_STATUS_FINISHED and acc[0]
    rich.close()
    col.close()


def test_rows_of_seqstep_entries_come_first_then_columnar_ones_in_order(stub, cl100k):
    s = Stream(stub)
    hd, nd, _ = open_ready(s, "d", DIGITS)
    hl, nl, _ = open_ready(s, "l", LETTERS)
    # one message: a SeqStep open, then columnar steps of which the middle one is refused
    req = columnar([(hl, nl + 1, cl100k.encode("ab")), (hd, nd + 1, cl100k.encode("x")), (hd + 1000, 1, [])],
                   seqs=[step("fresh", 0, spec=LETTERS)])
    r = s.send_request(req)
    assert r.results[0].status in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_WAITING)
    st, _ = statuses(r)
    assert st == [pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FAILED, pb.SEQ_STATUS_ERROR]
    problems = {p.index: (p.code, p.reason) for p in r.problems}
    assert set(problems) == {1, 2}
    assert problems[1][0] == C.INVALID_ARGUMENT.value[0] and "rejected" in problems[1][1]
    assert problems[2][0] == C.NOT_FOUND.value[0] and "handle" in problems[2][1]
    rows = plain_rows(r)
    assert rows[1] is None and rows[2] is None
    letters = set(cl100k.encode("c"))
    assert all(int(rows[0][t >> 5]) >> (t & 31) & 1 for t in letters)


@pytest.mark.parametrize("mangle, why", [
    (lambda q: setattr(q, "steps", q.steps[:4]), "disagree"),
    (lambda q: setattr(q, "token_counts", q.token_counts + b"\x01\x00\x00\x00"), "disagree"),
    (lambda q: setattr(q, "tokens", q.tokens + b"\x05\x00\x00\x00"), "disagree"),
    (lambda q: setattr(q, "handles", q.handles + b"\x01"), "disagree|not packed"),
    (lambda q: setattr(q, "tokens", q.tokens[:-1]), "disagree|not packed"),
])
def test_malformed_columns_are_refused_and_change_nothing(stub, cl100k, mangle, why):
    s = Stream(stub)
    hd, nd, _ = open_ready(s, "d", DIGITS)
    req = columnar([(hd, nd + 1, cl100k.encode("1")), (hd, nd + 1, cl100k.encode("1"))],
                   seqs=[step("side", 0, spec=DIGITS)])
    mangle(req)
    r = s.send_request(req)
    assert r.results[0].status in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_WAITING)   # the SeqStep entry is fine
    assert r.problems and all(p.code == C.INVALID_ARGUMENT.value[0] for p in r.problems)
    assert all(__import__("re").search(why, p.reason) for p in r.problems)
    ok = s.send_request(columnar([(hd, nd + 1, cl100k.encode("1"))]))     # the sequence did not move
    assert statuses(ok)[0] == [pb.SEQ_STATUS_READY]
    s.close()


def test_bad_entries_in_columns_fail_alone(stub, cl100k):
    s = Stream(stub)
    hd, nd, _ = open_ready(s, "d", DIGITS)
    hl, nl, _ = open_ready(s, "l", LETTERS)
    he, ne, _ = open_ready(s, "e", LETTERS)
    r = s.send_request(columnar([(hd, nd + 1, [100277 + 5]), (hl, nl + 1, cl100k.encode("a")),
                                 (hl, nl + 2, cl100k.encode("b")), (he, ne + 7, [])]))
    st, _ = statuses(r)
    problems = {p.index: p for p in r.problems}
    assert st[0] == pb.SEQ_STATUS_ERROR and "outside the vocabulary" in problems[0].reason
    assert st[1] == pb.SEQ_STATUS_READY
    assert st[2] == pb.SEQ_STATUS_ERROR and "twice" in problems[2].reason
    assert st[3] == pb.SEQ_STATUS_ERROR and problems[3].code == C.FAILED_PRECONDITION.value[0]
    r = s.send_request(columnar([(hd, nd + 1, cl100k.encode("4"))]))
    assert statuses(r)[0] == [pb.SEQ_STATUS_READY]
    s.close()


def test_a_lagging_rank_repeats_columnar_steps(stub, cl100k):
    """Tensor-parallel ranks on one session: rank b's columnar steps trail rank a's and still get
    the answers rank a got, also after rank a closed the sequence."""
    a, b = Stream(stub, session="col-tp"), Stream(stub, session="col-tp")
    handle, n, _ = open_ready(a, "p", LETTERS)
    parts = [cl100k.encode(t) for t in ("ab", "cd", "ef", "gh", "ij")]
    got_a = [a.send_request(columnar([(handle, n + 1 + k, t)])) for k, t in enumerate(parts)]
    last = n + len(parts)
    for k in range(last - RECENT_STEPS + 1, last + 1):
        got = b.send_request(columnar([(handle, k, parts[k - n - 1])]))
        assert statuses(got) == statuses(got_a[k - n - 1])
        assert np.array_equal(plain_rows(got)[0], plain_rows(got_a[k - n - 1])[0])
    old = b.send_request(columnar([(handle, last - RECENT_STEPS, parts[last - RECENT_STEPS - n - 1])]))
    assert old.problems[0].code == C.FAILED_PRECONDITION.value[0]
    diverged = b.send_request(columnar([(handle, last, cl100k.encode("zz"))]))
    assert diverged.problems[0].code == C.ABORTED.value[0]
    assert a.send(pb.SeqStep(seq_id="p", step=last, close=True)).results[0].status == pb.SEQ_STATUS_CLOSED
    for k in range(last - CLOSED_STEPS + 1, last + 1):      # after the close, by handle
        got = b.send_request(columnar([(handle, k, parts[k - n - 1])]))
        assert np.array_equal(plain_rows(got)[0], plain_rows(got_a[k - n - 1])[0])
    gone = b.send_request(columnar([(handle, last + 1, [])]))
    assert gone.problems[0].code == C.NOT_FOUND.value[0]
    # the id opened again is a new sequence with a new handle; the old handle does not reach it
    h2, n2, _ = open_ready(b, "p", LETTERS)
    assert h2 != handle
    stale = b.send_request(columnar([(handle, n2 + 1, cl100k.encode("q"))]))
    assert stale.problems[0].code == C.NOT_FOUND.value[0]
    assert statuses(b.send_request(columnar([(h2, n2 + 1, cl100k.encode("q"))])))[0] == [pb.SEQ_STATUS_READY]
    a.close()
    b.close()


def test_repeats_copy_rows_instead_of_filling_again(server, stub, cl100k):
    """A rank that repeats the current step gets the kept rows: the engine fills once per step."""
    a, b = Stream(stub, session="col-once"), Stream(stub, session="col-once")
    handle, n, _ = open_ready(a, "o", LETTERS)
    b.send(step("o", 0, spec=LETTERS))
    engine = server.service.engine
    fills = []
    original = engine.fill_batch

    def counting(matchers, *args, **kw):
        fills.append(len(matchers))
        return original(matchers, *args, **kw)

    engine.fill_batch = counting
    try:
        for k in range(1, 4):
            toks = cl100k.encode("abc"[k - 1])
            ra = a.send_request(columnar([(handle, n + k, toks)]))
            rb = b.send_request(columnar([(handle, n + k, toks)]))
            assert np.array_equal(plain_rows(ra)[0], plain_rows(rb)[0])
    finally:
        engine.fill_batch = original
    assert fills == [1, 1, 1]
    a.close()
    b.close()


def test_a_document_the_validator_ends_loses_its_row_and_the_next_rows_stay_in_place(stub, cl100k):
    """Complete mode (the default): uniqueItems is left to the validator. The document closes with
    a repeat, its sequence FAILS in the step that brought the ']', and the columnar entry after it
    still finds its own row."""
    s = Stream(stub)
    hu, nu, _ = open_ready(s, "u", {"json_schema": {"type": "array", "items": {"type": "integer"},
                                                    "uniqueItems": True}})
    hl, nl, _ = open_ready(s, "l", LETTERS)
    s.send_request(columnar([(hu, nu + 1, cl100k.encode("[1,1"))]))
    r = s.send_request(columnar([(hu, nu + 2, cl100k.encode("]")), (hl, nl + 1, cl100k.encode("ab"))]))
    st, _ = statuses(r)
    assert st == [pb.SEQ_STATUS_FAILED, pb.SEQ_STATUS_READY]
    assert r.problems[0].index == 0 and "does not match the JSON schema" in r.problems[0].reason
    assert r.num_rows == 1
    row = plain_rows(r)[1]
    assert all(int(row[t >> 5]) >> (t & 31) & 1 for t in cl100k.encode("c"))
    s.close()
