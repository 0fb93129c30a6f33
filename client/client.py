"""MaskClient: one gRPC session stream from a GPU worker to a maskd server.

    with MaskClient("127.0.0.1:50051") as mc:
        mc.open("req-1", {"json_schema": schema})
        fut = mc.step_async({"req-1": []})        # right after sampling
        ...                                       # forward pass runs
        res = fut.result()                        # right before the next sampling
        rows = res.bitmask                        # int32 (rows, words)

One StepRequest per decode step carries the whole batch. Steps are idempotent on the
server, so when the stream breaks the client reconnects, restores its sequences (each
re-opened at its step with its whole token history) and resends the steps in flight:
nothing is lost and no output changes.

A target of the form ``directory:HOST:PORT`` names a maskd cluster's directory instead of a
server: ``MaskClient`` then returns a ``maskd_client.cluster.ClusterClient`` with the same API,
which opens each sequence on its owner, splits every step by owner and merges the rows back.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import itertools
import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Mapping, Sequence

import grpc
import numpy as np

from maskd.rowcodec import RowDecoder
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc

log = logging.getLogger("maskd_client")
SESSION_METADATA_KEY = "maskd-session"
DIRECTORY_PREFIX = "directory:"
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN)


class MaskClientError(RuntimeError):
    """A server or protocol problem the caller has to act on."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class SeqStatus(enum.Enum):
    READY = pb.SEQ_STATUS_READY
    WAITING = pb.SEQ_STATUS_WAITING
    FAILED = pb.SEQ_STATUS_FAILED
    FINISHED = pb.SEQ_STATUS_FINISHED
    CLOSED = pb.SEQ_STATUS_CLOSED
    ERROR = pb.SEQ_STATUS_ERROR

    @property
    def has_rows(self) -> bool:
        return self in (SeqStatus.READY, SeqStatus.FINISHED)


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    server_version: str
    backend: str
    backend_version: str
    tokenizer: str
    vocab_size: int
    logits_width: int
    words_per_row: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]
    max_message_bytes: int
    row_dictionary_size: int = 0


@dataclasses.dataclass(frozen=True)
class StepInput:
    """What one sequence carries in a step (a plain token list is the common case)."""
    tokens: Sequence[int] = ()
    drafts: Sequence[int] = ()
    rollback: int = 0


@dataclasses.dataclass
class SeqResult:
    seq_id: str
    step: int
    status: SeqStatus
    row: int                  # index of this sequence's first row in StepResult.bitmask (-1: none)
    num_rows: int
    forced_tokens: list[int]
    reason: str = ""
    code: grpc.StatusCode | None = None
    accepting: bool = False
    drafts_valid: int = 0


@dataclasses.dataclass
class StepResult:
    seqs: dict[str, SeqResult]
    bitmask: np.ndarray       # int32 (rows, words_per_row)
    server_seconds: float
    round_trip_seconds: float

    def row_index(self, seq_id: str) -> int:
        return self.seqs[seq_id].row

    def tensor(self, device=None, buffers=None):
        """The rows as an int32 torch tensor (through preallocated BitmaskBuffers if given)."""
        if buffers is not None:
            return buffers.upload(self.bitmask)
        import torch
        t = torch.from_numpy(self.bitmask)
        return t if device is None else t.to(device, non_blocking=True)


_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


@dataclasses.dataclass
class _Seq:
    spec: pb.GrammarSpec
    step: int = -1                      # last step sent
    history: list = dataclasses.field(default_factory=list)  # accepted tokens, as sent
    opened: bool = False                # an open has been sent


@dataclasses.dataclass
class _Pending:
    request: pb.StepRequest
    future: concurrent.futures.Future
    # per seq: (seq_id, step, n_tokens, popped_by_rollback, opened_here)
    undo: list
    sent_at: float = 0.0
    internal: bool = False
    # closes riding on this request: (seq_id, future resolved with that close's SeqResult)
    closes: list = dataclasses.field(default_factory=list)
    close_results: dict = dataclasses.field(default_factory=dict)


