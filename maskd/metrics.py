"""Prometheus metrics of a maskd server, on their own registry so that several servers
(tests, Ray workers) can live in one process."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
_BYTES_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram("maskd_step_seconds", "Server time per decode step (request parsed to reply built)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.fill_seconds = Histogram("maskd_mask_fill_seconds", "Batched mask fill time per step",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.step_batch = Histogram("maskd_step_batch_size", "Sequences per step message",
                                    buckets=(1, 4, 16, 64, 128, 256, 512, 1024), registry=r)
        self.compile_seconds = Histogram("maskd_compile_seconds", "Grammar compile time",
                                         ["backend"], buckets=_COMPILE_BUCKETS, registry=r)
        self.cache_hits = Counter("maskd_grammar_cache_hits", "Grammar cache hits", ["cache"], registry=r)
        self.cache_misses = Counter("maskd_grammar_cache_misses", "Grammar cache misses", ["cache"], registry=r)
        self.cache_size = Gauge("maskd_grammar_cache_entries", "Grammars held in the local cache", registry=r)
        self.live_sequences = Gauge("maskd_live_sequences", "Open sequences", registry=r)
        self.waiting_sequences = Gauge("maskd_waiting_sequences", "Sequences waiting for their grammar", registry=r)
        self.sessions = Gauge("maskd_open_streams", "Open session streams", registry=r)
        self.row_bytes = Histogram("maskd_row_bytes", "Bytes sent per mask row", ["encoding"],
                                   buckets=_BYTES_BUCKETS, registry=r)
        self.rows_sent = Counter("maskd_rows_sent", "Mask rows sent", ["encoding"], registry=r)
        self.row_dict = Counter("maskd_row_dictionary_lookups", "Row dictionary lookups", ["result"], registry=r)
        self.errors = Counter("maskd_errors", "Errors by kind", ["kind"], registry=r)

    def serve_http(self, port: int, addr: str = "0.0.0.0"):
        """Starts the /metrics endpoint; returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)
