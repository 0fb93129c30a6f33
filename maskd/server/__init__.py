"""The maskd server: a gRPC MaskService over a grammar engine, one matcher per sequence.

Layers, each a module: ``config`` (ServerConfig, Limits), ``tokenizers``, ``engines`` (one
interface, one module per engine), ``grammar_cache`` (asynchronous compiles), ``session`` (the
step protocol), ``registry`` (sessions), ``service`` (gRPC and the reply path), ``auth``,
``metrics``, ``app`` (MaskServer: ports, health, drain).

Needs the ``server`` extra (grammar engines, tokenizers, prometheus-client).
"""
from typing import TYPE_CHECKING

from maskd.server.config import ConfigError, Limits, ServerConfig

if TYPE_CHECKING:
    from maskd.server.app import MaskServer

__all__ = ["ConfigError", "Limits", "MaskServer", "ServerConfig"]


def __getattr__(name: str):
    if name == "MaskServer":  # imports the engines: only when a server is built
        from maskd.server.app import MaskServer
        return MaskServer
    raise AttributeError(name)
