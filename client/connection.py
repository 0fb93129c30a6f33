"""A channel to one maskd server: TLS, credentials, the fingerprint guard, unary calls."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import grpc

from maskd.specs import PARTS_REVISIONS, GrammarSpec, SpecError, wire_for_revision
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc
from maskd.v1.contract import AUTH_METADATA_KEY, AUTH_SCHEME, SESSION_METADATA_KEY, GrammarState, ServerInfo
from maskd_client.types import MaskClientError

# Reconnects for a service that restarts. gRPC's defaults (the first retry after 1 s, x1.6 each
# time, up to 120 s apart) suit a far-away service; maskd is one hop away and, when it goes, comes
# back on the same address (a restart, a rescheduled pod) while an engine waits on it with requests
# in flight. With the defaults, requests still failed 8 s after a restarted maskd listened again, 22 s
# after a 90 s outage (issue 48). So: the first retry after 0.1 s, never more than 1 s between two
# (a refused connect costs a SYN and a RST; a server has a few clients), and a restarted server
# serves within about a second of listening. ``grpc.min_reconnect_backoff_ms`` is, in gRPC's core,
# the least time one connect attempt gets (default 20 s): 5 s is ample for TCP and TLS handshakes
# and keeps an address that drops packets (a vanished host) from holding the channel in CONNECTING
# for 20 s. A caller's ``channel_options`` with the same keys win.
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 5000),
)
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1), *RECONNECT_OPTIONS)


@dataclasses.dataclass(frozen=True)
class ConnectionSettings:
    """How to reach maskd servers; the cluster client uses the same settings for every worker."""
    tls: bool = False
    tls_root_certs: bytes | None = None
    auth_token: str | None = None
    channel_options: tuple[tuple[str, Any], ...] = ()
    timeout_s: float = 30.0
    expected_fingerprint: str | None = None   # the model's tokenizer: refuse a server with another


def fingerprint_of(tokenizer: Any) -> str | None:
    """A fingerprint string from a string or an object with a ``.fingerprint`` (None: no check)."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str):
        return tokenizer
    fp = getattr(tokenizer, "fingerprint", None)
    if isinstance(fp, str):
        return fp
    raise TypeError("tokenizer is a fingerprint string or an object with a .fingerprint attribute")


def spec_proto(spec: Any) -> pb.GrammarSpec:
    """A grammar spec as the wire message: a proto, a GrammarSpec, or any request shape
    ``GrammarSpec.from_request`` takes (maskd's dict, vLLM structured_outputs, OpenAI
    response_format, SGLang keys, a pydantic model class); SpecError when malformed."""
    if isinstance(spec, pb.GrammarSpec):
        return spec
    parsed = GrammarSpec.from_request(spec)
    if parsed is None:
        raise SpecError("this request asks for no constraint (response_format type 'text', or tool_choice "
                        "'auto' / 'none'): there is no grammar to open")
    return parsed.to_proto()


