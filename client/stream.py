"""One Session stream to one server: the request queue, the reader thread, row decoding, the
steps in flight, and the closes that wait to ride on the next step.

A ``StepStream`` never reconnects by itself: when its call ends it hands the steps still in flight
to its owner (``on_lost``), which restores the sequences somewhere and resends them.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import numpy as np

from maskd.rowcodec import RowBlockDecoder
from maskd.specs import NEWEST_PARTS_REVISION
from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import ACCEPTING_BIT, RESAMPLE_BIT, STATUS_MASK, SeqStatus, ServerInfo
from maskd_client.connection import Connection
from maskd_client.ledger import Undo
from maskd_client.types import MaskClientError, SeqResult, StepResult, grpc_code

log = logging.getLogger("maskd_client.stream")
_generation = itertools.count()


@dataclasses.dataclass
class InFlight:
    """A request sent (or to be sent again) and the future of its answer."""
    request: pb.StepRequest
    future: concurrent.futures.Future
    undo: list[Undo]
    internal: bool = False          # a restore: no undo, nobody else waits for it
    plain_ids: list[str] = dataclasses.field(default_factory=list)   # the columnar entries' sequences
    closes: list[tuple[str, concurrent.futures.Future]] = dataclasses.field(default_factory=list)
    attempts: int = 1               # times sent (bounded by the client's retry budget)
    sent_at: float = 0.0
    out: np.ndarray | None = None   # the caller's buffer the reply's rows decode into, when they fit


class StreamLost(MaskClientError):
    """The stream ended; what it carried is its owner's to resend."""


