"""What MaskClient and ClusterClient share: one ledger, a stream per server, recovery.

``ClientCore`` keeps the sequence ledger, a ``StepStream`` per server address (a single one for
``MaskClient``, one per worker for ``ClusterClient``), where each sequence lives (a ``Router``
decides), and the closes waiting for a step. A step is checked, recorded in the ledger, split by
server and sent at once; the parts' answers merge into one StepResult in batch order.

Recovery: a stream that ends hands its steps in flight to ``Recovery.stream_lost``. Retryable ends
(UNAVAILABLE, a stream that just ends, a server going away) start one recovery for that address,
on its own thread: the router names the new owners (the same server again, or the directory's
choice), grammars are registered there, every sequence of the lost address is reopened at its
state before the steps in flight (``SequenceLedger.restore_requests``, on a stream of its own),
then the steps in flight and those sent meanwhile go out again, in order. Its bound is time:
the steps wait ``recovery_timeout_s`` from the loss, attempts at most 1 s apart (at once when the
channel connects), a step sent at most ``retries + 1`` times; past it, they fail (UNAVAILABLE,
naming the server, how long it has been gone and why). Other ends (a server refusing the call)
fail the steps in flight at once. Either way the ledger is taken back to what the server
acknowledged and keeps every open sequence's history: the first step after the server is back
restores them (while it is still gone, such a step fails within seconds). The core holds
a ``maskd_client.recovery.Recovery`` for that, built over its lock and the state they share.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np

from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import ServerInfo
from maskd_client.connection import Connection, ConnectionSettings, spec_proto
from maskd_client.ledger import Advance, LedgerSequence, SequenceLedger, Undo
from maskd_client.merge import gather
from maskd_client.recovery import Recovery, RecoveryBudget
from maskd_client.routing import DirectoryError, NoOwner, Router
from maskd_client.stream import InFlight, StepStream, fail_all
from maskd_client.types import MaskClientError, StepInput, StepResult, Unreachable, reply_within

log = logging.getLogger("maskd_client")
_C = grpc.StatusCode


class ClientCore:
    def __init__(self, target: str, router: Router, settings: ConnectionSettings, *, session: str | None,
                 retries: int, retry_backoff_s: float, want_forced_tokens: bool, close_linger_s: float,
                 recovery_timeout_s: float, connect_timeout_s: float | None) -> None:
        self.target = target
        self.session = session or uuid.uuid4().hex
        self.retries = max(0, int(retries))
        self.retry_backoff_s = retry_backoff_s
        self.want_forced_tokens = want_forced_tokens
        self.close_linger_s = close_linger_s
        self.recovery_timeout_s = recovery_timeout_s
        self.connect_timeout_s = connect_timeout_s   # None: wait for the server up to timeout_s
        self.timeout_s = settings.timeout_s
        self._router = router
        self._settings = settings
        self._cond = threading.Condition(threading.RLock())   # guards everything below
        self._ledger = SequenceLedger()
        self._owner: dict[str, str] = {}
        self._connections: dict[str, Connection] = {}
        self._streams: dict[str, StepStream] = {}
        self._closes: dict[str, list[tuple[pb.SeqStep, concurrent.futures.Future]]] = {}
        self._closes_due = 0.0
        self._closer: threading.Thread | None = None
        self._closed = False
        self._info: ServerInfo | None = None
        self._recovery = Recovery(
            lock=self._cond, ledger=self._ledger, owner=self._owner, connections=self._connections,
            streams=self._streams, closes=self._closes, router=router, session=self.session,
            budget=RecoveryBudget(retries=self.retries, backoff_s=retry_backoff_s, timeout_s=recovery_timeout_s,
                                  reply_timeout_s=self.timeout_s),
            is_closed=lambda: self._closed, connect=self._connect, dispatch=self._dispatch,
            on_refused=self._refused, on_handles=self._handles)

    # -- context manager --------------------------------------------------------------------------
    def __enter__(self):
        self.info()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- what recovery did (reported by tests and tools) ------------------------------------------
    @property
    def recoveries(self) -> int:
        """Lost streams recovered (or tried)."""
        return self._recovery.recoveries

    @property
    def replays(self) -> int:
        """Sequences reopened with their token history."""
        return self._recovery.replays

    @property
    def resent_steps(self) -> int:
        """Steps sent again after a recovery."""
        return self._recovery.resent_steps

    @property
    def moved(self) -> int:
        """Sequences that changed server."""
        return self._recovery.moved

    @property
    def reconnects(self) -> int:
        return self._recovery.recoveries

    # -- connections ------------------------------------------------------------------------------
    def _connection(self, address: str) -> Connection:
        with self._cond:
            conn = self._connections.get(address)
            if conn is None:
                if self._closed:
                    raise MaskClientError("client is shut down")
                conn = self._connections[address] = Connection(address, self._settings)
            return conn

    def _connect(self, address: str) -> Connection:
        """A connection whose server answered Info (fail fast with connect_timeout_s if set)."""
        conn = self._connection(address)
        if conn._info is None and self.connect_timeout_s is not None:
            try:
                conn.info(timeout_s=self.connect_timeout_s, wait_for_ready=False)
            except MaskClientError as exc:
                if exc.code in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED):
                    self._drop_connection(address, conn)
                    raise Unreachable(address, str(exc)) from exc
                raise
        conn.info()
        return conn

    def _drop_connection(self, address: str, conn: Connection) -> None:
        with self._cond:
            if self._connections.get(address) is conn:
                del self._connections[address]
        conn.close()

    def _place(self, key: str) -> tuple[str, Connection]:
        """The owner of a new key and a live connection to it (asking again past dead addresses)."""
        suspects: set[str] = set()
        deadline = time.monotonic() + self.timeout_s
        try:
            address = self._router.place(key)
        except NoOwner as exc:
            raise MaskClientError(str(exc), _C.UNAVAILABLE) from exc
        while True:
            try:
                return address, self._connect(address)
            except Unreachable as exc:
                suspects.add(exc.address)
                if time.monotonic() > deadline or not self._retry_placement(suspects):
                    raise
                try:
                    address = self._router.replace(suspects, [key])[key]
                except NoOwner:
                    time.sleep(self.retry_backoff_s)

    def _same_owner(self, seq_id: str, grammar_id: str) -> bool:
        """Whether the router places the sequence where it placed the grammar's register."""
        try:
            return self._router.place(seq_id) == self._router.place(grammar_id)
        except (NoOwner, DirectoryError):   # placing the sequence raises it again, where it is handled
            return False

    def _retry_placement(self, suspects: set[str]) -> bool:
        """Whether another server may take a key when these are unreachable (a fixed one: no)."""
        return True

    def info(self) -> ServerInfo:
        if self._info is None:
            self._info = self._place("")[1].info()
        return self._info

    # -- sequences --------------------------------------------------------------------------------
    def open(self, seq_id: str, spec: Any, *, grammar_id: str = "") -> None:
        """Opens a sequence; the open travels with the next step, whose reply has its first mask.
        ``grammar_id``: the spec's id as ``register`` gave it: the open names the id instead of
        carrying the spec (a 200-tool spec is ~110 KB for the server to read again on the step
        path), where the sequence's server is the one ``register`` chose for that id (one server:
        always; a cluster: the id's owner, which holds what it registered). A server that does not
        hold the id (it evicted it) refuses the step (NOT_FOUND) and the sequence is not open
        there; the next step opens it with the spec. The spec is kept for restores."""
        spec_pb = spec_proto(spec)
        if grammar_id and not self._same_owner(seq_id, grammar_id):
            grammar_id = ""      # registered on another server: the sequence's would refuse the id
        with self._cond:
            self._ledger.open(seq_id, spec_pb, grammar_id)   # raises if it is open already
        try:
            address, _ = self._place(seq_id)
        except BaseException:
            with self._cond:
                self._ledger.close(seq_id)
            raise
        with self._cond:
            if seq_id in self._ledger:
                self._owner[seq_id] = address

    def owner_of(self, seq_id: str) -> str | None:
        """The address of the server a sequence lives on (None if not open here)."""
        with self._cond:
            return self._owner.get(seq_id)

    def history(self, seq_id: str) -> list[int]:
        with self._cond:
            return self._ledger.history(seq_id)

    @property
    def open_sequences(self) -> list[str]:
        with self._cond:
            return self._ledger.ids()

    def close(self, seq_id: str) -> concurrent.futures.Future:
        """Closes a sequence. The close travels with the next step to its server (one message, one
        server pass), alone after ``close_linger_s`` without a step, or at ``flush_closes()``. The
        future resolves to the close's SeqResult (None where the server no longer had it)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            address = self._owner.pop(seq_id, None)
            entry = self._ledger.close(seq_id)
            if entry is None or address is None or address not in self._streams:
                fut.set_result(None)   # never reached a server, or its server state is gone
                return fut
            waiting = self._closes.setdefault(address, [])
            waiting.append((entry, fut))
            if self.close_linger_s > 0:
                if sum(len(v) for v in self._closes.values()) == 1:
                    self._closes_due = time.monotonic() + self.close_linger_s
                self._start_closer()
                return fut
        self.flush_closes()
        return fut

    def flush_closes(self) -> None:
        """Sends the closes that wait for a step now, in messages of their own."""
        with self._cond:
            for address in list(self._closes):
                self._send_closes(address)

    def _send_closes(self, address: str, only: set[str] | None = None) -> None:
        """(under the lock) The waiting closes for ``address`` (those of ``only`` ids) alone."""
        waiting = self._closes.get(address, [])
        now = [c for c in waiting if only is None or c[0].seq_id in only]
        if not now:
            return
        rest = [c for c in waiting if c not in now]
        if rest:
            self._closes[address] = rest
        else:
            self._closes.pop(address, None)
        stream = self._streams.get(address)
        item = InFlight(pb.StepRequest(seqs=[c for c, _ in now]), concurrent.futures.Future(), [],
                        internal=True, closes=[(c.seq_id, f) for c, f in now])
        if stream is None or self._recovery.busy(address):
            fail_all([item], MaskClientError("no stream"))   # the server state is gone or being rebuilt
            return
        stream.send(item)

    def _start_closer(self) -> None:
        if self._closer is None:
            self._closer = threading.Thread(target=self._closer_loop, daemon=True, name="maskd-client-closer")
            self._closer.start()
        else:
            self._cond.notify_all()

    def _closer_loop(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._closes:
                    self._cond.wait()
                    continue
                left = self._closes_due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                for address in list(self._closes):
                    self._send_closes(address)

    # -- steps ------------------------------------------------------------------------------------
    def step(self, tokens_by_seq: Mapping[str, Any], timeout: float | None = None, *,
             out: np.ndarray | None = None) -> StepResult:
        return reply_within(self.step_async(tokens_by_seq, out=out), timeout if timeout is not None else self.timeout_s,
                            self.target)

    def step_async(self, tokens_by_seq: Mapping[str, Any], *,
                   out: np.ndarray | None = None) -> concurrent.futures.Future:
        """Sends one step for the batch now; the future resolves to its StepResult.

        ``out``: a buffer of the caller's (int32, C-contiguous, ``words_per_row`` columns; e.g. the
        host side of ``BitmaskBuffers.host_rows``) that the reply's rows are decoded straight into
        when the step goes to one server and they fit; the result's ``bitmask`` is then a view of
        it (read ``bitmask`` either way). Leave it alone until the future resolves.

        Input is checked before anything changes: a bad entry raises MaskClientError and leaves
        every sequence (and the closes waiting for this step) as it was."""
        if out is not None:
            _check_out(out, self.info().words_per_row)
        with self._cond:
            # The decode step's common case: one token for each sequence, all on one server.
            plain = None if self._closed else self._ledger.plain(tokens_by_seq)
            if plain is not None:
                addresses = set(map(self._owner.get, plain[0]))
                address = addresses.pop() if len(addresses) == 1 else None
                if address is not None:
                    one = _Part()
                    one.plain_ids, one.plain_seqs, one.plain_tokens = plain
                    return self._dispatch(address, self._request(address, one, out))
        advances = _parse(tokens_by_seq)
        info = self.info()
        if not advances:   # nothing to ask: answered here, with no rows
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(StepResult({}, np.zeros((0, info.words_per_row), dtype=np.int32)))
            return done
        with self._cond:
            if self._closed:
                raise MaskClientError("client is shut down")
            records = self._ledger.checked(advances)     # raises before anything changes
            parts: dict[str, _Part] = {}
            ledger, owner = self._ledger, self._owner
            for a, seq in zip(advances, records):
                address = owner[a.seq_id]
                part = parts.get(address)
                if part is None:
                    part = parts[address] = _Part()
                if (not a.drafts and not a.rollback and not a.propose and seq.opened and seq.handle > 0
                        and (not part.plain_ids or a.unmasked == part.plain_unmasked)):
                    part.plain_ids.append(a.seq_id)     # a columnar entry: a handle, a step, tokens
                    part.plain_seqs.append(seq)
                    part.plain_tokens.append(a.tokens)
                    part.plain_unmasked = a.unmasked    # one form per request: sampled unmasked or not
                else:
                    entry, undo = ledger.advance(a)
                    part.entries.append(entry)
                    part.undo.append(undo)
            if len(parts) == 1 and not next(iter(parts.values())).entries:
                # all columnar, on one server: its answer is in the batch's order already
                address, part = next(iter(parts.items()))
                return self._dispatch(address, self._request(address, part, out))
            futures = [self._dispatch(address, self._request(address, part)) for address, part in parts.items()]
            return gather([a.seq_id for a in advances], futures)

    def _request(self, address: str, part: _Part, out: np.ndarray | None = None) -> InFlight:
        """(under the lock) One server's part of a step as a request: closes waiting for it first,
        then SeqStep entries, then the columnar ones."""
        waiting = self._closes.get(address)
        if waiting:
            reopened = ({e.seq_id for e in part.entries} | set(part.plain_ids)) & {c.seq_id for c, _ in waiting}
            if reopened:   # a closed id opened again: its close goes first, on its own
                self._send_closes(address, reopened)
        closes = self._closes.pop(address, [])
        request = pb.StepRequest(seqs=[c for c, _ in closes] + part.entries, want_forced_tokens=self.want_forced_tokens)
        if part.plain_ids:
            handles, steps, undo = self._ledger.advance_plain(part.plain_ids, part.plain_seqs, part.plain_tokens)
            part.undo.append(undo)
            request.handles = np.array(handles, dtype="<u4").tobytes()
            request.steps = np.array(steps, dtype="<u4").tobytes()
            request.token_counts = np.array(undo.counts, dtype="<u4").tobytes()
            request.tokens = np.array(list(itertools.chain.from_iterable(part.plain_tokens)), dtype="<i4").tobytes()
            request.columnar_sampled_unmasked = part.plain_unmasked
        return InFlight(request, concurrent.futures.Future(), part.undo, closes=[(c.seq_id, f) for c, f in closes],
                        plain_ids=part.plain_ids, out=out)

    def _dispatch(self, address: str, item: InFlight) -> concurrent.futures.Future:
        """(under the lock) Sends on the address's stream, or hands the step to its recovery."""
        held = self._recovery.take(address, item)
        if held is not None:
            return held
        stream = self._streams.get(address)
        if stream is None:
            stream = self._streams[address] = self._new_stream(address)
        return stream.send(item, hand_over_when_ended=True)

    def _new_stream(self, address: str) -> StepStream:
        conn = self._connection(address)
        return StepStream(conn, self.session, conn.info(), on_lost=self._recovery.stream_lost, on_refused=self._refused,
                          on_handles=self._handles)

    def _handles(self, handles: dict[str, int]) -> None:
        with self._cond:
            self._ledger.set_handles(handles)

    def _refused(self, undo: list[Undo], seq_ids: set[str], step_kept: bool = False) -> None:
        """Entries the server refused (their steps are taken back), or with ``step_kept`` the
        sampled_unmasked tokens it refused (only the tokens are)."""
        with self._cond:
            if step_kept:
                self._ledger.retract(undo, seq_ids)
            else:
                self._ledger.undo(undo, seq_ids)

    # -- teardown ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ends every stream; a server frees a session's sequences when its last stream goes, so
        closes still waiting need no message of their own."""
        with self._cond:
            self._closed = True
            streams = list(self._streams.values())
            self._streams.clear()
            closes = [f for waiting in self._closes.values() for _, f in waiting]
            self._closes.clear()
            connections = list(self._connections.values())
            self._connections.clear()
            self._cond.notify_all()
        for fut in closes:
            if not fut.done():
                fut.set_result(None)
        for stream in streams:
            fail_all(stream.take_in_flight(), MaskClientError("client is shut down"))
            stream.close()
        self._recovery.end_pauses()      # no recovery subscribed to a channel that closes
        for conn in connections:
            conn.close()
        self._router.close()


# -- helpers ---------------------------------------------------------------------------------------
class _Part:
    """One server's share of a step while it is built."""
    __slots__ = ("entries", "plain_ids", "plain_seqs", "plain_tokens", "plain_unmasked", "undo")

    def __init__(self) -> None:
        self.entries: list[pb.SeqStep] = []
        self.undo: list[Undo] = []
        self.plain_ids: list[str] = []
        self.plain_seqs: list[LedgerSequence] = []
        self.plain_tokens: list[list[int]] = []
        self.plain_unmasked = False