class MaskClient:
    def __new__(cls, target: str = "", *args, **kwargs):
        # A cluster directory as target: the cluster client (same API) instead of one stream.
        if cls is MaskClient and isinstance(target, str) and target.startswith(DIRECTORY_PREFIX):
            from maskd_client.cluster import ClusterClient
            return ClusterClient(target, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, target: str, tokenizer: Any = None, *, session: str | None = None,
                 retries: int = 3, retry_backoff_s: float = 0.2, want_forced_tokens: bool = True,
                 channel_options: Iterable[tuple[str, Any]] = (), timeout_s: float = 30.0,
                 on_lost: Callable[["MaskClient", Any, str], None] | None = None,
                 auth_token: str | None = None, tls_root_certs: bytes | None = None,
                 tls: bool = False, close_linger_s: float = 0.05) -> None:
        self.target = target
        # A close rides on the next step's message; when no step is sent within this many
        # seconds it goes alone (0: every close goes at once in its own message).
        self.close_linger_s = close_linger_s
        # Cluster mode: a broken stream is handed to on_lost(client, call, details) (which moves
        # the sequences to their new owners) instead of reconnecting to the same target.
        self._on_lost = on_lost
        self.session = session or uuid.uuid4().hex
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.want_forced_tokens = want_forced_tokens
        self.timeout_s = timeout_s
        self._expected_fp = _fingerprint_of(tokenizer)
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                   *channel_options]
        if tls or tls_root_certs:
            creds = grpc.ssl_channel_credentials(root_certificates=tls_root_certs)
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._auth = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._stub = pb_grpc.MaskServiceStub(self._channel)
        self._info: ServerInfo | None = None
        self._seqs: dict[str, _Seq] = {}
        self._lock = threading.Lock()          # guards _seqs, _pending, stream state
        self._pending: list[_Pending] = []
        self._queue: queue.Queue | None = None
        self._call = None
        self._reader: threading.Thread | None = None
        self._decoder: RowDecoder | None = None
        self._closed = False
        self._lost = False
        self._closes: list[tuple[pb.SeqStep, concurrent.futures.Future]] = []   # not yet sent
        self._closes_due = 0.0
        self._closes_cond = threading.Condition(self._lock)
        self._closer: threading.Thread | None = None
        self._generation = itertools.count()
        self.reconnects = 0

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> "MaskClient":
        self.info()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- unary ----------------------------------------------------------------------------------
    def info(self) -> ServerInfo:
        if self._info is None:
            try:
                r = self._stub.Info(pb.InfoRequest(), timeout=self.timeout_s, wait_for_ready=True,
                                    metadata=self._auth)
            except grpc.RpcError as exc:
                raise MaskClientError(f"maskd at {self.target}: {exc.details()}", exc.code()) from exc
            info = ServerInfo(r.server_version, r.backend, r.backend_version, r.tokenizer, r.vocab_size,
                              r.logits_width, r.words_per_row, r.tokenizer_fingerprint,
                              tuple(r.eos_token_ids), r.max_message_bytes, r.row_dictionary_size)
            if self._expected_fp and info.tokenizer_fingerprint != self._expected_fp:
                raise MaskClientError(
                    f"maskd at {self.target} serves tokenizer {info.tokenizer!r} with fingerprint "
                    f"{info.tokenizer_fingerprint[:16]}..., not the expected {self._expected_fp[:16]}...: "
                    "masks would not line up with this model's vocabulary",
                    grpc.StatusCode.FAILED_PRECONDITION)
            self._info = info
        return self._info

    def register(self, spec, *, wait: bool = True) -> str:
        """Registers a grammar and returns its id; raises MaskClientError with the compile error."""
        req = pb.RegisterGrammarRequest(spec=_spec_proto(spec), wait=wait,
                                        tokenizer_fingerprint=self._expected_fp or "")
        try:
            return self._stub.RegisterGrammar(req, timeout=self.timeout_s, metadata=self._auth).grammar_id
        except grpc.RpcError as exc:
            raise MaskClientError(exc.details(), exc.code()) from exc

    # -- sequences ------------------------------------------------------------------------------
    def open(self, seq_id: str, spec) -> None:
        """Opens a sequence; the open travels with the next step, whose reply has its first mask."""
        spec_pb = _spec_proto(spec)
        with self._lock:
            if seq_id in self._seqs:
                raise MaskClientError(f"sequence {seq_id!r} is already open on this client",
                                      grpc.StatusCode.ALREADY_EXISTS)
            self._seqs[seq_id] = _Seq(spec_pb)

    def close(self, seq_id: str) -> concurrent.futures.Future:
        """Closes a sequence. The close travels with this client's next step (one message, one
        server pass, as a decode loop closes what finished and steps the rest), or on its own
        after ``close_linger_s`` without a step, or at ``flush_closes()``. The future resolves to
        the close's SeqResult (None where the sequence never reached the server)."""
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is not None and seq.opened:
                fut: concurrent.futures.Future = concurrent.futures.Future()
                self._closes.append((pb.SeqStep(seq_id=seq_id, step=seq.step, close=True), fut))
                if self.close_linger_s > 0:
                    if len(self._closes) == 1:
                        self._closes_due = time.monotonic() + self.close_linger_s
                        self._start_closer()
                    return fut
        if seq is None or not seq.opened:
            f: concurrent.futures.Future = concurrent.futures.Future()
            f.set_result(None)
            return f
        self.flush_closes()
        return fut

    def flush_closes(self) -> None:
        """Sends the closes that wait for a step now, in a message of their own."""
        with self._lock:
            closes, self._closes = self._closes, []
            if not closes:
                return
            if not self._closed:
                try:   # taken and queued in one critical section: no later message overtakes them
                    self._send_locked(pb.StepRequest(seqs=[c for c, _ in closes]), [], True, closes)
                    return
                except MaskClientError:   # no stream to be had: the server frees them when it drops
                    pass
        for _, f in closes:
            if not f.done():
                f.set_result(None)

    def _start_closer(self) -> None:
        """(under _lock) The thread that sends closes no step took within close_linger_s."""
        if self._closer is None:
            self._closer = threading.Thread(target=self._closer_loop, daemon=True, name="maskd-client-closer")
            self._closer.start()
        else:
            self._closes_cond.notify()

    def _closer_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed:
                    if not self._closes:
                        self._closes_cond.wait()
                        continue
                    left = self._closes_due - time.monotonic()
                    if left <= 0:
                        break
                    self._closes_cond.wait(left)
                if self._closed:
                    return
            self.flush_closes()

    def history(self, seq_id: str) -> list[int]:
        return list(self._seqs[seq_id].history)

    @property
    def open_sequences(self) -> list[str]:
        return list(self._seqs)

    # -- steps ----------------------------------------------------------------------------------
    def step(self, tokens_by_seq: Mapping[str, Any], timeout: float | None = None) -> StepResult:
        return self.step_async(tokens_by_seq).result(timeout if timeout is not None else self.timeout_s)

    def step_async(self, tokens_by_seq: Mapping[str, Any]) -> concurrent.futures.Future:
        """Sends one step for the batch now; the future resolves to its StepResult.

        Input is checked before anything changes: a bad entry raises MaskClientError and leaves
        every sequence (and the closes waiting for this step) as it was."""
        if self._lost and self._on_lost is None:
            self._recover_idle()  # before this step changes the local state the restore replays
        inputs = []
        for seq_id, value in tokens_by_seq.items():
            inp = value if isinstance(value, StepInput) else StepInput(tokens=value)
            try:
                tokens = [int(t) for t in inp.tokens]
                drafts = [int(t) for t in inp.drafts]
                rollback = int(inp.rollback)
            except (TypeError, ValueError) as exc:
                raise MaskClientError(f"sequence {seq_id!r}: tokens, drafts and rollback must be integers ({exc})",
                                      grpc.StatusCode.INVALID_ARGUMENT) from None
            inputs.append((seq_id, tokens, drafts, rollback))
        if self._closes and any(c.seq_id in tokens_by_seq for c, _ in self._closes):
            self.flush_closes()   # a closed id opened again: its close must go first, on its own
        req = pb.StepRequest(want_forced_tokens=self.want_forced_tokens)
        undo = []
        with self._lock:
            for seq_id, tokens, drafts, rollback in inputs:
                seq = self._seqs.get(seq_id)
                if seq is None:
                    raise MaskClientError(f"sequence {seq_id!r} is not open on this client",
                                          grpc.StatusCode.NOT_FOUND)
                if rollback < 0 or rollback > len(seq.history):
                    raise MaskClientError(
                        f"cannot roll back {rollback} tokens of {seq_id!r}: it has {len(seq.history)}",
                        grpc.StatusCode.OUT_OF_RANGE)
            closes, self._closes = self._closes, []
            for c, _ in closes:
                req.seqs.append(c)
            for seq_id, tokens, drafts, rollback in inputs:
                seq = self._seqs[seq_id]
                entry = req.seqs.add(seq_id=seq_id, tokens=tokens, draft_tokens=drafts, rollback=rollback)
                opened_here = not seq.opened
                if opened_here:
                    entry.spec.CopyFrom(seq.spec)
                    seq.opened = True
                popped: list[int] = []
                if rollback:
                    popped = seq.history[-rollback:]
                    del seq.history[-rollback:]
                seq.step += 1
                entry.step = seq.step
                seq.history.extend(tokens)
                undo.append((seq_id, seq.step, len(tokens), popped, opened_here))
        try:
            return self._send(req, undo, closes=closes)
        except MaskClientError:
            for _, f in closes:
                if not f.done():
                    f.set_result(None)
            raise

    # -- stream machinery -----------------------------------------------------------------------
    def _send(self, req: pb.StepRequest, undo: list, internal: bool = False,
              closes: list = ()) -> concurrent.futures.Future:
        with self._lock:
            return self._send_locked(req, undo, internal, closes)

    def _send_locked(self, req: pb.StepRequest, undo: list, internal: bool = False,
                     closes: list = ()) -> concurrent.futures.Future:
        if self._closed:
            raise MaskClientError("client is shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        pending = _Pending(req, fut, undo, time.perf_counter(), internal, list(closes))
        if closes:
            fut.add_done_callback(lambda f, p=pending: _settle_closes(p, f))
        self._ensure_stream()
        self._pending.append(pending)
        self._queue.put(req)
        return fut

    def _ensure_stream(self) -> None:
        if self._call is not None:
            return
        info = self.info()
        self._decoder = RowDecoder(info.words_per_row, info.logits_width, dict_size=info.row_dictionary_size)
        q: queue.Queue = queue.Queue()
        self._queue = q

        def requests():
            while True:
                item = q.get()
                if item is None:
                    return
                yield item

        self._call = self._stub.Session(requests(), metadata=((SESSION_METADATA_KEY, self.session), *self._auth))
        gen = next(self._generation)
        self._reader = threading.Thread(target=self._read, args=(self._call, gen), daemon=True,
                                        name=f"maskd-client-reader-{gen}")
        self._reader.start()

    def _read(self, call, gen: int) -> None:
        try:
            for reply in call:
                with self._lock:
                    if not self._pending:
                        log.error("maskd sent a reply nobody asked for")
                        continue
                    pending = self._pending.pop(0)
                    decoder = self._decoder
                self._resolve(pending, reply, decoder)
        except grpc.RpcError as exc:
            self._on_stream_error(call, exc)
            return
        except Exception as exc:  # a decoding bug: fail what is pending rather than hang
            self._fail_all(MaskClientError(f"maskd client reader failed: {exc}"))
            return
        self._on_stream_error(call, None)

    def _resolve(self, pending: _Pending, reply: pb.StepResponse, decoder: RowDecoder) -> None:
        try:
            bitmask = decoder.decode(reply)
        except Exception as exc:
            pending.future.set_exception(MaskClientError(f"cannot decode mask rows: {exc}"))
            return
        seqs = {}
        for r in reply.results:
            status = SeqStatus(r.status)
            seqs[r.seq_id] = SeqResult(
                r.seq_id, r.step, status, r.first_row if status.has_rows else -1, r.num_rows,
                list(r.forced_tokens), r.reason, _CODE_BY_VALUE.get(r.code) if r.code else None,
                r.accepting, r.drafts_valid)
        for c, _ in pending.closes:   # the closes that rode along are not part of the step's result
            pending.close_results[c.seq_id] = seqs.pop(c.seq_id, None)
        if not pending.internal:
            # An ERROR leaves the server's sequence unchanged: undo what this step did locally.
            errors = [s for s in seqs.values() if s.status is SeqStatus.ERROR]
            if errors:
                self._undo({e.seq_id for e in errors}, pending.undo)
        pending.future.set_result(StepResult(seqs, bitmask, reply.server_seconds,
                                             time.perf_counter() - pending.sent_at))

    def _undo(self, seq_ids: set[str], undo: list) -> None:
        with self._lock:
            for seq_id, step, n_tokens, popped, opened_here in undo:
                seq = self._seqs.get(seq_id)
                if seq_id not in seq_ids or seq is None or seq.step != step:
                    continue
                if n_tokens:
                    del seq.history[-n_tokens:]
                seq.history.extend(popped)
                seq.step -= 1
                if opened_here:
                    seq.opened = False

    def _on_stream_error(self, call, exc: grpc.RpcError | None) -> None:
        if self._on_lost is not None and (exc is None or exc.code() in _RETRYABLE):
            with self._lock:
                mine = self._call is call and not self._closed
            if mine:
                self._on_lost(self, call, exc.details() if exc is not None else "stream ended")
            return
        with self._lock:
            if self._call is not call:
                return
            self._call = None
            if self._queue is not None:
                self._queue.put(None)
            if self._closed:
                return
            if not self._pending:
                self._lost = True  # restored before the next step is sent
                return
            pending = list(self._pending)
            self._pending.clear()
        code = exc.code() if exc is not None else grpc.StatusCode.UNAVAILABLE
        details = exc.details() if exc is not None else "stream ended"
        if code not in _RETRYABLE:
            for p in pending:
                p.future.set_exception(MaskClientError(f"maskd stream failed: {details}", code))
            return
        self._reconnect(pending, details)

    def _recover_idle(self) -> None:
        """The stream was lost between steps: restore the sequences before sending more."""
        self._lost = False
        if not self._reconnect([], "stream lost between steps"):
            self._lost = True
            raise MaskClientError(f"maskd stream to {self.target} lost and not restored after "
                                  f"{self.retries} tries", grpc.StatusCode.UNAVAILABLE)

    def _reconnect(self, pending: list[_Pending], details: str) -> bool:
        last_error = details
        for attempt in range(self.retries):
            time.sleep(self.retry_backoff_s * (2 ** attempt))
            self.reconnects += 1
            try:
                self._restore_and_resend(pending)
                return True
            except (grpc.RpcError, MaskClientError, concurrent.futures.TimeoutError) as exc:
                last_error = getattr(exc, "details", lambda: str(exc))()
                with self._lock:
                    self._call = None
        for p in pending:
            if not p.future.done():
                p.future.set_exception(MaskClientError(
                    f"maskd stream to {self.target} lost and not restored after {self.retries} tries: {last_error}",
                    grpc.StatusCode.UNAVAILABLE))
        return False

    def restore_message(self, pending: list[_Pending]) -> pb.StepRequest:
        """Re-opens every live sequence at the state before the steps still in flight."""
        with self._lock:
            state = {sid: (s.step, list(s.history), s.opened, s.spec) for sid, s in self._seqs.items()}
        for p in reversed(pending):
            for seq_id, step, n_tokens, popped, opened_here in p.undo:
                if seq_id not in state:
                    continue
                s_step, hist, opened, spec = state[seq_id]
                if n_tokens:
                    del hist[-n_tokens:]
                hist.extend(popped)
                state[seq_id] = (step - 1, hist, opened and not opened_here, spec)
        req = pb.StepRequest()
        for seq_id, (step, hist, opened, spec) in state.items():
            if opened and step >= 0:
                e = req.seqs.add(seq_id=seq_id, step=step, tokens=hist)
                e.spec.CopyFrom(spec)
        return req

    def _restore_and_resend(self, pending: list[_Pending]) -> None:
        restore = self.restore_message(pending)
        if restore.seqs:
            reply = self._stub_session_once(restore)
            for r in reply.results:
                if r.status == pb.SEQ_STATUS_ERROR and r.code not in (
                        grpc.StatusCode.ALREADY_EXISTS.value[0], grpc.StatusCode.ABORTED.value[0]):
                    raise MaskClientError(f"cannot restore sequence {r.seq_id!r}: {r.reason}")
        with self._lock:
            self._ensure_stream()
            for p in pending:
                self._pending.append(p)
                self._queue.put(p.request)

    def _stub_session_once(self, request: pb.StepRequest) -> pb.StepResponse:
        """Sends one message on the (new) stream and waits for its reply."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._ensure_stream()
            self._pending.append(_Pending(request, fut, [], time.perf_counter(), True))
            self._queue.put(request)
        raw = fut.result(self.timeout_s)
        return _as_reply(raw)

    # -- cluster mode: handing sequences from a lost worker to their new owners ------------------
    def hand_over(self, call) -> list[_Pending] | None:
        """Takes this client out of service after its stream `call` broke; returns the steps that
        were in flight (None if `call` is not the current stream). ``restore_message`` and
        ``take_sequences`` still work afterwards."""
        with self._lock:
            if self._call is not call or self._closed:
                return None
            self._call = None
            self._closed = True
            if self._queue is not None:
                self._queue.put(None)
            pending = list(self._pending)
            self._pending.clear()
            closes, self._closes = self._closes, []
            self._closes_cond.notify_all()
        for _, f in closes:   # closes of sequences on a lost worker are moot
            f.set_result(None)
        return pending

    def take_sequences(self) -> dict[str, _Seq]:
        """Removes and returns the client-side state of every sequence (for another client)."""
        with self._lock:
            seqs, self._seqs = self._seqs, {}
        return seqs

    def adopt_sequences(self, seqs: Mapping[str, _Seq]) -> None:
        """Takes over sequences from another client (their state travels as is)."""
        with self._lock:
            clash = [s for s in seqs if s in self._seqs]
            if clash:
                raise MaskClientError(f"sequences {clash[:4]} are already open on {self.target}",
                                      grpc.StatusCode.ALREADY_EXISTS)
            self._seqs.update(seqs)

    def send_request(self, request: pb.StepRequest, undo: list = (), *, internal: bool = False
                     ) -> concurrent.futures.Future:
        """Sends a prepared StepRequest on this client's stream (restores, resent steps)."""
        return self._send(request, list(undo), internal=internal)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
            self._call = None
        for p in pending:
            if not p.future.done():
                p.future.set_exception(exc)

    def shutdown(self) -> None:
        """Ends the stream; the server frees every sequence of the session when its last stream
        goes, so closes still waiting for a step need no message of their own."""
        with self._lock:
            self._closed = True
            call, q = self._call, self._queue
            self._call = None
            closes, self._closes = self._closes, []
            self._closes_cond.notify_all()
        for _, f in closes:
            f.set_result(None)
        if q is not None:
            q.put(None)
        if call is not None:
            call.cancel()
        self._channel.close()


def _settle_closes(pending: _Pending, fut: concurrent.futures.Future) -> None:
    """Resolves the close futures of a request once its own future is done. A close that reached
    no server (its stream was lost, or its worker) resolves to None: the sequence is gone either way."""
    failed = fut.cancelled() or fut.exception() is not None
    for c, f in pending.closes:
        if not f.done():
            f.set_result(None if failed else pending.close_results.get(c.seq_id))


def _as_reply(result: StepResult) -> pb.StepResponse:
    reply = pb.StepResponse()
    for s in result.seqs.values():
        reply.results.add(seq_id=s.seq_id, step=s.step, status=s.status.value,
                          code=s.code.value[0] if s.code else 0, reason=s.reason)
    return reply


def _spec_proto(spec) -> pb.GrammarSpec:
    if isinstance(spec, pb.GrammarSpec):
        return spec
    if isinstance(spec, GrammarSpec):
        return spec.to_proto()
    return GrammarSpec.from_dict(spec).to_proto()


def _fingerprint_of(tokenizer: Any) -> str | None:
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str):
        return tokenizer
    fp = getattr(tokenizer, "fingerprint", None)
    if isinstance(fp, str):
        return fp
    raise TypeError("tokenizer is a fingerprint string or an object with a .fingerprint attribute")
