"""maskd_cluster without Ray: the hash ring, the shared grammar store, directory membership, the
cluster client's merge, and client recovery over real gRPC on loopback (two in-process servers
behind an in-process Directory service; a server stopped mid-generation)."""
import asyncio
import concurrent.futures
import threading

import grpc
import numpy as np
import pytest

from maskd.v1 import directory_pb2_grpc as dpb_grpc
from maskd_client import MaskClient, SeqStatus
from maskd_client.routing import DirectoryClient, HashRing, is_directory
from maskd_client.types import SeqResult, StepResult
from maskd_cluster.directory import DirectoryService, DirectoryState
from maskd_cluster.store import GrammarStore

# -- a deterministic generation driver (shared with test_cluster.py) ------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"enum": ["red", "green", "blue", "cyan"]},
]


def generation_specs(n: int, ids=None) -> dict:
    ids = ids or [f"gen-{i}" for i in range(n)]
    return {sid: {"json_schema": SCHEMAS[i % len(SCHEMAS)], "whitespace": "compact"} for i, sid in enumerate(ids)}


def allowed(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little"))


def generate(client, specs: dict, *, budget: int = 24, seed: int = 7, on_step=None, before_step=None):
    """Opens every sequence and samples tokens from its masks with a seeded RNG per sequence until
    the grammar finishes, EOS is drawn or the budget is spent. Returns (outputs, failures, steps)."""
    ids = list(specs)
    rngs = {sid: np.random.default_rng([seed, i]) for i, sid in enumerate(ids)}
    eos = set(client.info().eos_token_ids)
    for sid in ids:
        client.open(sid, specs[sid])
    out = {sid: [] for sid in ids}
    nxt = {sid: [] for sid in ids}
    failures = {}
    active, steps = ids, 0
    while active:
        if before_step is not None:
            before_step(steps)
        fut = client.step_async({sid: nxt[sid] for sid in active})
        if on_step is not None:
            on_step(steps)
        res = fut.result(120)
        steps += 1
        still = []
        for sid in active:
            r = res.seqs[sid]
            if r.status in (SeqStatus.FAILED, SeqStatus.ERROR):
                failures[sid] = r.reason
                client.close(sid)
                continue
            if r.status is SeqStatus.WAITING:
                nxt[sid] = []
                still.append(sid)
                continue
            ids_ok = allowed(res.bitmask[r.row])
            if r.status is SeqStatus.FINISHED or len(out[sid]) >= budget or not len(ids_ok):
                client.close(sid)
                continue
            tok = int(ids_ok[rngs[sid].integers(len(ids_ok))])
            out[sid].append(tok)
            if tok in eos:
                client.close(sid)
                continue
            nxt[sid] = [tok]
            still.append(sid)
        active = still
    return out, failures, steps


# -- hash ring ------------------------------------------------------------------------------------
KEYS = [f"seq-{i}" for i in range(3000)]


def test_ring_moves_only_the_keys_of_a_member_that_leaves_and_restores_them_on_return():
    ring = HashRing(["worker-0", "worker-1", "worker-2"], vnodes=128)
    before = dict(zip(KEYS, ring.owners(KEYS)))
    shares = {m: sum(1 for o in before.values() if o == m) / len(KEYS) for m in ring.members}
    assert all(0.2 < s < 0.47 for s in shares.values()), shares
    ring.remove("worker-1")
    after = dict(zip(KEYS, ring.owners(KEYS)))
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "worker-1"}
    assert all(after[k] in ("worker-0", "worker-2") for k in moved)
    ring.add("worker-1")
    assert dict(zip(KEYS, ring.owners(KEYS))) == before


def test_ring_join_takes_keys_only_for_the_new_member_and_is_the_same_in_every_process():
    ring = HashRing(["worker-0", "worker-1"])
    before = dict(zip(KEYS, ring.owners(KEYS)))
    ring.add("worker-2")
    after = dict(zip(KEYS, ring.owners(KEYS)))
    assert all(after[k] == "worker-2" for k in KEYS if after[k] != before[k])
    assert HashRing(["worker-2", "worker-0", "worker-1"]).owners(KEYS) == ring.owners(KEYS)
    assert HashRing([]).owner("x") is None


