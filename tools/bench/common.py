"""What the bench modes share: MaskBench data, statistics, servers, output files, machine info."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

import maskd
from maskd_tools.progress import bar

REPO_ROOT = pathlib.Path(maskd.__file__).resolve().parents[1]
DEFAULT_MASKBENCH = (REPO_ROOT / ".." / "shared" / "maskbench-dev").resolve()
SAMPLE_DIR = pathlib.Path(__file__).resolve().parents[1] / "samples" / "maskbench"

PERCENTILES = (25, 50, 75, 90, 95, 99, 99.9, 100)


def default_data_dir() -> pathlib.Path:
    """../shared/maskbench-dev next to the repository when it exists, else the built-in sample."""
    return DEFAULT_MASKBENCH if DEFAULT_MASKBENCH.is_dir() else SAMPLE_DIR


# -- data ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Schema:
    name: str                      # MaskBench file name
    schema: Any                    # the JSON schema (parsed)
    text: str                      # canonical JSON text, as maskd's GrammarSpec keeps it
    instances: list[list[int]]     # token streams of the valid test instances
    invalid: list[list[int]] = dataclasses.field(default_factory=list)   # ... of the invalid ones

    @property
    def spec(self) -> dict:
        return {"json_schema": self.schema}


@dataclasses.dataclass
class Instance:
    """One valid MaskBench instance to replay: its schema, its tokens, and the spec as sent (the
    bench modes build the message up front; None in ``maskd_tools.replay``, which opens with
    ``schema.spec``)."""
    schema: Schema
    tokens: list[int]
    spec_pb: Any = None


def instance_pool(schemas: Sequence[Schema], errors: Iterable[str], seed: int | None, what: str,
                  specs: dict[str, Any] | None = None) -> list[Instance]:
    """Every valid instance of the schemas that compiled (not in ``errors``), shuffled with
    ``seed``; ``specs``: the spec messages by file name (built from each schema otherwise)."""
    import random

    from maskd.specs import GrammarSpec

    failed = set(errors)
    pool = [Instance(s, toks, specs[s.name] if specs else GrammarSpec.from_dict(s.spec).to_proto())
            for s in schemas if s.name not in failed for toks in s.instances if toks]
    random.Random(seed).shuffle(pool)
    if not pool:
        raise SystemExit(f"maskd bench {what}: no valid instance whose schema compiles")
    return pool


def spread(items: Sequence, limit: int | None) -> list:
    """``limit`` items evenly spaced over ``items`` (all of them when limit is None or >= len)."""
    items = list(items)
    if limit is None or limit >= len(items):
        return items
    if limit <= 0:
        return []
    idx = np.unique(np.linspace(0, len(items) - 1, limit).round().astype(int))
    return [items[i] for i in idx]


def load_schemas(data_dir: str | os.PathLike, tokenizer, limit: int | None = None) -> list[Schema]:
    """MaskBench files of ``data_dir`` (``limit`` of them, evenly spaced over the sorted names),
    each with its valid instances tokenized from ``json.dumps(data, ensure_ascii=False)``."""
    from maskd.specs import GrammarSpec
    from maskd_tools.conformance import load_suite

    out = []
    for name, schema, tests in bar(spread(load_suite(data_dir), limit), desc="tokenize", unit="file"):
        text = GrammarSpec.from_dict({"json_schema": schema}).text
        streams = [tokenizer.encode(json.dumps(t["data"], ensure_ascii=False)) for t in tests if t.get("valid")]
        invalid = [tokenizer.encode(json.dumps(t["data"], ensure_ascii=False)) for t in tests if not t.get("valid")]
        out.append(Schema(name, schema, text, streams, invalid))
    return out


def allowed(bitmask: np.ndarray, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Whether tokens[k] is allowed by bitmask row rows[k] (int32 word layout)."""
    rows = np.asarray(rows, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(rows) == 0:
        return np.zeros(0, dtype=bool)
    words = bitmask[rows, tokens >> 5].astype(np.int64)
    return ((words >> (tokens & 31)) & 1).astype(bool)


# -- statistics ------------------------------------------------------------------------------
def _pkey(p: float) -> str:
    return "p" + (f"{p:g}".replace(".", "_"))


def summarize(values: Iterable[float], scale: float = 1e3, digits: int = 4) -> dict:
    """n, mean and p25 .. p100 of ``values`` (seconds), scaled (default: to milliseconds)."""
    a = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    a = a * scale
    out = {"n": int(a.size), "mean": round(float(a.mean()), digits)}
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        out[_pkey(p)] = round(float(v), digits)
    return out


def cdf_xy(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    a = np.sort(np.asarray(values, dtype=np.float64))
    return a, np.arange(1, len(a) + 1) / max(1, len(a))


# -- machine ---------------------------------------------------------------------------------
def machine_info() -> dict:
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "maskd": maskd.__version__,
    }
    try:
        # Other work on the machine skews timings: recorded so a reader can tell.
        info["load_average_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        import psutil
        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # pragma: no cover
        pass
    from importlib import metadata
    for dist in ("llguidance", "xgrammar", "grpcio", "protobuf", "numpy", "torch"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
        if rev.returncode == 0:
            info["git_commit"] = rev.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    # The step path's sources as they were for this run (the working tree may differ from the commit).
    import hashlib
    info["step_path_sources_sha256"] = {
        f: hashlib.sha256((REPO_ROOT / f).read_bytes()).hexdigest()[:12]
        for f in STEP_PATH_SOURCES if (REPO_ROOT / f).is_file()}
    return info


STEP_PATH_SOURCES = ("maskd/server/session.py", "maskd/server/service.py", "maskd/rowcodec.py",
                     "maskd/server/engines/llguidance_engine.py", "client/core.py", "client/stream.py")


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line(info: dict) -> str:
    mem = f", {info['memory_gib']} GiB" if "memory_gib" in info else ""
    load = info.get("load_average_1_5_15")
    load = f", load average {load[0]} at the end" if load else ""
    return (f"{info.get('cpu_model', '?')}, {info.get('logical_cpus', '?')} logical CPUs{mem}{load}; "
            f"Python {info.get('python')}, llguidance {info.get('llguidance', '-')}, "
            f"xgrammar {info.get('xgrammar', '-')}; {info.get('date_utc')}")


# -- servers ---------------------------------------------------------------------------------
class ServerHandle:
    """A maskd server to bench against: embedded (this process), a subprocess, or remote."""

    def __init__(self, address: str, kind: str, *, server=None, proc: subprocess.Popen | None = None,
                 log_path: pathlib.Path | None = None, metrics_url: str | None = None) -> None:
        self.address = address
        self.kind = kind
        self.metrics_url = metrics_url      # its Prometheus /metrics (a subprocess started with metrics)
        self._server = server
        self._proc = proc
        self.log_path = log_path

    @property
    def pid(self) -> int | None:
        if self._proc is not None:
            return self._proc.pid
        return os.getpid() if self._server is not None else None

    @property
    def server(self):
        """The embedded MaskServer (None for a subprocess or a remote server)."""
        return self._server

    @property
    def service(self):
        return self._server.service if self._server is not None else None

    def rss_bytes(self) -> int | None:
        if self.pid is None:
            return None
        import psutil
        return psutil.Process(self.pid).memory_info().rss

    def close(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0)
            self._server = None
        if self._proc is not None:
            proc, self._proc = self._proc, None
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The hot-path benchmarks compare the server's rows with in-process llguidance on the schemas both
# build as they are: their servers run strict JSON-schema mode (complete mode is measured by
# `maskd conformance` and `maskd bench engines --engines ...,maskd-complete`).
HOT_PATH_JSON_SCHEMA_MODE = "strict"


def llguidance_grammar(schema_text: str) -> str:
    """The llguidance grammar a server builds for a plain json_schema spec (the default whitespace
    bound included), for in-process replays that must give the server's rows."""
    import llguidance

    from maskd.server.engines.llguidance_engine import whitespace_pattern
    from maskd.specs import DEFAULT_MAX_WHITESPACE

    return llguidance.LLMatcher.grammar_from_json_schema(
        schema_text, overrides={"whitespace_pattern": whitespace_pattern(DEFAULT_MAX_WHITESPACE)})


def embedded_server(tokenizer: str, threads: int) -> ServerHandle:
    """A MaskServer on a free loopback port in this process (real gRPC)."""
    from maskd.server import MaskServer, ServerConfig

    server = MaskServer(ServerConfig(port=0, tokenizer=tokenizer, threads=threads,
                                     json_schema_mode=HOT_PATH_JSON_SCHEMA_MODE)).start()
    return ServerHandle(server.address, "embedded", server=server)


# -- placement: the server on its own cores, the worker on the rest ---------------------------
@dataclasses.dataclass(frozen=True)
class Placement:
    """``--pin S+W``: the first S CPUs this process may use go to the server process (every thread,
    compile workers included), the next W to the simulated worker (this process: the client, the
    in-process baselines)."""

    server_cpus: tuple[int, ...]
    worker_cpus: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> Placement:
        try:
            s, w = (int(x) for x in str(text).split("+"))
        except ValueError:
            raise ValueError(f"--pin takes SERVER+WORKER core counts such as 1+1, not {text!r}") from None
        cpus = sorted(os.sched_getaffinity(0))
        if s < 1 or w < 1 or s + w > len(cpus):
            raise ValueError(f"--pin {text}: needs {s}+{w} cores, this process may use {len(cpus)} ({cpus})")
        return cls(tuple(cpus[:s]), tuple(cpus[s:s + w]))

    def as_dict(self) -> dict:
        return {"server_cpus": list(self.server_cpus), "worker_cpus": list(self.worker_cpus)}

    def describe(self) -> str:
        return f"server on CPUs {list(self.server_cpus)}, worker on CPUs {list(self.worker_cpus)}"


def placement_from(args) -> Placement | None:
    """The run's Placement from ``--pin`` (None: not pinned, or the server is a --target elsewhere)."""
    pin = getattr(args, "pin", None)
    if not pin or str(pin).lower() == "none" or getattr(args, "target", None):
        return None
    return Placement.parse(pin)


def pin_process(pid: int, cpus: Sequence[int]) -> None:
    """Sets the CPU affinity of every thread of ``pid`` (threads started later inherit it from
    the thread that starts them)."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")] if os.path.isdir(f"/proc/{pid}/task") else [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass   # a thread that ended meanwhile


class pinned_here:
    """``with pinned_here(cpus):`` this process's threads on ``cpus``; the previous affinity after."""

    def __init__(self, cpus: Sequence[int] | None) -> None:
        self.cpus = tuple(cpus) if cpus else None
        self._before: set[int] | None = None

    def __enter__(self) -> pinned_here:
        if self.cpus:
            self._before = os.sched_getaffinity(0)
            pin_process(os.getpid(), self.cpus)
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            pin_process(os.getpid(), sorted(self._before))


def subprocess_server(tokenizer: str, threads: int, *, log_path: str | os.PathLike | None = None,
                      timeout_s: float = 180.0, cpus: Sequence[int] | None = None,
                      json_schema_mode: str = HOT_PATH_JSON_SCHEMA_MODE, metrics: bool = False) -> ServerHandle:
    """``maskd serve --port 0`` in a child process; returns once it prints its address. With
    ``cpus``, the child runs on those CPUs only (set before it starts its threads, and again on
    every thread once it serves). With ``metrics``, its Prometheus endpoint on a free port too
    (``metrics_url``)."""
    cmd = [sys.executable, "-m", "maskd.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--tokenizer", tokenizer, "--threads", str(threads), "--json-schema-mode", json_schema_mode,
           *(("--metrics-port", "0") if metrics else ())]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    log_path = pathlib.Path(log_path) if log_path else None
    stderr = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - child owns it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO_ROOT)
    if log_path:
        stderr.close()
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("maskd serving on "):
                address = line.split("maskd serving on ", 1)[1].split(",", 1)[0].strip()
                where = line.split(", metrics on ", 1)[1].strip() if ", metrics on " in line else None
                if cpus:
                    pin_process(proc.pid, cpus)
                return ServerHandle(address, "subprocess", proc=proc, log_path=log_path,
                                    metrics_url=f"http://{where}" if where else None)
    proc.kill()
    proc.wait(5)
    tail = log_path.read_text()[-2000:] if log_path and log_path.exists() else line
    raise RuntimeError(f"maskd serve did not start within {timeout_s:g} s: {tail}")


def remote_server(target: str) -> ServerHandle:
    return ServerHandle(target, "remote")


def open_server(kind: str, tokenizer: str, threads: int, target: str | None = None,
                log_path: str | os.PathLike | None = None, cpus: Sequence[int] | None = None) -> ServerHandle:
    if target:
        return remote_server(target)
    if kind == "subprocess" or cpus:
        return subprocess_server(tokenizer, threads, log_path=log_path, cpus=cpus)
    return embedded_server(tokenizer, threads)


def register_all(mc, schemas: Sequence[Schema], threads: int = 4) -> dict[str, str]:
    """Registers every schema (waiting for the compile); returns {file name: error} of failures."""
    import concurrent.futures

    from maskd_client import MaskClientError

    def one(s: Schema):
        try:
            mc.register(s.spec, wait=True)
            return s.name, None
        except MaskClientError as exc:
            return s.name, str(exc)

    errors = {}
    with concurrent.futures.ThreadPoolExecutor(threads) as pool, \
            bar(total=len(schemas), desc="compile", unit="schema") as compiling:
        for name, err in pool.map(one, schemas):
            compiling.update(1)
            if err is not None:
                errors[name] = err
    return errors


class InProcessEngine:
    """llguidance in this process, as a serving engine embeds it: one ``LLMatcher`` per batch slot,
    a deep copy of a per-schema template on open, one ``LLExecutor`` fill of the whole batch into
    ``bm`` (int32 words, a row per slot). The baseline of ``bench serve`` and ``bench e2e``."""

    def __init__(self, tok, threads: int, batch: int) -> None:
        import llguidance

        self.ll = tok.ll
        self.llg = llguidance
        self.executor = llguidance.LLExecutor(num_threads=max(1, threads))
        self.templates: dict[str, Any] = {}
        self.matchers: list = [None] * batch
        self.bm = np.zeros((batch, (tok.logits_width + 31) // 32), dtype=np.int32)

    def template(self, schema: Schema):
        """The schema's matcher template, compiled once (the server's grammar, whitespace bound included)."""
        t = self.templates.get(schema.name)
        if t is None:
            t = self.templates[schema.name] = self.llg.LLMatcher(self.ll, llguidance_grammar(schema.text),
                                                                 log_level=0)
        return t

    def open(self, i: int, schema: Schema) -> None:
        self.matchers[i] = self.template(schema).deep_copy()

    def consume(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Each (slot, token): the token consumed by that slot's matcher."""
        for i, t in pairs:
            self.matchers[i].consume_token(t)

    def fill(self) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(self.matchers)],
                                              self.bm.ctypes.data, self.bm.shape[1] * 4, self.bm.shape[0])


class Materializer:
    """Rows -> int32 torch tensor the way a GPU worker does it (maskd_client's BitmaskBuffers:
    a preallocated host buffer, then the device; on this CPU-only box the host view). Without
    torch, a copy into a preallocated numpy buffer."""

    def __init__(self, max_rows: int, words: int) -> None:
        self.kind = "numpy"
        self._buffers = None
        try:
            from maskd_client.apply import BitmaskBuffers
            self._buffers = BitmaskBuffers(max(1, max_rows), words, device="cpu")
            self.kind = "torch (maskd_client.BitmaskBuffers, cpu)"
        except Exception:
            self._np = np.empty((max(1, max_rows), words), dtype=np.int32)

    def out(self, max_rows: int) -> np.ndarray | None:
        """Where the next step's rows may be decoded (MaskClient.step_async's ``out``): the host
        buffer the next materialization uploads from, so that it needs no copy."""
        return self._buffers.host_rows(max_rows) if self._buffers is not None else None

    def __call__(self, bitmask: np.ndarray) -> np.ndarray:
        """Materializes; returns a numpy view of the materialized rows (for the token checks)."""
        if self._buffers is not None:
            return self._buffers.upload(bitmask).numpy()
        n = bitmask.shape[0]
        if n > self._np.shape[0]:
            self._np = np.empty((n, bitmask.shape[1]), dtype=np.int32)
        self._np[:n] = bitmask
        return self._np[:n]


# -- output ----------------------------------------------------------------------------------
class Output:
    """The output folder of one mode: <mode>.json, <mode>.md and PNGs; optionally --json OUT."""

    def __init__(self, out_dir: str | os.PathLike, mode: str, json_path: str | os.PathLike | None = None) -> None:
        self.dir = pathlib.Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mode = mode
        self.json_path = pathlib.Path(json_path) if json_path else None
        self.files: list[str] = []

    def path(self, name: str) -> pathlib.Path:
        p = self.dir / name
        self.files.append(str(p))
        return p

    def write(self, report: dict, markdown: str) -> None:
        report["files"] = sorted(set(self.files + [str(self.dir / f"{self.mode}.json"),
                                                   str(self.dir / f"{self.mode}.md")]))
        text = json.dumps(report, indent=2, default=_json_default)
        (self.dir / f"{self.mode}.json").write_text(text + "\n")
        (self.dir / f"{self.mode}.md").write_text(markdown)
        if self.json_path is not None:
            self.json_path.parent.mkdir(parents=True, exist_ok=True)
            self.json_path.write_text(text + "\n")


def args_dict(args, **over) -> dict:
    """A mode's parsed arguments (plus the sizes it settled on) as JSON-ready values."""
    d = {k: v for k, v in vars(args).items() if k != "func" and not callable(v)}
    d.update(over)
    return {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in d.items()}


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, pathlib.Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def positive_list(text: str, kind: type, flag: str, prog: str) -> list:
    """A comma-separated flag of positive numbers (``--batch-sizes 64,256``); anything else ends the
    run with a message that names the flag."""
    try:
        values = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"{prog}: {flag} takes comma-separated positive numbers, not {text!r}")
    return values


def targets_markdown(targets: dict | None) -> list[str]:
    """A report's targets as markdown lines: met or NOT met, with the figures behind each."""
    if not targets:
        return []
    lines = ["\n## Targets\n"]
    for k, v in targets.items():
        facts = ", ".join(f"{a}={b}" for a, b in v.items() if a != "met")
        lines.append(f"- `{k}`: {'met' if v['met'] else 'NOT met'} ({facts})")
    return lines + [""]


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported only when plotting)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def command_line() -> str:
    args = sys.argv[1:]
    prog = "maskd" if sys.argv and sys.argv[0].endswith("maskd") else pathlib.Path(sys.argv[0]).name
    return " ".join([prog] + args)
