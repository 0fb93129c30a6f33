"""The gRPC MaskService: Info, RegisterGrammar and the Session stream."""
from __future__ import annotations

import itertools
import threading

import grpc

import maskd
from maskd.engines import Engine
from maskd.grammar_cache import GrammarCache, GrammarState
from maskd.metrics import Metrics
from maskd.rowcodec import ALL_ENCODINGS, DEFAULT_DICT_SIZE, ENCODING_NAMES, RowEncoder
from maskd.sessions import Limits, Session
from maskd.specs import GrammarSpec, SpecError
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc

SESSION_METADATA_KEY = "maskd-session"
_STATE = {GrammarState.COMPILING: pb.GRAMMAR_STATE_COMPILING, GrammarState.READY: pb.GRAMMAR_STATE_READY,
          GrammarState.FAILED: pb.GRAMMAR_STATE_FAILED}


class MaskService(pb_grpc.MaskServiceServicer):
    def __init__(self, engine: Engine, cache: GrammarCache, *, limits: Limits, metrics: Metrics,
                 max_message_bytes: int, row_dict_size: int = DEFAULT_DICT_SIZE,
                 row_encodings: tuple[int, ...] = tuple(ALL_ENCODINGS)) -> None:
        self.row_dict_size = row_dict_size
        self.row_encodings = tuple(row_encodings)
        self.engine = engine
        self.cache = cache
        self.limits = limits
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._anonymous = itertools.count()
        self.draining = threading.Event()

    # -- unary calls ----------------------------------------------------------------------------
    def Info(self, request, context):
        tok = self.engine.tokenizer
        return pb.InfoResponse(
            server_version=maskd.__version__, backend=self.engine.name, backend_version=self.engine.version,
            tokenizer=tok.spec, vocab_size=tok.vocab_size, logits_width=self.engine.width,
            words_per_row=self.engine.words_per_row, tokenizer_fingerprint=tok.fingerprint,
            eos_token_ids=list(tok.eos_token_ids), max_message_bytes=self.max_message_bytes,
            max_rows_per_step=self.limits.max_rows_per_step, row_encodings=list(self.row_encodings),
            row_dictionary_size=self.row_dict_size if pb.ROW_ENCODING_DICT_REF in self.row_encodings else 0)

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
                self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "compile_error",
                            f"grammar {entry.grammar_id} does not compile: {entry.error}")
        return pb.RegisterGrammarResponse(grammar_id=entry.grammar_id, state=_STATE[entry.state],
                                          error=entry.error, compile_seconds=entry.compile_seconds)

    # -- the stream -----------------------------------------------------------------------------
    def Session(self, request_iterator, context):
        if self.draining.is_set():
            self._abort(context, grpc.StatusCode.UNAVAILABLE, "draining", "server is draining; connect elsewhere")
        key = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY) or f"anon-{next(self._anonymous)}"
        session = self._attach(key)
        encoder = RowEncoder(self.engine.words_per_row, self.engine.width, dict_size=self.row_dict_size,
                             encodings=self.row_encodings)
        try:
            for request in request_iterator:
                reply, rows = session.step(request)
                sizes = encoder.encode(rows, reply)
                self._observe(sizes, encoder.last_encodings)
                yield reply
        finally:
            self._detach(session)

    # -- sessions -------------------------------------------------------------------------------
    def _attach(self, key: str) -> Session:
        with self._sessions_lock:
            session = self._sessions.get(key)
            if session is None:
                session = Session(key, self.engine, self.cache, self.limits, self.metrics)
                self._sessions[key] = session
            session.streams += 1
            self.metrics.sessions.inc()
            return session

    def _detach(self, session: Session) -> None:
        with self._sessions_lock:
            session.streams -= 1
            self.metrics.sessions.dec()
            if session.streams == 0:
                del self._sessions[session.key]
                session.close_all()  # a dropped stream frees all its sequences

    def _observe(self, sizes: list[int], encodings: list[int]) -> None:
        if not sizes:
            return
        per_encoding: dict[int, list[int]] = {}
        for size, enc in zip(sizes, encodings):
            per_encoding.setdefault(enc, []).append(size)
        for enc, group in per_encoding.items():
            name = ENCODING_NAMES[enc]
            hist = self.metrics.row_bytes.labels(name)
            for size in group:
                hist.observe(size)
            self.metrics.rows_sent.labels(name).inc(len(group))
        refs = len(per_encoding.get(pb.ROW_ENCODING_DICT_REF, ()))
        if refs:
            self.metrics.row_dict.labels("hit").inc(refs)
        if len(sizes) > refs:
            self.metrics.row_dict.labels("miss").inc(len(sizes) - refs)

    def update_gauges(self) -> None:
        """Live/waiting gauges; called periodically, off the step path."""
        with self._sessions_lock:
            sessions = list(self._sessions.values())
        self.metrics.live_sequences.set(sum(len(s.seqs) for s in sessions))
        self.metrics.waiting_sequences.set(sum(s.waiting_count() for s in sessions))

    def live_sequences(self) -> int:
        with self._sessions_lock:
            return sum(len(s.seqs) for s in self._sessions.values())

    def _abort(self, context, code: grpc.StatusCode, kind: str, message: str):
        self.metrics.errors.labels(kind).inc()
        context.abort(code, message)