# -- shared grammar store -------------------------------------------------------------------------
def test_store_is_single_flight_and_keeps_compile_errors():
    async def scenario():
        store = GrammarStore(max_entries=8, claim_s=10.0)
        assert await store.get("g1", "w0/1") is None                  # w0 compiles
        waiter = asyncio.create_task(store.get("g1", "w1/1", 5.0))    # w1 waits for it
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await store.put("g1", b"grammar", None, "w0/1")
        assert await waiter == (b"grammar", None)
        assert await store.get("g2", "w1/1") is None
        await store.put("g2", None, "bad schema", "w1/1")
        assert await store.get("g2", "w0/1") == (None, "bad schema")   # errors are shared too
        stats = await store.stats()
        assert (stats["publishes"], stats["misses"], stats["hits"], stats["waits"]) == (2, 2, 2, 1)
        assert await store.publish_count("g1") == 1
        # A claim of a worker that died is released: a waiter compiles at once.
        assert await store.get("g3", "w0/1") is None
        waiter = asyncio.create_task(store.get("g3", "w1/1", 5.0))
        await asyncio.sleep(0.05)
        assert await store.release("w0/1") == 1
        assert await asyncio.wait_for(waiter, 1.0) is None
        # Bounded: the least recently used entries go.
        for i in range(10):
            await store.put(f"x{i}", b"y" * 10, None)
        assert (await store.stats())["entries"] == 8
    asyncio.run(scenario())


# -- directory membership -------------------------------------------------------------------------
def test_directory_state_follows_answers_misses_restarts_and_drains():
    gone = []
    st = DirectoryState(vnodes=16, misses_to_down=2, on_incarnation_gone=lambda w, i: gone.append((w, i)))
    st.seen("worker-0", "h:1", 11)
    st.seen("worker-1", "h:2", 21)
    assert [r.worker_id for r in st.live()] == ["worker-0", "worker-1"]
    e = st.epoch
    st.miss("worker-1", dead=False)
    assert len(st.live()) == 2                       # one missed poll is not death
    st.miss("worker-1", dead=False)
    assert [r.worker_id for r in st.live()] == ["worker-0"] and st.epoch > e
    st.seen("worker-1", "h:3", 22)                   # restarted: new incarnation and address
    rec = {r.worker_id: r for r in st.records()}["worker-1"]
    assert rec.live and rec.restarts == 1 and rec.address == "h:3"
    assert ("worker-1", 21) in gone
    st.unreachable("worker-1", "h:3")
    assert not {r.worker_id: r for r in st.records()}["worker-1"].live
    st.reachable("worker-1", "h:3")
    assert len(st.live()) == 2
    st.drained("worker-0", 11)
    st.seen("worker-0", "h:1", 11, draining=True)
    assert [r.worker_id for r in st.live()] == ["worker-1"]
    live, owners, _ = st.lookup(["a", "b"])
    assert [live[i].worker_id for i in owners] == ["worker-1", "worker-1"]


# -- merge ---------------------------------------------------------------------------------------
def _part(seqs, rows):
    return StepResult({s.seq_id: s for s in seqs}, np.array(rows, dtype=np.int32).reshape(len(rows), 1), 0.1, 0.2)


def test_merge_puts_rows_in_batch_order():
    from maskd_client.cluster import merge_results
    R = SeqStatus.READY
    a = _part([SeqResult("s2", 1, R, 0, 2, []), SeqResult("s0", 1, SeqStatus.WAITING, -1, 0, [])], [[20], [21]])
    b = _part([SeqResult("s1", 1, R, 0, 1, []), SeqResult("s3", 1, R, 1, 1, [])], [[10], [30]])
    m = merge_results(["s0", "s1", "s2", "s3"], [a, b])
    assert list(m.seqs) == ["s0", "s1", "s2", "s3"]
    assert m.bitmask[:, 0].tolist() == [10, 20, 21, 30]
    assert [m.seqs[s].row for s in m.seqs] == [-1, 0, 1, 3]


