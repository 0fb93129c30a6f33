"""``maskd bench vllm --timeline``: where each request's time to first token goes, phase by phase,
across vLLM's three processes and maskd.

The vLLM plugin here (entry point ``maskd_timeline`` of ``vllm.general_plugins``; it does nothing
unless ``MASKD_BENCH_TIMELINE`` is set, which only the bench sets) stamps, with the system-wide
monotonic clock, the points a request passes in each process:

* API server: ``AsyncLLM.add_request`` (its request id), maskd's admission (``_admit``; the
  register inside it, ``_Admission.check``, by thread), the first output of each request;
* engine core: ``Scheduler.add_request``, the steps that schedule a request first
  (``Scheduler.schedule``), ``grammar_bitmask`` and maskd's step inside it;
* worker: ``execute_model`` (the forward pass).

Each process appends ``<monotonic s> <event> <key>`` lines to ``$MASKD_BENCH_TIMELINE.<pid>``. The
bench stamps each request's send (``vllm_http.stream``: ``t0``, the response's ``id``), and
:func:`phases` puts them together per request: the HTTP request until vLLM's ``add_request``, maskd's
admission (its spec read and the register), the hand-over to the engine core, the wait to be
scheduled, the first step (forward, bitmask, sampling), the first token's way back to the client.
"""
from __future__ import annotations

import bisect
import functools
import inspect
import os
import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ENV = "MASKD_BENCH_TIMELINE"

# (label, from, to): the phases of one request's TTFT, between the named stamps ("sent" and
# "first chunk" are the client's). Admission is 0 for requests that are not maskd's.
PHASES = (
    ("HTTP request to vLLM's add_request", "sent", "add_request"),
    ("maskd admission (spec read, register)", "add_request", "admitted"),
    ("  of which the register", None, None),
    ("to the engine core", "admitted", "engine_core"),
    ("waiting to be scheduled", "engine_core", "scheduled"),
    ("first step (forward, bitmask, sample)", "scheduled", "first_output"),
    ("first token to the client", "first_output", "first chunk"),
)


# -- the vLLM side: stamps ----------------------------------------------------------------------
class _Stamps:
    def __init__(self, prefix: str) -> None:
        self.path = f"{prefix}.{os.getpid()}"
        self.lock = threading.Lock()
        self.file = open(self.path, "a", buffering=1)    # noqa: SIM115 (open for the process's life)

    def __call__(self, event: str, key: str = "") -> None:
        line = f"{time.monotonic():.6f} {event} {key}\n"
        with self.lock:
            self.file.write(line)


def register() -> None:
    """vLLM's ``general_plugins`` entry point: nothing unless ``MASKD_BENCH_TIMELINE`` is set.
    maskd's own plugin is installed first (idempotent), so these stamps wrap its patches."""
    prefix = os.environ.get(ENV, "").strip()
    if not prefix:
        return
    import maskd_client.vllm

    maskd_client.vllm.register()
    _install(_Stamps(prefix))


def _wrap(owner: Any, name: str, before: Any = None, after: Any = None) -> None:
    """``owner.name`` with ``before(args, kwargs)`` and ``after(args, kwargs, result)`` around it."""
    original = getattr(owner, name)
    if getattr(original, "_maskd_timeline", False):
        return
    if inspect.iscoroutinefunction(original):
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before:
                before(args, kwargs)
            result = await original(*args, **kwargs)
            if after:
                after(args, kwargs, result)
            return result
    else:
        def wrapper(*args: Any, **kwargs: Any) -> Any:   # type: ignore[misc]
            if before:
                before(args, kwargs)
            result = original(*args, **kwargs)
            if after:
                after(args, kwargs, result)
            return result
    functools.update_wrapper(wrapper, original)
    wrapper._maskd_timeline = True        # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _install(stamp: _Stamps) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.structured_output import StructuredOutputManager

    from maskd_client.vllm import admission, engine_core

    def thread() -> str:
        return str(threading.get_ident())

    def added(args: tuple, kwargs: dict) -> None:
        # (self, request_id, prompt, params, ...): the params' identity ties admission to the request
        params = args[3] if len(args) > 3 else kwargs.get("params")
        stamp("add_request", f"{args[1]} {id(params)}")

    _wrap(AsyncLLM, "add_request", before=added)
    _wrap(admission, "_admit", before=lambda a, k: stamp("admit", f"{id(a[0])} {thread()}"),
          after=lambda a, k, r: stamp("admitted", f"{id(a[0])} {thread()}"))
    _wrap(admission._Admission, "check", before=lambda a, k: stamp("register", thread()),
          after=lambda a, k, r: stamp("registered", thread()))
    seen: set[str] = set()

    def first_outputs(args: tuple, kwargs: dict) -> None:
        for out in args[1]:
            if out.request_id not in seen and out.new_token_ids:
                seen.add(out.request_id)
                stamp("first_output", out.request_id)

    _wrap(OutputProcessor, "process_outputs", before=first_outputs)
    _wrap(Scheduler, "add_request", before=lambda a, k: stamp("engine_core", a[1].request_id))

    def scheduled(args: tuple, kwargs: dict, out: Any) -> None:
        if out.scheduled_new_reqs:
            stamp("scheduled", ",".join(r.req_id for r in out.scheduled_new_reqs))

    _wrap(Scheduler, "schedule", after=scheduled)
    _wrap(StructuredOutputManager, "grammar_bitmask", before=lambda a, k: stamp("bitmask"),
          after=lambda a, k, r: stamp("bitmask_done"))
    _wrap(engine_core.MaskdStructuredOutputs, "_step", before=lambda a, k: stamp("maskd_step"),
          after=lambda a, k, r: stamp("maskd_step_done"))
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:      # (a worker class elsewhere: the forward goes unstamped)
        return
    _wrap(Worker, "execute_model", before=lambda a, k: stamp("forward"), after=lambda a, k, r: stamp("forward_done"))


