"""Cluster mode of the client: one MaskClient per maskd worker, routed by the directory.

    with MaskClient("directory:10.0.0.5:7000") as mc:     # a ClusterClient
        mc.open("req-1", {"json_schema": schema})
        res = mc.step({"req-1": []})

- Placement: the client keeps the directory's ring (ListWorkers: live worker ids, addresses and
  ring parameters, refreshed every few seconds) and opens each sequence on the owner of its id.
  A sequence stays on that worker while the worker lives, so a worker that joins moves nothing.
- Steps: ``step_async`` splits the batch by owner, sends the parts at once on each worker's
  stream and merges the replies into one StepResult whose rows follow the batch order.
- Recovery: matcher state is a function of (grammar, accepted tokens). When a worker's stream
  breaks, its client hands over the steps in flight (``MaskClient.hand_over``); the cluster client
  asks the directory for the new owners (naming the lost address as a suspect, which the
  directory probes and takes off the ring), makes sure the grammars are ready there, re-opens each
  sequence at its last acknowledged step with its whole token history (``restore_message``), moves
  the client-side state over and resends the steps in flight. The futures the caller holds resolve
  with the new owners' rows: no sequence fails and no output changes.

Needs only grpcio, protobuf and numpy (no Ray).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from typing import Any, Iterable, Mapping

import grpc
import numpy as np

from maskd.specs import GrammarSpec, SpecError
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc
from maskd_client.client import (MaskClient, MaskClientError, SeqStatus, ServerInfo, StepInput, StepResult,
                                 _spec_proto)
from maskd_cluster.directory_client import DirectoryClient, DirectoryError, strip_prefix
from maskd_cluster.hashring import DEFAULT_VNODES, RING_HASH, HashRing

log = logging.getLogger("maskd_client.cluster")
_C = grpc.StatusCode
_RESTORE_OK = (_C.ALREADY_EXISTS, _C.ABORTED)


class _Unreachable(Exception):
    def __init__(self, address: str, details: str) -> None:
        super().__init__(f"maskd worker at {address} is unreachable: {details}")
        self.address = address


def merge_results(order: list[str], parts: list[StepResult]) -> StepResult:
    """One StepResult from per-worker parts: every sequence of `order`, rows in that order."""
    if len(parts) == 1 and list(parts[0].seqs) == order:
        return parts[0]
    words = parts[0].bitmask.shape[1] if parts else 0
    where: dict[str, tuple[int, Any]] = {}
    for i, part in enumerate(parts):
        for sid, r in part.seqs.items():
            where[sid] = (i, r)
    src: list[list[int]] = [[] for _ in parts]
    dst: list[list[int]] = [[] for _ in parts]
    seqs = {}
    row = 0
    for sid in order:
        i, r = where[sid]
        if r.row >= 0 and r.num_rows:
            n = r.num_rows
            src[i].extend(range(r.row, r.row + n))
            dst[i].extend(range(row, row + n))
            r.row = row
            row += n
        seqs[sid] = r
    bitmask = np.empty((row, words), dtype=np.int32)
    for i, part in enumerate(parts):
        if src[i]:
            bitmask[dst[i]] = part.bitmask[src[i]]
    return StepResult(seqs, bitmask, max((p.server_seconds for p in parts), default=0.0),
                      max((p.round_trip_seconds for p in parts), default=0.0))


def _gather(order: list[str], futures: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """A future of the merged result of per-worker futures."""
    if len(futures) == 1:
        return futures[0]
    outer: concurrent.futures.Future = concurrent.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(_):
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            parts = [f.result() for f in futures]
            outer.set_result(merge_results(order, parts))
        except BaseException as exc:
            outer.set_exception(exc)

    for f in futures:
        f.add_done_callback(done)
    return outer


def _chain(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    def copy(f):
        if target.done():
            return
        exc = f.exception()
        if exc is not None:
            target.set_exception(exc)
        else:
            target.set_result(f.result())
    source.add_done_callback(copy)


def _done(value=None) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f


class ClusterClient:
    """The MaskClient API over a maskd cluster; ``target`` is ``directory:HOST:PORT``."""

    def __init__(self, target: str, tokenizer: Any = None, *, session: str | None = None,
                 retries: int = 3, retry_backoff_s: float = 0.2, want_forced_tokens: bool = True,
                 channel_options: Iterable[tuple[str, Any]] = (), timeout_s: float = 30.0,
                 refresh_s: float = 5.0, recovery_timeout_s: float = 60.0, connect_timeout_s: float = 5.0,
                 **client_options: Any) -> None:
        self.target = target
        self.directory_address = strip_prefix(target)
        self.session = session or uuid.uuid4().hex
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.want_forced_tokens = want_forced_tokens
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.recovery_timeout_s = recovery_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._tokenizer = tokenizer
        self._channel_options = tuple(channel_options)
        self._client_options = client_options   # passed on to every worker's MaskClient (e.g. TLS, auth)
        self._directory = DirectoryClient(self.directory_address, timeout_s=min(timeout_s, 10.0))
        self._cond = threading.Condition(threading.RLock())   # guards everything below
        self._connect_lock = threading.Lock()
        self._clients: dict[str, MaskClient] = {}      # worker address -> its client
        self._owner: dict[str, str] = {}               # seq id -> worker address
        self._failed: dict[str, str] = {}              # seq id -> why it could not be recovered
        self._recovering: set[str] = set()             # addresses whose sequences are moving
        self._ring: HashRing | None = None
        self._ring_addr: dict[str, str] = {}           # worker id -> address
        self._ring_at = 0.0
        self.epoch = 0
        self._info: ServerInfo | None = None
        self._closed = False
        # what recovery did (reported by tests and tools)
        self.recoveries = 0       # lost worker streams handled
        self.replays = 0          # sequences re-opened elsewhere with their token history
        self.resent_steps = 0     # in-flight steps sent again to new owners
        self.moved = 0            # sequences that changed worker

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> "ClusterClient":
        self.info()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def reconnects(self) -> int:
        return self.recoveries

    # -- membership -------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Reloads the ring of live workers from the directory."""
        try:
            reply = self._directory.list_workers(wait_for_ready=True)
        except DirectoryError as exc:
            raise MaskClientError(str(exc), exc.code) from exc
        if reply.ring_hash and reply.ring_hash != RING_HASH:
            log.warning("directory hashes with %s, this client with %s", reply.ring_hash, RING_HASH)
        live = {w.worker_id: w.address for w in reply.workers if w.live and w.address}
        ring = HashRing(live, vnodes=reply.ring_vnodes or DEFAULT_VNODES)
        with self._cond:
            self._ring, self._ring_addr, self._ring_at, self.epoch = ring, live, time.monotonic(), reply.epoch

    def workers(self) -> dict[str, str]:
        """Live worker id -> address, as this client last saw them."""
        with self._cond:
            return dict(self._ring_addr)

    def owner_of(self, seq_id: str) -> str | None:
        """The address of the worker a sequence lives on (None if not open here)."""
        with self._cond:
            return self._owner.get(seq_id)

    def _ring_owner(self, key: str) -> str:
        deadline = time.monotonic() + self.timeout_s
        delay = self.retry_backoff_s
        while True:
            with self._cond:
                stale = self._ring is None or time.monotonic() - self._ring_at > self.refresh_s
                have_ring = bool(self._ring)
            if stale or not have_ring:
                try:
                    self.refresh()
                except MaskClientError as exc:
                    if not have_ring:
                        raise
                    # The directory is not on the hot path: keep placing on the last ring we saw.
                    log.warning("cannot refresh the worker list, using the last one: %s", exc)
                    with self._cond:
                        self._ring_at = time.monotonic()
            with self._cond:
                wid = self._ring.owner(key) if self._ring else None
                if wid is not None:
                    return self._ring_addr[wid]
            if time.monotonic() > deadline:
                raise MaskClientError(f"no live maskd workers in the cluster at {self.directory_address}",
                                      _C.UNAVAILABLE)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)
            with self._cond:
                self._ring_at = 0.0

    def _place(self, key: str) -> tuple[str, MaskClient]:
        """The owner of `key` and a connected client to it (asking the directory past dead addresses)."""
        address = self._ring_owner(key)
        suspects: set[str] = set()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return address, self._connect(address)
            except _Unreachable as exc:
                suspects.add(exc.address)
                if time.monotonic() > deadline:
                    raise MaskClientError(str(exc), _C.UNAVAILABLE) from exc
                try:
                    address = self._directory.owners([key], suspects)[key].address
                except DirectoryError as dexc:
                    if time.monotonic() > deadline:
                        raise MaskClientError(str(dexc), dexc.code) from dexc
                    time.sleep(self.retry_backoff_s)
                with self._cond:
                    self._ring_at = 0.0   # refresh the ring on the next placement

    def _connect(self, address: str) -> MaskClient:
        with self._cond:
            client = self._clients.get(address)
            if client is not None:
                return client
        with self._connect_lock:
            with self._cond:
                client = self._clients.get(address)
                if client is not None:
                    return client
                if self._closed:
                    raise MaskClientError("client is shut down")
            client = MaskClient(address, self._tokenizer, session=self.session, retries=self.retries,
                                retry_backoff_s=self.retry_backoff_s, want_forced_tokens=self.want_forced_tokens,
                                channel_options=self._channel_options, timeout_s=self.timeout_s,
                                on_lost=self._on_lost, **self._client_options)
            try:
                # Fail fast on a dead address (MaskClient.info waits for the channel to be ready).
                pb_grpc.MaskServiceStub(client._channel).Info(pb.InfoRequest(), timeout=self.connect_timeout_s,
                                                              metadata=getattr(client, "_auth", ()))
            except grpc.RpcError as exc:
                client.shutdown()
                raise _Unreachable(address, exc.details() or exc.code().name) from exc
            client.info()  # checks the tokenizer fingerprint
            with self._cond:
                self._clients[address] = client
            return client

    # -- unary ----------------------------------------------------------------------------------
    def info(self) -> ServerInfo:
        if self._info is None:
            _, client = self._place("")
            self._info = client.info()
        return self._info

    def register(self, spec, *, wait: bool = True) -> str:
        """Registers (compiles) a grammar on the worker that owns its id; the cluster cache shares it."""
        spec_pb = _spec_proto(spec)
        info = self.info()
        try:
            key = GrammarSpec.from_proto(spec_pb).grammar_id(info.tokenizer_fingerprint, info.backend,
                                                              info.backend_version)
        except SpecError:
            key = ""   # any worker answers with the spec's error
        address = self._ring_owner(key)
        suspects: set[str] = set()
        for attempt in range(self.retries + 1):
            try:
                return self._connect(address).register(spec_pb, wait=wait)
            except (_Unreachable, MaskClientError) as exc:
                if (isinstance(exc, MaskClientError) and exc.code is not _C.UNAVAILABLE) or attempt == self.retries:
                    if isinstance(exc, _Unreachable):
                        raise MaskClientError(str(exc), _C.UNAVAILABLE) from exc
                    raise
            suspects.add(address)
            try:
                address = self._directory.owners([key], suspects)[key].address
            except DirectoryError as exc:
                raise MaskClientError(str(exc), exc.code) from exc
            with self._cond:
                self._ring_at = 0.0
        raise AssertionError("unreachable")

    # -- sequences ------------------------------------------------------------------------------
    def open(self, seq_id: str, spec) -> None:
        spec_pb = _spec_proto(spec)
        with self._cond:
            if seq_id in self._owner:
                raise MaskClientError(f"sequence {seq_id!r} is already open on this client", _C.ALREADY_EXISTS)
        while True:
            address, client = self._place(seq_id)
            with self._cond:
                if seq_id in self._owner:
                    raise MaskClientError(f"sequence {seq_id!r} is already open on this client",
                                          _C.ALREADY_EXISTS)
                if self._clients.get(address) is not client or address in self._recovering:
                    continue   # lost meanwhile: place again
                client.open(seq_id, spec_pb)
                self._owner[seq_id] = address
                self._failed.pop(seq_id, None)
                return

    def close(self, seq_id: str) -> concurrent.futures.Future:
        with self._cond:
            while self._owner.get(seq_id) in self._recovering:
                self._cond.wait(1.0)
            address = self._owner.pop(seq_id, None)
            self._failed.pop(seq_id, None)
            client = self._clients.get(address) if address else None
            if client is None:
                return _done()
            return client.close(seq_id)

    def flush_closes(self) -> None:
        """Sends every close still waiting for a step, on each worker's stream."""
        with self._cond:
            clients = list(self._clients.values())
        for c in clients:
            c.flush_closes()

    def history(self, seq_id: str) -> list[int]:
        with self._cond:
            while self._owner.get(seq_id) in self._recovering:
                self._cond.wait(1.0)
            address = self._owner[seq_id]
            return self._clients[address].history(seq_id)

    @property
    def open_sequences(self) -> list[str]:
        with self._cond:
            return list(self._owner)

    # -- steps ----------------------------------------------------------------------------------
    def step(self, tokens_by_seq: Mapping[str, Any], timeout: float | None = None) -> StepResult:
        return self.step_async(tokens_by_seq).result(timeout if timeout is not None else self.timeout_s)

    def step_async(self, tokens_by_seq: Mapping[str, Any]) -> concurrent.futures.Future:
        """Sends the batch's parts to their workers now; the future resolves to the merged result."""
        order = list(tokens_by_seq)
        if not order:
            words = self._info.words_per_row if self._info else 0
            return _done(StepResult({}, np.zeros((0, words), dtype=np.int32), 0.0, 0.0))
        with self._cond:
            deadline = time.monotonic() + self.recovery_timeout_s
            while True:
                owners = {}
                for sid in order:
                    address = self._owner.get(sid)
                    if address is None:
                        if sid in self._failed:
                            raise MaskClientError(f"sequence {sid!r} was lost: {self._failed[sid]}", _C.UNAVAILABLE)
                        raise MaskClientError(f"sequence {sid!r} is not open on this client", _C.NOT_FOUND)
                    owners[sid] = address
                if not (set(owners.values()) & self._recovering):
                    break
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise MaskClientError("timed out waiting for the recovery of a lost maskd worker",
                                          _C.DEADLINE_EXCEEDED)
            parts: dict[str, dict[str, Any]] = {}
            for sid in order:
                parts.setdefault(owners[sid], {})[sid] = tokens_by_seq[sid]
            self._check_rollbacks(parts)
            futures = [self._clients[address].step_async(part) for address, part in parts.items()]
        return _gather(order, futures)

    def _check_rollbacks(self, parts: dict[str, dict[str, Any]]) -> None:
        """Refuses bad input before any part is sent (a half-sent step would split the batch)."""
        for address, part in parts.items():
            client = self._clients[address]
            for sid, value in part.items():
                inp = value if isinstance(value, StepInput) else StepInput(tokens=value)
                try:
                    [int(t) for t in inp.tokens] + [int(t) for t in inp.drafts] + [int(inp.rollback)]
                except (TypeError, ValueError) as exc:
                    raise MaskClientError(f"sequence {sid!r}: tokens, drafts and rollback must be integers ({exc})",
                                          _C.INVALID_ARGUMENT) from None
                if isinstance(value, StepInput) and value.rollback:
                    have = len(client.history(sid))
                    if value.rollback > have:
                        raise MaskClientError(f"cannot roll back {value.rollback} tokens of {sid!r}: it has {have}",
                                              _C.OUT_OF_RANGE)

    # -- recovery -------------------------------------------------------------------------------
    def _on_lost(self, client: MaskClient, call, details: str) -> None:
        """Runs on the broken stream's reader thread."""
        address = client.target
        with self._cond:
            if self._closed:
                return
            pending = client.hand_over(call)
            if pending is None:
                return
            if self._clients.get(address) is client:
                del self._clients[address]
            self._recovering.add(address)
        log.warning("maskd worker at %s lost (%s): moving its sequences", address, details)
        try:
            self._recover(client, address, pending)
        except Exception as exc:
            log.error("cannot recover the sequences of %s: %s", address, exc)
            self._abandon(client, address, pending, exc)
        finally:
            with self._cond:
                self._recovering.discard(address)
                self._cond.notify_all()
            client.shutdown()

    def _recover(self, lost: MaskClient, address: str, pending: list) -> None:
        restore = lost.restore_message(pending)            # opened sequences at their acknowledged state
        keys = list(lost.open_sequences)
        known = set(keys)
        for p in pending:
            if not p.internal:
                for e in p.request.seqs:
                    if not e.close and e.seq_id not in known:
                        known.add(e.seq_id)
                        keys.append(e.seq_id)
        suspects = {address}
        deadline = time.monotonic() + self.recovery_timeout_s
        delay = self.retry_backoff_s
        while True:
            try:
                owners = self._new_owners(keys, suspects)
                targets = {a: self._connect(a) for a in sorted(set(owners.values()))}
                self._prepare_grammars(restore, owners, targets)
                with self._cond:
                    if self._closed:
                        raise MaskClientError("client is shut down")
                    if any(self._clients.get(a) is not c for a, c in targets.items()):
                        raise _Unreachable(next(a for a, c in targets.items() if self._clients.get(a) is not c),
                                           "lost during recovery")
                    self._move(lost, restore, pending, owners, targets)
                return
            except _Unreachable as exc:
                suspects.add(exc.address)
                why = exc
            except DirectoryError as exc:
                why = exc
            except MaskClientError as exc:
                if exc.code is not _C.UNAVAILABLE:
                    raise
                why = exc
            if time.monotonic() > deadline:
                raise MaskClientError(f"no new owner after {self.recovery_timeout_s:g} s: {why}", _C.UNAVAILABLE)
            log.info("recovery of %s: retrying (%s)", address, why)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)

    def _new_owners(self, keys: list[str], suspects: set[str]) -> dict[str, str]:
        if not keys:
            return {}
        try:
            owners = {k: w.address for k, w in self._directory.owners(keys, suspects).items()}
        except DirectoryError as exc:
            if exc.code not in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED) or "no live maskd workers" in str(exc):
                raise
            # The directory itself is away (restarting): the last ring without the lost workers.
            with self._cond:
                live = {w: a for w, a in self._ring_addr.items() if a not in suspects}
                vnodes = self._ring.vnodes if self._ring else DEFAULT_VNODES
            if not live:
                raise
            log.warning("directory unavailable (%s): placing on the last known ring without %s", exc,
                        sorted(suspects))
            ring = HashRing(live, vnodes=vnodes)
            return {k: live[ring.owner(k)] for k in keys}
        with self._cond:
            self._ring_at = 0.0   # the ring changed: reload it on the next placement
        return owners

    def _prepare_grammars(self, restore: pb.StepRequest, owners: dict[str, str],
                          targets: dict[str, MaskClient]) -> None:
        """A re-opened sequence takes its tokens at once, so its grammar must be ready on its new
        owner first (usually a hit in the cluster cache)."""
        done: set[tuple[str, bytes]] = set()
        for e in restore.seqs:
            address = owners[e.seq_id]
            key = (address, e.spec.SerializeToString(deterministic=True))
            if key in done:
                continue
            done.add(key)
            try:
                targets[address].register(e.spec, wait=True)
            except MaskClientError as exc:
                if exc.code is _C.UNAVAILABLE:
                    raise _Unreachable(address, str(exc)) from exc
                # A grammar that does not compile: the restore reports the sequence FAILED as before.

    def _move(self, lost: MaskClient, restore: pb.StepRequest, pending: list, owners: dict[str, str],
              targets: dict[str, MaskClient]) -> None:
        """Under the lock: state over, restores out, in-flight steps resent, in that order per stream."""
        seqs = lost.take_sequences()
        by_owner: dict[str, dict] = {}
        for sid, seq in seqs.items():
            by_owner.setdefault(owners[sid], {})[sid] = seq
        for a, part in by_owner.items():
            targets[a].adopt_sequences(part)
        for sid in seqs:
            self._owner[sid] = owners[sid]
        self.moved += sum(1 for sid in seqs if owners[sid] != lost.target)
        entries: dict[str, list] = {}
        for e in restore.seqs:
            entries.setdefault(owners[e.seq_id], []).append(e)
        for a, part in entries.items():
            fut = targets[a].send_request(pb.StepRequest(seqs=part), internal=True)
            fut.add_done_callback(self._check_restore)
        self.replays += len(restore.seqs)
        self.recoveries += 1
        for p in pending:
            if p.internal:   # a close (moot on a lost worker) or an earlier restore (redone above)
                if not p.future.done():
                    p.future.set_result(None)
                continue
            parts: dict[str, tuple[list, list]] = {}
            undo = {u[0]: u for u in p.undo}
            for e in p.request.seqs:
                if e.close:   # a close that rode on the step: moot on a lost worker
                    continue
                a = owners[e.seq_id]
                part = parts.setdefault(a, ([], []))
                part[0].append(e)
                if e.seq_id in undo:
                    part[1].append(undo[e.seq_id])
            if not parts:   # only closes rode on it
                p.future.set_result(None)
                continue
            futures = [targets[a].send_request(pb.StepRequest(seqs=es, want_forced_tokens=p.request.want_forced_tokens),
                                               us) for a, (es, us) in parts.items()]
            _chain(_gather([e.seq_id for e in p.request.seqs if not e.close], futures), p.future)
            self.resent_steps += 1
        log.warning("moved %d sequences of %s (%d re-opened with their tokens, %d steps resent)",
                    len(seqs), lost.target, len(restore.seqs), sum(1 for p in pending if not p.internal))

    @staticmethod
    def _check_restore(fut: concurrent.futures.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return   # that worker was lost too: its own recovery redoes the restore
        result = fut.result()
        if result is None:
            return
        for s in result.seqs.values():
            if s.status is SeqStatus.ERROR and s.code not in _RESTORE_OK:
                log.error("cannot restore sequence %r: %s", s.seq_id, s.reason)

    def _abandon(self, lost: MaskClient, address: str, pending: list, exc: Exception) -> None:
        why = f"maskd worker at {address} was lost and no other worker took its sequences: {exc}"
        seqs = lost.take_sequences()
        with self._cond:
            for sid in seqs:
                if self._owner.get(sid) == address:
                    del self._owner[sid]
                    self._failed[sid] = why
        for p in pending:
            if not p.future.done():
                p.future.set_exception(MaskClientError(why, _C.UNAVAILABLE))

    # -- teardown ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            clients = list(self._clients.values())
            self._clients.clear()
            self._cond.notify_all()
        for c in clients:
            c.shutdown()
        self._directory.close()
