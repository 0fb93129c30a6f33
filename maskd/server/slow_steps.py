"""Steps that took too long, told with where their time went.

A GPU worker waits on every step it sends, so a step over ``--slow-step`` (20 ms by default: a
forward pass) is logged at WARNING with its phases: waiting for the session's lock (another rank's
step), routing (admission, routing, readiness), consuming tokens, filling rows, answering (encoding
the reply), and beside them the CPU time of the step's thread and of the whole process (the grammar
engine fills rows on threads of its own) and the process's garbage collection in that span. A step
whose process had far less CPU than its wall time was off its core most of the time: another
process ran there, or the step waited for a lock (another rank's step on the session).

At most one line per second: the others are counted into the next line (and into
``maskd_slow_steps``), so a server that is slow for a while cannot flood its log.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

log = logging.getLogger("maskd.server.slow_steps")


class GcClock:
    """Seconds this process spent collecting garbage since it started counting (one per process:
    a collection stops every thread, whichever one triggered it)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self.seconds += time.perf_counter() - self._started
            self._started = 0.0


GC_CLOCK = GcClock()    # the process's one (the server's: nothing else imports this module)


class SlowSteps:
    """Logs the steps over ``threshold_s`` (see the module's docstring); ``count`` is every one seen."""

    def __init__(self, threshold_s: float, every_s: float = 1.0, counter: Any = None) -> None:
        self.threshold_s = threshold_s
        self.every_s = every_s
        self.counter = counter          # a Prometheus counter, incremented per slow step
        self.count = 0
        self.gc = GC_CLOCK
        self._unlogged = 0
        self._last_log = -float("inf")
        self._lock = threading.Lock()

    def start(self) -> tuple[float, float, float, float]:
        """What a step's timing starts from: (wall clock, this thread's CPU, the process's CPU, GC
        seconds)."""
        return time.perf_counter(), time.thread_time(), time.process_time(), self.gc.seconds

    def finish(self, start: tuple[float, float, float, float], marks: list[tuple[str, float]], entries: int) -> float:
        """The step's seconds; logged when over the threshold. ``marks``: (phase, wall clock at its
        end) in order; the time after the last mark is the answer's."""
        t0, thread0, process0, gc0 = start
        end = time.perf_counter()
        seconds = end - t0
        if seconds < self.threshold_s:
            return seconds
        thread_cpu, process_cpu = time.thread_time() - thread0, time.process_time() - process0
        collected = self.gc.seconds - gc0
        if self.counter is not None:
            self.counter.inc()
        with self._lock:
            self.count += 1
            if end - self._last_log < self.every_s:
                self._unlogged += 1
                return seconds
            more, self._unlogged, self._last_log = self._unlogged, 0, end
        phases, before = [], t0
        for name, at in [*marks, ("answer", end)]:
            phases.append(f"{name} {1e3 * (at - before):.1f}")
            before = at
        log.warning("slow step: %.1f ms for %d entries (%s ms); CPU: the step's thread %.1f ms, the process %.1f ms; "
                    "garbage collection %.1f ms%s%s", 1e3 * seconds, entries, ", ".join(phases), 1e3 * thread_cpu,
                    1e3 * process_cpu, 1e3 * collected,
                    "; the process was off its core most of the time (another process there, or a lock)"
                    if process_cpu < seconds / 2 else "",
                    f"; {more} more slow steps since the last line" if more else "")
        return seconds
