"""Who is calling: bearer tokens of tenants (a tokens file, reloaded on SIGHUP), mTLS client
certificates, or nobody (a server without auth has one anonymous tenant).

A tenant is the namespace of sessions and sequences, and the unit of quotas. Tokens are looked up
by their SHA-256 digest and compared in constant time; a token never appears in a log or a message.
Health checks (grpc.health.v1) never need credentials, so probes work on an authenticated port.

Tokens file: one ``TENANT TOKEN`` pair per line; ``#`` starts a comment; blank lines are skipped.
Tenant names are letters, digits, ``.``, ``_`` and ``-``; a token is at least 16 characters and
belongs to one tenant (a tenant may have several tokens, e.g. while rotating them).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
from typing import Any

import grpc

from maskd.v1.contract import AUTH_METADATA_KEY, AUTH_SCHEME

log = logging.getLogger("maskd.server.auth")
HEALTH_PREFIX = "/grpc.health.v1."
ANONYMOUS = ""
DEFAULT_TENANT = "default"        # the tenant of the single token of --auth-token-env
_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MIN_TOKEN_LENGTH = 16


class AuthConfigError(ValueError):
    """A tokens file or certificate setting that cannot work; the message says where."""


def parse_tokens(text: str, source: str = "tokens file") -> dict[str, str]:
    """``TENANT TOKEN`` lines -> {token: tenant}; AuthConfigError naming the line otherwise."""
    tokens: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise AuthConfigError(f"{source} line {n}: expected 'TENANT TOKEN', got {len(parts)} fields")
        tenant, token = parts
        if not _TENANT.match(tenant):
            raise AuthConfigError(f"{source} line {n}: tenant {tenant!r} is not letters, digits, '.', '_' or '-'")
        if len(token) < MIN_TOKEN_LENGTH:
            raise AuthConfigError(f"{source} line {n}: the token of {tenant!r} is shorter than "
                                  f"{MIN_TOKEN_LENGTH} characters")
        if token in tokens and tokens[token] != tenant:
            raise AuthConfigError(f"{source} line {n}: this token is already {tokens[token]!r}'s")
        tokens[token] = tenant
    if not tokens:
        raise AuthConfigError(f"{source} holds no 'TENANT TOKEN' line")
    return tokens


class Credentials:
    """The tenants a server knows and how a call proves it is one of them."""

    def __init__(self, *, token: str | None = None, tokens_file: str | None = None,
                 client_certificates: bool = False) -> None:
        self.tokens_file = tokens_file
        self.client_certificates = client_certificates
        self._single = {token: DEFAULT_TENANT} if token else {}
        self._lock = threading.Lock()
        self._by_digest: dict[bytes, tuple[bytes, str]] = {}
        self._mtime = 0.0
        self.reload()

    @property
    def required(self) -> bool:
        """Whether calls must prove a tenant (otherwise every call is the anonymous tenant)."""
        return bool(self._by_digest) or self.client_certificates

    @property
    def uses_tokens(self) -> bool:
        return bool(self._by_digest)

    def reload_if_changed(self) -> bool:
        """Reloads the tokens file when it changed on disk (a Kubernetes secret update sends no
        SIGHUP). Returns whether it reloaded; a bad file keeps the old tokens (logged)."""
        if not self.tokens_file:
            return False
        try:
            if os.stat(self.tokens_file).st_mtime == self._mtime:
                return False
            n = self.reload()
            log.warning("tokens file %s changed: %d tokens loaded", self.tokens_file, n)
            return True
        except (OSError, AuthConfigError) as exc:
            log.error("tokens file %s not reloaded, the old tokens stay: %s", self.tokens_file, exc)
            try:
                self._mtime = os.stat(self.tokens_file).st_mtime   # do not log the same bad file again
            except OSError:
                pass
            return False

    def reload(self) -> int:
        """(Re)reads the tokens file; the old tokens stay when the new file is bad. Returns the count."""
        tokens = dict(self._single)
        if self.tokens_file:
            try:
                self._mtime = os.stat(self.tokens_file).st_mtime
                with open(self.tokens_file, encoding="utf-8") as f:
                    tokens.update(parse_tokens(f.read(), self.tokens_file))
            except OSError as exc:
                raise AuthConfigError(f"cannot read the tokens file {self.tokens_file}: {exc.strerror}") from exc
        table = {_digest(t): (f"{AUTH_SCHEME} {t}".encode(), tenant) for t, tenant in tokens.items()}
        with self._lock:
            self._by_digest = table
        return len(table)

    def tenant_of(self, metadata: Any, auth_context: Any = None) -> str | None:
        """The caller's tenant, or None when it proves none (a token wins over a certificate)."""
        if not self.required:
            return ANONYMOUS
        sent = dict(metadata or ()).get(AUTH_METADATA_KEY, "")
        if sent:
            value = sent.encode() if isinstance(sent, str) else bytes(sent)
            scheme, _, token = value.partition(b" ")
            found = self._by_digest.get(_digest(token.decode(errors="replace")))
            if found is not None and hmac.compare_digest(value, found[0]) and scheme == AUTH_SCHEME.encode():
                return found[1]
            return None
        if self.client_certificates and auth_context:
            names = auth_context.get("x509_common_name") or ()
            if names:
                name = names[0].decode(errors="replace")
                return name if _TENANT.match(name) else None
        return None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses MaskService calls that prove no tenant (UNAUTHENTICATED)."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"missing or wrong credentials ({AUTH_METADATA_KEY} metadata "
                          f"'{AUTH_SCHEME} <token>', or a client certificate)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY)
        if sent is None and self.credentials.client_certificates:
            return continuation(handler_call_details)   # the certificate decides, in the service
        if self.credentials.tenant_of(handler_call_details.invocation_metadata) is not None:
            return continuation(handler_call_details)
        return self._deny_stream if method.endswith("/Session") else self._deny_unary
