"""MaskClient against real servers: pipelined steps, fingerprint guard, recovery after a lost
server, TLS and auth."""
import json
import shutil
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from conftest import allowed_ids, hold_compiles
from maskd.server import MaskServer, ServerConfig
from maskd.specs import GrammarSpec, SpecError
from maskd_client import MaskClient, MaskClientError, SeqStatus, StepInput

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["a", "bb", "ccc"]}},
          "required": ["n", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2)).start()
    yield srv
    srv.stop(grace=0.5)


def pick(row_ids, rng):
    return int(rng.choice(sorted(row_ids)))


def generate(client, seq_ids, seed, budget=60, on_step=None, in_flight=None):
    """Deterministic generations: each sequence samples uniformly among allowed ids. on_step(n)
    runs before step n goes out, in_flight(n) right after (while it is in flight); each once."""
    rng = np.random.default_rng(seed)
    eos = client.info().eos_token_ids[0]
    out = {s: [] for s in seq_ids}
    pending = {s: [] for s in seq_ids}
    live = set(seq_ids)
    n, called = 0, -1
    deadline = time.monotonic() + 120
    while live and n < budget:
        first = n != called
        called = n
        if on_step and first:
            on_step(n)
        fut = client.step_async({s: pending[s] for s in sorted(live)})
        if in_flight and first:
            in_flight(n)
        res = fut.result(60)
        if (res.status == SeqStatus.WAITING).any():   # a grammar compiling (again, on a restarted
            assert time.monotonic() < deadline, "grammars did not compile in 120 s"   # server): not
            time.sleep(0.01)                                                      # a step of the budget
        else:
            n += 1
        for s in sorted(live):
            r = res.seqs[s]
            assert r.status in (SeqStatus.READY, SeqStatus.FINISHED, SeqStatus.WAITING), r
            if r.status is SeqStatus.WAITING:
                pending[s] = []
                continue
            tok = pick(allowed_ids(res.bitmask[r.row]), rng)
            if tok == eos:
                live.discard(s)
                continue
            out[s].append(tok)
            pending[s] = [tok]
    return out


def test_generation_and_tensor(server, cl100k):
    with MaskClient(server.address, tokenizer=cl100k) as mc:
        for i in range(3):
            mc.open(f"g{i}", {"json_schema": SCHEMA, "whitespace": "compact"})
        out = generate(mc, [f"g{i}" for i in range(3)], seed=1)
        for toks in out.values():
            doc = json.loads(cl100k.decode(toks))
            assert set(doc) == {"n", "tag"}
        mc.open("t", {"regex": "[0-9]"})
        res = mc.step({"t": []})
        while res.seqs["t"].status is SeqStatus.WAITING:
            res = mc.step({"t": []})
        t = res.tensor()
        assert t.dtype.is_floating_point is False and tuple(t.shape) == res.bitmask.shape


def test_result_arrays_follow_the_order_of_the_step(server, cl100k):
    """Opens and drafts travel as SeqStep entries, plain steps as columns, and the server answers
    the entries first: the result still lists the sequences in the order the step named them."""
    digit, letter = {"regex": "[0-9]+"}, {"regex": "[a-z]+"}
    with MaskClient(server.address, tokenizer=cl100k) as mc:
        mc.register(digit)
        mc.register(letter)
        mc.open("d", digit)
        mc.open("l", letter)
        assert mc.step({"d": [], "l": []}).seqs["d"].status is SeqStatus.READY
        mc.open("new-digit", digit)                   # a SeqStep entry, named last
        res = mc.step({"l": [], "d": [], "new-digit": []})
        assert res.ids == ["l", "d", "new-digit"]
        assert (res.status == SeqStatus.READY).all()
        seven, x = set(cl100k.encode("7")), set(cl100k.encode("x"))
        for i, kind in enumerate(("letter", "digit", "digit")):
            ids = allowed_ids(res.bitmask[res.row[i]])
            assert (seven <= ids, x <= ids) == ((False, True) if kind == "letter" else (True, False)), (i, kind)
            assert res.row[i] == res.seqs[res.ids[i]].row


def test_fingerprint_mismatch_is_refused(server):
    with pytest.raises(MaskClientError, match="fingerprint"):
        MaskClient(server.address, tokenizer="0" * 64).info()


