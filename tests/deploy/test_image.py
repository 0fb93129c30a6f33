"""The container recipe cannot rot.

The Dockerfile's build stages are replayed outside a container builder: their COPY lines copy
these files into a scratch /src, their RUN lines (`python3 -m venv`, the `pip install`s) run as
written in a clean virtual environment; the `apt-get` line (gcc for the C row codec) is left to this
machine, which has gcc. What is rewritten for a run on this machine, and only
that: the paths /opt/maskd and /src point into a temporary folder; PIP_RETRIES=0 (an index this
machine cannot reach fails once instead of five times), PIP_COMPILE=0 (no .pyc for a throwaway
environment: --no-compile; pip reads PIP_NO_COMPILE=1 as --compile, which cost this test 40 s of torch
alone) and pip's cache kept (the recipe's PIP_NO_CACHE_DIR dropped). Then what the image
runs starts from that environment: its CMD (`maskd serve`, with 0.0.0.0 and the port rewritten to
127.0.0.1 and a free port) answers its HEALTHCHECK command; the xgrammar backend (which needs the
CPU torch) starts; Ray is the version the chart declares; the development tools (maskd-tools) are
not in it and `maskd bench` says what to install. The installs take a few minutes.
"""
from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml
from dockerfile import REPO, chain, effective, parse

