"""Grammar drafts (contract revision 4): a step asks the server to propose draft tokens.

Through the real gRPC server on cl100k: forced drafts and learned ones, a row for every draft
position equal to the row that position gets when the tokens are stepped one by one, the matcher
left where the accepted tokens put it, idempotent repeats, acceptance counted, bad requests
refused with a reason; and the drafter's memory bounds.
"""
import urllib.request

import numpy as np
import pytest
from test_server import Stream, step

from conftest import allowed_ids
from maskd.server import Limits, MaskServer, ServerConfig
from maskd.server.drafts import MIN_COUNT, DraftModel, GrammarCounts
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb

READY, ERROR = pb.SEQ_STATUS_READY, pb.SEQ_STATUS_ERROR


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1, metrics_port=0,
                                  limits=Limits(max_draft_tokens=8))).start()
    yield srv
    srv.stop(grace=1.0)


def ready(s, seq_id, spec, **kw):
    """Opens a sequence and steps until its grammar is ready; returns (step, reply)."""
    r = s.send(step(seq_id, 0, spec=spec, **kw))
    n = 0
    while r.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        r = s.send(step(seq_id, n, **kw))
    assert r.results[0].status == READY, r.results[0].reason
    return n, r


def metric(server, name, source):
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{source="{source}"}}'):
            return float(line.split()[-1])
    return 0.0


def rows_one_by_one(s, seq_id, spec, tokens):
    """The row at every position along ``tokens`` (and after them), stepping a fresh sequence."""
    n, r = ready(s, seq_id, spec)
    out = [r.dense[r.results[0].first_row].copy()]
    for t in tokens:
        n += 1
        r = s.send(step(seq_id, n, [t]))
        out.append(r.dense[r.results[0].first_row].copy())
    return out


def test_forced_drafts_with_exact_rows_and_the_matcher_left_in_place(stub, cl100k):
    spec = {"regex": "hello world[0-9]"}
    s = Stream(stub)
    n, _ = ready(s, "f", spec)
    r = s.send(step("f", n + 1, propose_drafts=4))
    res = r.results[0]
    drafts = list(res.proposed_drafts)
    assert cl100k.decode(drafts) == "hello world"[:len(cl100k.decode(drafts))] and drafts
    assert res.num_rows == 1 + len(drafts) and res.drafts_valid == len(drafts)
    expected = rows_one_by_one(s, "ref", spec, drafts)
    for k in range(len(drafts) + 1):     # each draft position has the row stepping there gives
        assert np.array_equal(r.dense[res.first_row + k], expected[k]), k
        if k < len(drafts):
            assert drafts[k] in allowed_ids(r.dense[res.first_row + k])
    # The matcher did not move: the next step's tokens are applied from where the step before left it.
    r2 = s.send(step("f", n + 2, drafts[:1]))
    assert np.array_equal(r2.dense[r2.results[0].first_row], expected[1])
    s.close()


def test_learned_drafts_come_from_what_the_grammars_sequences_wrote(stub, server, cl100k):
    spec = {"regex": "[a-z ]{1,80}"}           # nothing is forced: every draft here is learned
    text = cl100k.encode("the quick brown fox jumps over the lazy dog")
    s = Stream(stub)
    for i in range(MIN_COUNT):                  # two sequences write the text (drafting: the grammar learns)
        n, _ = ready(s, f"teach{i}", spec, propose_drafts=1)
        s.send(step(f"teach{i}", n + 1, text))
    proposed = metric(server, "maskd_drafts_proposed_total", "learned")
    accepted = metric(server, "maskd_drafts_accepted_total", "learned")
    n, _ = ready(s, "guess", spec)
    r = s.send(step("guess", n + 1, text[:2], propose_drafts=5))
    res = r.results[0]
    assert list(res.proposed_drafts) == text[2:7]
    assert res.num_rows == 6 and res.drafts_valid == 5
    # An engine accepted three of them and sampled its own bonus token.
    bonus = cl100k.encode(" cat")[0]
    r2 = s.send(step("guess", n + 2, [*text[2:5], bonus]))
    assert r2.results[0].status == READY
    assert metric(server, "maskd_drafts_proposed_total", "learned") == proposed + 5
    assert metric(server, "maskd_drafts_accepted_total", "learned") == accepted + 3
    s.close()


def grammar_metric(server, name, grammar_id):
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and f'grammar="{grammar_id}"' in line:
            return float(line.split()[-1])
    return None


def test_drafts_are_counted_per_grammar(stub, server, cl100k):
    """maskd_grammar_drafts_{proposed,accepted}_total{tenant, grammar}: one series per grammar the
    drafter holds, so an operator sees which grammars' drafts pay."""
    spec = {"regex": "hello world[0-9] and more"}
    s = Stream(stub)
    n, r = ready(s, "pg", spec)
    gid = s.send(step("pg", n + 1, propose_drafts=4))
    proposed = list(gid.results[0].proposed_drafts)
    assert proposed
    assert cl100k.decode(proposed) == "hello world"
    # An engine took the first draft and sampled its own token where the second was.
    r = s.send(step("pg", n + 2, [proposed[0], cl100k.encode(" wor")[0]]))
    assert r.results[0].status == READY
    gid = server.cache.grammar_id(GrammarSpec.from_dict(spec))
    assert grammar_metric(server, "maskd_grammar_drafts_proposed_total", gid) == len(proposed)
    assert grammar_metric(server, "maskd_grammar_drafts_accepted_total", gid) == 1
    never = server.cache.grammar_id(GrammarSpec.from_dict({"regex": "never used here"}))
    assert grammar_metric(server, "maskd_grammar_drafts_proposed_total", never) is None
    s.close()