class Connection:
    """One channel to one server. ``info`` is fetched once and checked against the expected
    tokenizer fingerprint: masks from a server with another vocabulary would not line up."""

    def __init__(self, target: str, settings: ConnectionSettings) -> None:
        self.target = target
        self.settings = settings
        given = {key for key, _ in settings.channel_options}
        options = [*(o for o in DEFAULT_CHANNEL_OPTIONS if o[0] not in given), *settings.channel_options]
        self.options: tuple[tuple[str, Any], ...] = tuple(options)
        if settings.tls or settings.tls_root_certs:
            creds = grpc.ssl_channel_credentials(root_certificates=settings.tls_root_certs)
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.MaskServiceStub(self.channel)
        self._auth: tuple[tuple[str, str], ...] = (
            ((AUTH_METADATA_KEY, f"{AUTH_SCHEME} {settings.auth_token}"),) if settings.auth_token else ())
        self._info: ServerInfo | None = None

    def metadata(self, session: str | None = None) -> tuple[tuple[str, str], ...]:
        """Call metadata: credentials, and the session key for Session streams."""
        return (((SESSION_METADATA_KEY, session),) if session else ()) + self._auth

    def info(self, *, timeout_s: float | None = None, wait_for_ready: bool = True) -> ServerInfo:
        """The server's Info (fetched once); MaskClientError when unreachable or mismatched."""
        if self._info is None:
            try:
                reply = self.stub.Info(pb.InfoRequest(), timeout=timeout_s or self.settings.timeout_s,
                                       wait_for_ready=wait_for_ready, metadata=self._auth)
            except grpc.RpcError as exc:
                raise MaskClientError(f"maskd at {self.target}: {exc.details() or exc.code().name}",
                                      exc.code()) from exc
            info = ServerInfo.from_proto(reply)
            expected = self.settings.expected_fingerprint
            if expected and info.tokenizer_fingerprint != expected:
                raise MaskClientError(
                    f"maskd at {self.target} serves tokenizer {info.tokenizer!r} with fingerprint "
                    f"{info.tokenizer_fingerprint[:16]}..., not the expected {expected[:16]}...: "
                    "masks would not line up with this model's vocabulary", grpc.StatusCode.FAILED_PRECONDITION)
            self._info = info
        return self._info

    def ping(self, timeout_s: float | None = None) -> None:
        """An Info call the server answers now (not the one kept): MaskClientError when it does not."""
        try:
            self.stub.Info(pb.InfoRequest(), timeout=timeout_s or self.settings.timeout_s, metadata=self._auth)
        except grpc.RpcError as exc:
            raise MaskClientError(f"maskd at {self.target}: {exc.details() or exc.code().name}", exc.code()) from exc

    def wire_spec(self, msg: pb.GrammarSpec, timeout_s: float | None = None) -> pb.GrammarSpec:
        """The spec as this server reads it: a kind sent as its parts (a tool-call array, a
        template) goes to a server of an older contract revision as its whole JSON schema
        (``maskd.specs.wire_for_revision``: compiled whole there, the same rows), so that clients
        can be upgraded before the servers they talk to."""
        if msg.WhichOneof("kind") not in PARTS_REVISIONS:
            return msg
        try:
            return wire_for_revision(msg, self.info(timeout_s=timeout_s).contract_revision)
        except SpecError:
            return msg      # malformed parts: the server refuses this spec alone, with its reason

    def register(self, spec: Any, *, wait: bool = True, timeout_s: float | None = None,
                 require_ready: bool = False) -> str:
        """Registers a grammar; returns its id. MaskClientError with the compile error (or
        DEADLINE_EXCEEDED when ``wait`` outlasts ``timeout_s``; the compile goes on).

        A server may answer a waiting register before the compile ends (its wait ends just ahead
        of the call's deadline, or it has no thread free to wait on it): the id comes back with
        the grammar still compiling, and a sequence opened on it answers WAITING until it is done.
        ``require_ready``: such an answer raises DEADLINE_EXCEEDED instead, whichever end's clock
        ran out first, so the id returned is always of a compiled grammar."""
        request = pb.RegisterGrammarRequest(spec=self.wire_spec(spec_proto(spec), timeout_s), wait=wait,
                                            tokenizer_fingerprint=self.settings.expected_fingerprint or "")
        try:
            reply = self.stub.RegisterGrammar(request, timeout=timeout_s or self.settings.timeout_s,
                                              metadata=self._auth)
        except grpc.RpcError as exc:
            raise MaskClientError(exc.details() or exc.code().name, exc.code()) from exc
        if require_ready and reply.state != GrammarState.READY:
            if reply.state == GrammarState.FAILED:
                raise MaskClientError(f"grammar {reply.grammar_id} does not compile: {reply.error}",
                                      grpc.StatusCode.INVALID_ARGUMENT)
            raise MaskClientError(f"grammar {reply.grammar_id} is still compiling on {self.target}",
                                  grpc.StatusCode.DEADLINE_EXCEEDED)
        return reply.grammar_id

    def close(self) -> None:
        """Closes the channel once gRPC's connectivity poller (a thread that runs while anything
        subscribed to the channel's state, and for up to 0.2 s after) has ended: a channel closed
        under it makes that thread raise "Channel closed!" (waits 1 s at most)."""
        poller = getattr(self.channel, "_connectivity_state", None)    # grpc._channel's; absent elsewhere
        deadline = time.monotonic() + 1.0
        while getattr(poller, "polling", False) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.channel.close()


def pairs(items: Iterable[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    return tuple((str(k), v) for k, v in items)
