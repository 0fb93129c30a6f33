"""``engine_env.deliver_answers``, the engine adapters' shared answer loop, against a real server:
rows go to ``ready``, refusals and failures to ``give_up`` with the server's reason, grammars still
compiling are polled with empty steps and given up once the wait runs out."""
import threading
import time

import grpc
import numpy as np
import pytest

from conftest import allowed_ids, hold_compiles
from maskd.server import MaskServer, ServerConfig
from maskd_client import MaskClient, SeqStatus
from maskd_client.engine_env import deliver_answers


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1)).start()
    yield srv
    srv.stop(grace=0.5)


def run(client, request, keys, wait_timeout_s):
    ready, given_up, steps = {}, {}, []

    def step(req):
        steps.append(req)
        return client.step_async(req).result(30)

    polls = deliver_answers(step(request), keys, step, wait_timeout_s,
                            lambda key, res, result: ready.__setitem__(key, result.bitmask[res.row].copy()),
                            lambda key, reason, res: given_up.__setitem__(key, reason))
    return polls, ready, given_up, steps[1:]


def test_rows_refusals_and_a_grammar_that_compiles_late(server, cl100k):
    gate = threading.Event()
    with MaskClient(server.address, session="settle-1") as client:
        client.open("ok", {"regex": "[ab]"})
        while client.step({"ok": []}).seqs["ok"].status is SeqStatus.WAITING:   # compiled before the gate
            time.sleep(0.01)
        hold_compiles(server.cache, gate)
        client.open("late", {"regex": "[cd]"})
        client.open("bad", {"regex": "[ab]"})
        timer = threading.Timer(0.2, gate.set)
        timer.start()
        polls, ready, given_up, polled = run(client, {"ok": [], "late": [], "bad": cl100k.encode("zz")},
                                             {"ok": 0, "late": 1, "bad": 2}, wait_timeout_s=10)
        timer.join()
    assert polls == len(polled) > 0
    assert all(set(req) == {"late"} and req["late"] == [] for req in polled)   # only the waiting one, empty
    assert sorted(ready) == [0, 1]
    assert allowed_ids(ready[0]) == set(cl100k.encode("a") + cl100k.encode("b"))
    assert allowed_ids(ready[1]) == set(cl100k.encode("c") + cl100k.encode("d"))
    assert list(given_up) == [2] and given_up[2]                      # the server's reason


def test_a_grammar_that_never_compiles_in_time_is_given_up(server):
    gate = threading.Event()
    hold_compiles(server.cache, gate)
    try:
        with MaskClient(server.address, session="settle-2") as client:
            client.open("slow", {"regex": "[ef]"})
            polls, ready, given_up, polled = run(client, {"slow": []}, {"slow": "key"}, wait_timeout_s=0.1)
    finally:
        gate.set()
    assert ready == {} and polls == len(polled) >= 5                   # 1, 2, 4, ... ms until 0.1 s
    assert given_up == {"key": "grammar still compiling after 0.1 s"}
    assert not np.any([req["slow"] for req in polled])


def test_again_sends_a_refused_open_at_once_with_its_spec(server, cl100k):
    # an open naming a grammar id the server does not hold (evicted): refused with NOT_FOUND and taken
    # back by the client; the adapter's ``again`` gives its entry, which goes out at once (no poll)
    with MaskClient(server.address, session="settle-3") as client:
        gid = client.register({"regex": "[gh]"}, wait=True)
        client.register({"regex": "[ij]"}, wait=True)                   # compiled: its spec opens READY
        client.open("kept", {"regex": "[gh]"}, grammar_id=gid)
        client.open("evicted", {"regex": "[ij]"}, grammar_id="0" * 64)
        client.open("refused", {"regex": "[ij]"}, grammar_id="1" * 64)
        codes, steps = [], []

        def again(key, res):
            codes.append((key, res.code))
            return [] if key == "e" else None

        def step(req):
            steps.append(req)
            return client.step_async(req).result(30)

        ready, given_up = {}, {}
        polls = deliver_answers(step({"kept": [], "evicted": [], "refused": []}),
                                {"kept": "k", "evicted": "e", "refused": "r"}, step, 10,
                                lambda key, res, result: ready.__setitem__(key, result.bitmask[res.row].copy()),
                                lambda key, reason, res: given_up.__setitem__(key, reason), again)
    assert polls == 0 and steps[1:] == [{"evicted": []}]             # sent again once, not polled
    assert sorted(codes) == [("e", grpc.StatusCode.NOT_FOUND), ("r", grpc.StatusCode.NOT_FOUND)]
    assert allowed_ids(ready["k"]) == set(cl100k.encode("g") + cl100k.encode("h"))
    assert allowed_ids(ready["e"]) == set(cl100k.encode("i") + cl100k.encode("j"))
    assert list(given_up) == ["r"] and "unknown grammar id" in given_up["r"]


def test_a_steps_answer_as_columns_rows_and_forced_tokens(server, cl100k):
    # what an adapter reads without a SeqResult per sequence: who has rows, and each one's forced tokens
    gate = threading.Event()
    with MaskClient(server.address, session="settle-4", want_forced_tokens=True) as client:
        client.open("forced", {"regex": "hello world [0-9]"})
        client.open("free", {"regex": "[ab]+"})
        while set(client.step({"forced": [], "free": []}).status.tolist()) & {int(SeqStatus.WAITING)}:
            time.sleep(0.01)
        hold_compiles(server.cache, gate)
        try:
            client.open("late", {"regex": "[kl]"})
            client.open("bad", {"regex": "[ab]"})
            result = client.step({"free": cl100k.encode("a"), "late": [], "forced": [], "bad": cl100k.encode("zz")})
        finally:
            gate.set()
    with_rows = [result.ids[i] for i in result.with_rows()]
    assert sorted(with_rows) == ["forced", "free"]
    assert {sid: result.seqs[sid].status for sid in ("late", "bad")} == {"late": SeqStatus.WAITING,
                                                                         "bad": SeqStatus.FAILED}
    for sid in result.ids:
        assert result.forced_tokens(sid) == list(result.seqs[sid].forced_tokens)
    assert cl100k.decode(result.forced_tokens("forced")) == "hello world "
