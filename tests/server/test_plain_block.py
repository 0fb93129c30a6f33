"""The decode step's common case as arrays (maskd/server/plain_block.py), through a real server: a
columnar part whose every entry is its sequence's next step with one token is answered without
per-entry objects, and answers exactly what the same steps get entry by entry (SeqStep entries,
the per-entry phases): statuses, accepting bits, forced tokens, failures with their reasons and
every row; an engine fault, a rejected token or a document the validator ends costs that entry
alone; a rank that repeats such a step gets the same answer."""
import grpc
import numpy as np
import pytest
from test_columnar import DIGITS, LETTERS, columnar, open_ready, plain_rows, statuses
from test_server import Stream, step

from maskd.server import Limits, MaskServer, ServerConfig
from maskd.server import plain_block as plain_block_module
from maskd.v1 import maskd_pb2 as pb

C = grpc.StatusCode
SCHEMA = {"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                          "required": ["ok", "n"], "additionalProperties": False}}
UNIQUE = {"json_schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1,
                                  limits=Limits(max_message_bytes=1 << 22))).start()
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture
def blocks(monkeypatch):
    """How many steps the server answered as a plain block (its own ``PlainBlock.of``, watched)."""
    seen = []
    of = plain_block_module.PlainBlock.of.__func__

    def watched(cls, request, session, answers):
        block = of(cls, request, session, answers)
        seen.append(block is not None)
        return block

    monkeypatch.setattr(plain_block_module.PlainBlock, "of", classmethod(watched))
    return seen


def one_by_one(stream, seq_id, spec, tokens, forced=False):
    """The reference: a sequence stepped with SeqStep entries, one token a step (the per-entry
    phases). Returns [(status, accepting, forced tokens, reason, row)] after each token."""
    r = stream.send(step(seq_id, 0, spec=spec))
    n = 0
    while r.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        r = stream.send(step(seq_id, n))
    out = []
    for k, t in enumerate(tokens):
        r = stream.send(step(seq_id, n + 1 + k, [t]), forced=forced)
        res = r.results[0]
        out.append((res.status, res.accepting, list(res.forced_tokens), res.reason,
                    r.dense[res.first_row] if res.num_rows else None))
    return out


def block_answers(reply, index, forced=False):
    """Entry ``index`` of a columnar reply, in the form ``one_by_one`` gives."""
    st, acc = statuses(reply)
    problems = {p.index: p.reason for p in reply.problems}
    got_forced = []
    if forced:
        counts = np.frombuffer(reply.forced_counts, "<u4")
        flat = np.frombuffer(reply.forced_tokens, "<i4").tolist()
        start = int(counts[:index].sum())
        got_forced = flat[start:start + int(counts[index])]
    return st[index], acc[index], got_forced, problems.get(index, ""), plain_rows(reply)[index]


def same(a, b):
    assert a[:4] == b[:4]
    assert (a[4] is None) == (b[4] is None)
    if a[4] is not None:
        assert np.array_equal(a[4], b[4])


def test_a_plain_block_answers_what_the_entries_get_one_by_one(stub, cl100k, blocks):
    """Four grammars stepped together as columns, beside each stepped alone as SeqStep entries:
    every answer equal at every step, a rejected token FAILED in its step (its row gone, the rows
    after it in place), a finished document FINISHED, forced tokens where the grammar forces them;
    a SeqStep open in the same request keeps its row first."""
    eos = cl100k.eos_token_ids[0]

    def chars(text):
        return [cl100k.encode(c)[0] for c in text]

    texts = {"d": (DIGITS, chars("123456")), "l": (LETTERS, chars("abcdefgh")),
             "j": (SCHEMA, cl100k.encode('{"ok":true,"n":7}') + [eos]), "x": (DIGITS, chars("12a3"))}
    ref_stream = Stream(stub)
    reference = {sid: one_by_one(ref_stream, "ref-" + sid, spec, toks, forced=True)
                 for sid, (spec, toks) in texts.items()}
    s = Stream(stub)
    opened = {sid: open_ready(s, sid, spec) for sid, (spec, _) in texts.items()}
    order = list(texts)
    length = max(len(t) for _, t in texts.values())
    for k in range(length):
        live = [sid for sid in order if k < len(texts[sid][1]) and (
            k == 0 or reference[sid][k - 1][0] in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FINISHED))]
        entries = [(opened[sid][0], opened[sid][1] + 1 + k, [texts[sid][1][k]]) for sid in live]
        seqs = [step(f"new-{k}", 0, spec=LETTERS)] if k == 1 else []
        r = s.send_request(columnar(entries, forced=True, seqs=seqs))
        for i, sid in enumerate(live):
            same(block_answers(r, i, forced=True), reference[sid][k])
        if seqs:
            assert r.results[0].seq_id == "new-1" and (r.results[0].first_row == 0 or r.results[0].num_rows == 0)
    assert reference["x"][2][0] == pb.SEQ_STATUS_FAILED and "token rejected" in reference["x"][2][3]
    assert reference["d"][5][0] == reference["j"][-1][0] == pb.SEQ_STATUS_FINISHED
    assert any(ref[2] for ref in reference["j"])          # the schema forced tokens somewhere
    assert blocks.count(True) >= length                   # the steps went as blocks (not the per-entry path)
    s.close()
    ref_stream.close()


