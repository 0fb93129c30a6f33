"""Tensor-parallel ranks in lockstep, as they run: 2 and 4 processes (torch.distributed, gloo on
loopback), each with its own SGLang grammar backend, against one real maskd server on one shared
session. Every rank gets identical rows at every step (the ranks all-gather and compare), each
grammar compiles once on the server (and once more after the server evicted it: every rank's open
by its id is refused and goes again with the spec), a rank that lags or loses its stream and
retries changes nothing, and readiness (polls of a grammar still compiling) is decided once per
(sequence, step)."""
import json
import socket
import threading
import time

import pytest
import torch.multiprocessing as mp
import tp_rank

from conftest import hold_compiles
from maskd.server import MaskServer, ServerConfig
from maskd.specs import GrammarSpec

DOCS = [({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, '{"ok": true}'),
        ({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, '{"ok":false}'),
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 4}, "[1, 22, 333]"),
        ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}, '{"name": "Ada", "age": 36}')]
DISTINCT = 3 + 1       # three schemas, and the regex nobody registered
EVICTED = 1            # the first schema, evicted from the server's cache before any rank opens it


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(server, name, labels=None):
    return server.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_in_lockstep(world, tmp_path):
    server = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=2, compile_threads=1)).start()
    gate = threading.Event()
    try:
        def close_gate():   # once the ranks registered their grammars, hold the next compile for a while
            deadline = time.time() + 300
            while not (tmp_path / "registered").exists() and time.time() < deadline:
                time.sleep(0.01)
            # evicted before the first fill: every rank's open names its id, is refused (NOT_FOUND) and
            # goes again with the spec; the server compiles it once more, the ranks stay in lockstep
            evicted = server.cache.get(server.cache.grammar_id(
                GrammarSpec.from_request({"json_schema": json.dumps(DOCS[0][0])})))
            assert evicted is not None
            with server.cache._lock:
                server.cache._remove(evicted)
            hold_compiles(server.cache, gate)                  # compiles wait for the gate
            (tmp_path / "gate").touch()
            while server.service.sessions.waiting_sequences() == 0 and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            gate.set()

        threading.Thread(target=close_gate, daemon=True).start()
        mp.spawn(tp_rank.run, args=(world, server.address, free_port(), str(tmp_path), DOCS, world - 1),
                 nprocs=world, join=True)
        reports = json.loads((tmp_path / "reports.json").read_text())
        assert server.cache.compiles == DISTINCT + EVICTED                         # once per grammar
        assert metric(server, "maskd_compile_seconds_count", {"backend": "llguidance"}) == DISTINCT + EVICTED
        # the only divergences are the retrying rank's restores: it reopens its sequences with their whole
        # history at a step the others have passed, which the server refuses and the client takes as done
        assert metric(server, "maskd_errors_total", {"kind": "divergence"}) == sum(r["replays"] for r in reports)
        first = reports[0]
        for r in reports[1:]:
            assert r["steps"] == first["steps"]
            assert r["polls_per_step"] == first["polls_per_step"]                 # readiness once per step
            # a rank whose open by the evicted id was refused sent it again: one step more than the others
            assert r["maskd_steps"] - r["reopen_steps"] == first["maskd_steps"] - first["reopen_steps"]
        assert sum(first["polls_per_step"]) > 0                                    # the late grammar waited
        assert sum(r["reopen_steps"] for r in reports) >= 1                        # the evicted id was refused
        assert reports[world - 1]["recoveries"] >= 1                               # that rank retried
    finally:
        gate.set()
        server.stop(grace=0.5)