_NO_DRAFTS: tuple[int, ...] = ()


def _check_out(out: Any, words: int) -> None:
    """A step's ``out`` buffer is what the row decoder writes into, or MaskClientError (nothing sent)."""
    if (not isinstance(out, np.ndarray) or out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != words
            or not out.flags["C_CONTIGUOUS"] or not out.flags["WRITEABLE"]):
        what = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise MaskClientError(f"out must be a writeable C-contiguous int32 array of shape (rows, {words}), "
                              f"not {what}", _C.INVALID_ARGUMENT)


def _parse(tokens_by_seq: Mapping[str, Any]) -> list[Advance]:
    """Each sequence's input as an Advance with int tokens. A plain token list (the decode step's
    common case) takes the short way: no StepInput, one list of ints, no drafts; a list of one
    int (a decode step's sampled token) is taken as it is."""
    advances: list[Advance] = []
    append = advances.append
    try:
        for seq_id, value in tokens_by_seq.items():
            if type(value) is list and len(value) == 1 and type(value[0]) is int:
                append(Advance(seq_id, value, _NO_DRAFTS, 0))
            elif isinstance(value, StepInput):
                append(Advance(seq_id, [int(t) for t in value.tokens], [int(t) for t in value.drafts],
                               int(value.rollback), int(value.propose), bool(value.sampled_unmasked)))
            else:
                append(Advance(seq_id, [int(t) for t in value], _NO_DRAFTS, 0))
    except (TypeError, ValueError) as exc:
        raise MaskClientError(f"sequence {seq_id!r}: tokens, drafts and rollback must be integers ({exc})",
                              _C.INVALID_ARGUMENT) from None
    return advances
