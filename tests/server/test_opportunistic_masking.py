"""Opportunistic masking (contract revision 5, DOMINO §3.5): a decode loop samples first and sends
the token it sampled without a row; the server checks it.

Through the real gRPC server on cl100k: an allowed token is consumed and answered without a row;
a refused one consumes nothing and gets the row of its position (equal to the row a sequence
stepped there the usual way gets) and the sequence lives on; EOS; the complete JSON-schema mode's
row-level checks (a token the grammar allows but the document's checks take out of the row is
refused); the client's record of the history; repeats, divergence, bad requests and the metric.
"""
import time

import numpy as np
import pytest
from test_server import Stream, step

from maskd.server import MaskServer, ServerConfig
from maskd.v1 import maskd_pb2 as pb
from maskd_client import MaskClient, SeqStatus, StepInput

READY, FINISHED, WAITING = SeqStatus.READY, SeqStatus.FINISHED, SeqStatus.WAITING
REGEX = {"regex": "hello world[0-9]"}
UNIQUE_TAGS = {"json_schema": {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "note": {"type": "string"}},
    "required": ["tags", "note"]}}


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1, metrics_port=0)).start()
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture
def mc(server):
    with MaskClient(server.address, want_forced_tokens=False) as client:
        yield client


def unmasked(*tokens):
    return StepInput(list(tokens), sampled_unmasked=True)


def opened(mc, sid, spec, first=None):
    """Opens a sequence and steps until its grammar is ready (``first``: the opening step's input)."""
    mc.open(sid, spec)
    r = mc.step({sid: first if first is not None else []})
    deadline = time.monotonic() + 120   # generous: CI runs on a loaded 2-core machine
    while r.seqs[sid].status is WAITING:
        assert time.monotonic() < deadline, "grammar never compiled"
        time.sleep(0.005)
        r = mc.step({sid: StepInput([], sampled_unmasked=True) if first is not None else []})
    return r


def row_of(r, sid):
    res = r.seqs[sid]
    assert res.row >= 0 and res.num_rows == 1, res
    return r.bitmask[res.row].copy()


def bit(row, token):
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def reference_rows(mc, sid, spec, tokens):
    """The row at every position along ``tokens``, stepping a sequence the usual way."""
    r = opened(mc, sid, spec)
    rows = [row_of(r, sid)]
    for t in tokens:
        r = mc.step({sid: [t]})
        rows.append(row_of(r, sid))
    return rows


def test_allowed_tokens_are_consumed_without_a_row(mc, cl100k):
    tokens = cl100k.encode("hello world5")
    ref = reference_rows(mc, "ref", REGEX, tokens)
    r = opened(mc, "a", REGEX, unmasked())
    res = r.seqs["a"]
    assert res.status is READY and res.num_rows == 0 and res.row == -1 and len(r.bitmask) == 0
    for k, t in enumerate(tokens[:-1]):
        r = mc.step({"a": unmasked(t)})
        res = r.seqs["a"]
        assert res.status is READY and res.num_rows == 0 and res.row == -1 and not res.resample, (k, res)
    assert mc.history("a") == tokens[:-1]
    # A plain step afterwards gets the row the usual way of stepping gives there.
    r = mc.step({"a": [tokens[-1]]})
    assert np.array_equal(row_of(r, "a"), ref[len(tokens)])
    eos = cl100k.eos_token_ids[0]
    r = mc.step({"a": unmasked(eos)})
    assert r.seqs["a"].status is FINISHED and r.seqs["a"].num_rows == 0


def test_a_refused_token_gets_the_row_to_sample_again_with(mc, cl100k):
    tokens = cl100k.encode("hello world5")
    ref = reference_rows(mc, "ref2", REGEX, tokens)
    r = opened(mc, "b", REGEX, unmasked())
    r = mc.step({"b": unmasked(tokens[0])})
    wrong = cl100k.encode(" planet")[0]
    assert not bit(ref[1], wrong)
    r = mc.step({"b": unmasked(wrong)})
    res = r.seqs["b"]
    assert res.status is READY and res.resample and res.num_rows == 1
    assert np.array_equal(r.bitmask[res.row], ref[1])          # the row of the position before it
    assert mc.history("b") == tokens[:1]                        # nothing consumed, here or there
    # The sequence lives on: the token sampled again with the row goes in as the next step.
    r = mc.step({"b": unmasked(tokens[1])})
    assert r.seqs["b"].status is READY and r.seqs["b"].num_rows == 0 and not r.seqs["b"].resample
    # EOS before the grammar may end is refused like any token.
    eos = cl100k.eos_token_ids[0]
    r = mc.step({"b": unmasked(eos)})
    assert r.seqs["b"].resample and np.array_equal(r.bitmask[r.seqs["b"].row], ref[2]) and not bit(ref[2], eos)
    r = mc.step({"b": [tokens[2]]})
    assert np.array_equal(row_of(r, "b"), ref[3])
    assert mc.history("b") == tokens[:3]


