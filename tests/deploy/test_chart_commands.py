"""Every container command the chart renders starts.

The chart is rendered with the real Helm engine (helm-python-sdk) in each mode, and each
container's command runs here as a process, against loopback, until it is healthy the way its
probes ask. What is rewritten for a run on one machine, and only that:

- 0.0.0.0 -> 127.0.0.1, and every port the chart names (gRPC, metrics, directory, Ray's GCS,
  dashboard, agent, metrics export, client server) -> a free loopback port (the maskd actors' own
  gRPC and metrics ports -> 0, a free one each, since all "pods" share this machine; they bind
  the pod IP in a pod, here --worker-host/--directory-host 127.0.0.1 keep them on loopback);
- the pod's environment: HOME (/tmp in the pod) -> a scratch folder, status.podIP -> 127.0.0.1,
  Kubernetes' $(VAR) references expanded as the kubelet does;
- the image's /etc/profile.d/maskd.sh (PATH for KubeRay's login shell) is $HOME/.profile here;
- ray mode: the Ray containers have no command in the chart; KubeRay (v1.7.0) generates
  `ulimit -n 65536; ray start [--head] --<param>=<value> ...` from rayStartParams and the container's
  resources (ray-operator/controllers/ray/common/pod.go: setMissingRayStartParams,
  generateRayStartCommand, convertParamMap). The test builds that line the same way, adding a
  short --temp-dir on the head (Unix socket paths are short). Ray's own processes use the
  machine's address as Ray picks it (Ray turns 127.0.0.1 into it), as in tests/cluster.

The chart values are those of a small deployment (1 thread, cl100k, one Ray worker with 1 CPU).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
psutil = pytest.importorskip("psutil")
from dockerfile import REPO  # noqa: E402

from maskd_client.health import SERVING, Unreachable, check  # noqa: E402

CHART = REPO / "helm" / "maskd"
BIN = os.path.dirname(sys.executable)   # maskd, ray: the console scripts of this environment


def render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name="mk", namespace="llm")
    return [d for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def one(docs, kind):
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def container(spec, name):
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A free port not handed out before in this run: the kernel may give a just-closed port again,
    and Ray refuses two of its components on one port (seen in CI: the dashboard's)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


class Processes:
    """What a test started, stopped by process id: each command and all its descendants."""

    def __init__(self) -> None:
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict, log_dir) -> subprocess.Popen:
        log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=log_dir)
        log.close()
        self.started.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, timeout: float = 20.0) -> int:
        try:
            family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = [proc.pid]
        proc.terminate()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
        for pid in family[1:]:           # e.g. the gcs_server, raylet and workers of `ray start`
            try:
                p = psutil.Process(pid)
                p.terminate()
                p.wait(10)
            except psutil.NoSuchProcess:
                pass
            except psutil.TimeoutExpired:
                p.kill()
        return code

    def stop_all(self) -> None:
        for _, proc in reversed(self.started):
            if proc.returncode is None:
                self.stop(proc)


def pod_env(c: dict, home) -> dict:
    """The container's environment as the kubelet would give it, for this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MASKD_"))}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    for item in c.get("env", []):
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            value = "127.0.0.1"
        else:
            continue
        env[item["name"]] = value
    env["HOME"] = str(home)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def rewrite_flags(words: list[str], ports: dict[str, int]) -> list[str]:
    """0.0.0.0 -> 127.0.0.1 and the value of each port flag in ``ports`` -> the free port given."""
    out = []
    for i, w in enumerate(words):
        if i and words[i - 1] in ports:
            out.append(str(ports[words[i - 1]]))
        else:
            out.append("127.0.0.1" if w == "0.0.0.0" else w)
    return out


