"""maskd on a real local Ray (2 CPUs): worker actors serving gRPC, the directory, the shared grammar
cache, recovery from a killed worker, and the cluster CLI. One Ray cluster for the module."""
import json
import os
import random
import signal
import time
import uuid

import pytest

# A Ray cluster on this machine alone binds and advertises loopback only (read when Ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from test_cluster_units import generate, generation_specs  # noqa: E402

from conftest import MASKBENCH, needs_maskbench  # noqa: E402
from maskd.server import ServerConfig  # noqa: E402
from maskd.specs import GrammarSpec  # noqa: E402
from maskd_client import MaskClient, SeqStatus  # noqa: E402
from maskd_client.routing import (  # noqa: E402
    DirectoryClient,
    HashRing,
    is_directory,
)
from maskd_cluster import launcher  # noqa: E402
from maskd_tools import conformance  # noqa: E402

pytestmark = pytest.mark.cluster
NS = "maskd-test"
SAMPLE = str(conformance.SAMPLE_DIR)
REPORT_KEYS = ("schemas", "compiled", "compile_errors", "valid_total", "valid_accepted", "invalid_total",
               "invalid_rejected", "false_accepts", "false_rejects", "masks", "compile_error_files")


@pytest.fixture(scope="module")
def cluster():
    for attempt in range(2):   # Ray's node start has a fixed 30 s limit, which a loaded 2-core machine can miss once
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NS,
                     logging_level="WARNING")
            break
        except Exception as exc:
            if attempt or "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
    cfg = launcher.ClusterConfig(workers=2, namespace=NS, worker_cpus=0.5, detached=False, poll_s=0.25,
                                 ready_timeout_s=150,
                                 server=ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1,
                                                     drain_grace_s=1.0, drafts_sync_s=0.25))
    address = launcher.up(cfg)

    class C:
        pass
    c = C()
    c.cfg, c.address, c.target = cfg, address, "directory:" + address
    try:
        yield c
    finally:
        try:
            launcher.down(NS, grace_s=1.0)
        finally:
            ray.shutdown()


def live_workers(address):
    with DirectoryClient(address) as dc:
        return {w.worker_id: w for w in dc.list_workers().workers if w.live}


def wait_workers(address, n, timeout_s=120):
    return launcher.wait_for(lambda: len(live_workers(address)) == n, timeout_s, 0.25)


def status_by_worker():
    return {w["worker_id"]: w for w in launcher.status(NS)["workers"]}


# -- loopback only ---------------------------------------------------------------------------------
def test_ray_the_directory_and_the_workers_bind_and_advertise_loopback(cluster):
    import psutil

    assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == ["127.0.0.1"]
    assert cluster.address.startswith("127.0.0.1:")
    workers = live_workers(cluster.address)
    assert workers and all(w.address.startswith("127.0.0.1:") for w in workers.values())
    mine = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}   # this Ray, its actors
    listening = {(c.laddr.ip, c.pid) for c in psutil.net_connections(kind="inet")
                 if c.status == "LISTEN" and c.pid in mine}
    assert listening
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip, _ in listening), sorted(listening)


# -- the directory --------------------------------------------------------------------------------
def test_directory_lists_live_workers_and_answers_without_ray(cluster):
    assert is_directory(cluster.address)
    workers = live_workers(cluster.address)
    assert sorted(workers) == ["worker-0", "worker-1"]
    assert all(w.address and w.address != cluster.address for w in workers.values())
    assert not is_directory(workers["worker-0"].address)      # a worker serves MaskService, not Directory
    keys = [f"k{i}" for i in range(300)]
    with DirectoryClient(cluster.address) as dc:
        owners = dc.owners(keys)
        vnodes = dc.list_workers().ring_vnodes
    ring = HashRing(["worker-0", "worker-1"], vnodes=vnodes)
    assert [owners[k].worker_id for k in keys] == ring.owners(keys)   # clients can hash the same way
    assert set(ring.owners(keys)) == {"worker-0", "worker-1"}


# -- conformance through the cluster ---------------------------------------------------------------
def _same(report_a, report_b):
    return {k: report_a[k] for k in REPORT_KEYS} == {k: report_b[k] for k in REPORT_KEYS}


