"""The gRPC MaskService: Info, RegisterGrammar and the Session stream.

The reply path is one method, ``_reply``: the step protocol's outcome (results and rows) is
encoded into a StepResponse, timed from the request's arrival to the encoded reply (that time is
``server_seconds`` and ``maskd_step_seconds``), and recorded in the metrics.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

import maskd
from maskd.rowcodec import ALL_ENCODINGS, DEFAULT_DICT_SIZE, RowEncoder
from maskd.server.config import Limits
from maskd.server.engines import Engine
from maskd.server.grammar_cache import GrammarCache
from maskd.server.metrics import Metrics
from maskd.server.registry import SessionRegistry
from maskd.server.session import StepOutcome
from maskd.specs import GrammarSpec, SpecError
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc
from maskd.v1.contract import CONTRACT_REVISION, SESSION_METADATA_KEY, GrammarState, RowEncoding

log = logging.getLogger("maskd.server.service")


class MaskService(pb_grpc.MaskServiceServicer):
    def __init__(self, engine: Engine, cache: GrammarCache, *, limits: Limits, metrics: Metrics,
                 row_dict_size: int = DEFAULT_DICT_SIZE,
                 row_encodings: tuple[int, ...] = tuple(ALL_ENCODINGS)) -> None:
        self.engine = engine
        self.cache = cache
        self.limits = limits
        self.metrics = metrics
        self.row_dict_size = row_dict_size
        self.row_encodings = tuple(row_encodings)
        self.sessions = SessionRegistry(engine, cache, limits)
        self._anonymous = itertools.count()
        self.draining = threading.Event()

    # -- unary calls ------------------------------------------------------------------------------
    def Info(self, request, context):
        tok = self.engine.tokenizer
        lim = self.limits
        return pb.InfoResponse(
            server_version=maskd.__version__, backend=self.engine.name, backend_version=self.engine.version,
            tokenizer=tok.spec, vocab_size=tok.vocab_size, logits_width=self.engine.width,
            words_per_row=self.engine.words_per_row, tokenizer_fingerprint=tok.fingerprint,
            eos_token_ids=list(tok.eos_token_ids), max_message_bytes=lim.max_message_bytes,
            max_rows_per_step=lim.max_rows_per_step, row_encodings=list(self.row_encodings),
            row_dictionary_size=self.row_dict_size if RowEncoding.DICT_REF in self.row_encodings else 0,
            contract_revision=CONTRACT_REVISION, max_tokens_per_step=lim.max_tokens_per_step,
            max_draft_tokens=lim.max_draft_tokens, max_sequences_per_session=lim.max_sequences_per_session,
            json_schema_mode=self.engine.json_schema_mode)

    def RegisterGrammar(self, request, context):
        if request.backend and request.backend != self.engine.name:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "unknown_backend",
                        f"this server runs backend {self.engine.name!r}, not {request.backend!r}")
        fp = self.engine.tokenizer.fingerprint
        if request.tokenizer_fingerprint and request.tokenizer_fingerprint != fp:
            self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, "tokenizer_mismatch",
                        f"tokenizer fingerprint {request.tokenizer_fingerprint[:16]}... does not match this "
                        f"server's {self.engine.tokenizer.spec!r} ({fp[:16]}...)")
        if not request.HasField("spec"):
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_spec", "RegisterGrammar needs a spec")
        try:
            spec = GrammarSpec.from_proto(request.spec)
        except SpecError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_spec", str(exc))
        if spec.size > self.limits.max_grammar_bytes:
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "grammar_too_large",
                        f"grammar is {spec.size} bytes; the limit is {self.limits.max_grammar_bytes}")
        entry = self.cache.lookup(spec)
        if request.wait:
            entry = self.cache.wait(entry)
            if entry.state is GrammarState.FAILED:
                self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "grammar_failed",
                            f"grammar {entry.grammar_id} does not compile: {entry.error}")
        return pb.RegisterGrammarResponse(grammar_id=entry.grammar_id, state=entry.state,
                                          error=entry.error, compile_seconds=entry.compile_seconds)

    # -- the stream -------------------------------------------------------------------------------
    def Session(self, request_iterator, context):
        if self.draining.is_set():
            self._abort(context, grpc.StatusCode.UNAVAILABLE, "draining", "server is draining; connect elsewhere")
        key = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY) or f"anon-{next(self._anonymous)}"
        session = self.sessions.attach(key)
        self.metrics.sessions.inc()
        encoder = RowEncoder(self.engine.words_per_row, self.engine.width, dict_size=self.row_dict_size,
                             encodings=self.row_encodings)
        try:
            for request in request_iterator:
                t0 = time.perf_counter()
                yield self._reply(session.step(request), encoder, t0)
        finally:
            self.metrics.sessions.dec()
            self.sessions.detach(session)

    def _reply(self, outcome: StepOutcome, encoder: RowEncoder, t0: float) -> pb.StepResponse:
        """The one reply path: results and encoded rows into a StepResponse, timed and recorded."""
        reply = pb.StepResponse(words_per_row=self.engine.words_per_row)
        reply.results.extend(outcome.results)
        sizes = encoder.encode(outcome.rows, reply)
        seconds = time.perf_counter() - t0
        reply.server_seconds = seconds
        self.metrics.observe_step(seconds=seconds, batch=len(outcome.results), fill_seconds=outcome.fill_seconds,
                                  row_sizes=sizes, row_encodings=encoder.last_encodings, refusals=outcome.refusals)
        if outcome.refusals and log.isEnabledFor(logging.DEBUG):
            log.debug("step of %d entries: refused or failed %s", len(outcome.results), dict(outcome.refusals))
        return reply

    # -- gauges -----------------------------------------------------------------------------------
    def update_gauges(self) -> None:
        """Live/waiting gauges; called periodically, off the step path."""
        self.metrics.live_sequences.set(self.sessions.live_sequences())
        self.metrics.waiting_sequences.set(self.sessions.waiting_sequences())

    def live_sequences(self) -> int:
        return self.sessions.live_sequences()

    def _abort(self, context, code: grpc.StatusCode, kind: str, message: str):
        self.metrics.errors.labels(kind).inc()
        log.info("%s refused (%s): %s", context.peer() if hasattr(context, "peer") else "call", kind, message[:300])
        context.abort(code, message)
