"""MaskClient: a GPU worker's session with one maskd server.

    with MaskClient("127.0.0.1:50051") as mc:
        mc.open("req-1", {"json_schema": schema})
        fut = mc.step_async({"req-1": []})        # right after sampling
        ...                                       # forward pass runs
        res = fut.result()                        # right before the next sampling
        rows = res.bitmask                        # int32 (rows, words)

One StepRequest per decode step carries the whole batch. Steps are idempotent on the server, so
when the stream breaks the client reconnects, restores its sequences (each reopened at its step
with its whole token history, in parts when long) and resends the steps in flight: nothing is
lost and no output changes (see ``maskd_client.core``).

A target of the form ``directory:HOST:PORT`` names a maskd cluster's directory instead of a
server: ``MaskClient`` then returns a ``maskd_client.cluster.ClusterClient`` with the same API.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from maskd_client.connection import ConnectionSettings, fingerprint_of
from maskd_client.core import ClientCore
from maskd_client.routing import DIRECTORY_PREFIX, FixedRouter


class MaskClient(ClientCore):
    """The maskd client API (``maskd_client.protocol.MaskdClient``) over one server.

    target: ``HOST:PORT`` (or ``directory:HOST:PORT`` for a cluster, see above).
    tokenizer: the model's tokenizer fingerprint (or an object with ``.fingerprint``): a server
        with another vocabulary is refused. None: no check.
    session: the session key; tensor-parallel ranks of one engine pass the same key.
    recovery_timeout_s: how long after the server is lost its steps in flight (and those sent
        meanwhile) wait for it to come back and take their sequences (restored from the history
        the client holds); past it they fail with UNAVAILABLE naming the server, and while it is
        still gone later steps fail within seconds. The history is kept: the first step after the
        server is back restores the sequences, however long it was gone (see maskd_client.core).
    retry_backoff_s: the first pause between two attempts (doubling, at most 1 s).
    retries: a step is sent at most ``retries + 1`` times (one whose server is lost each time fails).
    close_linger_s: how long a close waits to ride on a step before it goes alone (0: at once).
    """

    def __new__(cls, target: str = "", *args: Any, **kwargs: Any):
        # A cluster directory as target: the cluster client (same API) instead of one server.
        if cls is MaskClient and isinstance(target, str) and target.startswith(DIRECTORY_PREFIX):
            from maskd_client.cluster import ClusterClient
            return ClusterClient(target, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, target: str, tokenizer: Any = None, *, session: str | None = None, retries: int = 8,
                 retry_backoff_s: float = 0.1, want_forced_tokens: bool = True,
                 channel_options: Iterable[tuple[str, Any]] = (), timeout_s: float = 30.0,
                 auth_token: str | None = None, tls_root_certs: bytes | None = None, tls: bool = False,
                 close_linger_s: float = 0.05, recovery_timeout_s: float = 60.0) -> None:
        settings = ConnectionSettings(tls=tls, tls_root_certs=tls_root_certs, auth_token=auth_token,
                                      channel_options=tuple(channel_options), timeout_s=timeout_s,
                                      expected_fingerprint=fingerprint_of(tokenizer))
        super().__init__(target, FixedRouter(target), settings, session=session, retries=retries,
                         retry_backoff_s=retry_backoff_s, want_forced_tokens=want_forced_tokens,
                         close_linger_s=close_linger_s, recovery_timeout_s=recovery_timeout_s,
                         connect_timeout_s=None)
        self._connection(target)   # the channel exists from the start; it connects on first use

    def _retry_placement(self, suspects: set[str]) -> bool:
        return False   # one server: nowhere else to go

    def register(self, spec: Any, *, wait: bool = True, timeout_s: float | None = None,
                 require_ready: bool = False) -> str:
        """Registers a grammar and returns its id; raises MaskClientError with the compile error
        (DEADLINE_EXCEEDED when waiting outlasts ``timeout_s``: the compile goes on).
        ``require_ready``: an id only of a compiled grammar (``Connection.register``)."""
        return self._connection(self.target).register(spec, wait=wait, timeout_s=timeout_s,
                                                      require_ready=require_ready)