GLOBAL_ARGS, STAGES = parse()
TARGET = "cluster"                    # the default target (the last stage): what the chart runs
ENV_STAGE = "build-cluster"           # the stage whose /opt/maskd the target copies
CHART_VALUES = yaml.safe_load((REPO / "helm" / "maskd" / "values.yaml").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- static: the recipe, the chart and pyproject agree ----------------------------------------------------
def test_targets_and_their_environments():
    assert list(STAGES)[-1] == TARGET, "the default target (the last stage) is the one the chart runs"
    target = effective(STAGES, TARGET)
    assert [c for c in target.copies if c[0]] == [(ENV_STAGE, ["/opt/maskd"], "/opt/maskd")]
    assert effective(STAGES, "server").copies[-1] == ("build", ["/opt/maskd"], "/opt/maskd")
    for name in ("server", TARGET):
        t = effective(STAGES, name)
        assert t.user == "65532:65532", f"{name} must not run as root"
        assert t.cmd[:2] == ["maskd", "serve"] and t.healthcheck[:2] == ["maskd", "health"]
        assert GLOBAL_ARGS["PYTHON_IMAGE"].startswith("python:3.11-slim")
    # The chart's pod security context is the image's user.
    assert CHART_VALUES["podSecurityContext"]["runAsUser"] == 65532
    # The server target has no Ray: nothing in its stages installs it.
    server_runs = " ".join(r for s in chain(STAGES, "build") for r in s.runs)
    assert "ray" not in server_runs.lower() and "[cluster]" not in server_runs


def test_ray_pin_agrees_with_the_chart_and_with_pyproject():
    pin = STAGES[ENV_STAGE].args["RAY_VERSION"]
    assert CHART_VALUES["ray"]["rayVersion"] == pin, "helm/maskd/values.yaml ray.rayVersion != the Dockerfile's"
    installed = importlib.metadata.version("ray")   # what `pip install -e .[dev]` resolved here
    assert installed == pin, (f"pyproject resolves Ray {installed} here, the image pins {pin}: move the Dockerfile's "
                              "RAY_VERSION and the chart's ray.rayVersion together")


def test_torch_pin_is_the_one_make_setup_installs():
    makefile = (REPO / "Makefile").read_text()
    torch = STAGES["build"].args["TORCH_VERSION"]
    assert f"torch=={torch}" in makefile
    assert STAGES["build"].args["TORCH_INDEX_URL"].endswith("/whl/cpu")


def test_image_tag_is_the_package_version():
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    chart = yaml.safe_load((REPO / "helm" / "maskd" / "Chart.yaml").read_text())
    assert chart["appVersion"] == version, "the chart's default image tag (appVersion) is the package version"


def test_build_context_holds_what_the_recipe_copies():
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", "the context is an allow-list (.venv alone is gigabytes)"
    allowed = {ln[1:] for ln in ignore if ln.startswith("!")}
    sources = {src for s in STAGES.values() for frm, srcs, _ in s.copies if frm is None for src in srcs}
    assert sources <= allowed, f"COPY sources outside the build context: {sources - allowed}"
    for src in sources:
        assert (REPO / src).exists(), src
    assert "tools" not in allowed | sources, "the image ships the runtime, not the development tools (tools/)"


def test_make_image_says_when_no_builder_can_run():
    proc = subprocess.run(["make", "-s", "image", "OCI_BUILDERS=no-such-builder another-missing-builder"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "make image: no OCI builder can run on this machine" in proc.stderr
    assert "no-such-builder: not installed" in proc.stderr and "another-missing-builder: not installed" in proc.stderr


# -- the install steps in a clean venv ------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("image")
    venv, src = root / "opt-maskd", root / "src"

    def rewrite(text: str) -> str:
        return text.replace("/opt/maskd", str(venv)).replace("/src", str(src))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(PIP_RETRIES="0", PIP_COMPILE="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    log = []
    for stage in chain(STAGES, ENV_STAGE):
        for frm, sources, dest in stage.copies:
            assert frm is None
            for source in sources:
                target = pathlib.Path(rewrite(dest))
                target = target / source if dest.endswith("/") else target
                target.parent.mkdir(parents=True, exist_ok=True)
                if (REPO / source).is_dir():
                    shutil.copytree(REPO / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    shutil.copy2(REPO / source, target)
        stage_env = {**env, **stage.args}
        for key, value in stage.env.items():
            if key != "PIP_NO_CACHE_DIR":
                stage_env[key] = rewrite(value).replace("$PATH", env["PATH"])
        for run in stage.runs:
            if run.startswith("apt-get "):   # the base image's OS packages (gcc): this machine has them
                log.append(f"{run}: skipped (OS packages)")
                continue
            t0 = time.monotonic()
            done = subprocess.run(["sh", "-c", rewrite(run)], env=stage_env, cwd=root, capture_output=True,
                                  text=True, timeout=1500)
            log.append(f"{run}: {time.monotonic() - t0:.0f} s")
            assert done.returncode == 0, f"the recipe's `RUN {run}` fails:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    print("\n".join(log))
    return venv, {**env, "PATH": f"{venv / 'bin'}:{env['PATH']}", "HOME": str(root)}


def _py(venv, code: str, env) -> str:
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_environment_has_the_cpu_torch_and_the_pinned_ray(image_env):
    venv, env = image_env
    versions = dict(line.split("=", 1) for line in _py(venv, (
        "import importlib.metadata as m\n"
        "for d in m.distributions(): print(d.metadata['Name'].lower() + '=' + d.version)"), env).splitlines())
    assert versions["torch"] == STAGES["build"].args["TORCH_VERSION"] + "+cpu"
    assert not [d for d in versions if d.startswith("nvidia-")], "a CUDA build of torch came in"
    assert versions["ray"] == STAGES[ENV_STAGE].args["RAY_VERSION"] == CHART_VALUES["ray"]["rayVersion"]
    assert versions["maskd"] and "pytest" not in versions, "the image gets the runtime, not the dev extras"
    ray = subprocess.run([str(venv / "bin" / "ray"), "--version"], capture_output=True, text=True, env=env, timeout=120)
    assert ray.returncode == 0 and STAGES[ENV_STAGE].args["RAY_VERSION"] in ray.stdout
    up = subprocess.run([str(venv / "bin" / "maskd"), "cluster", "up", "--help"], capture_output=True, text=True,
                        env=env, timeout=120)
    assert up.returncode == 0 and "--foreground" in up.stdout
    # the row codec's C core was built by the recipe (gcc in the build stage), not the numpy fallback
    assert _py(venv, "import maskd.rowcodec as r; print(r._native is not None)", env) == "True"
    # the runtime without the development tools (maskd-tools, tools/): not installed, not inside the maskd
    # package either, and their commands say what to install
    assert "maskd-tools" not in versions
    assert _py(venv, "import importlib.util as u; print(u.find_spec('maskd_tools'), u.find_spec('maskd.tools'))",
               env) == "None None"
    shipped = _py(venv, "import importlib.metadata as m; print(*m.files('maskd'), sep='\\n')", env).splitlines()
    assert "maskd/cli.py" in shipped
    assert not [f for f in shipped if f.startswith(("maskd_tools", "maskd/tools/"))], "the image ships the tools"
    bench = subprocess.run([str(venv / "bin" / "maskd"), "bench", "--help"], capture_output=True, text=True, env=env,
                           timeout=120)
    assert bench.returncode == 1 and bench.stderr.startswith(
        "maskd bench needs the maskd-tools package, which is not installed here: pip install ./tools"), bench.stderr


def _local(argv: list[str], port: int) -> list[str]:
    """The image's command for a run here: 0.0.0.0 -> 127.0.0.1, port 50051 -> a free one."""
    return [{"0.0.0.0": "127.0.0.1", "50051": str(port), "127.0.0.1:50051": f"127.0.0.1:{port}"}.get(a, a)
            for a in argv]


@pytest.mark.parametrize("extra", [[], ["--backend", "xgrammar", "--tokenizer", "cl100k"]],
                         ids=["cmd", "cmd-xgrammar"])
def test_what_the_image_runs_starts_and_answers_its_health_check(image_env, extra):
    venv, env = image_env
    image = effective(STAGES, TARGET)
    port = _free_port()
    cmd = _local(image.cmd, port) + extra
    proc = subprocess.Popen([str(venv / "bin" / cmd[0]), *cmd[1:]], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        health = _local(image.healthcheck, port)
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"`{' '.join(cmd)}` exited: {proc.stderr.read()[-3000:]}"
            done = subprocess.run([str(venv / "bin" / health[0]), *health[1:]], capture_output=True, text=True,
                                  env=env, timeout=120)
            if done.returncode == 0:
                break
            assert time.monotonic() < deadline, f"no health within 240 s: {done.stderr}"
            time.sleep(1)
        assert done.stdout.strip() == f"127.0.0.1:{port} SERVING"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode in (0, -15), proc.stderr.read()[-2000:]


if __name__ == "__main__":   # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