def test_odd_entries_among_plain_ones_go_entry_by_entry_and_the_rest_stay_a_block(stub, cl100k, blocks):
    """A columnar part with an unknown handle, a repeat of the step before (its rows from the kept
    answer) and a token outside the vocabulary among plain entries: those three go through the
    per-entry phases, the plain ones stay a block (``PlainBlock.of`` takes them), and every entry
    gets what it gets alone: the same statuses, problems and rows, the rows in entry order."""
    s, ref = Stream(stub), Stream(stub)
    specs = {"a": LETTERS, "b": DIGITS, "c": LETTERS, "d": DIGITS}
    mine = {sid: open_ready(s, sid, spec) for sid, spec in specs.items()}
    theirs = {sid: open_ready(ref, sid, spec) for sid, spec in specs.items()}
    one = {sid: cl100k.encode(t) for sid, t in zip("abcd", "a1b2")}
    two = {sid: cl100k.encode(t) for sid, t in zip("abcd", "c3d4")}
    first = s.send_request(columnar([(mine[x][0], mine[x][1] + 1, one[x]) for x in "abcd"]))
    ref.send_request(columnar([(theirs[x][0], theirs[x][1] + 1, one[x]) for x in "abcd"]))
    outside = 1 << 30
    mixed = [(mine["a"][0], mine["a"][1] + 2, two["a"]),
             (987654, 1, two["a"]),                                   # a handle never given
             (mine["b"][0], mine["b"][1] + 1, one["b"]),              # b's step 1 again: a repeat
             (mine["c"][0], mine["c"][1] + 2, [outside]),             # outside the vocabulary
             (mine["d"][0], mine["d"][1] + 2, two["d"])]
    r = s.send_request(columnar(mixed))
    alone = ref.send_request(columnar([(theirs[x][0], theirs[x][1] + 2, two[x]) for x in "ad"]))
    st, _ = statuses(r)
    assert st == [pb.SEQ_STATUS_READY, pb.SEQ_STATUS_ERROR, pb.SEQ_STATUS_READY, pb.SEQ_STATUS_ERROR,
                  pb.SEQ_STATUS_READY]
    problems = {p.index: (p.code, p.reason) for p in r.problems}
    assert sorted(problems) == [1, 3] and problems[1][0] == C.NOT_FOUND.value[0]
    assert problems[3][0] == C.INVALID_ARGUMENT.value[0] and "outside the vocabulary" in problems[3][1]
    rows, want = plain_rows(r), plain_rows(alone)
    assert r.num_rows == 3 and rows[1] is None and rows[3] is None
    assert np.array_equal(rows[0], want[0]) and np.array_equal(rows[4], want[1])
    assert np.array_equal(rows[2], plain_rows(first)[1])                 # b's row of step 1, kept
    assert not np.array_equal(rows[0], rows[2])                          # letters and digits: in entry order
    assert blocks == [True, True, True, True]     # the mixed part too: its plain entries were a block
    after = s.send_request(columnar([(mine[x][0], mine[x][1] + 2, two[x]) for x in "bc"]))
    assert statuses(after)[0] == [pb.SEQ_STATUS_READY, pb.SEQ_STATUS_READY]   # the refused ones changed nothing
    s.close()
    ref.close()


