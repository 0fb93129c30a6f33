"""The client retries only what is retryable: a stream the server refused fails the step at once
with the reason (nothing hangs, nothing loops). A server that is gone, within the time bound
(``recovery_timeout_s``) and past it: tests/client/test_reconnect.py."""
import grpc
import pytest

from maskd.server import Limits, MaskServer, ServerConfig
from maskd_client import MaskClient, MaskClientError, SeqStatus


def ready(mc, sid):
    res = mc.step({sid: []})
    while res.seqs[sid].status is SeqStatus.WAITING:
        res = mc.step({sid: []})
    return res


def test_a_refused_stream_fails_the_step_at_once_and_nothing_is_lost(cl100k):
    """A message over the server's size limit ends the stream with RESOURCE_EXHAUSTED: not retried
    (a retry would only repeat it); the step fails with the reason, the ledger is as before, and
    the next step restores the sequences and carries on."""
    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1,
                                 limits=Limits(max_message_bytes=4096))) as srv, \
            MaskClient(srv.address, tokenizer=cl100k, retries=5) as mc:
        mc.open("a", {"regex": "[a-z ]+"})
        ready(mc, "a")
        mc.step({"a": cl100k.encode("hello")})
        big = cl100k.encode(" word" * 4000)[:4000]
        with pytest.raises(MaskClientError) as err:
            mc.step({"a": big})
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert mc.reconnects == 0 and mc.history("a") == cl100k.encode("hello")
        res = mc.step({"a": cl100k.encode(" world")})   # restored (its session ended with the stream)
        assert res.seqs["a"].status is SeqStatus.READY and mc.reconnects == 1
        assert mc.history("a") == cl100k.encode("hello") + cl100k.encode(" world")
