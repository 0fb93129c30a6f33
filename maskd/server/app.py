"""MaskServer: the gRPC MaskService with health checking and metrics, and a graceful drain."""
from __future__ import annotations

import concurrent.futures
import logging
import signal
import sys
import threading
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from maskd.server.auth import AuthInterceptor
from maskd.server.config import ConfigError, ServerConfig
from maskd.server.engines import create_engine
from maskd.server.grammar_cache import GrammarCache, SharedGrammarStore
from maskd.server.metrics import Metrics
from maskd.server.service import MaskService
from maskd.server.tokenizers import TokenizerError, load_tokenizer
from maskd.v1 import maskd_pb2_grpc as pb_grpc

log = logging.getLogger("maskd.server")
SERVICE_NAME = "maskd.v1.MaskService"


class MaskServer:
    def __init__(self, config: ServerConfig, *, shared_cache: SharedGrammarStore | None = None) -> None:
        config.check()
        self.config = config
        limits = config.limits
        self.metrics = Metrics()
        tokenizer = load_tokenizer(config.tokenizer, config.logits_width, allow_download=config.allow_hub_download)
        self.engine = create_engine(config.backend, tokenizer, threads=config.fill_threads)
        self.cache = GrammarCache(self.engine, max_entries=config.cache_entries,
                                  compile_threads=config.compile_threads,
                                  compile_timeout_s=limits.compile_timeout_s, metrics=self.metrics,
                                  shared=shared_cache)
        self.service = MaskService(self.engine, self.cache, limits=limits, metrics=self.metrics,
                                   row_dict_size=config.row_dict_size)
        self.health = health.HealthServicer()
        token = config.resolved_auth_token()
        self._grpc = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=limits.max_streams + 8,
                                                  thread_name_prefix="maskd-grpc"),
            options=[("grpc.max_receive_message_length", limits.max_message_bytes),
                     ("grpc.max_send_message_length", -1),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=limits.max_streams,
            interceptors=[AuthInterceptor(token)] if token else [])
        pb_grpc.add_MaskServiceServicer_to_server(self.service, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        bind = f"{config.host}:{config.port}"
        try:
            if config.tls_cert and config.tls_key:
                with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
                self.port = self._grpc.add_secure_port(bind, creds)
            else:
                self.port = self._grpc.add_insecure_port(bind)
        except RuntimeError:   # grpc: "Failed to bind to address ..." without the reason
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC port {bind}: {_bind_error(config.host, config.port)}")
        self.metrics_port: int | None = None
        self._metrics_http: Any = None
        self._stopped = threading.Event()
        self._gauge_thread = threading.Thread(target=self._refresh_gauges, daemon=True, name="maskd-gauges")

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> MaskServer:
        if self.config.metrics_port is not None:
            try:
                self._metrics_http, _ = self.metrics.serve_http(self.config.metrics_port,
                                                                self.config.metrics_bind_host)
            except OSError as exc:
                raise OSError(f"cannot bind the metrics port {self.config.metrics_bind_host}:"
                              f"{self.config.metrics_port}: {exc.strerror or exc}") from exc
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
        # Bounded: after some garbage input (e.g. a message over the size limit) grpc's shutdown event
        # can stay unset although every call has ended; the drain must not hang on it.
        if not self._grpc.stop(grace).wait((grace or 0.0) + 5.0):
            log.warning("maskd on %s: gRPC shutdown did not complete %g s after the grace period",
                        self.address, 5.0)
        self._stopped.set()
        self.cache.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        log.info("maskd on %s stopped", self.address)

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def serve_forever(self, grace_s: float = 10.0) -> None:
        """Runs until SIGTERM/SIGINT, then drains."""
        done = threading.Event()

        def on_signal(signum, frame):
            log.info("signal %s: draining", signum)
            done.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        done.wait()
        self.stop(grace=grace_s)

    def _refresh_gauges(self) -> None:
        while not self._stopped.wait(1.0):
            self.service.update_gauges()

    def __enter__(self) -> MaskServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=1.0)


def _bind_error(host: str, port: int) -> str:
    """Why HOST:PORT cannot be bound (grpc does not say): the OS's reason from a plain socket."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host!r}: {exc.strerror or exc}"
    family, _, _, _, address = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return "grpc could not bind it"


def start_or_exit(config: ServerConfig, prog: str = "maskd") -> MaskServer:
    """Starts a server, or exits the process with a message a person can act on (command lines)."""
    try:
        config.check()
        return MaskServer(config).start()
    except (ConfigError, TokenizerError) as exc:
        sys.exit(f"{prog}: {exc}")
    except (OSError, RuntimeError, ValueError) as exc:
        sys.exit(f"{prog}: cannot start the server: {exc}")
