"""The real-engine tests' view of maskd.tools.vllm_serve (``vllm serve`` processes on 127.0.0.1)."""
from maskd.tools.vllm_serve import ENGINE_OPTIONS, MODEL, THINK_END, Engine, server_metric, vllm_engine

__all__ = ["ENGINE_OPTIONS", "MODEL", "THINK_END", "Engine", "server_metric", "vllm_engine"]
