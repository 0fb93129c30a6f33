"""MaskServer: the gRPC MaskService with health checking, metrics, tenants, and a graceful drain.

Drain (SIGTERM, or ``stop``): health turns NOT_SERVING and new Session streams are refused at
once, while the port keeps answering for ``drain_delay_s`` (so load balancers and probes see the
drain); then gRPC stops taking calls and open streams get ``drain_grace_s`` to finish; then the
server exits. Every wait is bounded, whatever the input was.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from maskd.server import compile_pool
from maskd.server.auth import AuthConfigError, AuthInterceptor, Credentials
from maskd.server.config import ConfigError, ServerConfig
from maskd.server.drafts import SharedDraftCounts
from maskd.server.engines import create_engine
from maskd.server.grammar_cache import GrammarCache, SharedGrammarStore
from maskd.server.metrics import Metrics
from maskd.server.service import MaskServicer
from maskd.server.tokenizers import TokenizerError, load_tokenizer
from maskd.v1 import maskd_pb2_grpc as pb_grpc

log = logging.getLogger("maskd.server")
SERVICE_NAME = "maskd.v1.MaskService"
# gRPC threads beyond the stream cap: each Session stream holds a thread, so these stay free for
# health checks, Info and RegisterGrammar whatever the streams do.
UNARY_THREADS = 16


class MaskServer:
    def __init__(self, config: ServerConfig, *, shared_cache: SharedGrammarStore | None = None) -> None:
        config.check()
        self.config = config
        limits = config.limits
        try:
            self.credentials = Credentials(token=config.resolved_auth_token(), tokens_file=config.auth_tokens_file,
                                           client_certificates=bool(config.tls_client_ca))
        except AuthConfigError as exc:
            raise ConfigError(str(exc)) from exc
        self.metrics = Metrics()
        tokenizer = load_tokenizer(config.tokenizer, config.logits_width, allow_download=config.allow_hub_download)
        self.engine = create_engine(config.backend, tokenizer, threads=config.fill_threads,
                                    json_schema_mode=config.json_schema_mode)
        self._pool = (compile_pool.acquire(config.backend, config.tokenizer, config.logits_width,
                                           config.compile_threads, config.json_schema_mode, config.compile_nice)
                      if config.compile_isolation == "process" else None)
        self.cache = GrammarCache(self.engine, max_entries=config.cache_entries, max_bytes=config.cache_bytes,
                                  compile_threads=config.compile_threads, compile_timeout_s=limits.compile_timeout_s,
                                  metrics=self.metrics, shared=shared_cache, pool=self._pool,
                                  max_queued_per_tenant=limits.max_compiles_queued_per_tenant,
                                  max_queued=limits.max_compiles_queued,
                                  max_running_per_tenant=limits.max_compiles_running_per_tenant,
                                  nice=config.compile_nice)
        self.service = MaskServicer(self.engine, self.cache, limits=limits, metrics=self.metrics,
                                   credentials=self.credentials, row_dict_size=config.row_dict_size,
                                   shared_drafts=_draft_counts(shared_cache))
        self.health = health.HealthServicer()
        self._grpc = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=limits.max_streams + UNARY_THREADS,
                                                  thread_name_prefix="maskd-grpc"),
            options=[("grpc.max_receive_message_length", limits.max_message_bytes),
                     ("grpc.max_send_message_length", -1),
                     ("grpc.so_reuseport", 0)],
            interceptors=[AuthInterceptor(self.credentials)] if self.credentials.required else [])
        pb_grpc.add_MaskServiceServicer_to_server(self.service, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        bind = f"{config.host}:{config.port}"
        try:
            if config.tls_cert and config.tls_key:
                self.port = self._grpc.add_secure_port(bind, self._tls_credentials())
            else:
                self.port = self._grpc.add_insecure_port(bind)
        except RuntimeError:   # grpc: "Failed to bind to address ..." without the reason
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC port {bind}: {_bind_error(config.host, config.port)}")
        self.metrics_port: int | None = None
        self._metrics_http: Any = None
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._housekeeper = threading.Thread(target=self._housekeeping, daemon=True, name="maskd-housekeeping")
        self._drafts_sync = (threading.Thread(target=self._sync_drafts, daemon=True, name="maskd-drafts-sync")
                             if self.service.sessions.drafts.shared is not None else None)

    def _tls_credentials(self) -> grpc.ServerCredentials:
        cfg = self.config
        assert cfg.tls_cert and cfg.tls_key
        with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
            pair = (k.read(), c.read())
        if cfg.tls_client_ca:
            with open(cfg.tls_client_ca, "rb") as ca:
                return grpc.ssl_server_credentials([pair], root_certificates=ca.read(), require_client_auth=True)
        return grpc.ssl_server_credentials([pair])

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
        self.engine.prepare(nice=self.config.compile_nice)   # while the compile workers load their engines
        if self._pool is not None and not self._pool.wait_warm(120.0):
            log.warning("maskd: compile workers still loading the engine after 120 s; serving anyway")
        self._grpc.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._housekeeper.start()
        if self._drafts_sync is not None:
            self._drafts_sync.start()
        log.info("maskd serving on %s (backend %s, tokenizer %s, width %d, compiles in %s)", self.address,
                 self.engine.name, self.engine.tokenizer.spec, self.engine.width,
                 "worker processes" if self.config.compile_isolation == "process" else "server threads")
        return self

    def stop(self, grace: float | None = None, delay: float = 0.0) -> None:
        """Drains: health NOT_SERVING and new streams refused, ``delay`` seconds of that, then open
        streams get ``grace`` seconds (default: the config's drain grace), then everything stops."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            grace = self.config.drain_grace_s if grace is None else grace
            self.service.draining.set()
            for name in ("", SERVICE_NAME):
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            if delay > 0:
                log.info("maskd on %s: NOT_SERVING; stopping in %g s", self.address, delay)
                self._stopped.wait(delay)
            # Bounded: after some garbage input (e.g. a message over the size limit) grpc's shutdown
            # event can stay unset although every call has ended; the drain must not hang on it.
            if not self._grpc.stop(grace).wait(grace + 5.0):
                log.warning("maskd on %s: gRPC shutdown did not complete 5 s after the grace period", self.address)
            self._stopped.set()
            self.cache.close()
            if self._pool is not None:
                compile_pool.release(self._pool)
            if self._metrics_http is not None:
                self._metrics_http.shutdown()
            log.info("maskd on %s stopped", self.address)

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Runs until SIGTERM/SIGINT, then drains (SIGHUP reloads the tokens file). If the drain
        does not finish in its bounded time, the process exits anyway. ``on_ready`` runs once the
        signals are handled (a "serving" line printed before could be answered by a signal that
        still had its default action: killed, not drained)."""
        # The handlers only put the signal on a queue whose put is reentrant; the main thread acts
        # on it. (A handler that set a threading.Event deadlocked when the signal came while this
        # thread held the Event's own lock, entering its wait: the process never drained.)
        received: queue.SimpleQueue[int] = queue.SimpleQueue()

        def on_signal(signum, frame):
            received.put(signum)

        for handled in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(handled, on_signal)
        if on_ready is not None:
            on_ready()
        while (signum := _next_signal(received)) == signal.SIGHUP:
            try:
                n = self.credentials.reload()
                log.warning("SIGHUP: %d tokens loaded from %s", n, self.config.auth_tokens_file)
            except AuthConfigError as exc:
                log.error("SIGHUP: tokens file not reloaded, the old tokens stay: %s", exc)
        log.warning("signal %s: draining (delay %g s, grace %g s)", signal.Signals(signum).name,
                    self.config.drain_delay_s, self.config.drain_grace_s)
        limit = self.config.drain_delay_s + self.config.drain_grace_s + 15.0
        watchdog = threading.Timer(limit, _exit_now, args=(limit,))
        watchdog.daemon = True
        watchdog.start()
        self.stop(delay=self.config.drain_delay_s)
        watchdog.cancel()

    def _housekeeping(self) -> None:
        """Once a second, off the step path: gauges, the end of streams idle too long, and the
        tokens file reloaded when it changed."""
        while not self._stopped.wait(1.0):
            self.service.update_gauges()
            self.service.end_idle_streams()
            self.credentials.reload_if_changed()

    def _sync_drafts(self) -> None:
        """Grammar drafts' counts with the cluster's store, every --drafts-sync seconds (a thread of
        its own: an exchange waits on the store)."""
        drafts = self.service.sessions.drafts
        while not self._stopped.wait(self.config.drafts_sync_s):
            drafts.sync()

    def __enter__(self) -> MaskServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=1.0)


def _draft_counts(shared: SharedGrammarStore | None) -> SharedDraftCounts | None:
    """The shared store as the drafter's cluster-wide counts, where it keeps them."""
    return shared if shared is not None and hasattr(shared, "exchange_draft_counts") else None  # type: ignore[return-value]


def _next_signal(received: queue.SimpleQueue[int]) -> int:
    while True:
        try:
            return received.get(timeout=1.0)
        except queue.Empty:
            continue


def _exit_now(limit: float) -> None:
    log.error("maskd: the drain did not finish within %g s; exiting", limit)
    logging.shutdown()
    os._exit(1)


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