def test_an_engine_fault_in_a_blocks_fill_costs_that_entry_only(server, stub, cl100k, blocks, monkeypatch):
    """The engine raises on one matcher of the block's fill: that sequence fails with INTERNAL,
    the others get their rows (dense, in order; a rank repeating the step gets the same) and step on."""
    s, lagging = Stream(stub, session="block-fault"), Stream(stub, session="block-fault")
    opened = [open_ready(s, sid, LETTERS) for sid in ("a", "b", "c")]
    session = next(x for x in server.service.sessions.sessions() if "b" in x.seqs)
    victim = session.seqs["b"].matcher
    engine = server.service.engine
    real = type(engine).fill_batch

    def faulty(self, matchers, rows, drafts, out):
        if any(m is victim for m in matchers):
            raise RuntimeError("engine fault")
        return real(self, matchers, rows, drafts, out)

    monkeypatch.setattr(type(engine), "fill_batch", faulty)
    tok = cl100k.encode("q")
    r = s.send_request(columnar([(h, n + 1, tok) for h, n, _ in opened]))
    st, _ = statuses(r)
    assert st == [pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FAILED, pb.SEQ_STATUS_READY]
    assert r.problems[0].index == 1 and r.problems[0].code == C.INTERNAL.value[0]
    assert "engine fault" in r.problems[0].reason
    assert r.num_rows == 2
    rows = plain_rows(r)
    assert np.array_equal(rows[0], rows[2]) and rows[0].any()
    monkeypatch.setattr(type(engine), "fill_batch", real)
    again = lagging.send_request(columnar([(h, n + 1, tok) for h, n, _ in opened][::-1]))
    assert statuses(again)[0] == st[::-1] and again.problems[0].index == 1
    assert [x is None for x in plain_rows(again)] == [False, True, False]
    assert all(np.array_equal(x, rows[0]) for x in plain_rows(again) if x is not None)
    r = s.send_request(columnar([(opened[0][0], opened[0][1] + 2, tok), (opened[2][0], opened[2][1] + 2, tok)]))
    assert statuses(r)[0] == [pb.SEQ_STATUS_READY, pb.SEQ_STATUS_READY]
    assert blocks.count(True) == 2
    s.close()
    lagging.close()


def test_a_lagging_rank_gets_a_blocks_answers_failures_included(stub, cl100k, blocks):
    """Rank b repeats rank a's block steps (one token rejected in the second): the same statuses,
    problems and rows, from the answers the block kept."""
    a, b = Stream(stub, session="block-tp"), Stream(stub, session="block-tp")
    hd, nd, _ = open_ready(a, "d", DIGITS)
    hl, nl, _ = open_ready(a, "l", LETTERS)
    steps = [[(hd, nd + 1, cl100k.encode("1")), (hl, nl + 1, cl100k.encode("a"))],
             [(hd, nd + 2, cl100k.encode("z")), (hl, nl + 2, cl100k.encode("b"))]]
    got_a = [a.send_request(columnar(e)) for e in steps]
    assert statuses(got_a[1])[0] == [pb.SEQ_STATUS_FAILED, pb.SEQ_STATUS_READY]
    assert blocks == [True, True]
    for e, ra in zip(steps, got_a):
        rb = b.send_request(columnar(e))
        assert statuses(rb) == statuses(ra)
        assert [(p.index, p.code, p.reason) for p in rb.problems] == [(p.index, p.code, p.reason) for p in ra.problems]
        for x, y in zip(plain_rows(rb), plain_rows(ra)):
            assert (x is None and y is None) or np.array_equal(x, y)
    a.close()
    b.close()


def test_a_document_the_validator_ends_in_a_block_loses_its_row_alone(stub, cl100k, blocks):
    """Complete mode: uniqueItems is the validator's. The array closes with a repeat in a block
    step: that entry FAILS with the validator's reason, the entry after it keeps its row."""
    s = Stream(stub)
    hu, nu, _ = open_ready(s, "u", UNIQUE)
    hl, nl, _ = open_ready(s, "l", LETTERS)
    tokens = [cl100k.encode(c)[0] for c in "[1,1]"]
    letters = [cl100k.encode(c)[0] for c in "abcde"]
    for k, t in enumerate(tokens):
        r = s.send_request(columnar([(hu, nu + 1 + k, [t]), (hl, nl + 1 + k, [letters[k]])]))
    st, _ = statuses(r)
    assert st == [pb.SEQ_STATUS_FAILED, pb.SEQ_STATUS_READY]
    assert r.problems[0].index == 0 and "does not match the JSON schema" in r.problems[0].reason
    assert r.num_rows == 1 and plain_rows(r)[1].any()
    assert all(blocks)
    s.close()


