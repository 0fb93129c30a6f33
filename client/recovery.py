"""Recovery: rebuilding a lost server's sequences somewhere and sending their steps again.

``Recovery`` is the collaborator a ``ClientCore`` hands its lost streams to (see maskd_client.core
for the rules). It is built over the core's lock and the state it shares with the core, passed in
explicitly (the ledger, owners, connections, streams, waiting closes), the router, the session key,
a ``RecoveryBudget`` and the core's calls it needs (connect, dispatch, refusals, handles); it owns
what only it keeps: the recoveries under way, the servers lost between steps, its counters.

``stream_lost`` (on the stream's reader thread) decides; ``_recover`` (on a thread of its own)
asks the router for the new owners, asks each whether it answers, makes the grammars ready there,
sends the restores (in parts) on streams of their own and waits for them, then resends the steps in
flight and those held meanwhile, in order; past the budget, ``_give_up`` fails them and takes the
ledger back.

The bound is time, counted from the loss: a lost server's steps wait ``recovery_timeout_s`` for
it (or another) to take its sequences back, however many attempts that takes (a refused connect
costs a SYN and a RST; attempts go at most ``MAX_PAUSE_S`` apart and at once when the channel
connects). The sequences' history stays in the ledger past it: while the server is still gone,
each later step for it fails within ``QUICK_S`` naming it, and the first step after it is back
restores them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from maskd.v1 import maskd_pb2 as pb
from maskd.v1.contract import SeqStatus
from maskd_client.connection import Connection
from maskd_client.ledger import SequenceLedger, UndoRecord, records_of
from maskd_client.merge import chain, gather
from maskd_client.routing import NoOwner, Router
from maskd_client.stream import InFlight, StepStream, fail_all
from maskd_client.types import MaskClientError, Unreachable, describe, reply_within

log = logging.getLogger("maskd_client")
_C = grpc.StatusCode
# Stream ends worth a reconnect: the server (or the path to it) went away. Anything else is the
# server refusing the call, which a retry would only repeat.
RETRYABLE = frozenset((_C.UNAVAILABLE, _C.CANCELLED, _C.INTERNAL, _C.DEADLINE_EXCEEDED))
# The most a recovery waits between two attempts (full jitter below it, doubling from the client's
# retry_backoff_s): the channel's own reconnects are at most 1 s apart too (RECONNECT_OPTIONS), and
# a pause ends when the channel connects.
MAX_PAUSE_S = 1.0
# What a step for a server lost longer than recovery_timeout_s gets: one more look, long enough
# for a channel backing off (1 s at most) to find a server that is back, then an error naming it.
QUICK_S = 2.0
# A recovery that keeps failing says so this often (the first failure at once).
LOG_EVERY_S = 10.0
_RESTORE_OK = (_C.ALREADY_EXISTS, _C.ABORTED)   # another rank restored it first
DEFAULT_MAX_TOKENS_PER_STEP = 4096


@dataclasses.dataclass
class LostServer:
    """A server whose stream ended, and the steps that wait for its sequences to be restored."""

    address: str
    in_flight: list[InFlight]          # sent on the lost stream, never answered
    held: list[InFlight] = dataclasses.field(default_factory=list)   # sent by the caller meanwhile
    reason: str = ""
    since: float = dataclasses.field(default_factory=time.monotonic)   # when it was lost


@dataclasses.dataclass(frozen=True)
class RecoveryBudget:
    """What recovering a lost server may spend. ``timeout_s``: how long after the loss its steps
    wait for it to take their sequences back, whatever the number of attempts (past it they fail;
    the history stays, see the module). ``backoff_s``: the first pause between attempts, doubled up
    to ``MAX_PAUSE_S``, full jitter. ``retries``: a step is sent at most ``retries + 1`` times (one
    whose server is lost with it each time fails). ``reply_timeout_s`` bounds each restore's and
    grammar's answer once the server answered."""

    retries: int
    backoff_s: float
    timeout_s: float
    reply_timeout_s: float


