"""``engine_env.settle``, the engine adapters' shared answer loop, against a real server: rows go to
``ready``, refusals and failures to ``give_up`` with the server's reason, grammars still compiling
are polled with empty steps and given up once the wait runs out."""
import threading
import time

import numpy as np
import pytest

from conftest import allowed_ids, hold_compiles
from maskd.server import MaskServer, ServerConfig
from maskd_client import MaskClient, SeqStatus
from maskd_client.engine_env import settle


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

    polls = settle(step(request), keys, step, wait_timeout_s,
                   lambda key, res, result: ready.__setitem__(key, result.bitmask[res.row].copy()),
                   given_up.__setitem__)
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
