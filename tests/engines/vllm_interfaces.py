"""What the vLLM plugin's interface tests share: a real maskd server per module (cl100k, one step
thread, one compile worker) and the part of vLLM's ModelConfig that admission reads."""
import pytest

from maskd.server import MaskServer, ServerConfig


class Vocabulary:
    """What admission reads of vLLM's ModelConfig: the vocabulary size (a model that is no diffusion LM)."""

    is_diffusion = False

    def __init__(self, size: int) -> None:
        self.size = size

    def get_vocab_size(self) -> int:
        return self.size


@pytest.fixture(scope="module")
def server():
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, compile_threads=1)).start()
    yield srv
    srv.stop(grace=0.5)
