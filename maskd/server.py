"""A maskd server: gRPC MaskService + health + metrics, with graceful drain."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import signal
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from maskd.engines import create_engine
from maskd.engines.base import EngineLimits
from maskd.grammar_cache import GrammarCache, SharedGrammarStore
from maskd.metrics import Metrics
from maskd.rowcodec import DEFAULT_DICT_SIZE
from maskd.service import MaskService
from maskd.sessions import Limits
from maskd.tokenizers import load_tokenizer
from maskd.v1 import maskd_pb2_grpc as pb_grpc

log = logging.getLogger("maskd.server")
SERVICE_NAME = "maskd.v1.MaskService"


@dataclasses.dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051                 # 0 picks a free port
    tokenizer: str = "deepseek-v4"
    backend: str = "llguidance"
    logits_width: int | None = None
    threads: int = max(1, (os.cpu_count() or 2))
    compile_threads: int = 2
    compile_timeout_s: float = 30.0
    cache_entries: int = 1024
    max_streams: int = 256
    max_message_bytes: int = 64 << 20
    max_grammar_bytes: int = 1 << 20
    max_draft_tokens: int = 16
    max_rows_per_step: int = 8192
    metrics_port: int | None = None   # None: no HTTP endpoint; 0: a free port
    metrics_host: str = "0.0.0.0"
    tls_cert: str | None = None       # PEM files; both set: serve TLS
    tls_key: str | None = None
    auth_token: str | None = None     # clients send "authorization: Bearer <token>"
    row_dict_size: int = DEFAULT_DICT_SIZE  # rows per stream for DICT_REF (0: off)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses MaskService calls without the bearer token; health checks stay open for probes."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith("/grpc.health.v1."):
            return continuation(handler_call_details)
        md = dict(handler_call_details.invocation_metadata or ())
        if md.get("authorization") == self._expected:
            return continuation(handler_call_details)
        return self._deny_stream if method.endswith("/Session") else self._deny_unary


class MaskServer:
    def __init__(self, config: ServerConfig, *, shared_cache: SharedGrammarStore | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        tokenizer = load_tokenizer(config.tokenizer, config.logits_width)
        self.engine = create_engine(config.backend, tokenizer, threads=config.threads,
                                    limits=EngineLimits(config.max_grammar_bytes, config.compile_timeout_s))
        self.cache = GrammarCache(self.engine, max_entries=config.cache_entries,
                                  compile_threads=config.compile_threads,
                                  compile_timeout_s=config.compile_timeout_s, metrics=self.metrics,
                                  shared=shared_cache)
        limits = Limits(max_grammar_bytes=config.max_grammar_bytes, max_draft_tokens=config.max_draft_tokens,
                        max_rows_per_step=config.max_rows_per_step)
        self.service = MaskService(self.engine, self.cache, limits=limits, metrics=self.metrics,
                                   max_message_bytes=config.max_message_bytes, row_dict_size=config.row_dict_size)
        self.health = health.HealthServicer()
        self._grpc = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=config.max_streams + 8,
                                                  thread_name_prefix="maskd-grpc"),
            options=[("grpc.max_receive_message_length", config.max_message_bytes),
                     ("grpc.max_send_message_length", -1),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=config.max_streams,
            interceptors=[AuthInterceptor(config.auth_token)] if config.auth_token else [])
        pb_grpc.add_MaskServiceServicer_to_server(self.service, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        bind = f"{config.host}:{config.port}"
        if config.tls_cert or config.tls_key:
            if not (config.tls_cert and config.tls_key):
                raise ValueError("TLS needs both a certificate and a key")
            with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            self.port = self._grpc.add_secure_port(bind, creds)
        else:
            self.port = self._grpc.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        self.metrics_port: int | None = None
        self._metrics_http = None
        self._stopped = threading.Event()
        self._gauge_thread = threading.Thread(target=self._refresh_gauges, daemon=True, name="maskd-gauges")

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> "MaskServer":
        if self.config.metrics_port is not None:
            self._metrics_http, _ = self.metrics.serve_http(self.config.metrics_port, self.config.metrics_host)
            self.metrics_port = self._metrics_http.server_port
        self._grpc.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._gauge_thread.start()
        log.info("maskd serving on %s (backend %s, tokenizer %s, width %d)", self.address,
                 self.engine.name, self.engine.tokenizer.spec, self.engine.width)
        return self

    def stop(self, grace: float | None = 5.0) -> None:
        """Drains: health goes NOT_SERVING, new streams are refused, open ones get `grace` seconds."""
        if self._stopped.is_set():
            return
        self.service.draining.set()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._grpc.stop(grace).wait()
        self._stopped.set()
        self.cache.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def serve_forever(self) -> None:
        """Runs until SIGTERM/SIGINT, then drains."""
        done = threading.Event()

        def on_signal(signum, frame):
            log.info("signal %s: draining", signum)
            done.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        done.wait()
        self.stop(grace=10.0)

    def _refresh_gauges(self) -> None:
        while not self._stopped.wait(1.0):
            self.service.update_gauges()

    def __enter__(self) -> "MaskServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=1.0)
