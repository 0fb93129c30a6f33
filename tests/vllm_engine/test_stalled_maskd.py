"""A stalled maskd costs only maskd's requests (issue 48, item 3), in a real vLLM CPU engine.

A `maskd serve` process of the test's own is stopped (SIGSTOP) for STOP_S while unconstrained and
maskd streams are in flight: the engine core waits at most ``MASKD_STEP_DEADLINE_S`` for maskd's
answer, then holds maskd's requests out of its steps; the unconstrained streams keep decoding (their
longest inter-token gap stays far under the stop), and once maskd is continued its requests are
scheduled again and finish, their outputs matching their grammar.
"""
import concurrent.futures
import itertools
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from harness import ENGINE_OPTIONS, MODEL, vllm_engine

from maskd_tools.vllm_serve import free_port

STOP_S = 5.0
GAP_BOUND_S = 1.5          # an unconstrained stream's longest gap while maskd is stopped for STOP_S
WORDS = r"([a-z]{2,5} ){40}end"
PLAIN, MASKD = 4, 4
IN_FLIGHT = 20             # tokens every stream has before maskd is stopped (the normal gaps come from these)


@pytest.fixture
def maskd_process():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "maskd.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--tokenizer", "deepseek-v4", "--threads", "1", "--compile-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        assert "maskd serving on" in line, f"maskd serve did not start: {line!r}"
        yield proc, f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(10)


def stream(url: str, body: dict, times: list, text: list, started: threading.Event) -> dict:
    """A streamed /v1/completions request: each chunk's arrival (time.monotonic()) and text (``started``
    set at the IN_FLIGHT-th); the last chunk's finish reason."""
    req = urllib.request.Request(url + "/v1/completions", headers={"content-type": "application/json"},
                                 data=json.dumps({"model": MODEL, "stream": True, **body}).encode())
    finish = None
    with urllib.request.urlopen(req, timeout=120) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            if choice.get("text"):
                times.append(time.monotonic())
                text.append(choice["text"])
                if len(times) >= IN_FLIGHT:
                    started.set()
            finish = choice.get("finish_reason") or finish
    return {"finish_reason": finish, "text": "".join(text)}


def test_a_stopped_maskd_stalls_only_maskds_requests(logs, maskd_process):
    proc, target = maskd_process
    env = {"MASKD_TARGET": target, "MASKD_STEP_DEADLINE_S": "0.1"}     # the hold is opt-in
    with vllm_engine(logs, *ENGINE_OPTIONS, "--max-num-seqs", "16", env=env, name="maskd-stalled") as engine:
        regex = {"structured_outputs": {"regex": WORDS}}
        assert engine.complete({"prompt": "warm", "max_tokens": 400, **regex})   # the grammar compiled
        bodies = {f"plain-{i}": {"prompt": f"Story {i}:", "max_tokens": 900, "ignore_eos": True, "temperature": 0.8,
                                 "seed": i} for i in range(PLAIN)}
        bodies.update({f"maskd-{i}": {"prompt": f"Words {i}:", "max_tokens": 400, "temperature": 0.8, "seed": i,
                                      **regex} for i in range(MASKD)})
        times = {k: [] for k in bodies}
        texts = {k: [] for k in bodies}
        started = {k: threading.Event() for k in bodies}
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            futures = {k: pool.submit(stream, engine.url, b, times[k], texts[k], started[k]) for k, b in bodies.items()}
            for k, event in started.items():          # every stream in flight
                assert event.wait(60), f"{k} sent fewer than {IN_FLIGHT} tokens in 60 s"
            os.kill(proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                time.sleep(STOP_S)          # the fault's length (the outcome is read from the streams)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            resumed = time.monotonic()
            results = {k: f.result(timeout=120) for k, f in futures.items()}

    during = {k: sum(stopped <= t <= resumed for t in ts) for k, ts in times.items()}
    gaps = {k: max((b - a for a, b in itertools.pairwise(ts) if b > stopped and a < resumed), default=0.0)
            for k, ts in times.items()}
    plain_gap = max(gaps[k] for k in bodies if k.startswith("plain"))
    maskd_gap = max(gaps[k] for k in bodies if k.startswith("maskd"))
    normal = sorted(b - a for k, ts in times.items() if k.startswith("plain") for a, b in itertools.pairwise(ts)
                    if b < stopped)
    p50, p99 = normal[len(normal) // 2], normal[int(len(normal) * 0.99)]
    print(f"\nbefore the stop: unconstrained inter-token gaps p50 {p50:.3f} s, p99 {p99:.3f} s ({len(normal)})")
    print(f"maskd stopped {resumed - stopped:.2f} s: unconstrained streams' longest gap {plain_gap:.3f} s "
          f"(tokens during the stop: {[during[k] for k in bodies if k.startswith('plain')]}); "
          f"maskd streams' longest gap {maskd_gap:.3f} s")
    for k in bodies:
        if k.startswith("plain"):
            assert during[k] > 0, f"{k} got no token while maskd was stopped"
            assert gaps[k] < GAP_BOUND_S, f"{k}: a gap of {gaps[k]:.2f} s while maskd was stopped {STOP_S} s"
        else:
            assert results[k]["finish_reason"] == "stop", (k, results[k])
            assert re.fullmatch(WORDS, results[k]["text"]), (k, results[k]["text"])
    assert maskd_gap > STOP_S / 2         # maskd's streams did wait for maskd (held, not unconstrained)
    log = engine.log_text()
    assert "maskd's requests are held out of vLLM's steps" in log
    assert "are scheduled again" in log
