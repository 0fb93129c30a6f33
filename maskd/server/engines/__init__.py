"""Grammar engines behind one interface (see base.py); one module per engine."""
from __future__ import annotations

from maskd.server.config import BACKENDS
from maskd.server.engines.base import CompiledGrammar, Engine, GrammarCompileError, Matcher, UnsupportedSpec


def create_engine(backend: str, tokenizer, *, threads: int, json_schema_mode: str = "strict") -> Engine:
    """Builds the named backend for a loaded tokenizer."""
    if backend == "llguidance":   # with xgrammar for the specs llguidance cannot express (fallback.py)
        from maskd.server.engines.fallback import FallbackEngine
        from maskd.server.engines.llguidance_engine import LLGuidanceEngine
        from maskd.server.engines.revisions import xgrammar_engine_version

        def xgrammar_engine() -> Engine:   # imported when first needed (xgrammar imports torch: seconds)
            from maskd.server.engines.xgrammar_engine import XGrammarEngine
            return XGrammarEngine(tokenizer, threads=threads, json_schema_mode=json_schema_mode)
        return FallbackEngine(LLGuidanceEngine(tokenizer, threads=threads, json_schema_mode=json_schema_mode),
                              xgrammar_engine, f"xgrammar {xgrammar_engine_version()}")
    if backend == "xgrammar":
        from maskd.server.engines.xgrammar_engine import XGrammarEngine
        return XGrammarEngine(tokenizer, threads=threads, json_schema_mode=json_schema_mode)
    raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "CompiledGrammar", "Engine", "GrammarCompileError", "Matcher",
           "UnsupportedSpec", "create_engine"]
