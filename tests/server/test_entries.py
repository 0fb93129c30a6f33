"""A step's entries in one form: SeqStep messages and columnar arrays parsed into entries indexed
in one answer record (step_answers.py), and each answer written back in the form its entry came in."""
import collections

import numpy as np

from maskd.server import entries
from maskd.server.step_answers import StepAnswers
from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import ACCEPTING_BIT, Code, SeqStatus


class Seq:
    def __init__(self, seq_id):
        self.seq_id = seq_id


def columnar(request, handles, steps, counts, tokens):
    request.handles = np.array(handles, "<u4").tobytes()
    request.steps = np.array(steps, "<u4").tobytes()
    request.token_counts = np.array(counts, "<u4").tobytes()
    request.tokens = np.array(tokens, "<i4").tobytes()
    return request


def test_both_forms_parse_into_entries_seqsteps_first():
    request = pb.StepRequest(seqs=[pb.SeqStep(seq_id="a", step=0, tokens=[1, 2], spec=pb.GrammarSpec(regex="x+")),
                                   pb.SeqStep(seq_id="b", step=3, draft_tokens=[7, 8], rollback=1, close=False),
                                   pb.SeqStep(seq_id="c", step=1, grammar_id="g1", history_offset=4)])
    columnar(request, [5, 9, 6], [2, 4, 3], [1, 0, 2], [11, 12, 13])
    answers = entries.answers_for(request)
    found, unknown, problem = entries.parse(request, {5: Seq("p"), 6: Seq("q")}, answers)
    assert (unknown, problem) == (1, "")
    assert [(e.seq_id, e.step, e.tokens) for e in found] == [
        ("a", 0, [1, 2]), ("b", 3, []), ("c", 1, []), ("p", 2, [11]), ("", 4, []), ("q", 3, [12, 13])]
    a, b, c = found[:3]
    assert (a.opens, a.spec.regex, a.seq) == ("spec", "x+", None)
    assert (b.opens, b.drafts, b.rollback) == (None, (7, 8), 1)
    assert (c.opens, c.grammar_id, c.history_offset) == ("grammar_id", "g1", 4)
    assert [e.index for e in found] == list(range(6)) and (len(answers), answers.named) == (6, 3)
    assert answers.seq_ids == ["a", "b", "c"] and answers.steps == [0, 3, 1]
    assert found[3].seq.seq_id == "p" and found[3].drafts == ()
    assert answers.status_of(4) == SeqStatus.ERROR and answers.problems[4][0] == Code.NOT_FOUND
    assert "unknown sequence handle 9" in answers.problems[4][1]
    assert [answers.status_of(i) for i in (0, 1, 2, 3, 5)] == [SeqStatus.UNSPECIFIED] * 5


def test_columnar_arrays_that_disagree_are_one_problem_for_that_part():
    request = columnar(pb.StepRequest(seqs=[pb.SeqStep(seq_id="a", step=1, tokens=[3])]), [5, 6], [1], [1, 1], [2, 3])
    found, unknown, problem = entries.parse(request, {5: Seq("p"), 6: Seq("q")}, entries.answers_for(request))
    assert "columnar arrays disagree: 2 handles, 1 steps" in problem
    assert [e.index for e in found] == [0, 1, 2] and unknown == 0
    request.handles = b"\x01\x00\x00"
    assert "not packed 32-bit values" in entries.parse(request, {}, StepAnswers(1, 1))[2]


def test_each_answer_goes_back_in_its_entrys_form():
    answers = StepAnswers(4, 2, ["a", "b"], [4, 1])
    answers.set_status(0, SeqStatus.READY, accepting=True)          # a SeqStep entry with rows and drafts
    answers.first_row[0], answers.num_rows[0], answers.handles[0] = 2, 3, 17
    answers.drafts_valid[0], answers.forced[0] = 2, [5, 6]
    counts = collections.Counter()
    answers.refuse(1, counts, Code.INVALID_ARGUMENT, "no")
    answers.set_status(2, SeqStatus.FINISHED, accepting=True)       # the columnar ones
    answers.forced[2] = [9]
    answers.status[3] = SeqStatus.FAILED
    answers.problems[3] = (Code.INVALID_ARGUMENT, "token rejected")
    reply = pb.StepResponse()
    entries.write_answers(answers, reply, want_forced=True)
    assert counts == {"invalid_argument": 1}
    assert [(r.seq_id, r.step, r.status, r.first_row, r.num_rows, r.accepting, r.handle, r.drafts_valid,
             list(r.forced_tokens)) for r in reply.results] == [
        ("a", 4, SeqStatus.READY, 2, 3, True, 17, 2, [5, 6]), ("b", 1, SeqStatus.ERROR, 0, 0, False, 0, 0, [])]
    assert (reply.results[1].code, reply.results[1].reason) == (Code.INVALID_ARGUMENT, "no")
    assert list(reply.statuses) == [SeqStatus.FINISHED | ACCEPTING_BIT, SeqStatus.FAILED]
    assert [(p.index, p.code, p.reason) for p in reply.problems] == [(1, Code.INVALID_ARGUMENT, "token rejected")]
    assert np.frombuffer(reply.forced_counts, "<u4").tolist() == [1, 0]
    assert np.frombuffer(reply.forced_tokens, "<i4").tolist() == [9]
