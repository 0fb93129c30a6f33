"""A client newer than its server (a rolling upgrade): kinds the server's contract revision does not
know go to it as the whole JSON schema their parts make.

A tool-call array goes on the wire as its parts since contract revision 6, a template since 7. A
server of an older revision has no such field: it reads the message as naming no kind and refuses
it. The server here is a real one that reports an older revision and reads specs as that revision
did (the newer fields dropped, as protobuf drops fields it does not know); the client must send it
what it reads, through ``register``, through an open that carries its spec on the step stream, and
not otherwise."""
import json

import grpc
import pytest

from maskd.server import MaskServer, ServerConfig, service, step_routing
from maskd.specs import PARTS_REVISIONS, GrammarSpec, wire_for_revision
from maskd.v1 import maskd_pb2 as pb
from maskd_client import MaskClient, MaskClientError, SeqStatus

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}
TOOLS = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
                   {"type": "function", "function": {"name": "get_time", "parameters": PARAMS}}],
         "tool_choice": "required"}
TEMPLATE = {"template": {"schema": {"type": "object", "properties": {"step": {"$hole": "step"}},
                                    "required": ["step"], "additionalProperties": False},
                         "arguments": {"step": PARAMS}}}
CALL = '[{"name": "get_time", "parameters": {"city": "Oslo"}}]'
DOCUMENT = '{"step": {"city": "Oslo"}}'


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2)).start()
    yield srv
    srv.stop(grace=0.5)


def reads_as(revision: int):
    """GrammarSpec as a server of ``revision`` reads the wire: the fields later revisions added are
    unknown to it, so a message holding one names no kind."""
    unknown = [kind for kind, since in PARTS_REVISIONS.items() if since > revision]

    class OlderSpec(GrammarSpec):
        @classmethod
        def from_proto(cls, msg: pb.GrammarSpec) -> GrammarSpec:
            if msg.WhichOneof("kind") in unknown:
                dropped = pb.GrammarSpec()
                dropped.CopyFrom(msg)
                dropped.ClearField(msg.WhichOneof("kind"))
                msg = dropped
            return GrammarSpec.from_proto(msg)
    return OlderSpec


@pytest.fixture(params=[5, 6])
def older(request, server, monkeypatch):
    """The server, reporting and reading contract revision 5 (before tool-call parts) or 6 (before templates)."""
    revision = request.param
    monkeypatch.setattr(service, "CONTRACT_REVISION", revision)
    monkeypatch.setattr(service, "GrammarSpec", reads_as(revision))
    monkeypatch.setattr(step_routing, "GrammarSpec", reads_as(revision))
    return revision


def _run(mc, seq_id: str, text: str, tok) -> SeqStatus:
    """Steps ``seq_id`` through ``text``'s tokens, each checked against its row; the status after."""
    r = mc.step({seq_id: []})
    while r.seqs[seq_id].status is SeqStatus.WAITING:
        r = mc.step({seq_id: []})
    for t in tok.encode(text):
        assert r.seqs[seq_id].status is SeqStatus.READY, r.seqs[seq_id]
        row = r.bitmask[r.seqs[seq_id].row]
        assert (int(row[t >> 5]) >> (t & 31)) & 1, f"token {t} refused"
        r = mc.step({seq_id: [t]})
    return r.seqs[seq_id].status


@pytest.mark.parametrize("request_", [TOOLS, TEMPLATE], ids=["tool_calls", "template"])
def test_a_kind_newer_than_the_server_goes_as_its_whole_schema(server, older, request_, cl100k):
    spec = GrammarSpec.from_request(request_)
    parts_pb = spec.to_proto()
    kind = parts_pb.WhichOneof("kind")
    knows = PARTS_REVISIONS[kind] <= older
    with MaskClient(server.address, tokenizer=cl100k) as mc:
        info = mc.info()
        assert info.contract_revision == older
        stub = mc._connection(server.address).stub
        if not knows:    # what the server does with the parts: refuses them (this test's premise)
            with pytest.raises(grpc.RpcError) as refused:
                stub.RegisterGrammar(pb.RegisterGrammarRequest(spec=parts_pb, wait=True), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "names no kind" in refused.value.details()
        wire = wire_for_revision(parts_pb, older)
        assert (wire is parts_pb) == knows
        if not knows:
            assert wire.WhichOneof("kind") == "json_schema" and json.loads(wire.json_schema) == json.loads(spec.text)
            assert wire.options == parts_pb.options
        gid = mc.register(request_, wait=True, require_ready=True)
        sent = wire if not knows else parts_pb
        assert gid == GrammarSpec.from_proto(sent).grammar_id(
            info.tokenizer_fingerprint, info.backend, info.backend_version, json_schema_mode=info.json_schema_mode)
        valid = CALL if kind == "tool_calls" else DOCUMENT
        mc.open("by-id", request_, grammar_id=gid)
        mc.open("by-spec", request_)       # the spec rides on the step stream
        done = (SeqStatus.READY, SeqStatus.FINISHED)
        assert _run(mc, "by-id", valid, cl100k) in done
        assert _run(mc, "by-spec", valid, cl100k) in done
        eos = info.eos_token_ids[0]
        r = mc.step({"by-id": [], "by-spec": []})
        for s in ("by-id", "by-spec"):
            row = r.bitmask[r.seqs[s].row]
            assert (int(row[eos >> 5]) >> (eos & 31)) & 1, "the end is allowed after a valid output"
        wrong = CALL.replace("get_time", "get_date") if kind == "tool_calls" else DOCUMENT.replace("city", "town")
        mc.open("wrong", request_)
        with pytest.raises(AssertionError, match="refused"):
            _run(mc, "wrong", wrong, cl100k)


def test_malformed_parts_to_an_older_server_are_refused_there_alone(server, older, cl100k):
    """Parts that do not make a schema are not rewritten: the server refuses that open alone and
    the stream's other sequence steps on."""
    bad = pb.GrammarSpec(tool_calls=pb.ToolCalls(tools=[pb.ToolFunction(name="f", parameters="{not json")]))
    with MaskClient(server.address, tokenizer=cl100k) as mc:
        with pytest.raises(MaskClientError) as refused:
            mc.register(bad, wait=True)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        mc.open("good", {"regex": "[0-9]+"})
        mc.open("bad", bad)
        r = mc.step({"good": [], "bad": []})
        while r.seqs["good"].status is SeqStatus.WAITING:
            r = mc.step({"good": []})
        assert r.seqs["good"].status is SeqStatus.READY
        assert mc.step({"good": cl100k.encode("42")}).seqs["good"].status is SeqStatus.READY
