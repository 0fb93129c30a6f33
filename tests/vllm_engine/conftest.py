"""Fixtures of the real-engine tests: one maskd server (real gRPC on a loopback port, deepseek-v4,
the model's vocabulary) and one reference engine for the session (maskd installed, not configured:
vLLM's own guidance backend), which every module that compares with it shares: an engine start is
~50 s of this suite on 2 cores, and an idle engine costs no CPU (vLLM's workers stop spinning 1 s
after their last step). Engines that run maskd are started by the modules that test them."""
import logging
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from harness import ENGINE_OPTIONS, TOOL_PARSER, vllm_engine

from maskd.server import MaskServer, ServerConfig


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def maskd_server(logs):
    """The server's log at DEBUG in the session's log folder, beside the engines' (every register's wait
    and every compile's queue, start and time)."""
    handler = logging.FileHandler(logs / "maskd-server.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
    handler.setLevel(logging.DEBUG)
    logger = logging.getLogger("maskd")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    server = MaskServer(ServerConfig(host="127.0.0.1", port=0, tokenizer="deepseek-v4", threads=1,
                                     compile_threads=1)).start()
    yield server
    server.stop(grace=1.0)
    logger.removeHandler(handler)
    logger.setLevel(level)
    handler.close()


@pytest.fixture(scope="session")
def reference(logs):
    """maskd installed and not configured (no MASKD_TARGET): vLLM's own guidance backend serves
    structured outputs, exactly as without maskd. Shared by the session: a test must leave it as
    it found it (no request left in flight)."""
    with vllm_engine(logs, *ENGINE_OPTIONS, *TOOL_PARSER, name="reference") as engine:
        yield engine