class StepStream:
    def __init__(self, connection: Connection, session: str, info: ServerInfo, *,
                 on_lost: Callable[[StepStream, grpc.RpcError | None], None],
                 on_refused: Callable[..., None],
                 on_handles: Callable[[dict[str, int]], None]) -> None:
        self.connection = connection
        self.address = connection.target
        self.older = info.contract_revision < NEWEST_PARTS_REVISION   # opens' specs rewritten (send)
        self.decoder: RowBlockDecoder | None = RowBlockDecoder(info.words_per_row, info.logits_width,
                                                              dict_size=info.row_dictionary_size,
                                       compression=info.row_compression)
        self._on_lost = on_lost
        self._on_refused = on_refused
        self._on_handles = on_handles
        self._handed_over = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: collections.deque[InFlight] = collections.deque()
        self._lock = threading.Lock()
        self._ended = False
        self._call = connection.stub.Session(self._requests(), metadata=connection.metadata(session))
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"maskd-client-reader-{next(_generation)}")
        self._reader.start()

    # -- sending ----------------------------------------------------------------------------------
    def send(self, item: InFlight, *, hand_over_when_ended: bool = False) -> concurrent.futures.Future:
        """Queues a request. On a stream that has ended, raises StreamLost (nothing queued), or with
        ``hand_over_when_ended`` keeps the request for ``take_in_flight`` (the loss handler resends
        it) as long as the loss has not been handled yet."""
        if self.older:
            for entry in item.request.seqs:
                if entry.HasField("spec"):
                    spec = entry.spec
                    wire = self.connection.wire_spec(spec)
                    if wire is not spec:
                        entry.spec.CopyFrom(wire)
        with self._lock:
            if self._handed_over or (self._ended and not hand_over_when_ended):
                raise StreamLost(f"maskd stream to {self.address} has ended", grpc.StatusCode.UNAVAILABLE)
            item.sent_at = time.perf_counter()
            self._in_flight.append(item)
            if not self._ended:
                self._queue.put(item.request)
        return item.future

    def adopt(self, on_lost: Callable[[StepStream, grpc.RpcError | None], None]) -> bool:
        """Gives the stream a new loss handler; False when it has ended already."""
        with self._lock:
            if self._ended:
                return False
            self._on_lost = on_lost
            return True

    def _requests(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            yield item

    @property
    def ended(self) -> bool:
        return self._ended

    def take_in_flight(self) -> list[InFlight]:
        """Ends the stream for new requests; returns what was sent and not answered."""
        with self._lock:
            self._ended = self._handed_over = True
            items = list(self._in_flight)
            self._in_flight.clear()
        return items

    def close(self) -> None:
        """Ends the request stream and the call; what is in flight is abandoned to the caller."""
        with self._lock:
            self._ended = True
        self._queue.put(None)
        self._call.cancel()

    # -- reading ----------------------------------------------------------------------------------
    def _read(self) -> None:
        error: grpc.RpcError | None = None
        try:
            for reply in self._call:
                with self._lock:
                    item = self._in_flight.popleft() if self._in_flight else None
                if item is None:
                    log.error("maskd at %s sent a reply nobody asked for", self.address)
                    continue
                self._resolve(item, reply)
        except grpc.RpcError as exc:
            error = exc
        except Exception as exc:  # a decoding bug: fail what is pending rather than hang
            log.exception("maskd client reader failed")
            for item in self.take_in_flight():
                _fail(item, MaskClientError(f"maskd client reader failed: {exc}"))
            self._queue.put(None)
            return
        with self._lock:
            was_ended = self._ended
            self._ended = True
            on_lost = self._on_lost
        self._queue.put(None)
        if not (was_ended and error is not None and error.code() is grpc.StatusCode.CANCELLED):
            on_lost(self, error)

    def _resolve(self, item: InFlight, reply: pb.StepResponse) -> None:
        if self.decoder is None:
            return
        try:
            out = item.out
            bitmask = self.decoder.decode(reply.row_block, reply.num_rows,
                                          out if out is not None and len(out) >= reply.num_rows else None)
            if reply.words_per_row and reply.words_per_row != self.decoder.words:
                raise ValueError(f"{reply.words_per_row} words per row, this client expects {self.decoder.words}")
            result = result_of(reply, item, bitmask)
        except Exception as exc:   # out of step from here on: drop the stream, its owner restores
            self.decoder = None
            _fail(item, MaskClientError(f"cannot decode the reply from {self.address}: {exc}",
                                        grpc.StatusCode.DATA_LOSS))
            self._call.cancel()
            return
        result.round_trip_seconds = time.perf_counter() - item.sent_at
        details = result._details
        for seq_id, fut in item.closes:   # closes that rode along are not part of the step's result
            if not fut.done():
                fut.set_result(details.get(seq_id))
        handles = {sid: r.handle for sid, r in ((r.seq_id, r) for r in reply.results)
                   if r.handle and r.status != SeqStatus.ERROR}
        if handles:
            self._on_handles(handles)
        if not item.internal:
            refused = {sid for sid, d in details.items() if d.status is SeqStatus.ERROR}
            if refused:   # an ERROR leaves the server's sequence unchanged: take the step back here
                self._on_refused(item.undo, refused)
            resampled = {sid for sid, d in details.items() if d.resample}
            if resampled:   # sampled_unmasked tokens refused: the server consumed nothing of them
                self._on_refused(item.undo, resampled, True)
        if not item.future.done():
            item.future.set_result(result)


def result_of(reply: pb.StepResponse, item: InFlight, bitmask: np.ndarray) -> StepResult:
    """The StepResult of a reply: SeqStep entries (closes apart) first, then the columnar ones,
    whose answers are arrays (one Python object per sequence only where there is a reason)."""
    details: dict[str, SeqResult] = {}
    rich_ids = []
    for r in reply.results:
        status = SeqStatus(r.status)
        rows_follow = (status is SeqStatus.READY or status is SeqStatus.FINISHED) and r.num_rows > 0
        details[r.seq_id] = SeqResult(r.seq_id, r.step, status, r.first_row if rows_follow else -1, r.num_rows,
                                      list(r.forced_tokens), r.reason, grpc_code(r.code), r.accepting, r.drafts_valid,
                                      list(r.proposed_drafts), r.resample)
        rich_ids.append(r.seq_id)
    closing = {sid for sid, _ in item.closes}
    rich_ids = [sid for sid in rich_ids if sid not in closing]
    plain_ids = item.plain_ids
    n_plain = len(plain_ids)
    packed = np.frombuffer(reply.statuses, dtype=np.uint8)
    if len(packed) != n_plain:
        raise ValueError(f"{len(packed)} columnar answers for {n_plain} columnar entries")
    plain_status = packed & STATUS_MASK
    if item.request.columnar_sampled_unmasked:   # rows only where a token was refused
        has_rows = (packed & RESAMPLE_BIT) > 0
    else:
        has_rows = (plain_status == SeqStatus.READY) | (plain_status == SeqStatus.FINISHED)
    first_plain_row = sum(details[sid].num_rows for sid in rich_ids if details[sid].row >= 0)
    plain_row = np.where(has_rows, first_plain_row + np.cumsum(has_rows) - 1, -1).astype(np.int32)
    if first_plain_row + int(has_rows.sum()) > len(bitmask):
        raise ValueError("the reply's rows do not cover its answers")
    steps = np.frombuffer(item.request.steps, dtype="<u4") if n_plain else np.zeros(0, np.int64)
    for p in reply.problems:
        sid = plain_ids[p.index]
        details[sid] = SeqResult(sid, int(steps[p.index]), SeqStatus(int(plain_status[p.index])), -1, 0, [],
                                 p.reason, grpc_code(p.code))
    if item.request.columnar_sampled_unmasked:   # the few refused tokens get a detailed answer
        for i in np.flatnonzero(has_rows).tolist():
            sid = plain_ids[i]
            details[sid] = SeqResult(sid, int(steps[i]), SeqStatus(int(plain_status[i])), int(plain_row[i]), 1, [],
                                     accepting=bool(packed[i] & ACCEPTING_BIT), resample=True)
    forced: dict[str, list[int]] = {}
    if reply.forced_counts:
        counts = np.frombuffer(reply.forced_counts, dtype="<u4")
        flat = np.frombuffer(reply.forced_tokens, dtype="<i4").tolist()
        ends = np.cumsum(counts).tolist()
        for i in np.flatnonzero(counts).tolist():
            forced[plain_ids[i]] = flat[ends[i] - int(counts[i]):ends[i]]
    if not rich_ids:
        return StepResult(None, bitmask, reply.server_seconds, ids=list(plain_ids), status=plain_status,
                          row=plain_row, num_rows=has_rows.astype(np.int32), accepting=(packed & ACCEPTING_BIT) > 0,
                          steps=steps.astype(np.int64), details=details, forced=forced)
    rich = [details[sid] for sid in rich_ids]
    return StepResult(None, bitmask, reply.server_seconds, ids=rich_ids + list(plain_ids),
                      status=np.concatenate([np.array([int(d.status) for d in rich], np.uint8), plain_status]),
                      row=np.concatenate([np.array([d.row for d in rich], np.int32), plain_row]),
                      num_rows=np.concatenate([np.array([d.num_rows for d in rich], np.int32),
                                               has_rows.astype(np.int32)]),
                      accepting=np.concatenate([np.array([d.accepting for d in rich], bool),
                                                (packed & ACCEPTING_BIT) > 0]),
                      steps=np.concatenate([np.array([d.step for d in rich], np.int64), steps.astype(np.int64)]),
                      details=details, forced=forced)


def _fail(item: InFlight, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)
    for _, fut in item.closes:
        if not fut.done():
            fut.set_result(None)


def fail_all(items: Sequence[InFlight], exc: BaseException) -> None:
    for item in items:
        _fail(item, exc)
