"""The house: packages depend one way, and a GPU worker's install is the client alone.

* The import contracts in pyproject.toml (import-linter) hold: cli > tools > cluster > server |
  client > shared layer > generated contract; the client imports no engine, no Ray, no server; the
  step protocol imports no gRPC.
* ``pip install .[client]`` into a clean virtual environment pulls no grammar engine and no Ray, and
  that environment alone steps a real server.
* One name per concept: no class name is defined in two modules of the runtime packages (``maskd``,
  ``client``, ``cluster``), so a name in a log, a traceback or a review says which thing it is.
* The runtime wheel ships without the development tools: they are a distribution of their own,
  ``maskd-tools`` (``tools/`` -> ``maskd_tools``), at the runtime's version; where they are not
  installed, ``maskd bench`` (and the other tools' subcommands) say what to install.
"""
import ast
import collections
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import venv
import zipfile

import pytest
import tomllib

from conftest import REPO
from maskd.server import MaskServer, ServerConfig


def test_import_contracts_hold():
    lint = pathlib.Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        pytest.skip("import-linter is not installed (the dev extra)")
    done = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


RUNTIME_PACKAGES = ("maskd", "client", "cluster")


def _class_modules() -> dict[str, set[str]]:
    """Every class name defined in the runtime packages (nested ones too) -> the modules defining it."""
    where: dict[str, set[str]] = collections.defaultdict(set)
    for package in RUNTIME_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith("maskd/v1/") and "_pb2" in path.name:   # generated (make proto)
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if isinstance(node, ast.ClassDef):
                    where[node.name].add(rel)
    return where


def test_no_class_name_is_defined_in_two_modules():
    where = _class_modules()
    twice = {name: sorted(modules) for name, modules in where.items() if len(modules) > 1}
    assert not twice, "one name per concept: these class names are defined in more than one module " \
                      f"(rename each after what it is, or make the copies one class): {twice}"


CLIENT_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from maskd_client import MaskClient, SeqStatus
    with MaskClient(sys.argv[1]) as mc:
        mc.open("clean", {"regex": "[0-9]"})
        res = mc.step({"clean": []})
        while res.seqs["clean"].status is SeqStatus.WAITING:
            # asked again after a pause, as a worker asks at its next step: back to back, this loop and the
            # server answering it took both cores from the compile (at nice 19) it waits for, past 120 s
            time.sleep(0.02)
            res = mc.step({"clean": []})
        row = res.bitmask[res.seqs["clean"].row]
        heavy = [m for m in ("llguidance", "xgrammar", "ray", "torch", "transformers", "maskd.server", "maskd_cluster")
                 if m in sys.modules]
        print(json.dumps({"status": res.seqs["clean"].status.name, "set_bits": int(sum(bin(w & 0xFFFFFFFF).count("1")
                          for w in row.tolist())), "heavy": heavy}))
""")


def test_client_extra_in_a_clean_venv_steps_a_real_server(tmp_path):
    env_dir = tmp_path / "client-venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "--no-compile", f"{REPO}[client]"], capture_output=True, text=True, env=env, timeout=900)
    if install.returncode != 0 and "Could not find a version" in install.stderr + install.stdout:
        pytest.skip(f"the package index cannot be reached: {install.stderr[-300:]}")
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            env=env, check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"grpcio", "protobuf", "numpy", "maskd"} <= names
    forbidden = {"ray", "llguidance", "xgrammar", "torch", "transformers", "tokenizers", "tiktoken"}
    assert not names & forbidden, names & forbidden

    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1)) as server:
        run = subprocess.run([str(py), "-c", CLIENT_SCRIPT, server.address], capture_output=True, text=True,
                             env=env, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out == {"status": "READY", "set_bits": 10, "heavy": []}   # the digits 0-9, nothing else loaded

    # the same install has the `maskd` command, without the tools: their subcommands say what to install
    bench = subprocess.run([str(env_dir / "bin" / "maskd"), "bench", "--help"], capture_output=True, text=True,
                           env=env, timeout=120, cwd=tmp_path)
    assert bench.returncode != 0 and bench.stdout == ""
    assert bench.stderr.startswith("maskd bench needs the maskd-tools package, which is not installed here: "
                                   "pip install ./tools"), bench.stderr


# -- the runtime wheel and the tools' own ------------------------------------------------------------------
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TOOLS_PYPROJECT = tomllib.loads((REPO / "tools" / "pyproject.toml").read_text())
_NOT_SOURCES = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "build")


def _wheel(tmp_path, src: pathlib.Path) -> list[str]:
    """The files of the wheel pip builds from ``src``, a copy of the project's sources (an in-tree
    build would also pack whatever an earlier build left in build/)."""
    out = tmp_path / "wheel"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_runtime_wheel_ships_no_tools(tmp_path):
    src = tmp_path / "src"   # what the Dockerfile copies too: pyproject, README and the package folders
    for folder in set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / folder, src / folder, ignore=_NOT_SOURCES)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    names = _wheel(tmp_path, src)
    packages = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert packages == {"maskd", "maskd_client", "maskd_cluster"}, packages
    assert "maskd/cli.py" in names and "maskd/server/app.py" in names
    tools = [n for n in names if "maskd_tools" in n or n.startswith("maskd/tools/") or "/samples/" in n]
    assert not tools, f"the runtime wheel ships development tools: {tools}"


def test_tools_are_their_own_distribution_at_the_runtime_version(tmp_path):
    version = PYPROJECT["project"]["version"]
    assert TOOLS_PYPROJECT["project"]["version"] == version
    assert f"maskd[server]=={version}" in TOOLS_PYPROJECT["project"]["dependencies"]
    shutil.copytree(REPO / "tools", tmp_path / "src", ignore=_NOT_SOURCES)
    names = _wheel(tmp_path, tmp_path / "src")
    assert {n.split("/", 1)[0] for n in names} == {"maskd_tools", f"maskd_tools-{version}.dist-info"}
    assert {"maskd_tools/bench/cli.py", "maskd_tools/demo.py", "maskd_tools/protogen.py"} <= set(names)
    assert [n for n in names if n.startswith("maskd_tools/samples/maskbench/") and n.endswith(".json")]