class Recovery:
    """Restores the sequences of a client's lost servers and resends their steps.

    Every argument but ``budget`` and the callables is the client's own state, shared by reference
    and guarded by ``lock`` (the client's condition): ``ledger`` its sequences, ``owner`` seq_id ->
    server address, ``connections`` and ``streams`` by address, ``closes`` the closes waiting for a
    step by address. ``is_closed`` says whether the client is shut down; ``connect`` gives a
    connection whose server answered Info (raising Unreachable); ``dispatch`` (under the lock) sends
    a step to an address; ``on_refused`` and ``on_handles`` are the client's handlers of a stream's
    refusals and new handles, given to the restore streams too.
    """

    def __init__(self, *, lock: threading.Condition, ledger: SequenceLedger, owner: dict[str, str],
                 connections: dict[str, Connection], streams: dict[str, StepStream],
                 closes: dict[str, list[tuple[pb.SeqStep, concurrent.futures.Future]]], router: Router,
                 session: str, budget: RecoveryBudget, is_closed: Callable[[], bool],
                 connect: Callable[[str], Connection],
                 dispatch: Callable[[str, InFlight], concurrent.futures.Future],
                 on_refused: Callable[..., None],
                 on_handles: Callable[[dict[str, int]], None]) -> None:
        self._cond = lock
        self._ledger = ledger
        self._owner = owner
        self._connections = connections
        self._streams = streams
        self._closes = closes
        self._router = router
        self._session = session
        self._budget = budget
        self._is_closed = is_closed
        self._connect = connect
        self._dispatch = dispatch
        self._on_refused = on_refused
        self._on_handles = on_handles
        self._recovering: dict[str, LostServer] = {}   # under way, by lost address
        self._pauses: set[threading.Event] = set()      # recoveries' pauses now (set: ends one)
        # address -> when it was lost: ended idle, refused the call, or not recovered in time; the
        # next step that goes there restores its sequences first
        self._lost: dict[str, float] = {}
        # what recovery did (reported by tests and tools)
        self.recoveries = 0       # lost streams recovered (or tried)
        self.replays = 0          # sequences reopened with their token history
        self.resent_steps = 0     # steps sent again after a recovery
        self.moved = 0            # sequences that changed server

    def busy(self, address: str) -> bool:
        """(under the lock) Whether a recovery of ``address`` is under way."""
        return address in self._recovering

    def take(self, address: str, item: InFlight) -> concurrent.futures.Future | None:
        """(under the lock) A step for ``address`` while its server is being restored (held, sent
        after the restores) or was lost between steps (its recovery starts now); None when the
        address has a stream to send on."""
        recovery = self._recovering.get(address)
        if recovery is not None:
            recovery.held.append(item)
            return item.future
        since = self._lost.pop(address, None)
        if since is not None:
            self._start_recovery(LostServer(address, [], [item], "stream lost between steps", since))
            return item.future
        return None

    def stream_lost(self, stream: StepStream, error: grpc.RpcError | None) -> None:
        """A stream ended (its reader thread): recover, fail, or note it for the next step."""
        address = stream.address
        code = error.code() if error is not None else _C.UNAVAILABLE
        details = (error.details() if error is not None else "") or f"stream ended ({code.name})"
        with self._cond:
            items = stream.take_in_flight()
            current = self._streams.get(address) is stream
            if current:
                del self._streams[address]
                # the session there is gone with its handles: SeqStep entries until a restore gives new ones
                self._ledger.forget_handles([s for s, a in self._owner.items() if a == address])
            closes = self._closes.pop(address, []) if current else []
            user = [i for i in items if not i.internal]
            fail_all([i for i in items if i.internal], MaskClientError(details, code))
            if self._is_closed() or not current:
                fail_all(user, MaskClientError(f"maskd stream to {address} ended: {details}", code))
            elif code not in RETRYABLE:
                self._undo_items(user)
                fail_all(user, MaskClientError(f"maskd stream to {address} failed: {details}", code))
                self._lost.setdefault(address, time.monotonic())
            elif user:
                self._start_recovery(LostServer(address, user, [], details))
            else:
                self._lost.setdefault(address, time.monotonic())
        for _, fut in closes:   # the server dropped those sequences with the stream anyway
            if not fut.done():
                fut.set_result(None)
        if current and not self._is_closed():
            log.warning("maskd stream to %s ended (%s: %s)", address, code.name, details)

    def _undo_items(self, items: list[InFlight]) -> None:
        for item in reversed(items):
            self._ledger.undo(item.undo)

    def _start_recovery(self, recovery: LostServer) -> None:
        """(under the lock)"""
        self._recovering[recovery.address] = recovery
        self.recoveries += 1
        threading.Thread(target=self._recover, args=(recovery,), daemon=True,
                         name=f"maskd-client-recovery-{recovery.address}").start()

    def _recover(self, rec: LostServer) -> None:
        suspects = {rec.address}
        budget = self._budget
        # from the loss: a server gone longer than timeout_s (given up before) gets one more look
        deadline = max(rec.since + budget.timeout_s, time.monotonic() + QUICK_S)
        why = rec.reason
        attempts, next_log = 0, 0.0
        while True:
            attempts += 1
            with self._cond:
                if self._is_closed():
                    why = "the client is shut down"
                    break
                if any(i.attempts > budget.retries for i in rec.in_flight):
                    why = f"a step was sent {budget.retries + 1} times and its server lost each time ({why})"
                    break
            try:
                self._restore_and_resend(rec, suspects, deadline, attempts)
                return
            except Unreachable as exc:
                suspects.add(exc.address)
                why = str(exc)
            except NoOwner as exc:
                why = str(exc)
            except (MaskClientError, concurrent.futures.TimeoutError) as exc:
                code = getattr(exc, "code", None)
                if code is not None and code not in RETRYABLE:
                    why = str(exc)
                    break
                why = describe(exc)
            now = time.monotonic()
            if now >= deadline:
                break          # _give_up says so
            if now >= next_log:
                next_log = now + LOG_EVERY_S
                log.warning("maskd at %s: no reconnect yet, %.1f s after it was lost (%d attempts so far; its "
                            "steps wait up to %.0f s more): %s", rec.address, now - rec.since, attempts,
                            deadline - now, why)
            ceiling = min(MAX_PAUSE_S, budget.backoff_s * 2 ** min(attempts, 16))
            self._pause(rec.address, min(deadline - now, random.uniform(0, ceiling)))
        self._give_up(rec, why, attempts)

    def _pause(self, address: str, seconds: float) -> None:
        """The pause before a recovery's next attempt, cut short when the channel to ``address``
        connects (a restarted server listens again): the attempt goes at once. A channel connected
        all along (the server answered, with an error worth retrying) waits the whole pause. The
        client's shutdown ends it too (``end_pauses``)."""
        connected = threading.Event()
        with self._cond:
            if self._is_closed():
                return
            conn = self._connections.get(address)
            self._pauses.add(connected)
        try:
            if conn is None:
                connected.wait(seconds)
                return
            seen: list[grpc.ChannelConnectivity] = []

            def watch(state: grpc.ChannelConnectivity) -> None:   # first the state now, then each change
                if (state is grpc.ChannelConnectivity.READY and seen
                        and seen[-1] is not grpc.ChannelConnectivity.READY):
                    connected.set()
                seen.append(state)

            conn.channel.subscribe(watch, try_to_connect=True)
            try:
                connected.wait(seconds)
            finally:
                conn.channel.unsubscribe(watch)
        finally:
            with self._cond:
                self._pauses.discard(connected)
                self._cond.notify_all()

    def end_pauses(self, timeout_s: float = 5.0) -> None:
        """Ends every recovery's pause and waits (``timeout_s`` at most) until none is in one: the
        client shuts down, and its channels must not close under a pause's subscription."""
        with self._cond:
            for pause in self._pauses:
                pause.set()
            self._cond.wait_for(lambda: not self._pauses, timeout_s)

    def _restore_and_resend(self, rec: LostServer, suspects: set[str], deadline: float, attempts: int) -> None:
        with self._cond:
            keys = [s for s, a in self._owner.items() if a == rec.address]
        owners = self._router.replace(suspects, keys) if keys else {}
        targets = {a: self._connect(a) for a in sorted(set(owners.values()))}
        # Every server the sequences go to answers Info first (within what is left of the wait): one
        # that does not is an attempt that failed, not a reconnect; once it answered, grammars and
        # restores get their whole reply_timeout_s (a grammar may compile there for seconds).
        for address in sorted(set(targets) or {rec.address}):
            self._probe(address, max(0.5, min(self._budget.reply_timeout_s, deadline - time.monotonic())))
        with self._cond:
            records = [i.undo for i in rec.in_flight + rec.held]
            limit = next(iter(targets.values())).info().max_tokens_per_step if targets else 0
            restores = self._ledger.restore_requests(keys, records, limit or DEFAULT_MAX_TOKENS_PER_STEP)
        self._prepare_grammars(restores, owners, targets)
        restored = {e.seq_id for e in restores[0].seqs} if restores else set()
        fresh: dict[str, StepStream] = {}
        try:
            self._send_restores(restores, owners, targets, fresh)
            with self._cond:
                if self._is_closed():
                    raise MaskClientError("client is shut down")
                for address, stream in list(fresh.items()):
                    if address not in self._streams and stream.adopt(self.stream_lost):
                        self._streams[address] = fresh.pop(address)   # it becomes the stream there
                for sid in keys:
                    if sid in self._owner:
                        self._owner[sid] = owners[sid]
                self.moved += sum(1 for sid in keys if owners[sid] != rec.address)
                self.replays += sum(1 for r in restores[:1] for _ in r.seqs)
                del self._recovering[rec.address]
                self._resend(rec, owners)
        finally:
            for stream in fresh.values():
                stream.close()
        # Here every server answered and every restore was answered: say what happened.
        where = ", ".join(sorted(set(owners.values()))) or rec.address
        moved_to = "" if where == rec.address else f" on {where}"
        what = f"{len(restored)} sequences of {rec.address} restored{moved_to}" if restored else "nothing to restore"
        log.warning("maskd: reconnected to %s %.1f s after it was lost (attempt %d): %s (%d steps in flight resent, "
                    "%d held meanwhile sent)", where, time.monotonic() - rec.since, attempts, what,
                    len(rec.in_flight), len(rec.held))

    def _probe(self, address: str, timeout_s: float) -> None:
        """One Info call that the server at ``address`` must answer: Unreachable when it does not."""
        try:
            self._connect(address).ping(timeout_s)
        except MaskClientError as exc:
            if exc.code in RETRYABLE:
                raise Unreachable(address, str(exc).removeprefix(f"maskd at {address}: ")) from exc
            raise

    def _prepare_grammars(self, restores: list[pb.StepRequest], owners: dict[str, str],
                          targets: dict[str, Connection]) -> None:
        """A reopened sequence takes its tokens at once: its grammar must be ready where it goes
        (usually a cache hit), so that no restored sequence answers WAITING."""
        done: set[tuple[str, bytes]] = set()
        for e in restores[0].seqs if restores else ():
            key = (owners[e.seq_id], e.spec.SerializeToString(deterministic=True))
            if key in done:
                continue
            done.add(key)
            try:
                targets[key[0]].register(e.spec, wait=True)
            except MaskClientError as exc:
                if exc.code in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED):
                    raise Unreachable(key[0], str(exc)) from exc
                # A grammar that does not compile: the restore reports the sequence FAILED as before.

    def _send_restores(self, restores: list[pb.StepRequest], owners: dict[str, str],
                       targets: dict[str, Connection], fresh: dict[str, StepStream]) -> None:
        """Sends the restore parts on streams of their own, in order, and waits for all answers."""
        futures = []
        for request in restores:
            by_owner: dict[str, list[pb.SeqStep]] = {}
            for e in request.seqs:
                by_owner.setdefault(owners[e.seq_id], []).append(e)
            for address, entries in by_owner.items():
                stream = fresh.get(address)
                if stream is None:
                    conn = targets[address]
                    stream = fresh[address] = StepStream(conn, self._session, conn.info(), on_lost=_fail_restores,
                                                         on_refused=self._on_refused, on_handles=self._on_handles)
                futures.append((address, stream.send(InFlight(pb.StepRequest(seqs=entries),
                                                              concurrent.futures.Future(), [], internal=True))))
        for address, fut in futures:
            try:
                result = reply_within(fut, self._budget.reply_timeout_s, address)
            except concurrent.futures.TimeoutError as exc:
                if fut.done():
                    raise
                raise MaskClientError(f"restore: {exc}", _C.DEADLINE_EXCEEDED) from None
            for s in result.seqs.values():
                if s.status is SeqStatus.ERROR and s.code not in _RESTORE_OK:
                    log.error("cannot restore sequence %r: %s", s.seq_id, s.reason)

    def _resend(self, rec: LostServer, owners: dict[str, str]) -> None:
        """(under the lock) The steps in flight, then those held, to the new owners in order. Closes
        that rode on them are moot: the server dropped those sequences."""
        for item in rec.in_flight + rec.held:
            for _, fut in item.closes:
                if not fut.done():
                    fut.set_result(None)
            entries = [e for e in item.request.seqs if not e.close] + as_seq_steps(item)
            if not entries:
                if not item.future.done():
                    item.future.set_result(None)
                continue
            undo = {u.seq_id: u for u in records_of(item.undo)}
            by_owner: dict[str, tuple[list[pb.SeqStep], list[UndoRecord]]] = {}
            for e in entries:
                part = by_owner.setdefault(owners.get(e.seq_id) or self._owner.get(e.seq_id, rec.address), ([], []))
                part[0].append(e)
                if e.seq_id in undo:
                    part[1].append(undo[e.seq_id])
            futures = []
            for address, (es, us) in by_owner.items():
                part_item = InFlight(pb.StepRequest(seqs=es, want_forced_tokens=item.request.want_forced_tokens),
                                     concurrent.futures.Future(), us,
                                     attempts=item.attempts + (item in rec.in_flight))
                futures.append(self._dispatch(address, part_item))
            chain(gather([e.seq_id for e in entries], futures), item.future)
            if item in rec.in_flight:
                self.resent_steps += 1

    def _give_up(self, rec: LostServer, why: str, attempts: int) -> None:
        """Fails the recovery's steps with what happened and takes the ledger back to what the
        server acknowledged; the address stays lost (since ``rec.since``): the next step for it
        restores its sequences from their history, or fails within QUICK_S while it is gone."""
        with self._cond:
            self._recovering.pop(rec.address, None)
            items = rec.in_flight + rec.held
            self._undo_items(items)
            if not self._is_closed():
                self._lost.setdefault(rec.address, rec.since)
        lost_for = time.monotonic() - rec.since
        message = (f"maskd at {rec.address} was lost {lost_for:.1f} s ago; its sequences were not restored after "
                   f"{attempts} attempts (recovery_timeout_s={self._budget.timeout_s:g}): {why}")
        fail_all(items, MaskClientError(message, _C.UNAVAILABLE))
        log.error("%s; %d steps failed", message, len(items))


def as_seq_steps(item: InFlight) -> list[pb.SeqStep]:
    """A request's columnar entries as SeqSteps: their handles belonged to a lost session, so a
    resend names the sequences (the restore gave new handles, used from the next step on)."""
    if not item.plain_ids:
        return []
    req = item.request
    steps = np.frombuffer(req.steps, dtype="<u4").tolist()
    counts = np.frombuffer(req.token_counts, dtype="<u4").tolist()
    tokens = np.frombuffer(req.tokens, dtype="<i4").tolist()
    out, pos = [], 0
    for sid, step, n in zip(item.plain_ids, steps, counts):
        out.append(pb.SeqStep(seq_id=sid, step=step, tokens=tokens[pos:pos + n]))
        pos += n
    return out


def _fail_restores(stream: StepStream, error: grpc.RpcError | None) -> None:
    """Loss handler of a stream that carries restores: the recovery waiting on them retries."""
    details = (error.details() if error is not None else "") or "stream ended"
    fail_all(stream.take_in_flight(), MaskClientError(f"restore stream to {stream.address} lost: {details}",
                                                      _C.UNAVAILABLE))
