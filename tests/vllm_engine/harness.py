"""The real-engine tests' view of maskd.tools.vllm_serve (``vllm serve`` processes on 127.0.0.1)."""
from maskd.tools.vllm_serve import ENGINE_OPTIONS, MODEL, THINK_END, Engine, server_metric, vllm_engine

__all__ = ["ENGINE_OPTIONS", "MODEL", "THINK_END", "Engine", "server_metric", "vllm_engine"]

# tool_choice "required" needs a tool parser in vLLM, which vLLM loads only with auto tool choice on
# (the JSON call array is then the constraint); one that leaves "required" to that array (no
# structural tag of its own).
TOOL_PARSER = ("--enable-auto-tool-choice", "--tool-call-parser", "xlam")
