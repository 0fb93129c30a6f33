"""The `maskd` command as a person meets it, through real processes: it fails fast and says why
(an unreachable target, an empty data folder, a busy port, an unknown tokenizer), names what
failed in its summaries, draws progress bars only on a terminal, and dispatches to the development
tools (maskd-tools, a distribution of their own) where they are installed and says what to install
where they are not."""
import fcntl
import http.server
import json
import os
import pathlib
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

import maskd
from maskd_tools.conformance import SAMPLE_DIR, errors_by_reason, reason_of


def _maskd(*args, env=None, timeout=180, **kw):
    return subprocess.run([sys.executable, "-m", "maskd.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, **kw)


def _closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _write_suite(folder, cases: dict) -> None:
    folder.mkdir(exist_ok=True)
    for name, (schema, tests) in cases.items():
        (folder / name).write_text(json.dumps({"schema": schema, "tests": tests}))


def test_version():
    proc = _maskd("--version", timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"maskd {maskd.__version__}"


# -- the development tools: dispatched to where installed, what to install where not ------------------
TOOL_COMMANDS = ("conformance", "demo", "tiny-model", "real-model", "bench", "soak", "chaos")
TOOLS_MISSING = ("needs the maskd-tools package, which is not installed here: pip install ./tools from a "
                 "checkout of the maskd repository (make setup installs it into .venv); the runtime package and "
                 "the image do not ship maskd's development tools")


def _maskd_after(preamble: str, *args):
    """The `maskd` command in a process that first runs ``preamble`` (which breaks imports)."""
    return subprocess.run([sys.executable, "-c", f"{preamble}\nfrom maskd.cli import main\nsys.exit(main())", *args],
                          capture_output=True, text=True, timeout=120)


def _maskd_without(blocked: tuple[str, ...], *args):
    """The `maskd` command where these modules cannot be imported (as where they are not installed)."""
    return _maskd_after(f"import sys\nfor name in {blocked!r}: sys.modules[name] = None", *args)


def test_the_tools_dispatch_where_installed():
    script = pathlib.Path(sys.executable).with_name("maskd")   # the console script `make setup` installs
    bench = subprocess.run([str(script), "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert bench.returncode == 0 and bench.stdout.startswith("usage: maskd bench"), bench.stderr
    listing = _maskd("--help", timeout=120)
    assert listing.returncode == 0 and "not installed" not in listing.stdout
    assert all(f"    {command}" in listing.stdout for command in TOOL_COMMANDS)


@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "e2e", "--quick"], ["demo"],
                                  ["chaos", "--minutes", "1"]])
def test_without_the_tools_their_commands_say_what_to_install(argv):
    proc = _maskd_without(("maskd_tools",), *argv)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"maskd {argv[0]} {TOOLS_MISSING}\n"


def test_without_the_tools_the_runtime_commands_work_and_the_tools_are_listed_as_missing():
    listing = _maskd_without(("maskd_tools",), "--help")
    assert listing.returncode == 0, listing.stderr
    for command in TOOL_COMMANDS:
        assert re.search(rf"    {command}\s+\(not installed here: needs the maskd-tools package\)", listing.stdout), \
            listing.stdout
    serve = _maskd_without(("maskd_tools",), "serve", "--help")
    assert serve.returncode == 0 and "--port" in serve.stdout
    typo = _maskd_without(("maskd_tools",), "serve", "--no-such-flag")   # other commands still refuse unknown flags
    assert typo.returncode == 2 and "unrecognized arguments: --no-such-flag" in typo.stderr


BROKEN_BENCH = """import sys
class Broken:
    def find_spec(self, name, path=None, target=None):
        if name == "maskd_tools.bench.cli":
            raise ImportError("cannot import name 'gone' from 'maskd_tools.bench.common'")
sys.meta_path.insert(0, Broken())"""


def test_a_tool_that_is_installed_but_does_not_load_says_so():
    proc = _maskd_after(BROKEN_BENCH, "bench", "--help")
    assert proc.returncode == 1
    assert proc.stderr.startswith("maskd bench cannot be loaded (cannot import name 'gone' from "
                                  "'maskd_tools.bench.common'): pip install ./tools"), proc.stderr
    listing = _maskd_after(BROKEN_BENCH, "--help")
    assert re.search(r"    bench\s+\(cannot be loaded here\)", listing.stdout), listing.stdout
    assert "not installed" not in listing.stdout   # the other tools load


def test_a_tool_whose_dependency_is_missing_names_it():
    proc = _maskd_without(("tqdm",), "conformance", "--embedded")
    assert proc.returncode == 1
    assert proc.stderr.startswith("maskd conformance needs tqdm, which is not installed here (the maskd-tools "
                                  "package brings it): pip install ./tools"), proc.stderr


# -- unreachable targets: a short connect deadline, the reason, a non-zero exit ---------------------
@pytest.mark.parametrize("argv", [
    ["conformance", "--connect-timeout", "2", "--target"],
    ["bench", "wire", "--quick", "--connect-timeout", "2", "--data", str(SAMPLE_DIR), "--target"],
    ["health", "--timeout", "2", "--target"],
])
def test_unreachable_target_fails_fast_with_the_reason(argv):
    port = _closed_port()
    proc = _maskd(*argv, f"127.0.0.1:{port}", timeout=90)   # before: conformance waited up to 600 s
    assert proc.returncode != 0
    assert f"maskd at 127.0.0.1:{port} is unreachable: nothing answered within 2 s" in proc.stderr, proc.stderr
    assert "refused" in proc.stderr.lower(), proc.stderr


def test_cluster_status_on_an_unreachable_directory_says_so():
    port = _closed_port()
    proc = _maskd("cluster", "status", "--directory", f"127.0.0.1:{port}", "--timeout", "2", timeout=90)
    assert proc.returncode != 0
    assert f"no maskd directory at 127.0.0.1:{port}" in proc.stderr and "refused" in proc.stderr.lower()
    assert "Ray" not in proc.stderr, proc.stderr   # before: it talked about a missing local Ray


def test_health_of_a_serving_and_a_draining_server():
    from maskd.server import MaskServer, ServerConfig

    server = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1)).start()
    try:
        ok = _maskd("health", "--target", server.address, "--service", "maskd.v1.MaskService", timeout=60)
        assert ok.returncode == 0 and ok.stdout.strip() == f"{server.address} SERVING"
        missing = _maskd("health", "--target", server.address, "--service", "no.such.Service", timeout=60)
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    finally:
        server.stop(grace=0.1)


