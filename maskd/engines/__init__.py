"""Grammar engines behind one interface (see base.py); one module per engine."""
from __future__ import annotations

from maskd.engines.base import CompiledGrammar, Engine, GrammarCompileError, Matcher, UnsupportedSpec

BACKENDS = ("llguidance", "xgrammar")


def create_engine(backend: str, tokenizer, *, threads: int, limits=None) -> Engine:
    """Builds the named backend for a loaded tokenizer."""
    if backend == "llguidance":
        from maskd.engines.llguidance_engine import LLGuidanceEngine
        return LLGuidanceEngine(tokenizer, threads=threads, limits=limits)
    if backend == "xgrammar":
        from maskd.engines.xgrammar_engine import XGrammarEngine
        return XGrammarEngine(tokenizer, threads=threads, limits=limits)
    raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "CompiledGrammar", "Engine", "GrammarCompileError", "Matcher",
           "UnsupportedSpec", "create_engine"]
