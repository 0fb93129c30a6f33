"""Restores in parts (the contract's "Restores"): a history longer than max_tokens_per_step reopens a
sequence in parts, idempotently, and ends at the rows the undisturbed sequence had."""
import grpc
import numpy as np
import pytest

from maskd.rowcodec import RowBlockDecoder
from maskd.server import Limits, MaskServer, ServerConfig
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc

C = grpc.StatusCode
SPEC = GrammarSpec.from_dict({"regex": "[a-z ]+"}).to_proto()


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1,
                                  limits=Limits(max_tokens_per_step=8))).start()
    yield srv
    srv.stop(grace=0.5)


class Stream:
    def __init__(self, address):
        self.channel = grpc.insecure_channel(address)
        self.requests = []
        self.call = pb_grpc.MaskServiceStub(self.channel).Session(self._gen())
        self.decoder = None

    def _gen(self):
        import time
        while True:
            while not self.requests:
                time.sleep(0.001)
            item = self.requests.pop(0)
            if item is None:
                return
            yield item

    def send(self, *seqs):
        self.requests.append(pb.StepRequest(seqs=list(seqs)))
        reply = next(self.call)
        if self.decoder is None:
            self.decoder = RowBlockDecoder(reply.words_per_row, 100277)
        return reply, self.decoder.decode(reply.row_block, reply.num_rows)

    def close(self):
        self.requests.append(None)
        self.channel.close()


def part(seq_id, step, tokens, offset, spec=SPEC):
    e = pb.SeqStep(seq_id=seq_id, step=step, tokens=tokens, history_offset=offset)
    e.spec.CopyFrom(spec)
    return e


def ready(s, seq_id):
    """Opens a sequence and waits until its grammar is compiled; returns the step it is at."""
    reply, _ = s.send(part(seq_id, 0, [], 0))
    n = 0
    while reply.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        reply, _ = s.send(pb.SeqStep(seq_id=seq_id, step=n))
    return n


def test_a_history_longer_than_a_step_restores_in_parts(server, cl100k):
    history = cl100k.encode("the quick brown fox jumps over the lazy dog " * 3)
    assert len(history) > 3 * 8
    s = Stream(server.address)
    # the undisturbed sequence: the history in steps of at most 8 tokens
    n = ready(s, "ref")
    for i in range(0, len(history), 8):
        n += 1
        reply, rows = s.send(pb.SeqStep(seq_id="ref", step=n, tokens=history[i:i + 8]))
    want = rows[reply.results[0].first_row].copy()
    assert reply.results[0].status == pb.SEQ_STATUS_READY

    # one restore entry of the whole history is refused: it is longer than a step may be
    reply, _ = s.send(part("r", 40, history, 0))
    assert reply.results[0].code == C.INVALID_ARGUMENT.value[0] and "history_offset" in reply.results[0].reason

    # in parts: offset 0 opens it, each later part continues at the offset the server holds
    offsets = list(range(0, len(history), 8))
    for k, off in enumerate(offsets):
        reply, rows = s.send(part("r", 40, history[off:off + 8], off))
        assert reply.results[0].status == pb.SEQ_STATUS_READY, reply.results[0].reason
        if k == 1:   # a part sent again (another rank, a retry) changes nothing
            again, again_rows = s.send(part("r", 40, history[off:off + 8], off))
            assert again.results[0].status == pb.SEQ_STATUS_READY
            assert np.array_equal(again_rows[again.results[0].first_row], rows[reply.results[0].first_row])
    assert np.array_equal(rows[reply.results[0].first_row], want)

    # garbage parts: other tokens at a known offset, a gap, a part of a sequence nobody opened
    reply, _ = s.send(part("r", 40, history[:8][::-1], 0))
    assert reply.results[0].code == C.ABORTED.value[0] and "divergence" in reply.results[0].reason
    assert str(history[0]) not in reply.results[0].reason.split("sequence")[0]
    reply, _ = s.send(part("r", 40, history[:8], len(history) + 16))
    assert reply.results[0].code == C.FAILED_PRECONDITION.value[0] and "offset" in reply.results[0].reason
    reply, _ = s.send(part("nobody", 3, history[:8], 8))
    assert reply.results[0].code == C.FAILED_PRECONDITION.value[0] and "offset 0 opens it" in reply.results[0].reason

    # the restored sequence goes on like the undisturbed one
    tail = cl100k.encode("and runs")
    a, a_rows = s.send(pb.SeqStep(seq_id="ref", step=n + 1, tokens=tail))
    b, b_rows = s.send(pb.SeqStep(seq_id="r", step=41, tokens=tail))
    assert np.array_equal(a_rows[a.results[0].first_row], b_rows[b.results[0].first_row])
    s.close()


def test_info_reports_the_limits_a_restore_needs(server):
    with grpc.insecure_channel(server.address) as ch:
        info = pb_grpc.MaskServiceStub(ch).Info(pb.InfoRequest())
    assert info.max_tokens_per_step == 8 and info.contract_revision >= 2
    assert info.max_draft_tokens == 16 and info.max_sequences_per_session == 65536