# -- bad data -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["conformance", "--embedded"], ["conformance", "--in-process"],
                                  ["bench", "serve", "--quick"], ["bench", "engines", "--quick"]])
def test_an_empty_data_folder_is_an_error(tmp_path, argv):
    proc = _maskd(*argv, "--data", str(tmp_path), timeout=120)
    assert proc.returncode != 0 and f"no MaskBench files (*.json) in {tmp_path}" in proc.stderr, proc.stderr


def test_files_without_test_instances_are_an_error(tmp_path):
    _write_suite(tmp_path, {"a.json": ({"type": "integer"}, []), "b.json": ({"type": "string"}, [])})
    proc = _maskd("conformance", "--in-process", "--tokenizer", "cl100k", "--data", str(tmp_path))
    assert proc.returncode != 0 and "hold no test instances" in proc.stderr, proc.stderr


# -- busy ports, named -------------------------------------------------------------------------------
def test_busy_grpc_port_is_named(busy_port):
    proc = _maskd("serve", "--port", str(busy_port), "--tokenizer", "cl100k")
    assert proc.returncode != 0
    assert f"cannot bind the gRPC port 127.0.0.1:{busy_port}: Address already in use" in proc.stderr, proc.stderr


def test_busy_metrics_port_is_named(busy_port):
    proc = _maskd("serve", "--port", "0", "--metrics-port", str(busy_port), "--tokenizer", "cl100k")
    assert proc.returncode != 0
    assert f"cannot bind the metrics port 127.0.0.1:{busy_port}" in proc.stderr, proc.stderr


