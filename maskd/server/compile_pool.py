"""Grammar compiles in worker processes: a crash or a runaway compile costs only that grammar.

A grammar engine is native code: a schema whose ``$ref`` chain is 1,500 levels deep overflows
llguidance's stack and takes the whole process down; a pathological grammar can compile for
minutes. So every compile runs first in a worker process (``python -m
maskd.server.compile_worker``, its own interpreter: no gRPC thread is forked, no ``__main__`` is
re-imported): the worker compiles the spec with the server's engine on a thread of
``COMPILE_STACK_BYTES`` and returns ``Engine.serialize`` of the result over a pipe.

* A worker that dies (a signal, a native crash) fails only that grammar: CompileCrashed.
* A compile past its time limit is stopped for real: the worker is killed and replaced
  (CompileTimeout; the grammar cache does not keep a timeout as a permanent failure). The limit
  is of the worker's CPU time (where /proc tells it), not of the wall clock: workers run at the
  priority the server's ``compile_nice`` names (19, the lowest, by default), so that a compile
  never takes the core from the step path, and a compile that waited for a busy core has not used
  its time. A wall-clock backstop
  (``wall_limit``) still ends one that never gets the core.
* The server then loads the serialized grammar (``Engine.deserialize``) on a compile thread whose
  stack is ``SERVER_STACK_BYTES``, four times the worker's, so what a worker survived the server
  survives too.

Pools are shared within a process by (backend, tokenizer, width, mode, nice) and live until it exits: several
servers in one process (tests, tools) start their workers once. Workers start with the first server
that uses them and load the engine at once, off the request path: at the process's priority (the
server serves only once they are warm), then at compile_nice; a worker that replaces another loads
at compile_nice.
"""
from __future__ import annotations

import atexit
import collections
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from maskd.server.engines import GrammarCompileError
from maskd.specs import GrammarSpec

log = logging.getLogger("maskd.server.compile_pool")
COMPILE_STACK_BYTES = 64 << 20     # a worker's compile thread
SERVER_STACK_BYTES = 256 << 20     # the server's compile threads (4x: what a worker survives, the server does)
ENGINE_LOAD_LIMIT_S = 300.0        # a worker loading an engine (at start, or the fallback's at its first spec)
_HEADER = struct.Struct("<I")
_MIN_WAIT_S = 0.02                 # the least a CPU-time check waits before it looks again
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def wall_limit(cpu_limit_s: float) -> float:
    """How long, by the wall clock, a request with ``cpu_limit_s`` of CPU time may take at most: the
    backstop for a worker that never gets a core (a machine saturated by work of higher priority)."""
    return 4 * cpu_limit_s + 60.0


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) the process ``pid`` has used; None where /proc does not tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return None


class CompileCrashed(GrammarCompileError):
    """The worker compiling the grammar died (a native crash, e.g. a stack overflow)."""


class CompileTimeout(GrammarCompileError):
    """The compile ran past its time limit; the worker was killed."""


