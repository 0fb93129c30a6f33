"""ClusterClient: the MaskClient API over a maskd cluster, routed by its directory.

    with MaskClient("directory:10.0.0.5:7000") as mc:     # a ClusterClient
        mc.open("req-1", {"json_schema": schema})
        res = mc.step({"req-1": []})

- Placement: the client keeps the directory's ring (live worker ids and addresses, refreshed every
  few seconds) and opens each sequence on the owner of its id. A sequence stays on that worker
  while the worker lives, so a worker that joins moves nothing.
- Steps: ``step_async`` splits the batch by owner, sends the parts at once on each worker's stream
  and merges the answers into one StepResult whose rows follow the batch order.
- Recovery (``maskd_client.core``): when a worker's stream breaks, the directory names the new
  owners (the lost address is a suspect, which the directory probes and takes off the ring),
  grammars are made ready there, each sequence is reopened with its token history and the steps
  in flight are sent again. The futures the caller holds resolve with the new owners' rows.

Needs only grpcio, protobuf and numpy (no Ray).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from maskd.specs import GrammarSpec, SpecError
from maskd_client.connection import ConnectionSettings, fingerprint_of, spec_proto
from maskd_client.core import ClientCore
from maskd_client.merge import merge_results
from maskd_client.routing import DirectoryError, DirectoryRouter, NoOwner, strip_prefix
from maskd_client.types import MaskClientError, Unreachable

__all__ = ["ClusterClient", "merge_results"]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class ClusterClient(ClientCore):
    """The MaskClient API over a cluster; ``target`` is ``directory:HOST:PORT``."""

    def __init__(self, target: str, tokenizer: Any = None, *, session: str | None = None, retries: int = 8,
                 retry_backoff_s: float = 0.1, want_forced_tokens: bool = True,
                 channel_options: Iterable[tuple[str, Any]] = (), timeout_s: float = 30.0,
                 refresh_s: float = 5.0, recovery_timeout_s: float = 60.0, connect_timeout_s: float = 5.0,
                 auth_token: str | None = None, tls_root_certs: bytes | None = None, tls: bool = False,
                 close_linger_s: float = 0.05) -> None:
        self.directory_address = strip_prefix(target)
        self._directory_router = DirectoryRouter(self.directory_address, timeout_s=timeout_s, refresh_s=refresh_s,
                                                 backoff_s=retry_backoff_s)
        settings = ConnectionSettings(tls=tls, tls_root_certs=tls_root_certs, auth_token=auth_token,
                                      channel_options=tuple(channel_options), timeout_s=timeout_s,
                                      expected_fingerprint=fingerprint_of(tokenizer))
        super().__init__(target, self._directory_router, settings, session=session, retries=retries,
                         retry_backoff_s=retry_backoff_s, want_forced_tokens=want_forced_tokens,
                         close_linger_s=close_linger_s, recovery_timeout_s=recovery_timeout_s,
                         connect_timeout_s=connect_timeout_s)

    @property
    def epoch(self) -> int:
        return self._directory_router.epoch

    def refresh(self) -> None:
        """Reloads the ring of live workers from the directory."""
        try:
            self._directory_router.refresh()
        except DirectoryError as exc:
            raise MaskClientError(str(exc), exc.code) from exc

    def workers(self) -> dict[str, str]:
        """Live worker id -> address, as this client last saw them."""
        return self._directory_router.workers()

    def info(self):
        try:
            return super().info()
        except DirectoryError as exc:
            raise MaskClientError(str(exc), exc.code) from exc

    def register(self, spec: Any, *, wait: bool = True, timeout_s: float | None = None,
                 require_ready: bool = False) -> str:
        """Registers (compiles) a grammar on the worker that owns its id; the cluster cache shares it.
        ``require_ready``: an id only of a compiled grammar (``Connection.register``)."""
        spec_pb = spec_proto(spec)
        info = self.info()
        try:
            key = GrammarSpec.from_proto(spec_pb).grammar_id(info.tokenizer_fingerprint, info.backend,
                                                              info.backend_version,
                                                              json_schema_mode=info.json_schema_mode or "strict")
        except SpecError:
            key = ""   # any worker answers with the spec's error
        suspects: set[str] = set()
        address = self._directory_router.place(key)
        for attempt in range(self.retries + 1):
            try:
                return self._connect(address).register(spec_pb, wait=wait, timeout_s=timeout_s,
                                                       require_ready=require_ready)
            except MaskClientError as exc:
                unreachable = isinstance(exc, Unreachable) or exc.code is _UNAVAILABLE
                if not unreachable or attempt == self.retries:
                    raise
            suspects.add(address)
            try:
                address = self._directory_router.replace(suspects, [key])[key]
            except NoOwner as exc:
                raise MaskClientError(str(exc), _UNAVAILABLE) from exc
        raise AssertionError("unreachable")
