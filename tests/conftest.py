import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
MASKBENCH = (REPO / ".." / "shared" / "maskbench-dev").resolve()
# tests/engines/ drive vLLM's and SGLang's own classes: they run in .venv-engines (make test runs them
# there with its own pytest); a venv without the engines does not collect them.
collect_ignore = [] if all(importlib.util.find_spec(m) for m in ("vllm", "sglang")) else ["engines"]

needs_maskbench = pytest.mark.skipif(
    not MASKBENCH.is_dir(), reason=f"needs ../shared/maskbench-dev (MaskBench-dev files) at {MASKBENCH}")


@pytest.fixture(scope="session")
def cl100k():
    from maskd.server.tokenizers import load_tokenizer
    return load_tokenizer("cl100k")


@pytest.fixture(scope="session")
def deepseek():
    from maskd.server.tokenizers import load_tokenizer
    return load_tokenizer("deepseek-v4")


def allowed_ids(row):
    """Token ids whose bit is set in one int32 mask row."""
    import numpy as np
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def pytest_addoption(parser):
    parser.addoption("--fuzz-seconds", type=float, default=None,
                     help="seconds each wire fuzzer runs (default $MASKD_FUZZ_SECONDS, else 20)")


@pytest.fixture
def fuzz_seconds(request):
    import os
    value = request.config.getoption("--fuzz-seconds")
    return float(value if value is not None else os.environ.get("MASKD_FUZZ_SECONDS", 20))


def hold_compiles(cache, gate):
    """Compiles that start from now on wait for ``gate`` (as if every compile thread were busy);
    once it is set they run as usual."""
    original = cache._compile

    def held(entry):
        gate.wait()
        original(entry)

    cache._compile = held
