"""Quotas and leftovers: streams and live sequences capped per tenant and per server with
RESOURCE_EXHAUSTED naming the cap, work per request bounded, idle streams ended, and health checks
and Info never starved by Session load."""
import queue
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskd.server import Limits, MaskServer, ServerConfig
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc
from maskd.v1.contract import SESSION_METADATA_KEY

C = grpc.StatusCode
SPEC = GrammarSpec.from_dict({"regex": "[0-9]+"}).to_proto()
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-9876543210xx"}


class Stream:
    def __init__(self, ch, token=None, session=None):
        self.q = queue.SimpleQueue()
        md = ([("authorization", f"Bearer {token}")] if token else []) + \
            ([(SESSION_METADATA_KEY, session)] if session else [])
        self.call = pb_grpc.MaskServiceStub(ch).Session(iter(self.q.get, None), metadata=md)

    def send(self, *seqs):
        self.q.put(pb.StepRequest(seqs=list(seqs)))
        return next(self.call)

    def close(self):
        self.q.put(None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "tokens"
    path.write_text("".join(f"{t} {k}\n" for t, k in TOKENS.items()))
    limits = Limits(max_streams=6, max_streams_per_tenant=3, max_sequences=8, max_sequences_per_tenant=5,
                    max_tokens_per_request=64, idle_timeout_s=1.0)
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, auth_tokens_file=str(path),
                                  limits=limits)).start()
    yield srv
    srv.stop(grace=0.5)


def test_streams_are_capped_per_tenant_and_health_and_info_stay_open(server):
    with grpc.insecure_channel(server.address) as ch:
        held = [Stream(ch, TOKENS["alice"]) for _ in range(3)]
        for s in held:
            assert s.send().results == []          # each is attached and served
        extra = Stream(ch, TOKENS["alice"])
        with pytest.raises(grpc.RpcError) as err:
            extra.send()
        assert err.value.code() == C.RESOURCE_EXHAUSTED and "--max-streams-per-tenant" in err.value.details()
        bob = Stream(ch, TOKENS["bob"])            # another tenant still gets one
        assert bob.send().results == []
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        info = pb_grpc.MaskServiceStub(ch).Info(pb.InfoRequest(), timeout=5,
                                               metadata=[("authorization", f"Bearer {TOKENS['bob']}")])
        assert info.tokenizer == "cl100k"
        for s in [*held, bob]:
            s.close()


def test_live_sequences_are_capped_per_tenant_and_per_server(server):
    with grpc.insecure_channel(server.address) as ch:
        a, b = Stream(ch, TOKENS["alice"]), Stream(ch, TOKENS["bob"])
        r = a.send(*[pb.SeqStep(seq_id=f"a{i}", step=0, spec=SPEC) for i in range(6)])
        codes = [x.code for x in r.results]
        assert codes[:5] == [0] * 5 and codes[5] == C.RESOURCE_EXHAUSTED.value[0]
        assert "--max-sequences-per-tenant" in r.results[5].reason
        r = b.send(*[pb.SeqStep(seq_id=f"b{i}", step=0, spec=SPEC) for i in range(4)])
        codes = [x.code for x in r.results]
        assert codes[:3] == [0] * 3 and codes[3] == C.RESOURCE_EXHAUSTED.value[0]
        assert "(--max-sequences)" in r.results[3].reason
        assert a.send(pb.SeqStep(seq_id="a0", step=0, close=True)).results[0].status == pb.SEQ_STATUS_CLOSED
        r = b.send(pb.SeqStep(seq_id="b3", step=0, spec=SPEC))   # a slot freed by alice's close
        assert r.results[0].code == 0
        a.close()
        b.close()
    deadline = time.time() + 5
    while server.service.quotas.sequences and time.time() < deadline:
        time.sleep(0.05)
    assert server.service.quotas.sequences == 0   # a dropped stream gives its sequences back


def test_work_per_request_is_bounded(server):
    with grpc.insecure_channel(server.address) as ch:
        s = Stream(ch, TOKENS["alice"])
        r = s.send(*[pb.SeqStep(seq_id=f"w{i}", step=0, spec=SPEC, tokens=[15] * 20) for i in range(4)])
        assert all(x.code == C.RESOURCE_EXHAUSTED.value[0] and "--max-tokens-per-request" in x.reason
                   for x in r.results)
        r = s.send(pb.SeqStep(seq_id="w0", step=0, spec=SPEC, tokens=[15] * 20))
        assert r.results[0].code == 0
        s.close()


def test_an_idle_stream_is_ended_and_its_sequences_freed(server):
    with grpc.insecure_channel(server.address) as ch:
        s = Stream(ch, TOKENS["bob"], session="idle-one")
        s.send(pb.SeqStep(seq_id="i", step=0, spec=SPEC))
        before = server.metrics.registry.get_sample_value("maskd_errors_total", {"kind": "idle_stream"}) or 0
        time.sleep(3.0)
        with pytest.raises(grpc.RpcError) as err:
            s.send(pb.SeqStep(seq_id="i", step=1))
        assert err.value.code() == C.CANCELLED
        assert server.metrics.registry.get_sample_value("maskd_errors_total", {"kind": "idle_stream"}) > before
        assert not any(sess.key == "idle-one" for sess in server.service.sessions.sessions())


def test_too_many_streams_on_the_server(cl100k):
    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1,
                                 limits=Limits(max_streams=2, max_streams_per_tenant=2))) as srv, \
            grpc.insecure_channel(srv.address) as ch:
        held = [Stream(ch) for _ in range(2)]
        for s in held:
            s.send()
        with pytest.raises(grpc.RpcError) as err:
            Stream(ch).send()
        assert err.value.code() == C.RESOURCE_EXHAUSTED and "--max-streams" in err.value.details()
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        for s in held:
            s.close()