def test_one_servers_answer_is_reordered_into_batch_order():
    """One server answers its SeqStep entries first: the caller still gets its own order, rows too
    (several rows for a sequence with drafts, none for a waiting one)."""
    from maskd_client.cluster import merge_results
    R = SeqStatus.READY
    part = _part([SeqResult("new", 0, R, 0, 1, []), SeqResult("d", 4, R, 1, 3, []),
                  SeqResult("w", 2, SeqStatus.WAITING, -1, 0, []), SeqResult("p", 7, R, 4, 1, [])],
                 [[1], [20], [21], [22], [40]])
    m = merge_results(["p", "d", "w", "new"], [part])
    assert list(m.seqs) == ["p", "d", "w", "new"]
    assert m.bitmask[:, 0].tolist() == [40, 20, 21, 22, 1]
    assert [m.seqs[s].row for s in m.seqs] == [0, 1, -1, 4]
    assert [m.seqs[s].num_rows for s in m.seqs] == [1, 3, 0, 1]
    assert m.row.tolist() == [0, 1, -1, 4] and m.steps.tolist() == [7, 4, 2, 0]


# -- the cluster client over real gRPC, without Ray ----------------------------------------------------
class DictStore:
    """A SharedGrammarStore in memory (the Ray actor's protocol, for in-process servers)."""

    def __init__(self):
        self.data, self.lock, self.puts = {}, threading.Lock(), 0

    def get(self, gid):
        with self.lock:
            return self.data.get(gid)

    def put(self, gid, data, error):
        with self.lock:
            self.data[gid] = (data, error)
            self.puts += 1

    def get_many(self, gids):
        return [self.get(g) for g in gids]

    def put_many(self, items):
        for gid, data, error in items:
            self.put(gid, data, error)


