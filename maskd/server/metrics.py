"""Prometheus metrics of a maskd server, on their own registry so that several servers
(tests, Ray workers) can live in one process."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from maskd.v1.contract import RowEncoding

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
_BYTES_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
_ENCODING_LABELS = {e.value: e.name.lower() for e in RowEncoding}


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram("maskd_step_seconds",
                                      "Server time per decode step (request received to reply encoded)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.slow_steps = Counter("maskd_slow_steps", "Steps over --slow-step (each logged with its phases, at "
                                  "most one line a second)", registry=r)
        self.fill_seconds = Histogram("maskd_mask_fill_seconds", "Batched mask fill time per step",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.step_batch = Histogram("maskd_step_batch_size", "Sequences per step message",
                                    buckets=(1, 4, 16, 64, 128, 256, 512, 1024), registry=r)
        self.compile_seconds = Histogram("maskd_compile_seconds", "Grammar compile time",
                                         ["backend"], buckets=_COMPILE_BUCKETS, registry=r)
        self.cache_hits = Counter("maskd_grammar_cache_hits", "Grammar cache hits", ["cache"], registry=r)
        self.cache_misses = Counter("maskd_grammar_cache_misses", "Grammar cache misses", ["cache"], registry=r)
        self.cache_size = Gauge("maskd_grammar_cache_entries", "Grammars held in the local cache", registry=r)
        self.cache_bytes = Gauge("maskd_grammar_cache_bytes", "Bytes of the grammars held in the local cache",
                                 registry=r)
        self.compile_queue = Gauge("maskd_compile_queue", "Grammars waiting for a compile thread", registry=r)
        self.live_sequences = Gauge("maskd_live_sequences", "Open sequences", registry=r)
        self.waiting_sequences = Gauge("maskd_waiting_sequences", "Sequences waiting for their grammar", registry=r)
        self.sessions = Gauge("maskd_open_streams", "Open session streams", registry=r)
        self.row_bytes = Histogram("maskd_row_bytes", "Bytes sent per mask row", ["encoding"],
                                   buckets=_BYTES_BUCKETS, registry=r)
        self.rows_sent = Counter("maskd_rows_sent", "Mask rows sent", ["encoding"], registry=r)
        self.row_dict = Counter("maskd_row_dictionary_lookups", "Row dictionary lookups", ["result"], registry=r)
        self.validation_seconds = Histogram(
            "maskd_validation_seconds", "Complete JSON-schema mode: document checks per step (decoding, early "
            "checks of closed sub-documents, final checks before EOS), run beside the mask fill",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.validation_failures = Counter(
            "maskd_validation_failures", "Complete JSON-schema mode: sequences failed by the JSON Schema validator "
            "(final: the finished document; early: a closed sub-document; eos: an EOS token on a document that "
            "does not pass; draft: a draft EOS on one)", ["kind"], registry=r)
        self.drafts_proposed = Counter(
            "maskd_drafts_proposed", "Grammar drafts proposed (propose_drafts), by source: forced (the grammar "
            "forces the token) or learned (counts of what the grammar's sequences wrote next)", ["source"], registry=r)
        self.drafts_accepted = Counter(
            "maskd_drafts_accepted", "Proposed grammar drafts the next step's tokens took, by source", ["source"],
            registry=r)
        self.opportunistic_steps = Counter(
            "maskd_opportunistic_steps", "Steps whose token was sampled without a row (sampled_unmasked), by "
            "outcome: allowed (consumed, no row sent) or resample (refused: a row sent to sample again with)",
            ["outcome"], registry=r)
        self.tool_pieces = Counter(
            "maskd_tool_call_pieces", "tool_choice 'required' call arrays composed from per-tool pieces: pieces "
            "compiled for one (compiled), pieces found compiled (cached), arrays composed (composed)", ["outcome"],
            registry=r)
        self.errors = Counter("maskd_errors", "Errors by kind (refused entries, failed sequences, "
                                              "compile failures, aborted calls)", ["kind"], registry=r)

    def observe_step(self, *, seconds: float, batch: int, fill_seconds: float, row_sizes: np.ndarray,
                     row_encodings: np.ndarray, refusals: Mapping[str, int]) -> None:
        """Everything one step records: the one place the reply path calls. Row sizes are bytes in
        the row block (before the stream's compression), per encoding: one observation each of
        the encoding's mean, weighted by its rows, keeps this O(encodings) per step."""
        self.step_seconds.observe(seconds)
        self.step_batch.observe(batch)
        if fill_seconds:
            self.fill_seconds.observe(fill_seconds)
        for kind, n in refusals.items():
            self.errors.labels(kind).inc(n)
        if not len(row_encodings):
            return
        counts = np.bincount(row_encodings, minlength=len(_ENCODING_LABELS))
        totals = np.bincount(row_encodings, weights=row_sizes, minlength=len(_ENCODING_LABELS))
        for enc, n in enumerate(counts.tolist()):
            if n:
                name = _ENCODING_LABELS[enc]
                self.rows_sent.labels(name).inc(n)
                self.row_bytes.labels(name).observe(float(totals[enc]) / n)
        refs = int(counts[RowEncoding.DICT_REF])
        if refs:
            self.row_dict.labels("hit").inc(refs)
        if len(row_encodings) > refs:
            self.row_dict.labels("miss").inc(len(row_encodings) - refs)

    def watch_drafts(self, drafts: Any) -> None:
        """Per-grammar draft metrics, read from the drafter at each scrape: one series per grammar
        it holds (bounded by its grammars; a grammar it forgets leaves the scrape)."""
        self.registry.register(_PerGrammarDrafts(drafts))

    def serve_http(self, port: int, addr: str):
        """Starts the /metrics endpoint on addr:port; returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)


class _PerGrammarDrafts:
    """Collector of maskd_grammar_drafts_{proposed,accepted}_total{tenant, grammar}."""

    def __init__(self, drafts: Any) -> None:
        self.drafts = drafts

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        proposed = CounterMetricFamily("maskd_grammar_drafts_proposed", "Grammar drafts proposed, per grammar "
                                       "(the grammars the drafter holds)", labels=["tenant", "grammar"])
        accepted = CounterMetricFamily("maskd_grammar_drafts_accepted", "Proposed grammar drafts the next "
                                       "step's tokens took, per grammar", labels=["tenant", "grammar"])
        for key, n_proposed, n_accepted in self.drafts.per_grammar():
            tenant, _, grammar = key.rpartition("\x00")
            proposed.add_metric([tenant, grammar], n_proposed)
            accepted.add_metric([tenant, grammar], n_accepted)
        yield proposed
        yield accepted
