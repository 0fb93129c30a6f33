"""The gRPC MaskService: Info, RegisterGrammar and the Session stream.

The reply path is one method, ``_reply``: the step protocol's outcome (answers and rows) is
encoded into a StepResponse, timed from the request's arrival to the encoded reply (that time is
``server_seconds`` and ``maskd_step_seconds``), and recorded in the metrics.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, NoReturn

import grpc

import maskd
from maskd.rowcodec import ALL_ENCODINGS, DEFAULT_DICT_SIZE, RowBlockEncoder
from maskd.server import entries
from maskd.server.auth import Credentials
from maskd.server.config import Limits
from maskd.server.engines import Engine
from maskd.server.grammar_cache import GrammarCache, QueueFull
from maskd.server.metrics import Metrics
from maskd.server.quotas import Quotas
from maskd.server.registry import SessionRegistry
from maskd.server.session import StepOutcome
from maskd.server.slow_steps import SlowSteps
from maskd.server.step_routing import spec_problem
from maskd.specs import GrammarSpec, SpecError
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc
from maskd.v1.contract import CONTRACT_REVISION, SESSION_METADATA_KEY, Code, GrammarState, RowEncoding

log = logging.getLogger("maskd.server.service")
# RegisterGrammar calls that may block on a compile at once; more answer at once with the state.
# This keeps threads of the gRPC pool free for health checks and Info.
MAX_BLOCKING_REGISTERS = 8


class MaskServicer(pb_grpc.MaskServiceServicer):
    def __init__(self, engine: Engine, cache: GrammarCache, *, limits: Limits, metrics: Metrics,
                 credentials: Credentials | None = None, row_dict_size: int = DEFAULT_DICT_SIZE,
                 row_encodings: tuple[int, ...] = tuple(ALL_ENCODINGS), shared_drafts: Any = None) -> None:
        self.engine = engine
        self.cache = cache
        self.limits = limits
        self.metrics = metrics
        self.credentials = credentials or Credentials()
        self.row_dict_size = row_dict_size
        self.row_encodings = tuple(row_encodings)
        self.quotas = Quotas(limits)
        self.sessions = SessionRegistry(engine, cache, limits, self.quotas, shared_drafts)
        self.draining = threading.Event()
        self._blocking_registers = threading.BoundedSemaphore(MAX_BLOCKING_REGISTERS)
        self.slow_steps = SlowSteps(limits.slow_step_s, counter=metrics.slow_steps)

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
            row_compression="zstd", json_schema_mode=self.engine.json_schema_mode)

    def RegisterGrammar(self, request, context):
        tenant = self._tenant(context)
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
        problem = spec_problem(spec, self.limits)
        if problem:
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "grammar_too_large", problem)
        try:
            entry = self.cache.lookup(spec, tenant, start_pieces=True)
        except QueueFull as exc:
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "compile_queue_full", str(exc))
        if request.wait and self._blocking_registers.acquire(blocking=False):
            try:
                remaining = context.time_remaining()
                t0 = time.monotonic()
                entry = self.cache.wait(entry, remaining if remaining < 1e6 else None)
                log.debug("register %s waited %.3f s of %.1f: %s", entry.grammar_id, time.monotonic() - t0,
                          remaining, entry.state.name)
            finally:
                self._blocking_registers.release()
            if entry.state is GrammarState.FAILED:
                code = (grpc.StatusCode.RESOURCE_EXHAUSTED if entry.error_code == Code.RESOURCE_EXHAUSTED
                        else grpc.StatusCode.INVALID_ARGUMENT)
                self._abort(context, code, "grammar_failed",
                            f"grammar {entry.grammar_id} does not compile: {entry.error}")
        return pb.RegisterGrammarResponse(grammar_id=entry.grammar_id, state=entry.state,
                                          error=entry.error, compile_seconds=entry.compile_seconds)

    # -- the stream -------------------------------------------------------------------------------
    def Session(self, request_iterator, context):
        if self.draining.is_set():
            self._abort(context, grpc.StatusCode.UNAVAILABLE, "draining", "server is draining; connect elsewhere")
        tenant = self._tenant(context)
        problem = self.quotas.open_stream(tenant)
        if problem:
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too_many_streams", problem)
        try:
            # Without a key a stream gets a session of its own, under a name nobody can guess.
            key = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY) or "anon-" + secrets.token_hex(16)
            attachment = self.sessions.attach(tenant, key, context)
        except BaseException:
            self.quotas.close_stream(tenant)
            raise
        session = attachment.session
        self.metrics.sessions.inc()
        encoder = RowBlockEncoder(self.engine.words_per_row, self.engine.width, dict_size=self.row_dict_size,
                                  encodings=self.row_encodings)
        try:
            for request in request_iterator:
                t0 = self.slow_steps.start()
                attachment.last_active = time.monotonic()
                try:
                    outcome = session.step(request)
                except Exception as exc:   # a bug no phase caught: the entries fail, the stream lives
                    log.exception("step of %d entries failed", len(request.seqs))
                    outcome = session.refuse_all(request, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")
                yield self._reply(outcome, encoder, t0, request.want_forced_tokens)
                attachment.last_active = time.monotonic()
        finally:
            self.metrics.sessions.dec()
            self.sessions.detach(attachment)
            self.quotas.close_stream(tenant)

    def _reply(self, outcome: StepOutcome, encoder: RowBlockEncoder, t0: tuple[float, float, float, float],
               want_forced: bool) -> pb.StepResponse:
        """The one reply path: the step's answers (entries.write_answers) and the encoded rows into a StepResponse,
        timed and recorded (a slow step logged with its phases: slow_steps.py)."""
        reply = pb.StepResponse(words_per_row=self.engine.words_per_row, num_rows=len(outcome.rows))
        entries.write_answers(outcome.answers, reply, want_forced)
        try:
            reply.row_block = encoder.encode(outcome.rows)
        finally:
            if outcome.release is not None:
                outcome.release()     # the rows may sit in a buffer the session reuses
        seconds = self.slow_steps.finish(t0, outcome.marks, outcome.batch)
        reply.server_seconds = seconds
        self.metrics.observe_step(seconds=seconds, batch=outcome.batch,
                                  fill_seconds=outcome.fill_seconds, row_sizes=encoder.last_sizes,
                                  row_encodings=encoder.last_kinds, refusals=outcome.refusals)
        for outcome_kind, n in outcome.unmasked.items():
            self.metrics.opportunistic_steps.labels(outcome_kind).inc(n)
        if outcome.refusals and log.isEnabledFor(logging.DEBUG):
            log.debug("step of %d entries: refused or failed %s", outcome.batch, dict(outcome.refusals))
        return reply

    # -- gauges -----------------------------------------------------------------------------------
    def update_gauges(self) -> None:
        """Live/waiting gauges; called periodically, off the step path."""
        self.metrics.live_sequences.set(self.sessions.live_sequences())
        self.metrics.waiting_sequences.set(self.sessions.waiting_sequences())
        self.metrics.compile_queue.set(self.cache.queued())

    def end_idle_streams(self) -> int:
        """Ends the Session streams that carried nothing for the idle timeout; returns how many."""
        idle = self.sessions.idle(self.limits.idle_timeout_s)
        for attachment in idle:
            log.info("ending a Session stream of tenant %r idle for over %g s", attachment.session.tenant,
                     self.limits.idle_timeout_s)
            self.metrics.errors.labels("idle_stream").inc()
            if attachment.context is not None:
                attachment.context.cancel()
        return len(idle)

    def _tenant(self, context) -> str:
        tenant = self.credentials.tenant_of(context.invocation_metadata(), context.auth_context())
        if tenant is None:
            self._abort(context, grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
                        "missing or wrong credentials (a bearer token, or a client certificate whose common "
                        "name is a tenant)")
        return tenant or ""

    def live_sequences(self) -> int:
        return self.sessions.live_sequences()

    def _abort(self, context, code: grpc.StatusCode, kind: str, message: str) -> NoReturn:
        self.metrics.errors.labels(kind).inc()
        log.info("%s refused (%s): %s", context.peer() if hasattr(context, "peer") else "call", kind, message[:300])
        context.abort(code, message)
        raise AssertionError("context.abort returns only by raising")