# -- the bench side: phases ---------------------------------------------------------------------
def read(prefix: str | os.PathLike) -> list[tuple[float, str, str]]:
    """Every stamp of every process under ``prefix``, in time order: (seconds, event, key)."""
    prefix = Path(prefix)
    stamps: list[tuple[float, str, str]] = []
    for path in prefix.parent.glob(prefix.name + ".*"):
        for line in path.read_text().splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3:
                stamps.append((float(parts[0]), parts[1], parts[2]))
    stamps.sort()
    return stamps


def phases(stamps: Sequence[tuple[float, str, str]], requests: Iterable[dict]) -> list[dict[str, float]]:
    """Per request (a result of ``vllm_http.stream`` with ``t0``, ``ttft`` and ``id``), the
    milliseconds of each of ``PHASES`` and its TTFT; a request whose stamps are not all found is
    left out. vLLM's ids: the response's ``id`` is the API request's prefix (``cmpl-X`` of
    ``cmpl-X-0``), the engine core's is the API's with a suffix: stamps are matched by prefix.
    Admission is tied to its request by the sampling params' identity, the register to its
    admission by the thread it ran on."""
    first: dict[str, dict[str, float]] = {}                  # request id -> event -> first time
    params_of: dict[str, str] = {}                           # API request id -> its params' id
    admissions: dict[str, list[tuple[float, float, float]]] = {}   # params id -> (begin, end, register s)
    open_admissions: dict[str, tuple[str, float, float]] = {}      # thread -> (params id, begin, register s)
    register_at: dict[str, float] = {}                             # thread -> a register's start
    for t, event, key in stamps:
        if event == "scheduled":
            for rid in key.split(","):
                first.setdefault(rid, {}).setdefault(event, t)
        elif event == "add_request":
            rid, _, pid = key.partition(" ")
            first.setdefault(rid, {}).setdefault(event, t)
            params_of[rid] = pid
        elif event == "admit":
            pid, _, th = key.partition(" ")
            open_admissions[th] = (pid, t, 0.0)
        elif event == "register":
            register_at[key] = t
        elif event == "registered" and key in register_at and key in open_admissions:
            pid, begun, reg = open_admissions[key]
            open_admissions[key] = (pid, begun, reg + t - register_at.pop(key))
        elif event == "admitted":
            pid, _, th = key.partition(" ")
            if th in open_admissions and open_admissions[th][0] == pid:
                _, begun, reg = open_admissions.pop(th)
                admissions.setdefault(pid, []).append((begun, t, reg))
        elif key:
            first.setdefault(key, {}).setdefault(event, t)
    keys = sorted(first)
    out = []
    for req in requests:
        rid, t0, ttft = req.get("id"), req.get("t0"), req.get("ttft")
        if not rid or t0 is None or ttft is None:
            continue
        at: dict[str, float] = {"sent": t0, "first chunk": t0 + ttft}
        api_id = None
        for key in _with_prefix(keys, rid):
            if key in params_of and api_id is None:
                api_id = key
            for event, t in first[key].items():
                at[event] = min(t, at.get(event, t))
        if api_id is None or not {"add_request", "engine_core", "scheduled", "first_output"} <= at.keys():
            continue
        # its admission: the first of its params' that began after its add_request
        mine = [a for a in admissions.get(params_of[api_id], ()) if at["add_request"] <= a[0] <= at["engine_core"]]
        at["admitted"] = mine[0][1] if mine else at["add_request"]
        row = {label: (1000 * (mine[0][2] if mine else 0.0) if start is None else 1000 * (at[end] - at[start]))
               for label, start, end in PHASES}
        row["TTFT"] = 1000 * ttft
        out.append(row)
    return out


def _with_prefix(keys: Sequence[str], prefix: str) -> list[str]:
    i = bisect.bisect_left(keys, prefix)
    found = []
    while i < len(keys) and keys[i].startswith(prefix):
        found.append(keys[i])
        i += 1
    return found


def summarize(rows: Sequence[dict[str, float]]) -> dict[str, Any]:
    """The p50 of each phase over the requests (ms), and how many requests had every stamp."""
    if not rows:
        return {"requests": 0}
    return {"requests": len(rows), **{k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}}
