"""The client API as a typed protocol: ``MaskClient`` and ``ClusterClient`` both satisfy it, and
engine adapters take any ``MaskdClient``."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from maskd.v1.contract import ServerInfo
from maskd_client.types import StepResult


@runtime_checkable
class MaskdClient(Protocol):
    target: str
    session: str
    timeout_s: float

    def info(self) -> ServerInfo: ...

    def register(self, spec: Any, *, wait: bool = True, timeout_s: float | None = None,
                 require_ready: bool = False) -> str: ...

    def open(self, seq_id: str, spec: Any, *, grammar_id: str = "") -> None: ...

    def step(self, tokens_by_seq: Mapping[str, Any], timeout: float | None = None, *,
             out: Any = None) -> StepResult: ...

    def step_async(self, tokens_by_seq: Mapping[str, Any], *, out: Any = None) -> concurrent.futures.Future: ...

    def close(self, seq_id: str) -> concurrent.futures.Future: ...

    def flush_closes(self) -> None: ...

    def history(self, seq_id: str) -> list[int]: ...

    @property
    def open_sequences(self) -> list[str]: ...

    @property
    def reconnects(self) -> int: ...

    def shutdown(self) -> None: ...