def write_message(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """n bytes from a pipe; TimeoutError past the deadline, EOFError when the writer is gone."""
    chunks, left = [], n
    poller = select.poll()         # not select(): a server with many open files has descriptors past 1024
    poller.register(fd, select.POLLIN)
    while left:
        wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
        if not poller.poll(wait):
            raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Budget:
    """A request's time limit: ``limit_s`` of the worker's CPU time from now, looked at whenever the
    wall clock says it could be spent, and ``wall_limit(limit_s)`` of wall-clock time at most."""

    def __init__(self, pid: int, limit_s: float | None) -> None:
        self.pid, self.limit_s = pid, limit_s
        now = time.monotonic()
        self.cpu0 = cpu_seconds(pid)
        self.wall_deadline = None if limit_s is None else now + wall_limit(limit_s)
        self._check = None if limit_s is None else now + limit_s

    def next_check(self) -> float | None:
        return self._check

    def spent(self) -> bool:
        """Whether the limit is reached; if not, when to look again (the CPU time left, by the wall)."""
        assert self.limit_s is not None and self.wall_deadline is not None
        now = time.monotonic()
        if now >= self.wall_deadline:
            return True
        cpu = cpu_seconds(self.pid)
        if cpu is None or self.cpu0 is None:
            return True           # no CPU clock: the wall clock's limit
        left = self.limit_s - (cpu - self.cpu0)
        if left <= 0:
            return True
        self._check = min(self.wall_deadline, now + max(left, _MIN_WAIT_S))
        return False


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, key: tuple[str, str, int | None, str, int]) -> None:
        backend, tokenizer, width, json_schema_mode, nice = key
        cmd = [sys.executable, "-m", "maskd.server.compile_worker", backend, tokenizer, str(width or 0),
               str(COMPILE_STACK_BYTES), json_schema_mode, str(nice)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # A process group of its own (^C at a terminal does not reach it) in the server's session: where
        # the kernel groups tasks by session (sched_autogroup_enabled, on in most distributions'
        # kernels) a nice value counts only inside the session's group, so a worker in a session of its
        # own at nice 19 still took half of a core it shared with the server (a busy loop beside it:
        # 50 %; in the server's session: 1 %). In the server's group it yields to the step path, and
        # the group as a whole shares the machine with other sessions as before.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, process_group=0)
        self.ready = False

    def call(self, request: Any, timeout_s: float | None) -> Any:
        """The worker's answer (``send``, then ``receive``)."""
        return self.receive(self.send(request, timeout_s))

    def send(self, request: Any, timeout_s: float | None) -> _Budget:
        """Writes the request; returns its time limit: ``timeout_s`` of the worker's CPU time (the
        wall clock where /proc does not tell), with ``wall_limit`` of it as a backstop."""
        assert self.proc.stdin is not None
        write_message(self.proc.stdin, request)
        return _Budget(self.proc.pid, timeout_s)

    def receive(self, budget: _Budget) -> Any:
        """The answer to the request sent. While the worker loads an engine on the way
        ("loading" ... "loaded": the fallback's secondary engine, seconds on a busy machine) the
        request's clock stops and the load has ENGINE_LOAD_LIMIT_S; it starts again, from zero,
        after the load."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        limit_s = budget.limit_s
        while True:
            header = self._header(fd, budget)
            (size,) = _HEADER.unpack(header)
            message = pickle.loads(read_exact(fd, size, budget.wall_deadline))
            if message == ("loading", None):
                budget = _Budget(self.proc.pid, ENGINE_LOAD_LIMIT_S)
            elif message == ("loaded", None):
                budget = _Budget(self.proc.pid, limit_s)
            else:
                return message

    @staticmethod
    def _header(fd: int, budget: _Budget) -> bytes:
        """The next message's header; TimeoutError once the request has used its CPU time (or its
        wall-clock backstop) without one."""
        while True:
            try:
                return read_exact(fd, _HEADER.size, budget.next_check())
            except TimeoutError:
                if budget.spent():
                    raise

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait(10)

    def exit_status(self) -> str:
        """How the worker ended (it is killed if it still runs after a broken conversation)."""
        try:
            code = self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.kill()
            return "a broken pipe"
        if code < 0 and -code in signal.valid_signals():
            return f"signal {signal.Signals(-code).name}"
        return f"exit code {code}"


class CompilePool:
    def __init__(self, backend: str, tokenizer: str, logits_width: int | None, workers: int,
                 json_schema_mode: str = "strict", nice: int = 0) -> None:
        self.key = (backend, tokenizer, logits_width, json_schema_mode, nice)
        self.workers = workers
        self._idle: collections.deque[_Worker] = collections.deque()
        self._cond = threading.Condition()
        self._started = 0
        self._closed = False
        self._warm_error: str | None = None
        self.users = 0
        self.crashes = 0
        self.timeouts = 0
        # the first workers load at the process's priority: their server does not serve before they are
        # warm, and at compile_nice on a busy machine (a restart beside an engine using every core) a
        # 129k vocabulary's load took 46 s
        self._warmers = [threading.Thread(target=self._warm_one, args=(True,), daemon=True, name="maskd-compile-warm")
                         for _ in range(workers)]
        self._started = workers
        for t in self._warmers:
            t.start()

    def _warm_one(self, at_once: bool = False) -> None:
        """Starts a worker and waits for it to load the engine (seconds for a large vocabulary);
        ``at_once``: at the process's priority (before the server serves), else at compile_nice."""
        try:
            worker = _Worker(self.key)
            if worker.call(("warm", at_once), ENGINE_LOAD_LIMIT_S) != ("ok", None):
                raise RuntimeError("unexpected answer")
            worker.ready = True
            with self._cond:
                self._idle.append(worker)
                self._cond.notify()
        except Exception as exc:   # a worker that cannot load the engine: report it, start no more
            log.error("a compile worker cannot load the engine %s: %s", self.key, exc)
            with self._cond:
                self._started -= 1
                self._warm_error = f"{type(exc).__name__}: {exc}"
                self._cond.notify_all()

    def wait_warm(self, timeout_s: float) -> bool:
        """Waits until every worker has loaded the engine; False if that took longer than timeout_s."""
        for t in self._warmers:
            t.join(timeout_s)
        if self._warm_error and not self._idle:
            raise RuntimeError(f"compile workers cannot load the engine: {self._warm_error}")
        return all(not t.is_alive() for t in self._warmers)

    def compile(self, spec: GrammarSpec, timeout_s: float) -> bytes:
        """Serialized compiled grammar; GrammarCompileError (CompileCrashed, CompileTimeout) if not."""
        return self._ask(("compile", spec), timeout_s, f"a {spec.kind} grammar",
                         f"grammar compile exceeded the {timeout_s:g} s limit (stopped)",
                         "the grammar crashed its compile worker ({how}): it is nested or chained too deeply, "
                         "or too large, for this server")

    def compile_many(self, specs: list[GrammarSpec], timeout_s: float, wait: bool = True) -> PendingCompiles | None:
        """Sends the specs to the compile workers and returns at once; ``results()`` of what it
        returns waits for each spec's serialized grammar or its error, in order (the caller does
        its own part meanwhile: a tool-call array's router is built while the workers compile its
        new pieces). The specs are split over the idle workers, one batch each (at least one: it
        waits for one where none is idle, and never holds one while it waits for another). A
        batch its worker does not survive (CompileCrashed) or finish in ``timeout_s`` per spec
        (CompileTimeout) gives that error for each of its specs: compile them one at a time to
        find the one at fault. A batch has one compile's time limit: pieces compile in
        milliseconds, a limit is for the one that does not. With ``wait`` False: None where no
        worker is idle."""
        if not specs:
            return PendingCompiles(self, [], [], timeout_s)
        first = self._take() if wait else self._take_idle()
        if first is None:
            return None
        workers = [first]
        while len(workers) < min(self.workers, len(specs)):
            more = self._take_idle()
            if more is None:
                break
            workers.append(more)
        n = len(workers)
        chunks = [specs[i::n] for i in range(n)]
        sent = [self._send(w, ("compile_many", chunk), timeout_s) for w, chunk in zip(workers, chunks)]
        return PendingCompiles(self, chunks, sent, timeout_s)

    def _send(self, worker: _Worker, request: tuple[str, Any], timeout_s: float) -> tuple[_Worker, Any]:
        """(the worker, its request's budget, or the error that writing the request raised)."""
        try:
            return worker, worker.send(request, timeout_s)
        except (OSError, ValueError) as exc:      # the worker is gone: answered as a crash
            return worker, exc

    def _ask(self, request: tuple[str, Any], timeout_s: float, what: str, timed_out: str, crashed: str) -> Any:
        """One request to an idle worker: its answer (``_answer``)."""
        return self._answer(self._send(self._take(), request, timeout_s), what, timed_out, crashed)

    def _answer(self, sent: tuple[_Worker, Any], what: str, timed_out: str, crashed: str) -> Any:
        """A sent request's answer, the worker given back; or the worker killed (a timeout) or
        replaced (a crash) and CompileTimeout / CompileCrashed raised (``crashed`` is formatted
        with how)."""
        worker, budget = sent
        try:
            if isinstance(budget, Exception):
                raise budget
            kind, value = worker.receive(budget)
        except TimeoutError:
            self.timeouts += 1
            worker.kill()
            self._replace(worker)
            raise CompileTimeout(timed_out) from None
        except (EOFError, OSError, pickle.UnpicklingError, ValueError, struct.error):
            how = worker.exit_status()
            self.crashes += 1
            log.warning("a compile worker died (%s) on %s", how, what)
            self._replace(worker)
            raise CompileCrashed(crashed.format(how=how)) from None
        self._give_back(worker)
        if kind == "error":
            raise GrammarCompileError(value)
        return value

    def _take_idle(self) -> _Worker | None:
        """An idle worker, or None where none is idle now."""
        with self._cond:
            return self._idle.popleft() if self._idle and not self._closed else None

    def _take(self) -> _Worker:
        with self._cond:
            while not self._idle:
                if self._closed:
                    raise GrammarCompileError("the server is shutting down")
                if self._started == 0:
                    raise GrammarCompileError(f"no compile worker can run: {self._warm_error}")
                self._cond.wait()
            return self._idle.popleft()

    def _give_back(self, worker: _Worker) -> None:
        with self._cond:
            if self._closed:
                worker.kill()
                return
            self._idle.append(worker)
            self._cond.notify()

    def _replace(self, dead: _Worker) -> None:
        """A killed or crashed worker: start another one in the background."""
        with self._cond:
            self._started -= 1
            if self._closed:
                return
            self._started += 1
        t = threading.Thread(target=self._warm_one, daemon=True, name="maskd-compile-warm")
        t.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle = list(self._idle)
            self._idle.clear()
            self._cond.notify_all()
        for worker in idle:
            worker.kill()