@pytest.fixture
def mini_cluster():
    from maskd.server import MaskServer, ServerConfig

    store = DictStore()

    def server():
        return MaskServer(ServerConfig(host="127.0.0.1", port=0, tokenizer="cl100k", threads=1, compile_threads=1),
                          shared_cache=store).start()

    servers = {"worker-0": server(), "worker-1": server()}
    state = DirectoryState(vnodes=64)
    for i, (wid, srv) in enumerate(servers.items()):
        state.seen(wid, srv.address, i + 1)
    grpc_server = grpc.server(concurrent.futures.ThreadPoolExecutor(8))
    dpb_grpc.add_DirectoryServicer_to_server(DirectoryService(state), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()

    class Mini:
        pass
    mini = Mini()
    mini.servers, mini.state, mini.store, mini.address, mini.server = servers, state, store, f"127.0.0.1:{port}", server
    mini.directory = grpc_server
    yield mini
    grpc_server.stop(0)
    for srv in list(servers.values()):
        srv.stop(grace=0)


def test_directory_target_and_lookup(mini_cluster):
    assert is_directory(mini_cluster.address)
    assert not is_directory(mini_cluster.servers["worker-0"].address)   # a maskd server is not one
    with DirectoryClient(mini_cluster.address) as dc:
        reply = dc.list_workers()
        assert [(w.worker_id, w.live) for w in reply.workers] == [("worker-0", True), ("worker-1", True)]
        assert reply.ring_vnodes == 64
        owners = dc.owners(KEYS[:200])
    ring = HashRing(["worker-0", "worker-1"], vnodes=64)
    assert [owners[k].worker_id for k in KEYS[:200]] == ring.owners(KEYS[:200])


def test_opens_name_a_grammar_id_only_on_the_server_that_registered_it(mini_cluster, server_opens):
    # register places a grammar on its id's owner; a sequence lives on its own id's owner: an open
    # there names the id, elsewhere it carries the spec (that server would refuse the id)
    from maskd_client.routing import HashRing

    spec = {"json_schema": SCHEMAS[0], "whitespace": "compact"}
    ring = HashRing(["worker-0", "worker-1"], vnodes=64)
    with MaskClient(f"directory:{mini_cluster.address}") as mc:
        grammar_id = mc.register(spec, wait=True)
        ids = [f"by-owner-{i}" for i in range(16)]
        for sid in ids:
            mc.open(sid, spec, grammar_id=grammar_id)
        res = mc.step({sid: [] for sid in ids})
        while (res.status == SeqStatus.WAITING).any():    # the other worker compiles it (or loads it)
            res = mc.step({sid: [] for sid in ids})
        assert all(res.seqs[sid].status is SeqStatus.READY for sid in ids)
        owner = ring.owner(grammar_id)
        expected = {sid: "grammar_id" if ring.owner(sid) == owner else "spec" for sid in ids}
        assert dict(server_opens) == expected
        assert set(expected.values()) == {"grammar_id", "spec"}          # both kinds were exercised
        rows = {sid: res.bitmask[res.seqs[sid].row] for sid in ids}
        assert all((rows[sid] == rows[ids[0]]).all() for sid in ids)


def test_client_recovers_when_a_server_stops_mid_generation(mini_cluster):
    specs = generation_specs(8)
    target = "directory:" + mini_cluster.address
    with MaskClient(target) as ref_client:
        assert type(ref_client).__name__ == "ClusterClient"
        reference, failures, _ = generate(ref_client, specs)
    assert not failures
    assert any(len(v) > 3 for v in reference.values())

    longest = max(reference, key=lambda sid: len(reference[sid]))
    with MaskClient(target) as mc:
        victim = {}

        def on_step(step):
            if step == 3:   # the worker that owns the longest sequence dies with this step in flight
                victim["placed"] = {sid: mc.owner_of(sid) for sid in specs}
                victim["address"] = mc.owner_of(longest)
                victim["id"] = next(w for w, s in mini_cluster.servers.items() if s.address == victim["address"])
                mini_cluster.servers.pop(victim["id"]).stop(grace=0)

        outputs, failures, _ = generate(mc, specs, on_step=on_step)
        assert outputs == reference
        assert failures == {}
        lost = [sid for sid, a in victim["placed"].items() if a == victim["address"]]
        assert mc.recoveries == 1 and 1 <= mc.replays <= len(lost) and mc.moved >= 1
        survivor = next(iter(mini_cluster.servers.values())).address
        assert all(mc.owner_of(s) in (None, survivor) for s in specs)
        # The directory took the dead worker off the ring when the client named it a suspect.
        assert [r.worker_id for r in mini_cluster.state.live()] == [w for w in ("worker-0", "worker-1")
                                                                    if w != victim["id"]]

        # The worker comes back (a restart: same id, new address): new sequences go to it again.
        back = mini_cluster.server()
        mini_cluster.servers[victim["id"]] = back
        mini_cluster.state.seen(victim["id"], back.address, 99)
        mc.refresh()
        ring = HashRing(["worker-0", "worker-1"], vnodes=64)
        mine = [k for k in KEYS if ring.owner(k) == victim["id"]][:2]
        for k in mine:
            mc.open(k, {"regex": "[ab]{1,3}"})
        for _ in range(100):   # the grammar is new to that worker: WAITING until it is compiled
            res = mc.step({k: [] for k in mine})
            if all(res.seqs[k].status is not SeqStatus.WAITING for k in mine):
                break
        assert all(res.seqs[k].status is SeqStatus.READY for k in mine)
        assert all(mc.owner_of(k) == back.address for k in mine)



def test_client_recovers_while_the_directory_is_down(mini_cluster):
    specs = generation_specs(6, [f"nd-{i}" for i in range(6)])
    target = "directory:" + mini_cluster.address
    with MaskClient(target) as mc:
        reference, failures, _ = generate(mc, specs, seed=11)
    assert not failures
    longest = max(reference, key=lambda sid: len(reference[sid]))
    assert len(reference[longest]) > 3
    with MaskClient(target) as mc:
        lost = {}

        def on_step(step):
            if step == 2:
                mini_cluster.directory.stop(0)        # the directory goes away (e.g. its actor restarts) ...
                lost["address"] = mc.owner_of(longest)
                lost["open"] = [s for s in mc.open_sequences if mc.owner_of(s) == lost["address"]]
                wid = next(w for w, srv in mini_cluster.servers.items() if srv.address == lost["address"])
                mini_cluster.servers.pop(wid).stop(grace=0)   # ... and then a worker dies

        outputs, failures, _ = generate(mc, specs, seed=11, on_step=on_step)
        assert failures == {} and outputs == reference
        assert mc.recoveries == 1 and mc.moved == len(lost["open"]) >= 1


def test_cli_forgets_state_whose_ray_cluster_is_gone(tmp_path, monkeypatch, capsys):
    """A state file left by an `up` whose Ray head has died must not make the next command hang
    on ray.init: it is recognised as stale and removed."""
    import json
    import socket

    from maskd_cluster import cli as ccli

    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("MASKD_STATE_DIR", str(tmp_path))
    path = tmp_path / "cluster-ns1.json"
    path.write_text(json.dumps({"ray_address": dead, "directory": dead, "started_head": True}))
    assert ccli._live_state("ns1") == {}
    assert not path.exists() and "is gone" in capsys.readouterr().err
    # a live address is kept
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        live = f"127.0.0.1:{s.getsockname()[1]}"
        path.write_text(json.dumps({"ray_address": live, "started_head": True}))
        assert ccli._live_state("ns1")["ray_address"] == live
    assert not ccli._reachable("no-port") and not ccli._reachable(None)


# -- grammar drafts learned cluster-wide, through the store's own code (without Ray) ----------------
class StoreDrafts:
    """The GrammarStore actor's draft-count exchange, called in process (Ray only carries the call)."""

    def __init__(self):
        self.store = GrammarStore(max_draft_grammars=4, max_draft_contexts=64)

    def exchange_draft_counts(self, learned, wanted):
        return asyncio.run(self.store.exchange_draft_counts(learned, wanted))


def test_draft_counts_exchanged_through_the_store_merge_and_stay_bounded():
    from maskd.server.drafts import CONTEXT, DraftModel, GrammarCounts

    shared = StoreDrafts()
    a, b = DraftModel(shared=shared), DraftModel(shared=shared)
    text = list(range(100, 120))
    a.learn("g", [], text)
    a.learn("g", [], text)
    assert b.sync() == 0                           # b learned and asked nothing: nothing to exchange
    assert a.sync() == 1 and b.stats("g") == 0     # a's counts went to the store
    b.learn("g", [], text[:5])                     # b learns a little itself, then exchanges
    assert b.sync() == 1
    counts = b._grammars["g"]
    assert counts.guess(text[:CONTEXT]) == text[CONTEXT]
    assert counts.contexts[tuple(text[:CONTEXT])][text[CONTEXT]] == 3     # a's two and b's one
    # Rows are what travels: they round-trip, and the store keeps its bounds.
    rows = counts.rows()
    again = GrammarCounts(64)
    again.merge(rows)
    assert again.contexts == counts.contexts
    for k in range(10):
        a.learn(f"other{k}", [], list(range(0, 200)))
    a.sync()
    assert len(shared.store._draft_counts) == 4
    assert all(len(c.contexts) <= 64 for c in shared.store._draft_counts.values())


def test_a_store_that_does_not_answer_loses_no_counts():
    from maskd.server.drafts import DraftModel

    class Gone:
        calls = 0

        def exchange_draft_counts(self, learned, wanted):
            Gone.calls += 1
            raise TimeoutError("the store did not answer")

    model = DraftModel(shared=Gone())
    model.learn("g", [], [1, 2, 3, 1, 2, 3])
    assert model.sync() == 0 and Gone.calls == 1
    assert model.stats("g") == 3                       # proposing goes on from what is known here
    shared = StoreDrafts()
    model.shared = shared
    assert model.sync() == 1                           # what did not go out goes with the next one
    assert shared.store._draft_counts["g"].contexts[(1, 2)] == {3: 2}
