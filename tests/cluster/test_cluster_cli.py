"""`maskd cluster up | status | down` as separate processes, the way an operator runs them: `up`
starts its own local Ray head, a later process finds the cluster through the state file, the
directory address serves `maskd conformance`, and `down` leaves no Ray process behind."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="the cluster extra (Ray) is not installed")
pytestmark = pytest.mark.cluster


def _maskd(*args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "maskd.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _ray_processes(state_dir: pathlib.Path | None = None) -> int:
    """Ray head processes on this machine (with ``state_dir``: only those started with that
    MASKD_STATE_DIR in their environment, i.e. by this test)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    count = 0
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "gcs_server" not in args and "/raylet" not in args:
            continue
        if state_dir is not None:
            try:
                env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"MASKD_STATE_DIR={state_dir}".encode() not in env:
                continue
        count += 1
    return count


def test_up_status_conformance_down_from_separate_processes(tmp_path):
    if _ray_processes():
        pytest.skip("another Ray cluster runs on this machine; this test starts and stops its own")
    env = {**os.environ, "MASKD_STATE_DIR": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    ns = "maskd-test-proc"
    up = _maskd("cluster", "up", "--workers", "1", "--namespace", ns, "--num-cpus", "2", "--tokenizer", "cl100k",
                "--worker-cpus", "1", "--threads", "1", "--compile-threads", "1", "--timeout", "150", env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "%|" not in up.stderr and "\r" not in up.stderr, "progress bars belong on a terminal only"
        directory = up.stdout.strip().splitlines()[-1]
        host, _, port = directory.rpartition(":")
        assert host and port.isdigit()

        st = _maskd("cluster", "status", "--namespace", ns, "--json", env=env)
        assert st.returncode == 0, st.stderr
        report = json.loads(st.stdout)
        assert [w["worker_id"] for w in report["workers"]] == ["worker-0"] and report["workers"][0]["live"]

        out = tmp_path / "conformance.json"
        conf = _maskd("conformance", "--target", directory, "--tokenizer", "cl100k", "--json", str(out), env=env)
        assert conf.returncode == 0, conf.stdout + conf.stderr
        result = json.loads(out.read_text())
        assert result["valid_accepted"] == result["valid_total"] > 0
        assert result["invalid_rejected"] == result["invalid_total"] > 0

        st = _maskd("cluster", "status", "--namespace", ns, "--json", env=env)
        cache = json.loads(st.stdout)["cache"]
        assert cache["entries"] == result["compiled"] + result["compile_errors"]
    finally:
        down = _maskd("cluster", "down", "--namespace", ns, "--grace", "0.5", env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "drained and removed 1 workers" in down.stdout and "stopped the local Ray head" in down.stdout
    assert not (tmp_path / f"cluster-{ns}.json").exists()
    assert _ray_processes(tmp_path) == 0
    # with nothing left, status says so instead of hanging
    st = _maskd("cluster", "status", "--namespace", ns, env=env, timeout=120)
    assert st.returncode != 0 and "no maskd cluster found" in st.stderr


@pytest.mark.parametrize("flags, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--workers", "two"], "invalid int value"),
    (["--row-dict-size", "-1"], "--row-dict-size must be >= 0"),
    (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
])
def test_up_refuses_bad_flags_before_starting_anything(tmp_path, flags, message):
    env = {**os.environ, "MASKD_STATE_DIR": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    up = _maskd("cluster", "up", "--namespace", "maskd-test-bad", *flags, env=env, timeout=120)
    assert up.returncode != 0 and message in up.stderr, up.stderr
    assert _ray_processes(tmp_path) == 0 and not list(tmp_path.iterdir())
