"""Bearer-token authentication for MaskService calls (health checks stay open for probes)."""
from __future__ import annotations

import hmac

import grpc

from maskd.v1.contract import AUTH_METADATA_KEY, AUTH_SCHEME

HEALTH_PREFIX = "/grpc.health.v1."


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses MaskService calls whose credentials are not ``<AUTH_SCHEME> <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"{AUTH_SCHEME} {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"missing or wrong bearer token ({AUTH_METADATA_KEY} metadata)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(sent.encode(), self._expected):   # constant time
            return continuation(handler_call_details)
        return self._deny_stream if method.endswith("/Session") else self._deny_unary
