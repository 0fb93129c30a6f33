"""py-spy over a real vLLM engine's processes (``maskd bench vllm --profile``): where a step's time goes.

While one mode's requests decode, ``py-spy record --idle --format raw`` samples vLLM's engine core
(the scheduler, the structured-output manager: where vLLM's own backends and maskd's plugin make
the batch's bitmask), its worker (forward pass, sampling, applying the bitmask) and the maskd
server, all at once for the same seconds. Each process's main thread is summarised as shares of
its wall time in the frames that tell a step's story; multiplied by the step time (inter-token
latency) they are milliseconds per step.
"""
from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from maskd_tools.bench.profile import parse_raw, py_spy_path

# (label, frame substring) per process; shares are of samples of the thread holding the first entry.
CORE_FRAMES = (
    ("main loop", "run_busy_loop"),
    ("schedule", "Scheduler.schedule ("),
    ("execute_model (send)", "MultiprocExecutor.execute_model ("),
    ("grammar bitmask", "get_grammar_bitmask ("),
    ("  maskd: the step (send, wait, place rows)", "MaskdStructuredOutputs.rows ("),
    ("  vLLM backend: fill", "_fill_bitmasks ("),
    ("sample_tokens (waits for the worker)", "MultiprocExecutor.sample_tokens ("),
    ("update_from_output", "Scheduler.update_from_output ("),
)
WORKER_FRAMES = (
    ("main loop", "worker_busy_loop"),
    ("waiting for the engine core", "MessageQueue.dequeue ("),
    ("execute_model (forward)", "Worker.execute_model ("),
    ("sample_tokens", "Worker.sample_tokens ("),
    ("  apply_grammar_bitmask", "apply_grammar_bitmask ("),
    ("  top-k/top-p sampling", "TopKTopPSampler.forward_cpu ("),
)
SERVER_FRAMES = (
    ("stream thread", "_stream_response_in_pool"),
    ("waiting for the next step", "_RequestIterator"),
    ("Session.step", "Session.step ("),
    ("  consume", "Session._consume ("),
    ("  fill", "Session._fill ("),
    ("reply (encode + send)", "MaskServicer._reply ("),
)


def processes(engine_pid: int) -> dict[str, int]:
    """The engine core's and the worker's pids under a ``vllm serve`` process (by process title)."""
    import psutil

    found: dict[str, int] = {}
    for child in psutil.Process(engine_pid).children(recursive=True):
        try:
            name = child.name()
        except psutil.Error:
            continue
        if "EngineCore" in name:
            found.setdefault("engine_core", child.pid)
        elif "Worker" in name:
            found.setdefault("worker", child.pid)
    return found


def start(pids: dict[str, int], seconds: float, out: Path, tag: str, rate: int = 100) -> list:
    """py-spy recorders, one per process, for ``seconds``; ``finish`` waits for them."""
    spy = py_spy_path()
    if spy is None:
        raise SystemExit("maskd bench vllm --profile needs py-spy (it is in the dev extra)")
    recorders = []
    for role, pid in pids.items():
        raw = out / f"profile-{tag}-{role}.raw.txt"
        cmd = [spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
               "--format", "raw", "--output", str(raw), "--nonblocking", "--idle"]
        recorders.append((role, raw, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    return recorders


def finish(recorders: list, timeout: float) -> dict[str, dict]:
    """Each process's shares (``summarize``), once its recorder is done."""
    shares: dict[str, dict] = {}
    for role, raw, proc in recorders:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            err = b"timed out"
        if proc.returncode != 0 or not raw.exists():
            shares[role] = {"error": f"py-spy exited {proc.returncode}: {err.decode(errors='replace')[-300:]}"}
            continue
        frames = {"engine_core": CORE_FRAMES, "worker": WORKER_FRAMES, "maskd_server": SERVER_FRAMES}[role]
        shares[role] = summarize(raw.read_text(), frames)
    return shares


def summarize(raw: str, frames: Sequence[tuple[str, str]]) -> dict:
    """Shares of the first frame's thread's samples in which each frame appears."""
    stacks, _ = parse_raw(raw)
    thread = [(fs, n) for fs, n in stacks if any(frames[0][1] in f for f in fs)]
    total = sum(n for _, n in thread)
    out: dict = {"samples": total}
    for label, needle in frames[1:]:
        hit = sum(n for fs, n in thread if any(needle in f for f in fs))
        out[label] = round(hit / total, 4) if total else None
    return out