def test_step_errors_are_reported_and_undone(server, cl100k):
    with MaskClient(server.address, tokenizer=cl100k) as mc:
        mc.open("e", {"regex": "[0-9]+"})
        r = mc.step({"e": []})
        while r.seqs["e"].status is SeqStatus.WAITING:
            r = mc.step({"e": []})
        bad = mc.step({"e": [10 ** 6]})
        assert bad.seqs["e"].status is SeqStatus.ERROR and bad.seqs["e"].code == grpc.StatusCode.INVALID_ARGUMENT
        ok = mc.step({"e": cl100k.encode("5")})  # the client undid the refused step: numbers line up
        assert ok.seqs["e"].status is SeqStatus.READY
        assert mc.history("e") == cl100k.encode("5")
        with pytest.raises(MaskClientError, match="not open"):
            mc.step({"nope": []})
        with pytest.raises(MaskClientError, match="roll back"):
            mc.step({"e": StepInput(rollback=5)})
        with pytest.raises(SpecError):
            mc.open("x", {"regex": 5})


def test_an_open_names_the_registered_grammar_id_and_falls_back_to_the_spec(server, cl100k, server_opens):
    def seen():
        return [kind for _, kind in server_opens]

    spec = {"json_schema": SCHEMA}
    with MaskClient(server.address, tokenizer=cl100k) as mc:
        gid = mc.register(spec, wait=True)
        mc.open("by-id", spec, grammar_id=gid)
        mc.open("by-spec", spec)
        r = _ready(mc, "by-id", "by-spec")
        assert seen() == ["grammar_id", "spec"]
        assert (r.bitmask[r.seqs["by-id"].row] == r.bitmask[r.seqs["by-spec"].row]).all()
        tokens = cl100k.encode('{"n": 7')
        r = mc.step({"by-id": tokens, "by-spec": tokens})
        assert (r.bitmask[r.seqs["by-id"].row] == r.bitmask[r.seqs["by-spec"].row]).all()
        # an id the server does not hold (evicted, another server's): the step is refused with
        # NOT_FOUND and taken back; the next step opens the sequence with its spec
        server_opens.clear()
        mc.open("gone", spec, grammar_id="0" * 64)
        refused = mc.step({"gone": tokens})
        assert refused.seqs["gone"].status is SeqStatus.ERROR
        assert refused.seqs["gone"].code == grpc.StatusCode.NOT_FOUND
        assert mc.history("gone") == []
        r = mc.step({"gone": tokens})
        while r.seqs["gone"].status is SeqStatus.WAITING:
            r = mc.step({"gone": []})
        assert seen() == ["grammar_id", "spec"]
        assert r.seqs["gone"].status is SeqStatus.READY and mc.history("gone") == tokens
        assert (r.bitmask[r.seqs["gone"].row] == _ready(mc, "by-id").bitmask[0]).all()


def _messages(server) -> float:
    """Step messages the server has handled so far."""
    return server.metrics.registry.get_sample_value("maskd_step_batch_size_count") or 0.0


def _ready(mc, *seq_ids):
    r = mc.step({s: [] for s in seq_ids})
    while any(r.seqs[s].status is SeqStatus.WAITING for s in seq_ids):
        r = mc.step({s: [] for s in seq_ids})
    return r


def test_a_close_rides_on_the_next_step(server, cl100k):
    with MaskClient(server.address, tokenizer=cl100k, close_linger_s=30) as mc:
        mc.open("c-a", {"regex": "[0-9]+"})
        mc.open("c-b", {"regex": "[a-z]+"})
        _ready(mc, "c-a", "c-b")
        before_live, before_msgs = server.service.live_sequences(), _messages(server)
        closed = mc.close("c-a")
        assert not closed.done()                      # waits for the step, not sent alone
        res = mc.step({"c-b": cl100k.encode("x")})
        assert closed.result(5).status is SeqStatus.CLOSED
        assert set(res.seqs) == {"c-b"} and res.seqs["c-b"].status is SeqStatus.READY
        assert _messages(server) == before_msgs + 1     # close and step in one message
        assert server.service.live_sequences() == before_live - 1
        with pytest.raises(MaskClientError, match="not open"):
            mc.step({"c-a": []})


def test_a_close_with_no_step_after_it_goes_alone(server, cl100k):
    with MaskClient(server.address, tokenizer=cl100k, close_linger_s=0.05) as mc:
        mc.open("l-a", {"regex": "[0-9]+"})
        _ready(mc, "l-a")
        before = server.service.live_sequences()
        assert mc.close("l-a").result(10).status is SeqStatus.CLOSED
        assert server.service.live_sequences() == before - 1
        mc.open("l-b", {"regex": "[0-9]+"})
        _ready(mc, "l-b")
        f = mc.close("l-b")
        mc.flush_closes()
        assert f.result(10).status is SeqStatus.CLOSED
    with MaskClient(server.address, tokenizer=cl100k, close_linger_s=0) as mc:   # 0: at once
        mc.open("l-c", {"regex": "[0-9]+"})
        _ready(mc, "l-c")
        assert mc.close("l-c").result(10).status is SeqStatus.CLOSED
        assert mc.close("never-opened").result(1) is None


