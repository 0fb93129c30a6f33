"""The real-engine tests' view of maskd_tools.vllm_serve (``vllm serve`` processes on 127.0.0.1)."""
import contextlib
from collections.abc import Iterator

from maskd_tools import vllm_serve
from maskd_tools.vllm_serve import ENGINE_OPTIONS, MODEL, THINK_END, VllmServer, server_metric

__all__ = ["EAGER", "ENGINE_OPTIONS", "MODEL", "THINK_END", "VllmServer", "server_metric", "vllm_engine"]

# tool_choice "required" needs a tool parser in vLLM, which vLLM loads only with auto tool choice on
# (the JSON call array is then the constraint); one that leaves "required" to that array (no
# structural tag of its own).
TOOL_PARSER = ("--enable-auto-tool-choice", "--tool-call-parser", "xlam")

# Every test engine runs its model eagerly. vLLM 0.32's CPU build cannot load the torch.compile
# cache it writes ("'function' object has no attribute 'finalize_loading'"), so each start compiled
# the model again: about a minute of every start on a 2-core machine, a third of this suite's time.
# The tests compare engines started with the same options (maskd against vLLM's own backend), and
# the model's compile mode is not what they test; `maskd bench vllm` keeps vLLM's default.
EAGER = ("--enforce-eager",)


@contextlib.contextmanager
def vllm_engine(log_dir, *args: str, **kwargs) -> Iterator[VllmServer]:
    with vllm_serve.vllm_engine(log_dir, *args, *EAGER, **kwargs) as engine:
        yield engine