class PendingCompiles:
    """Batches of specs sent to compile workers, answered by ``results()`` (called once: it gives
    each worker back, or replaces it)."""

    def __init__(self, pool: CompilePool, chunks: list[list[GrammarSpec]], sent: list[tuple[_Worker, Any]],
                 timeout_s: float) -> None:
        self.pool, self.chunks, self.sent, self.timeout_s = pool, chunks, sent, timeout_s

    def results(self) -> list[bytes | GrammarCompileError]:
        """Each spec's serialized grammar or its error, in the order they were given."""
        n = len(self.chunks)
        out: list[Any] = [None] * sum(len(c) for c in self.chunks)
        for i, (chunk, sent) in enumerate(zip(self.chunks, self.sent)):
            try:
                answer: Any = self.pool._answer(
                    sent, f"a batch of {len(chunk)} grammars",
                    f"a batch of {len(chunk)} grammars exceeded {self.timeout_s:g} s (stopped)",
                    "a batch of grammars crashed its compile worker ({how})")
            except GrammarCompileError as exc:
                answer = [exc] * len(chunk)
            for k, result in enumerate(answer):
                if isinstance(result, tuple):
                    kind, value = result
                    result = value if kind == "ok" else GrammarCompileError(value)
                out[i + k * n] = result
        return out


_POOLS: dict[tuple, CompilePool] = {}
_POOLS_LOCK = threading.Lock()


def acquire(backend: str, tokenizer: str, logits_width: int | None, workers: int,
            json_schema_mode: str = "strict", nice: int = 0) -> CompilePool:
    """The process's pool for this engine configuration and worker priority (started on first use; a
    larger one replaces a smaller one that nobody uses)."""
    key = (backend, tokenizer, logits_width, json_schema_mode, nice)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or (pool.workers < workers and pool.users == 0):
            if pool is not None:
                pool.close()
            pool = _POOLS[key] = CompilePool(backend, tokenizer, logits_width, workers, json_schema_mode, nice)
        pool.users += 1
        return pool


def release(pool: CompilePool) -> None:
    """A server is done with its pool (the workers stay for the next server in this process)."""
    with _POOLS_LOCK:
        pool.users -= 1


@atexit.register
def _close_all() -> None:
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()