def wait_healthy(address: str, service: str = "", proc=None, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc is None or proc.poll() is None, f"the process behind {address} exited with {proc.returncode}"
        try:
            if check(address, service=service, connect_timeout_s=2.0) == SERVING:
                return
        except Unreachable:
            pass
        assert time.monotonic() < deadline, f"{address} not healthy within {timeout_s:g} s"
        time.sleep(0.5)


def log_tail(tmp, name: str) -> str:
    path = tmp / f"{name}.log"
    return path.read_text()[-4000:] if path.exists() else ""


# -- standalone: the Deployment's container -----------------------------------------------------------
INFO_LINE = "INFO maskd.server: maskd serving on"


@pytest.mark.parametrize("server_values, info_logged", [
    ({"logLevel": "info"}, True),
    ({"extraArgs": ["-v"]}, True),                        # the chart tests' own example: it used to crash-loop
    ({"logLevel": "warning", "extraArgs": ["--compile-threads", "1"]}, False),
])
def test_standalone_container_starts_and_serves(tmp_path, server_values, info_logged):
    docs = render({"server": {"threads": 1, "tokenizer": "cl100k", **server_values}})
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(spec, "maskd")
    grpc_port, metrics_port = free_port(), free_port()
    argv = rewrite_flags(c["command"] + c["args"], {"--port": grpc_port, "--metrics-port": metrics_port})
    assert argv[:3] == ["maskd", "serve", "--host"] and argv[3] == "127.0.0.1"
    procs = Processes()
    try:
        proc = procs.start("maskd", argv, pod_env(c, tmp_path), tmp_path)
        probe = c["readinessProbe"]["grpc"]
        assert probe["port"] == int(c["args"][c["args"].index("--port") + 1])
        wait_healthy(f"127.0.0.1:{grpc_port}", probe.get("service", ""), proc)      # the readiness probe
        wait_healthy(f"127.0.0.1:{grpc_port}", c["livenessProbe"]["grpc"].get("service", ""), proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            assert b"maskd_live_sequences" in reply.read()
        assert procs.stop(proc) in (0, -15)
    finally:
        procs.stop_all()
    assert (INFO_LINE in log_tail(tmp_path, "maskd")) is info_logged, log_tail(tmp_path, "maskd")


# -- ray mode: the RayCluster's head, its maskd-cluster container, a worker -------------------------------
def kuberay_start_line(params: dict, resources: dict, *, head: bool) -> str:
    """The `ray start` line KubeRay v1.7.0 puts in a Ray container (see the module docstring)."""
    params = dict(params)
    if head:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", "8080")
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", "52365")
    cpu = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu")
    if "num-cpus" not in params and cpu is not None:
        params["num-cpus"] = str(int(float(str(cpu).rstrip("m")) / (1000 if str(cpu).endswith("m") else 1)))
    flags = ""
    for key in sorted(params):
        value = str(params[key])
        if value.lower() in ("true", "false") and key not in ("log-color", "include-dashboard", "include-log-monitor"):
            flags += f" --{key} " if value.lower() == "true" else ""
        else:
            flags += f" --{key}={value} "
    return "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; " + ("ray start --head" if head else "ray start") + flags


def agent_healthy(port: int) -> bool:
    """KubeRay's probes for Ray >= 2.53: GET /api/healthz on the dashboard agent's port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/healthz", timeout=3) as reply:
            return reply.status == 200
    except OSError:
        return False


def start_ray_container(procs: Processes, name: str, line: str, env: dict, tmp, port: int,
                        restarts: int = 2) -> subprocess.Popen:
    """A Ray container started and healthy, restarted when its `ray start` exits first, as the kubelet
    restarts a RayCluster pod's container (restartPolicy Always). Seen in CI on a loaded machine: a
    worker's `ray start` gives up after Ray's fixed 30 s wait for the GCS to list its node and exits
    1; in a cluster the kubelet starts it again. Each try's log is kept (name.log, name.1.log, ...)."""
    for attempt in range(restarts + 1):
        proc = procs.start(name, ["bash", "-lc", "--", line], env, tmp)
        deadline = time.monotonic() + 180.0
        while not agent_healthy(port):
            if proc.poll() is not None:
                break
            assert time.monotonic() < deadline, f"{name}'s health not within 180 s:\n{log_tail(tmp, name)}"
            time.sleep(0.5)
        else:
            return proc
        assert attempt < restarts, f"{name} exited with {proc.returncode} {attempt + 1} times:\n{log_tail(tmp, name)}"
        procs.stop(proc)            # what its group left, before the restart
        (tmp / f"{name}.log").rename(tmp / f"{name}.{attempt + 1}.log")
    raise AssertionError("unreachable")


def wait_for(predicate, what: str, proc, tmp, name: str, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{log_tail(tmp, name)}"
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:g} s:\n{log_tail(tmp, name)}"
        time.sleep(0.5)


@pytest.mark.cluster
def test_ray_mode_containers_start_and_serve(tmp_path):
    pytest.importorskip("ray", reason="the cluster extra (Ray) is not installed")
    small = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}
    docs = render({"mode": "ray", "server": {"threads": 1, "tokenizer": "cl100k", "logLevel": "info"},
                   "ray": {"head": {"resources": small},
                           "worker": {"replicas": 1, "minReplicas": 1, "threads": 1, "resources": small}}})
    rc = one(docs, "RayCluster")
    head_spec = rc["spec"]["headGroupSpec"]["template"]["spec"]
    (group,) = rc["spec"]["workerGroupSpecs"]
    worker_spec = group["template"]["spec"]
    ray_head, sidecar = container(head_spec, "ray-head"), container(head_spec, "maskd-cluster")
    ray_worker = container(worker_spec, "ray-worker")
    assert "command" not in ray_head and "command" not in ray_worker   # KubeRay writes those

    gcs = free_port()
    node = {name: {"metrics-export-port": str(free_port()), "dashboard-agent-listen-port": str(free_port())}
            for name in ("head", "worker")}
    scratch = tempfile.mkdtemp(prefix="mk-", dir="/tmp")    # Ray's socket paths must stay short
    # What the image's /etc/profile.d/maskd.sh does for KubeRay's `bash -lc`, for this environment.
    profile = re.search(r"echo '(export PATH=[^']+)' > /etc/profile.d/maskd.sh", (REPO / "Dockerfile").read_text())
    assert profile, "the Dockerfile must put /opt/maskd/bin on the PATH of login shells"
    with open(os.path.join(scratch, ".profile"), "w") as f:
        f.write(profile.group(1).replace("/opt/maskd/bin", BIN) + "\n")
    procs = Processes()
    try:
        head_params = {**rc["spec"]["headGroupSpec"]["rayStartParams"], **node["head"], "port": str(gcs),
                       "dashboard-port": str(free_port()), "ray-client-server-port": str(free_port()),
                       "temp-dir": os.path.join(scratch, "ray")}
        head_params["dashboard-host"] = "127.0.0.1"
        line = kuberay_start_line(head_params, ray_head["resources"], head=True)
        assert "--num-cpus=0" in line   # no maskd actor on the head
        start_ray_container(procs, "ray-head", line, pod_env(ray_head, scratch), tmp_path,
                            int(node["head"]["dashboard-agent-listen-port"]))

        worker_params = {**group["rayStartParams"], **node["worker"], "address": f"127.0.0.1:{gcs}"}
        line = kuberay_start_line(worker_params, ray_worker["resources"], head=False)
        assert '--resources="{\\"maskd_cpu_node\\":1}"' in line and "--num-cpus=1" in line
        start_ray_container(procs, "ray-worker", line, pod_env(ray_worker, scratch), tmp_path,
                            int(node["worker"]["dashboard-agent-listen-port"]))

        # The maskd-cluster container: its script as rendered; in its `maskd cluster up` line the ports
        # and 0.0.0.0 are rewritten (env: RAY_ADDRESS = $(MY_POD_IP):6379 -> this GCS).
        env = pod_env(sidecar, scratch)
        assert env["RAY_ADDRESS"] == "127.0.0.1:6379"
        env["RAY_ADDRESS"] = f"127.0.0.1:{gcs}"
        directory_port = free_port()
        script_lines = []
        for ln in sidecar["args"][0].splitlines():
            if "maskd cluster up" in ln:
                words = rewrite_flags(shlex.split(ln), {"--directory-port": directory_port, "--port": 0,
                                                        "--metrics-port": 0})
                # In a pod the actors bind and advertise the pod IP; here: loopback.
                ln = shlex.join(words + ["--worker-host", "127.0.0.1", "--directory-host", "127.0.0.1"])
            script_lines.append(ln)
        assert sidecar["command"] == ["/bin/sh", "-c"]
        up = procs.start("maskd-cluster", ["/bin/sh", "-c", "\n".join(script_lines)], env, tmp_path)
        directory = f"127.0.0.1:{directory_port}"
        rendered_up = shlex.split(next(ln for ln in sidecar["args"][0].splitlines() if "cluster up" in ln))
        probe = sidecar["readinessProbe"]["tcpSocket"]["port"]   # a named port: the directory's
        assert {p["name"]: p["containerPort"] for p in sidecar["ports"]}[probe] == int(
            rendered_up[rendered_up.index("--directory-port") + 1])
        wait_for(lambda: _tcp_open(directory_port), "the directory port (the readiness probe)", up, tmp_path,
                 "maskd-cluster", timeout_s=300)
        wait_healthy(directory, proc=up, timeout_s=120)
        # The directory answers as soon as it runs; `cluster up` prints its summary once the workers serve.
        wait_for(lambda: "maskd cluster: 1 workers" in log_tail(tmp_path, "maskd-cluster"), "the worker serving",
                 up, tmp_path, "maskd-cluster", timeout_s=300)

        status = subprocess.run([os.path.join(BIN, "maskd"), "cluster", "status", "--directory", directory, "--json"],
                                capture_output=True, text=True, env=env, timeout=120)
        assert status.returncode == 0, status.stderr
        workers = json.loads(status.stdout)["workers"]
        assert [w["worker_id"] for w in workers if w["live"]] == ["worker-0"], workers
        wait_healthy(workers[0]["address"], "maskd.v1.MaskService", timeout_s=60)
        assert workers[0]["address"].startswith("127.0.0.1:")
        # --foreground: the container's process stays up once the cluster is, and ends cleanly on SIGTERM.
        time.sleep(1.0)
        assert up.poll() is None, log_tail(tmp_path, "maskd-cluster")
        assert procs.stop(up) == 0, log_tail(tmp_path, "maskd-cluster")
        assert "maskd cluster: 1 workers" in log_tail(tmp_path, "maskd-cluster")
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)


def _tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