def test_a_closed_id_opened_again_before_the_next_step(server, cl100k):
    with MaskClient(server.address, tokenizer=cl100k, close_linger_s=30) as mc:
        mc.open("r", {"regex": "[0-9]+"})
        _ready(mc, "r")
        mc.step({"r": cl100k.encode("7")})
        closed = mc.close("r")
        mc.open("r", {"regex": "[a-z]+"})             # the same id, another grammar
        res = _ready(mc, "r")
        assert closed.result(5).status is SeqStatus.CLOSED
        assert res.seqs["r"].step == 0
        ids = allowed_ids(res.bitmask[res.seqs["r"].row])
        assert cl100k.encode("x")[0] in ids and cl100k.encode("7")[0] not in ids


def test_garbage_tokens_change_nothing(server, cl100k):
    with MaskClient(server.address, tokenizer=cl100k, close_linger_s=30) as mc:
        mc.open("g-a", {"regex": "[0-9]+"})
        mc.open("g-b", {"regex": "[0-9]+"})
        _ready(mc, "g-a", "g-b")
        closed = mc.close("g-b")
        for garbage in (["x"], [None], [1.5j], StepInput(tokens=[1], rollback="two"), StepInput(propose="four")):
            with pytest.raises(MaskClientError, match="integers") as err:
                mc.step({"g-a": garbage})
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(MaskClientError, match="propose must be >= 0") as err:
            mc.step({"g-a": StepInput(propose=-1)})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert mc.history("g-a") == [] and not closed.done()
        res = mc.step({"g-a": cl100k.encode("42")})    # step numbers still line up
        assert res.seqs["g-a"].status is SeqStatus.READY
        assert closed.result(5).status is SeqStatus.CLOSED


def test_lost_server_is_replaced_and_outputs_do_not_change(cl100k):
    """Steps are idempotent and state is a function of the tokens: after the server is lost the
    client restores every sequence on the replacement and the outputs are the undisturbed ones."""
    ids = [f"r{i}" for i in range(4)]
    ref_srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2)).start()
    with MaskClient(ref_srv.address, tokenizer=cl100k) as mc:
        for s in ids:
            mc.open(s, {"json_schema": SCHEMA, "whitespace": "compact"})
        reference = generate(mc, ids, seed=7)
    ref_srv.stop(grace=0)

    first = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2)).start()
    port = first.port
    state = {"server": first}

    def swap(n):
        if n == 6 and state["server"] is first:  # lose the server mid-generation, bring a fresh one up on the same port
            state["server"].stop(grace=0)
            state["server"] = MaskServer(ServerConfig(port=port, tokenizer="cl100k", threads=2)).start()

    with MaskClient(f"127.0.0.1:{port}", tokenizer=cl100k, retries=5) as mc:
        for s in ids:
            mc.open(s, {"json_schema": SCHEMA, "whitespace": "compact"})
        out = generate(mc, ids, seed=7, on_step=swap)
        assert mc.reconnects >= 1
    state["server"].stop(grace=0)
    assert out == reference


def test_unreachable_server_is_a_clear_error():
    mc = MaskClient("127.0.0.1:1", timeout_s=1.0)
    with pytest.raises(MaskClientError, match=r"127\.0\.0\.1:1"):
        mc.info()
    mc.shutdown()