def _single_server_report(suite):
    from maskd.server import MaskServer, ServerConfig
    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1)) as srv:
        return conformance.run_through_server(srv.address, "cl100k", suite, batch=16)


def test_conformance_through_the_cluster_matches_a_single_server(cluster, tmp_path, capsys):
    from maskd import cli

    suite = conformance.load_suite(SAMPLE)
    single = _single_server_report(suite)
    through = conformance.run_through_server(cluster.target, "cl100k", suite, batch=16)
    assert _same(single, through), (single, through)
    assert through["false_accepts"] == [] and through["false_rejects"] == []
    # `maskd conformance --target HOST:PORT` notices that HOST:PORT is a directory.
    out = tmp_path / "report.json"
    rc = cli.main(["conformance", "--target", cluster.address, "--tokenizer", "cl100k", "--batch", "16",
                   "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    assert report["target"] == cluster.target and _same(single, report)
    print(f"\nconformance (sample): single {conformance.summary_line(single)}\n"
          f"                      cluster {conformance.summary_line(through)}")


@needs_maskbench
def test_conformance_on_a_maskbench_slice_matches_a_single_server(cluster, tmp_path):
    # Every 94th file: a slice across the sources (the first ~100 files have no invalid instances).
    for path in sorted(MASKBENCH.glob("*.json"))[::94][:12]:
        (tmp_path / path.name).symlink_to(path)
    suite = conformance.load_suite(tmp_path)
    single = _single_server_report(suite)
    through = conformance.run_through_server(cluster.target, "cl100k", suite, batch=32)
    assert _same(single, through), (single, through)
    assert through["invalid_total"] > 0
    print(f"\nconformance (maskbench-dev, {len(suite)} files): single {conformance.summary_line(single)}\n"
          f"                                      cluster {conformance.summary_line(through)}")


# -- the shared grammar cache -----------------------------------------------------------------------
def test_a_grammar_used_on_both_workers_is_compiled_once(cluster):
    nonce = uuid.uuid4().hex
    good = {"json_schema": {"type": "object", "title": nonce, "properties": {"v": {"type": "integer"}},
                            "required": ["v"]}}
    bad = {"json_schema": {"type": "object", "title": nonce, "properties": {"v": {"$ref": "#/$defs/missing"}}}}
    store = launcher.get_store(NS)
    before = status_by_worker()
    with MaskClient(cluster.target) as mc:
        info = mc.info()
        ring = HashRing(list(mc.workers()), vnodes=live_vnodes(cluster))
        per_worker = {}
        for i in range(200):
            per_worker.setdefault(ring.owner(f"c-{nonce}-{i}"), []).append(f"c-{nonce}-{i}")
        seqs = [s for w in ("worker-0", "worker-1") for s in per_worker[w][:3]]
        for i, sid in enumerate(seqs):
            mc.open(sid, good if i % 2 == 0 else bad)   # both grammars on both workers, in one step
        for _ in range(200):
            res = mc.step({sid: [] for sid in seqs})
            if all(res.seqs[s].status is not SeqStatus.WAITING for s in seqs):
                break
        statuses = {sid: res.seqs[sid].status for sid in seqs}
        assert {sid for sid, st in statuses.items() if st is SeqStatus.READY} == set(seqs[0::2])
        assert {sid for sid, st in statuses.items() if st is SeqStatus.FAILED} == set(seqs[1::2])
        reasons = {res.seqs[s].reason for s in seqs[1::2]}
        assert len(reasons) == 1   # the same compile error on both workers
        owners = {mc.owner_of(s) for s in seqs}
        assert len(owners) == 2
    after = status_by_worker()
    compiles = sum(after[w]["compiles"] - before[w]["compiles"] for w in after)
    shared_hits = sum(after[w]["shared_hits"] - before[w]["shared_hits"] for w in after)
    fp, backend, version = info.tokenizer_fingerprint, info.backend, info.backend_version
    gid_good = GrammarSpec.from_dict(good).grammar_id(fp, backend, version)
    gid_bad = GrammarSpec.from_dict(bad).grammar_id(fp, backend, version)
    publishes = ray.get([store.publish_count.remote(gid_good), store.publish_count.remote(gid_bad)])
    print(f"\nshared cache: 2 grammars (one a compile error) on 2 workers: compiles {compiles}, "
          f"shared hits {shared_hits}, publishes {publishes}")
    assert compiles == 2            # one per grammar, cluster-wide
    assert shared_hits == 2         # the other worker took each from the cluster cache
    assert publishes == [1, 1]


def test_grammar_drafts_learned_on_one_worker_are_proposed_on_the_other(cluster, cl100k):
    """Sequences of a grammar on worker-0 write a text; a sequence of the same grammar on worker-1,
    which never saw one, is proposed that text's next tokens once the counts went round the store."""
    from maskd.server.drafts import MIN_COUNT
    from maskd_client import StepInput

    spec = {"regex": f"[a-z ]{{1,{90 + uuid.uuid4().int % 100}}}"}    # a grammar new to this cluster
    text = cl100k.encode("the quick brown fox jumps over the lazy dog")
    ids = balanced_ids(cluster, 2 * (MIN_COUNT + 40), f"drafts-{uuid.uuid4().hex[:8]}")
    teachers, guessers = ids[0::2][:MIN_COUNT], ids[1::2]           # worker-0's, worker-1's

    def ready(mc, sid):
        mc.open(sid, spec)
        r = mc.step({sid: StepInput((), propose=1)})
        for _ in range(400):
            if r.seqs[sid].status is not SeqStatus.WAITING:
                break
            r = mc.step({sid: StepInput((), propose=1)})
        assert r.seqs[sid].status is SeqStatus.READY, r.seqs[sid]

    workers = live_workers(cluster.address)
    with MaskClient(cluster.target) as mc:
        for sid in teachers:
            ready(mc, sid)
            mc.step({sid: text})
        assert {mc.owner_of(s) for s in teachers} == {workers["worker-0"].address}
        proposed = []
        deadline = time.monotonic() + 60       # a few sync periods (0.25 s) on a loaded machine
        for sid in guessers:
            ready(mc, sid)
            assert mc.owner_of(sid) == workers["worker-1"].address
            proposed = mc.step({sid: StepInput(text[:2], propose=5)}).seqs[sid].proposed_drafts
            mc.close(sid)
            if proposed or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    assert proposed == text[2:7]
    stats = ray.get(launcher.get_store(NS).stats.remote())
    assert stats["draft_grammars"] >= 1 and stats["draft_exchanges"] >= 2


def test_tool_pieces_compiled_on_one_worker_serve_the_other(cluster):
    """A tool set new to the cluster, opened on worker-0, is composed from one piece per tool, each
    published to the cluster's store; the same tools but one, shuffled, plus a new one, opened on
    worker-1: its pieces come from the store, and only the new tool's is compiled there (issue 19)."""
    nonce = uuid.uuid4().hex[:8]

    def tool(i):
        return {"type": "function", "function": {"name": f"t{nonce}_{i}", "parameters": {
            "type": "object", "properties": {f"arg_{nonce}_{i}": {"type": "string"}, "n": {"type": "integer"}},
            "required": [f"arg_{nonce}_{i}"]}}}

    first = [tool(i) for i in range(20)]
    later = first[1:] + [tool(20)]
    random.Random(0).shuffle(later)
    sid0, sid1 = balanced_ids(cluster, 2, f"tools-{nonce}")
    before = status_by_worker()
    with MaskClient(cluster.target) as mc:
        for sid, tools in ((sid0, first), (sid1, later)):
            mc.open(sid, {"tools": tools, "tool_choice": "required"})
            res = mc.step({sid: []})
            for _ in range(400):
                if res.seqs[sid].status is not SeqStatus.WAITING:
                    break
                res = mc.step({sid: []})
            assert res.seqs[sid].status is SeqStatus.READY, res.seqs[sid]
            mc.close(sid)
    after = status_by_worker()
    delta = {w: {k: after[w][k] - before[w][k] for k in ("compiles", "shared_hits")} for w in after}
    print(f"\ntool pieces across the cluster: {delta}")
    assert delta["worker-0"] == {"compiles": 21, "shared_hits": 0}     # 20 pieces and the array composed
    assert delta["worker-1"] == {"compiles": 2, "shared_hits": 19}     # the new tool's piece and the array


def live_vnodes(cluster):
    with DirectoryClient(cluster.address) as dc:
        return dc.list_workers().ring_vnodes


# -- recovery -------------------------------------------------------------------------------------
def balanced_ids(cluster, n, prefix):
    """n sequence ids, alternately owned by worker-0 and worker-1."""
    with DirectoryClient(cluster.address) as dc:
        vnodes = dc.list_workers().ring_vnodes
    ring = HashRing(["worker-0", "worker-1"], vnodes=vnodes)
    ids, j = [], 0
    while len(ids) < n:
        sid = f"{prefix}-{j}"
        j += 1
        if ring.owner(sid) == f"worker-{len(ids) % 2}":
            ids.append(sid)
    return ids


def test_a_worker_killed_mid_generation_changes_no_output(cluster):
    assert wait_workers(cluster.address, 2)
    specs = generation_specs(8, balanced_ids(cluster, 8, "gen"))
    with MaskClient(cluster.target) as mc:
        generate(mc, specs)   # compiles every grammar: the runs below take the same steps, none WAITING
    with MaskClient(cluster.target) as mc:
        reference, failures, steps = generate(mc, specs)
    assert not failures and steps > 6
    incarnations = {w.worker_id: w.incarnation for w in live_workers(cluster.address).values()}
    # Kill midway through the victim's longest sequence, with a step in flight: the victim is frozen
    # (SIGSTOP) before the step goes out and killed (ray.kill, restartable) right after it was sent.
    victim_id = "worker-1"
    mine = [sid for i, sid in enumerate(specs) if i % 2 == 1]
    kill_at = max(2, min(steps // 2, max(len(reference[sid]) for sid in mine) - 2))
    pid = status_by_worker()[victim_id]["pid"]
    victim = {}

    with MaskClient(cluster.target) as mc:
        def before_step(step):
            if step == kill_at:
                victim["address"] = mc.workers()[victim_id]
                victim["open"] = [sid for sid in mc.open_sequences if mc.owner_of(sid) == victim["address"]]
                os.kill(pid, signal.SIGSTOP)

        def on_step(step):
            if step == kill_at:
                ray.kill(launcher.get_worker(victim_id, NS), no_restart=False)
                # ray.kill is asynchronous: go on once the process is gone
                assert launcher.wait_for(lambda: not _alive(pid), 30, 0.02)

        outputs, failures, _ = generate(mc, specs, before_step=before_step, on_step=on_step)
        figures = {"sequences": len(specs), "open on the killed worker": len(victim["open"]),
                   "replays": mc.replays, "resent steps": mc.resent_steps, "moved": mc.moved,
                   "recoveries": mc.recoveries, "failures": len(failures),
                   "outputs equal": outputs == reference, "tokens": sum(map(len, outputs.values()))}
    print(f"\nkill test ({victim_id} killed at step {kill_at} of {steps}): {figures}")
    assert failures == {}
    assert outputs == reference
    assert mc.recoveries == 1 and mc.resent_steps == 1
    assert mc.replays == len(victim["open"]) >= 1 and mc.moved == len(victim["open"])
    # Ray restarts the worker (same id, new process and address) and it rejoins the ring.
    assert wait_workers(cluster.address, 2)
    back = live_workers(cluster.address)[victim_id]
    assert back.incarnation != incarnations[victim_id] and back.restarts >= 1


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_ring_moves_only_the_lost_workers_sequences(cluster):
    keys = [f"seq-{i}" for i in range(400)]
    with DirectoryClient(cluster.address) as dc:
        assert wait_workers(cluster.address, 2)
        before = {k: w.worker_id for k, w in dc.owners(keys).items()}
        ray.kill(launcher.get_worker("worker-1", NS), no_restart=True)   # gone for good
        assert launcher.wait_for(lambda: list(live_workers(cluster.address)) == ["worker-0"], 60, 0.25)
        during = {k: w.worker_id for k, w in dc.owners(keys).items()}
        moved = {k for k in keys if before[k] != during[k]}
        print(f"\nring: {len(moved)} of {len(keys)} sequences moved, all from worker-1")
        assert moved == {k for k in keys if before[k] == "worker-1"} and moved
        assert set(during.values()) == {"worker-0"}
        # A new worker-1 (same stable id) takes back exactly the same sequences.
        launcher.wait_for(lambda: "maskd-worker-1" not in launcher.worker_names(NS), 30)
        assert launcher.up(cluster.cfg) == cluster.address
        assert wait_workers(cluster.address, 2)
        assert {k: w.worker_id for k, w in dc.owners(keys).items()} == before


def test_draining_a_worker_moves_its_open_sequences(cluster):
    specs = {f"d-{k}": v for k, v in generation_specs(6).items()}
    with MaskClient(cluster.target) as mc:
        generate(mc, specs, seed=3)   # compiles every grammar: the runs below take the same steps, none WAITING
    with MaskClient(cluster.target) as mc:
        reference, failures, steps = generate(mc, specs, seed=3)
    assert not failures
    longest = max(reference, key=lambda sid: len(reference[sid]))
    with MaskClient(cluster.target) as mc:
        def on_step(step):
            if step == max(2, min(steps // 2, len(reference[longest]) - 2)):
                workers = {a: w for w, a in mc.workers().items()}
                ray.get(launcher.get_worker(workers[mc.owner_of(longest)], NS).drain.remote(0.5))

        outputs, failures, _ = generate(mc, specs, seed=3, on_step=on_step)
        assert mc.recoveries >= 1 and mc.moved >= 1
    assert failures == {} and outputs == reference
    # put the drained worker back: scale down to 1 and up to 2 again
    drained = [w for w, s in status_by_worker().items() if s.get("draining")]
    for wid in drained:
        launcher.stop_worker(wid, NS, grace_s=0.5)
    launcher.wait_for(lambda: not set(drained) & {n.replace("maskd-", "") for n in launcher.worker_names(NS)}, 30)
    assert launcher.up(cluster.cfg) == cluster.address
    assert wait_workers(cluster.address, 2)


# -- the CLI --------------------------------------------------------------------------------------
def test_cli_up_status_down(cluster, tmp_path, monkeypatch, capsys):
    from maskd import cli

    monkeypatch.setenv("MASKD_STATE_DIR", str(tmp_path))
    ns = "maskd-test-cli"
    rc = cli.main(["cluster", "up", "--workers", "1", "--namespace", ns, "--tokenizer", "cl100k",
                   "--worker-cpus", "0.25", "--threads", "1", "--compile-threads", "1", "--timeout", "150"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    directory = out[-1]
    host, _, port = directory.rpartition(":")
    assert host and port.isdigit() and is_directory(directory)
    try:
        assert cli.main(["cluster", "status", "--namespace", ns]) == 0
        text = capsys.readouterr().out
        assert "worker-0" in text and "yes" in text and "shared grammar cache" in text
        assert cli.main(["cluster", "status", "--directory", directory, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert [w["worker_id"] for w in report["workers"]] == ["worker-0"] and report["workers"][0]["live"]
        # the client takes the directory address as its target
        with MaskClient("directory:" + directory) as mc:
            mc.register({"choice": ["yes", "no"]})      # compiled once the call returns
            mc.open("s", {"choice": ["yes", "no"]})
            res = mc.step({"s": []})
            assert res.seqs["s"].status is SeqStatus.READY
    finally:
        assert cli.main(["cluster", "down", "--namespace", ns, "--grace", "0.5"]) == 0
    assert "drained and removed 1 workers" in capsys.readouterr().out
    assert not launcher.worker_names(ns)
    assert not (tmp_path / f"cluster-{ns}.json").exists()


def test_cli_up_reports_a_worker_that_cannot_start(cluster, tmp_path, monkeypatch, capsys):
    from maskd import cli

    monkeypatch.setenv("MASKD_STATE_DIR", str(tmp_path))
    ns = "maskd-test-bad"
    try:
        with pytest.raises(SystemExit) as exc:
            cli.main(["cluster", "up", "--workers", "1", "--namespace", ns, "--tokenizer", "hf:/no/such/tokenizer.json",
                      "--worker-cpus", "0.25", "--timeout", "120"])
        assert "failed to start" in str(exc.value) and "/no/such/tokenizer.json" in str(exc.value)
    finally:
        launcher.down(ns, grace_s=0.1)