def test_the_complete_modes_row_checks_decide_not_the_grammar_alone(mc, cl100k):
    """``'"]'`` after ``["a", "a`` is what the grammar allows, but it would close an array that does
    not pass uniqueItems: the row does not allow it, so the check refuses it."""
    tokens = cl100k.encode('{"tags": ["a", "a"], "note": "n"}')
    r = opened(mc, "c", UNIQUE_TAGS, unmasked())
    n = 0
    while not cl100k.decode(tokens[:n]).endswith('"a", "a'):
        r = mc.step({"c": unmasked(tokens[n])})
        assert r.seqs["c"].status is READY and not r.seqs["c"].resample, cl100k.decode(tokens[:n + 1])
        n += 1
    closing = tokens[n]
    r = mc.step({"c": unmasked(closing)})
    res = r.seqs["c"]
    assert res.resample and res.status is READY and not bit(r.bitmask[res.row], closing)
    comma = cl100k.encode('",')[0]
    assert bit(r.bitmask[res.row], comma)
    r = mc.step({"c": unmasked(comma)})
    assert r.seqs["c"].status is READY and not r.seqs["c"].resample and r.seqs["c"].num_rows == 0
    assert mc.history("c") == tokens[:n] + [comma]


def test_repeats_divergence_and_bad_requests(stub, cl100k, server):
    s = Stream(stub)
    r = s.send(step("r", 0, spec=REGEX, sampled_unmasked=True))
    n = 0
    while r.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        r = s.send(step("r", n, sampled_unmasked=True))
    assert r.results[0].num_rows == 0
    hello, wrong = cl100k.encode("hello")[0], cl100k.encode(" planet")[0]
    first = s.send(step("r", n + 1, [wrong], sampled_unmasked=True))
    again = s.send(step("r", n + 1, [wrong], sampled_unmasked=True))          # another rank, a retry
    for reply in (first, again):
        res = reply.results[0]
        assert res.status == pb.SEQ_STATUS_READY and res.resample and res.num_rows == 1
    assert np.array_equal(first.dense[0], again.dense[0])
    diverged = s.send(step("r", n + 1, [wrong]))                              # the same tokens, masked
    assert diverged.results[0].status == pb.SEQ_STATUS_ERROR and "divergence" in diverged.results[0].reason
    ok = s.send(step("r", n + 2, [hello], sampled_unmasked=True))
    repeat = s.send(step("r", n + 2, [hello], sampled_unmasked=True))
    for reply in (ok, repeat):
        assert reply.results[0].status == pb.SEQ_STATUS_READY and reply.results[0].num_rows == 0
        assert not reply.results[0].resample
    bad = [step("r", n + 3, [hello], draft_tokens=[hello], sampled_unmasked=True),
           step("r", n + 3, [hello], propose_drafts=2, sampled_unmasked=True),
           step("r", n + 3, [hello, hello], sampled_unmasked=True)]
    for msg in bad:
        res = s.send(msg).results[0]
        assert res.status == pb.SEQ_STATUS_ERROR and res.code == 3 and "sampled_unmasked" in res.reason, res
    # Nothing changed: the step after the last applied one is still n + 3.
    world = cl100k.encode(" world")[0]
    assert s.send(step("r", n + 3, [world], sampled_unmasked=True)).results[0].num_rows == 0
    s.close()
    registry = server.metrics.registry
    assert registry.get_sample_value("maskd_opportunistic_steps_total", {"outcome": "resample"}) >= 1
    assert registry.get_sample_value("maskd_opportunistic_steps_total", {"outcome": "allowed"}) >= 2