# -- unknown tokenizers: no hub unless asked ----------------------------------------------------------
class _Hub:
    """A stand-in Hugging Face endpoint on loopback that records every request (and has no models)."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                hub.requests.append(self.path)
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = _answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub_env(tmp_path):
    hub = _Hub()
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    yield hub, env
    hub.close()


def test_unknown_tokenizer_fails_without_asking_the_hub(hub_env):
    hub, env = hub_env
    proc = _maskd("serve", "--port", "0", "--tokenizer", "deepseek-v5", env=env)
    assert proc.returncode != 0
    assert "unknown tokenizer 'deepseek-v5' (did you mean 'deepseek-v4'?)" in proc.stderr, proc.stderr
    assert "--allow-hub-download" in proc.stderr
    assert hub.requests == [], f"the server asked the hub: {hub.requests}"


def test_allow_hub_download_asks_the_hub(hub_env):
    hub, env = hub_env
    proc = _maskd("serve", "--port", "0", "--tokenizer", "no-such-org/no-such-model", "--allow-hub-download",
                  env=env)
    assert proc.returncode != 0 and "unknown tokenizer 'no-such-org/no-such-model'" in proc.stderr
    assert any("no-such-org/no-such-model" in path for path in hub.requests), hub.requests


def test_conformance_refuses_an_unknown_tokenizer_before_connecting(hub_env):
    hub, env = hub_env
    proc = _maskd("conformance", "--target", f"127.0.0.1:{_closed_port()}", "--tokenizer", "qwen9", env=env)
    assert proc.returncode != 0 and "unknown tokenizer 'qwen9'" in proc.stderr and "unreachable" not in proc.stderr
    assert hub.requests == []


# -- summaries that name what failed and why -----------------------------------------------------------
def test_compile_errors_are_grouped_by_reason(tmp_path):
    one = [{"valid": True, "data": "abc"}]
    _write_suite(tmp_path, {
        "ahead.json": ({"type": "string", "pattern": "^(?=a)abc$"}, one),
        "behind.json": ({"type": "string", "pattern": "^(?<=a)bc$"}, one),
        "ahead2.json": ({"type": "string", "pattern": "^(?!b)abc$"}, one),
        "semver.json": ({"type": "string", "format": "semver"}, one),
        "fine.json": ({"type": "string", "pattern": "^abc$"}, one + [{"valid": False, "data": "abd"}]),
    })
    out = tmp_path / "report.json"
    # strict: complete mode would compile these relaxed and leave the lookarounds to the validator
    proc = _maskd("conformance", "--embedded", "--tokenizer", "cl100k", "--json-schema-mode", "strict",
                  "--data", str(tmp_path), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "compile errors: 4 schemas, 2 reasons" in lines
    look = next(ln for ln in lines if "look-around" in ln)
    assert look.strip().startswith("3 x regex parse error") and "ahead.json, ahead2.json, behind.json" in look
    assert any(ln.strip() == "1 x Unknown format: semver: semver.json" for ln in lines), lines
    groups = json.loads(out.read_text())["compile_errors_by_reason"]
    assert [(g["count"], g["files"]) for g in groups] == [(3, ["ahead.json", "ahead2.json", "behind.json"]),
                                                         (1, ["semver.json"])]


def test_reason_of_drops_what_names_one_schema():
    assert reason_of("grammar g-0123abcd does not compile: Unknown format: semver") == "Unknown format: semver"
    assert reason_of("lookarounds not supported yet; End in regex /x/\n  while processing #/a") == \
        "lookarounds not supported yet"
    assert reason_of("regex parse error:\n    ^(?=a)$\n     ^^^\nerror: look-around is not supported") == \
        "regex parse error: look-around is not supported"
    assert reason_of("") == "(no message)"
    groups = errors_by_reason({"b": "x; 1", "a": "x; 2", "c": "y"})
    assert groups == [{"reason": "x", "count": 2, "files": ["a", "b"]}, {"reason": "y", "count": 1, "files": ["c"]}]


# -- progress bars: on a terminal, never in a pipe ------------------------------------------------------
def test_no_progress_bars_when_output_is_not_a_terminal():
    proc = _maskd("conformance", "--embedded", "--tokenizer", "cl100k")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "%|" not in proc.stderr and "it/s" not in proc.stderr, proc.stderr
    assert proc.stdout.count("\n") == 1 and "false rejects 0" in proc.stdout


def test_progress_bars_on_a_terminal():
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))   # a 120-column terminal
    try:
        proc = subprocess.Popen([sys.executable, "-m", "maskd.cli", "conformance", "--embedded", "--tokenizer",
                                 "cl100k"], stdout=subprocess.PIPE, stderr=secondary, text=True)
        os.close(secondary)
        seen = b""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:   # the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(primary)
    assert proc.returncode == 0
    text = seen.decode(errors="replace")
    assert "compile" in text and "schema" in text and "check" in text and "instance" in text, text
    assert "%|" in text, text        # tqdm's bar
    assert "false rejects 0" in out   # the summary still goes to stdout