def test_a_draft_the_grammar_refuses_is_never_proposed(stub, cl100k):
    spec = {"regex": "[a-z ]{1,24}"}
    text = cl100k.encode(" the quick brown fox")          # 20 characters
    s = Stream(stub)
    for i in range(MIN_COUNT):
        n, _ = ready(s, f"t{i}", spec, propose_drafts=1)
        s.send(step(f"t{i}", n + 1, text))
    # The same context 12 characters later: " brown" would pass the grammar's 24.
    n, _ = ready(s, "late", spec)
    r = s.send(step("late", n + 1, cl100k.encode("aaaaaaaaaaaa") + text[:2], propose_drafts=4))
    assert r.results[0].status == READY
    assert list(r.results[0].proposed_drafts) == [] and r.results[0].num_rows == 1
    n, _ = ready(s, "early", spec)                         # where it fits, it is proposed
    r = s.send(step("early", n + 1, text[:2], propose_drafts=4))
    assert list(r.results[0].proposed_drafts) == text[2:4]
    s.close()


def test_a_grammar_nobody_drafts_teaches_nothing(stub, server, cl100k):
    spec = {"regex": "[a-z ]{1,70}"}
    text = cl100k.encode(" the quick brown fox")
    s = Stream(stub)
    for i in range(MIN_COUNT):                   # nobody asks for drafts: no counts are kept
        n, _ = ready(s, f"plain{i}", spec)
        s.send(step(f"plain{i}", n + 1, text))
    n, _ = ready(s, "ask", spec)
    r = s.send(step("ask", n + 1, text[:2], propose_drafts=2))
    assert list(r.results[0].proposed_drafts) == []
    s.close()


def test_a_repeat_gets_the_same_proposal_and_other_inputs_are_a_divergence(stub, cl100k):
    spec = {"regex": "hello world[0-9]"}
    s = Stream(stub)
    n, _ = ready(s, "rep", spec)
    r1 = s.send(step("rep", n + 1, propose_drafts=3))
    r2 = s.send(step("rep", n + 1, propose_drafts=3))       # another rank, or a retry
    assert list(r1.results[0].proposed_drafts) == list(r2.results[0].proposed_drafts)
    assert r1.results[0].num_rows == r2.results[0].num_rows
    for k in range(r1.results[0].num_rows):
        assert np.array_equal(r1.dense[r1.results[0].first_row + k], r2.dense[r2.results[0].first_row + k])
    r3 = s.send(step("rep", n + 1, propose_drafts=2))
    assert r3.results[0].status == ERROR and "divergence" in r3.results[0].reason
    s.close()


@pytest.mark.parametrize("kw, text", [
    ({"propose_drafts": 9}, "propose_drafts 9; the limit is 8"),
    ({"propose_drafts": 2, "draft_tokens": [1, 2]}, "not both"),
])
def test_bad_proposal_requests_are_refused_and_lose_nothing(stub, kw, text):
    s = Stream(stub)
    n, r0 = ready(s, "bad", {"regex": "hello world[0-9]"})
    r = s.send(step("bad", n + 1, **kw))
    assert r.results[0].status == ERROR and text in r.results[0].reason
    r = s.send(step("bad", n + 1, propose_drafts=1))        # the sequence is where it was
    assert r.results[0].status == READY and len(r.results[0].proposed_drafts) == 1
    assert np.array_equal(r.dense[r.results[0].first_row], r0.dense[r0.results[0].first_row])
    s.close()


def test_the_drafters_memory_is_bounded():
    counts = GrammarCounts(limit=8)
    counts.add([], list(range(100)))
    assert len(counts.contexts) <= 8
    counts = GrammarCounts(limit=64)
    for nxt in range(10):                        # many next tokens after one context: a few kept
        counts.add([1, 2], [nxt])
    assert len(counts.contexts[(1, 2)]) <= 4
    model = DraftModel(max_grammars=3, max_contexts=16)
    for g in range(10):
        model.learn(f"g{g}", [1, 2], [3, 4, 5])
    assert model.grammars() == 3 and model.stats("g9") and not model.stats("g0")


def test_a_guess_needs_counts_and_a_clear_majority():
    counts = GrammarCounts(limit=64)
    counts.add([1, 2], [3])
    assert counts.guess([1, 2]) is None          # seen once
    counts.add([1, 2], [3])
    assert counts.guess([1, 2]) == 3
    counts.add([1, 2], [4])
    counts.add([1, 2], [4])
    assert counts.guess([1, 2]) is None          # no clear majority