def test_columnar_steps_sampled_unmasked_and_mixed_with_plain_ones(mc, cl100k, monkeypatch):
    """Sequences whose handles are known step in the columnar form (StepRequest
    .columnar_sampled_unmasked); rows come back only for the refused tokens, at the right place
    among the rows of sequences stepped the usual way in the same step."""
    from maskd.server import entries

    seen = []
    parse = entries.parse

    def watched(request, by_handle, answers, columnar=True):     # the server's own parse, watched: which form came in
        seen.append((len(request.handles) // 4, request.columnar_sampled_unmasked, len(request.seqs)))
        return parse(request, by_handle, answers, columnar)

    monkeypatch.setattr(entries, "parse", watched)
    tokens = cl100k.encode("hello world5")
    ref = reference_rows(mc, "col-ref", REGEX, tokens)
    ids = [f"col-{i}" for i in range(4)]
    for sid in ids:
        opened(mc, sid, REGEX, unmasked())
    r = mc.step({sid: unmasked(tokens[0]) for sid in ids})           # all columnar now (handles known)
    assert seen[-1] == (4, True, 0)
    assert all(r.seqs[sid].num_rows == 0 and r.seqs[sid].row == -1 for sid in ids) and len(r.bitmask) == 0
    wrong = cl100k.encode(" planet")[0]
    plain = "col-plain"
    opened(mc, plain, REGEX)
    mc.step({plain: [tokens[0]]})
    r = mc.step({"col-0": unmasked(tokens[1]), "col-1": unmasked(wrong), "col-2": unmasked(tokens[1]),
                 "col-3": unmasked(wrong), plain: [tokens[1]]})
    assert seen[-1] == (4, True, 1)     # the plain step went as a SeqStep entry beside them
    assert [r.seqs[s].resample for s in ids] == [False, True, False, True]
    assert r.seqs["col-0"].num_rows == 0 and r.seqs["col-2"].num_rows == 0
    for sid in ("col-1", "col-3"):
        assert np.array_equal(r.bitmask[r.seqs[sid].row], ref[1])
    assert np.array_equal(r.bitmask[r.seqs[plain].row], ref[2])
    assert len(r.bitmask) == 3
    assert mc.history("col-1") == tokens[:1] and mc.history("col-0") == tokens[:2]
    r = mc.step({"col-1": unmasked(tokens[1]), "col-3": [tokens[1]]})  # sampled again with the row
    assert r.seqs["col-1"].num_rows == 0 and np.array_equal(r.bitmask[r.seqs["col-3"].row], ref[2])


def test_columnar_entries_sampled_unmasked_with_more_than_one_token_are_refused_alone(stub, cl100k):
    """Garbage in the columnar form: an entry with two tokens under columnar_sampled_unmasked is
    refused (INVALID_ARGUMENT, in `problems`) and its sequence is unchanged; its neighbour's single
    token is checked as usual."""
    s = Stream(stub)
    handles = []
    for sid in ("g0", "g1"):
        r = s.send(step(sid, 0, spec=REGEX, sampled_unmasked=True))
        n = 0
        while r.results[0].status == pb.SEQ_STATUS_WAITING:
            n += 1
            r = s.send(step(sid, n, sampled_unmasked=True))
        handles.append((r.results[0].handle, n))
    hello, world = cl100k.encode("hello")[0], cl100k.encode(" world")[0]
    req = pb.StepRequest(columnar_sampled_unmasked=True)
    req.handles = np.array([h for h, _ in handles], "<u4").tobytes()
    req.steps = np.array([n + 1 for _, n in handles], "<u4").tobytes()
    req.token_counts = np.array([2, 1], "<u4").tobytes()
    req.tokens = np.array([hello, world, hello], "<i4").tobytes()
    reply = s.send_request(req)
    packed = np.frombuffer(reply.statuses, np.uint8)
    assert (packed & 0x0F).tolist() == [pb.SEQ_STATUS_ERROR, pb.SEQ_STATUS_READY]
    assert [(p.index, p.code) for p in reply.problems] == [(0, 3)] and "sampled_unmasked" in reply.problems[0].reason
    assert reply.num_rows == 0                        # the good token was allowed: no row for anyone
    retry = s.send(step("g0", handles[0][1] + 1, [hello], sampled_unmasked=True))   # g0 was unchanged
    assert retry.results[0].status == pb.SEQ_STATUS_READY and retry.results[0].num_rows == 0
    s.close()


def test_a_token_sampled_unmasked_while_the_grammar_compiles_is_refused_not_queued(stub, cl100k):
    """Tokens that arrive while a grammar compiles wait for it (a restored history); one sampled
    without its row cannot be checked then, so it is refused (FAILED_PRECONDITION) and the sequence
    is unchanged: once READY the same token is checked."""
    s = Stream(stub)
    spec = {"regex": f"hello world[0-9]{{{1 + int(time.time() * 1e6) % 50},60}}"}   # new: it compiles now
    hello, wrong = cl100k.encode("hello")[0], cl100k.encode(" planet")[0]
    r = s.send(step("w", 0, spec=spec, sampled_unmasked=True))
    n, refused = 0, 0
    while r.results[0].status == pb.SEQ_STATUS_WAITING:
        r = s.send(step("w", n + 1, [wrong], sampled_unmasked=True))
        res = r.results[0]
        if res.status == pb.SEQ_STATUS_ERROR:
            assert res.code == 9 and "still compiling" in res.reason, res     # FAILED_PRECONDITION
            refused += 1
            r = s.send(step("w", n + 1, sampled_unmasked=True))   # the same step without the token
            n += 1
    if refused == 0:
        pytest.skip("the grammar compiled before a token arrived (nothing to refuse on this run)")
    assert r.results[0].status == pb.SEQ_STATUS_READY
    r = s.send(step("w", n + 1, [wrong], sampled_unmasked=True))      # now it is checked: refused, resample
    assert r.results[0].resample and r.results[0].num_rows == 1
    r = s.send(step("w", n + 2, [hello], sampled_unmasked=True))
    assert r.results[0].status == pb.SEQ_STATUS_READY and r.results[0].num_rows == 0
    s.close()