def test_auth_token(cl100k):
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, auth_token="s3cret")).start()
    try:
        with pytest.raises(MaskClientError) as err:
            MaskClient(srv.address, timeout_s=5).info()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(MaskClientError):
            MaskClient(srv.address, timeout_s=5, auth_token="wrong").info()
        with MaskClient(srv.address, auth_token="s3cret") as mc:
            mc.open("a", {"regex": "[0-9]"})
            r = mc.step({"a": []})
            assert r.seqs["a"].status in (SeqStatus.WAITING, SeqStatus.READY)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(srv.address) as ch:  # probes need no token
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == 1
    finally:
        srv.stop(grace=0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_tls(tmp_path, cl100k):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    srv = MaskServer(ServerConfig(host="127.0.0.1", port=0, tokenizer="cl100k", threads=1,
                                  tls_cert=str(cert), tls_key=str(key))).start()
    try:
        with MaskClient(f"localhost:{srv.port}", tls_root_certs=cert.read_bytes()) as mc:
            assert mc.info().tokenizer == "cl100k"
        with pytest.raises(MaskClientError):
            MaskClient(f"localhost:{srv.port}", timeout_s=3).info()  # plaintext to a TLS port
    finally:
        srv.stop(grace=0)


def test_an_empty_step_is_answered_at_once_with_no_rows(server):
    with MaskClient(server.address) as mc:
        res = mc.step({}, timeout=5)
        assert res.ids == [] and res.bitmask.shape == (0, mc.info().words_per_row)
        mc.open("e", {"regex": "[ab]"})
        assert mc.step({"e": []}).seqs["e"].status in (SeqStatus.READY, SeqStatus.WAITING)
        assert mc.step_async({}).result(5).ids == []          # with a sequence open too


def test_register_require_ready_gives_only_ids_of_compiled_grammars(server):
    """A waiting register may be answered with the grammar still compiling (the server's wait ends
    just before the call's deadline, or it has no thread free to wait): with ``require_ready`` that
    is DEADLINE_EXCEEDED, never an id; a grammar that does not compile is INVALID_ARGUMENT."""
    gate = threading.Event()
    hold_compiles(server.cache, gate)
    slots = server.service._blocking_registers
    taken = 0
    with MaskClient(server.address) as mc:
        try:
            held = {"regex": "[0-9]{3}-require-ready"}
            assert mc.register(held, wait=False)                 # queued: an id, not ready
            with pytest.raises(MaskClientError) as waited:       # the wait (or its deadline) ends first
                mc.register(held, wait=True, timeout_s=0.5, require_ready=True)
            assert waited.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            while slots.acquire(blocking=False):                 # no thread left to wait on it
                taken += 1
            t0 = time.monotonic()
            assert mc.register(held, wait=True, timeout_s=5)     # without require_ready: the id, at once
            with pytest.raises(MaskClientError) as answered:
                mc.register(held, wait=True, timeout_s=5, require_ready=True)
            assert answered.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "still compiling" in str(answered.value) and time.monotonic() - t0 < 4
        finally:
            for _ in range(taken):
                slots.release()
            gate.set()
        grammar_id = mc.register(held, wait=True, timeout_s=30, require_ready=True)
        assert grammar_id == server.cache.grammar_id(GrammarSpec.from_request(held))
        deadline = time.monotonic() + 30
        while True:   # without waiting: still compiling at first, then the refusal the server cached
            with pytest.raises(MaskClientError) as failed:
                mc.register({"regex": "[a-"}, wait=False, require_ready=True)
            if failed.value.code is not grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT and "does not compile" in str(failed.value)


def test_a_steps_rows_decode_into_the_callers_buffer(server, cl100k):
    """``out``: the reply's rows are decoded straight into the caller's buffer (the result's bitmask
    is a view of it) and equal the rows of the same step without it; a buffer too small gets a new
    array; a buffer of the wrong form is refused before anything is sent."""
    digits = {"regex": "[0-9]{1,8}"}
    tokens = [cl100k.encode(c)[0] for c in "1234"]
    with MaskClient(server.address) as mc:
        words = mc.info().words_per_row
        mc.register(digits, wait=True, timeout_s=30, require_ready=True)
        for sid in ("into", "alone", "small"):
            mc.open(sid, digits)
        assert set(mc.step({"into": [], "alone": [], "small": []}).status.tolist()) == {SeqStatus.READY}
        out = np.full((4, words), -1, dtype=np.int32)
        for t in tokens[:2]:
            alone = mc.step({"alone": [t]})
            got = mc.step({"into": [t]}, out=out)
            assert np.shares_memory(got.bitmask, out) and got.row_index("into") == 0
            assert np.array_equal(got.bitmask[0], alone.bitmask[alone.row_index("alone")])
            assert (out[1:] == -1).all()                      # only the reply's rows were written
        tiny = np.zeros((0, words), dtype=np.int32)
        small = mc.step({"small": [tokens[0]]}, out=tiny)
        assert not np.shares_memory(small.bitmask, tiny) and len(small.bitmask) == 1
        for bad in (np.zeros((2, words), np.int64), np.zeros((2, words + 1), np.int32),
                    np.zeros((2, 2 * words), np.int32)[:, ::2], [[0] * words]):
            with pytest.raises(MaskClientError) as refused:
                mc.step({"into": [tokens[2]]}, out=bad)
            assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert mc.history("into") == tokens[:2]               # nothing changed
        assert mc.step({"into": [tokens[2]]}, out=out).seqs["into"].status is SeqStatus.READY