def test_a_rank_repeating_a_whole_block_gets_it_without_a_pass_over_its_entries(server, stub, cl100k, monkeypatch):
    """Lockstep ranks send the same columnar bytes: the second gets the first's answer from the
    block (no parse of its entries, no fill), also after the sequences stepped on or closed; other
    tokens at the same step are a divergence, as entry by entry."""
    from maskd.server import entries

    a, b = Stream(stub, session="block-repeat"), Stream(stub, session="block-repeat")
    opened = [open_ready(a, sid, spec) for sid, spec in (("d", DIGITS), ("l", LETTERS), ("x", DIGITS))]
    parsed, fills = [], []
    parse, fill = entries.parse, type(server.service.engine).fill_batch

    def watched_parse(request, by_handle, answers, columnar=True):
        parsed.append(request)
        return parse(request, by_handle, answers, columnar)

    def counted_fill(self, *args):
        fills.append(1)
        return fill(self, *args)

    monkeypatch.setattr(entries, "parse", watched_parse)
    monkeypatch.setattr(type(server.service.engine), "fill_batch", counted_fill)
    one, letter = cl100k.encode("1"), cl100k.encode("a")
    first = columnar([(opened[0][0], opened[0][1] + 1, one), (opened[1][0], opened[1][1] + 1, letter),
                      (opened[2][0], opened[2][1] + 1, letter)], forced=True)      # x rejects its token
    second = columnar([(opened[0][0], opened[0][1] + 2, one), (opened[1][0], opened[1][1] + 2, letter)], forced=True)
    got_a = [a.send_request(first), a.send_request(second)]
    assert (len(parsed), len(fills)) == (2, 2)
    assert statuses(got_a[0])[0] == [pb.SEQ_STATUS_READY, pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FAILED]
    for request, ra in zip((first, second), got_a):
        rb = b.send_request(request)
        assert (rb.statuses, rb.forced_counts, rb.forced_tokens) == (ra.statuses, ra.forced_counts, ra.forced_tokens)
        assert [(p.index, p.code, p.reason) for p in rb.problems] == [(p.index, p.code, p.reason) for p in ra.problems]
        assert np.array_equal(rb.dense, ra.dense) and rb.num_rows == ra.num_rows
    assert (len(parsed), len(fills)) == (2, 2)          # both repeats answered from the blocks
    assert a.send(pb.SeqStep(seq_id="l", step=opened[1][1] + 2, close=True)).results[0].status == pb.SEQ_STATUS_CLOSED
    rb = b.send_request(second)                          # after the close: its last answers are kept
    assert rb.statuses == got_a[1].statuses and np.array_equal(rb.dense, got_a[1].dense)
    other = b.send_request(columnar([(opened[0][0], opened[0][1] + 2, cl100k.encode("2"))]))
    assert other.problems[0].code == C.ABORTED.value[0]
    a.close()
    b.close()


def test_sequences_stepped_as_blocks_leave_no_cycles_for_the_collector(cl100k):
    """Sequences keep their steps' answers (step_answers.py), which hold no sequence, and a block
    is dropped with its step: closed sequences and old answers are freed by reference counting,
    not left in cycles for the garbage collector's full passes."""
    import gc

    from maskd.server.config import Limits
    from maskd.server.engines import create_engine
    from maskd.server.grammar_cache import GrammarCache
    from maskd.server.plain_block import PlainBlock
    from maskd.server.sequence import SequenceState
    from maskd.server.session import Session
    from maskd.server.step_answers import StepAnswers
    from maskd.specs import GrammarSpec

    engine = create_engine("llguidance", cl100k, threads=1)
    cache = GrammarCache(engine, compile_threads=1)
    spec = GrammarSpec.from_request({"regex": "[a-z]{1,100}"})
    assert cache.wait(cache.lookup(spec, ""), 60).compiled is not None
    session = Session("cycles", engine, cache, Limits())
    a = cl100k.encode("a")[0]
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for n in range(2):
            opened = session.step(pb.StepRequest(seqs=[pb.SeqStep(seq_id=f"c{n}-{i}", step=0, spec=spec.to_proto())
                                                       for i in range(8)]))
            handles = np.array([opened.answers.handles[i] for i in range(8)], "<u4").tobytes()
            for k in range(1, 8):
                outcome = session.step(pb.StepRequest(handles=handles, steps=np.full(8, k, "<u4").tobytes(),
                                                      token_counts=np.ones(8, "<u4").tobytes(),
                                                      tokens=np.full(8, a, "<i4").tobytes()))
                assert outcome.answers.named == 0 and outcome.release is not None
                outcome.release()
            session.step(pb.StepRequest(seqs=[pb.SeqStep(seq_id=f"c{n}-{i}", step=7, close=True) for i in range(8)]))
        session.closed.clear()
        session.by_handle.clear()
        session.blocks.clear()
        del outcome
        gc.collect()
        assert not [x for x in gc.garbage if isinstance(x, (PlainBlock, SequenceState, StepAnswers))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
