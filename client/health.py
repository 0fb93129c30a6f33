"""Is a maskd server (or a cluster directory) there? The standard grpc.health.v1 check, with the
reason when it is not: what command lines and probes ask before they start real work."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskd_client.types import MaskClientError, Unreachable

__all__ = ["SERVING", "Unreachable", "check"]

SERVING = "SERVING"


def _target(address: str) -> str:
    return address[len("directory:"):] if address.startswith("directory:") else address


def check(address: str, *, service: str = "", connect_timeout_s: float = 10.0, tls: bool = False,
          root_certs: bytes | None = None) -> str:
    """The serving status name (``SERVING``, ``NOT_SERVING``, ...) of ``service`` at ``address``.

    Retries while the address refuses connections, up to ``connect_timeout_s``; then raises
    Unreachable with gRPC's last reason (connection refused, name not resolved, ...). A server
    that answers without the service raises MaskClientError (NOT_FOUND).
    """
    target = _target(address)
    if tls or root_certs:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root_certs))
    else:
        channel = grpc.insecure_channel(target)
    deadline = time.monotonic() + connect_timeout_s
    reason = "no answer"
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unreachable(target, f"nothing answered within {connect_timeout_s:g} s: {reason}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=min(left, 5.0),
                                   wait_for_ready=False)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    what = f"service {service!r}" if service else "the health service"
                    raise MaskClientError(f"{target} answers, but not for {what}: "
                                          f"{code.name}: {exc.details()}", code) from exc
                reason = exc.details() or code.name
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
    finally:
        channel.close()
