"""Where sequences live: a fixed server, or the owner on a cluster's consistent-hash ring.

* ``HashRing``: consistent hashing with virtual nodes over stable worker ids. Each member owns
  ``vnodes`` points on a 64-bit ring; a key belongs to the member of the first point at or after
  the key's hash. A member that leaves moves only its own keys; the directory and the clients
  compute the same ring from the same member ids.
* ``DirectoryClient``: the cluster directory's gRPC service (no Ray needed).
* ``Router``: what a client asks about placement. ``FixedRouter`` is one server (reconnects go
  to it again); ``DirectoryRouter`` is a cluster: new sequences go to their ring owner, and when
  a worker is lost the directory names the new owners.
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import grpc

from maskd.v1 import directory_pb2 as dpb
from maskd.v1 import directory_pb2_grpc as dpb_grpc
from maskd_client.connection import RECONNECT_OPTIONS

log = logging.getLogger("maskd_client.routing")
DIRECTORY_PREFIX = "directory:"

RING_HASH = "blake2b-64"
DEFAULT_VNODES = 128


def hash64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, members: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        self._members: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for m in members:
            self._members.add(m)
        self._rebuild()

    @property
    def members(self) -> list[str]:
        return sorted(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member: str) -> bool:
        return member in self._members

    def add(self, member: str) -> bool:
        if member in self._members:
            return False
        self._members.add(member)
        self._rebuild()
        return True

    def remove(self, member: str) -> bool:
        if member not in self._members:
            return False
        self._members.discard(member)
        self._rebuild()
        return True

    def owner(self, key: str) -> str | None:
        if not self._points:
            return None
        i = bisect.bisect_left(self._points, hash64(key))
        return self._owners[i if i < len(self._points) else 0]

    def owners(self, keys: Sequence[str]) -> list[str | None]:
        return [self.owner(k) for k in keys]

    def _rebuild(self) -> None:
        # Ties between points (astronomically rare) are broken by member id, so every
        # process builds the identical ring.
        points = sorted((hash64(f"{m}#{v}"), m) for m in self._members for v in range(self.vnodes))
        self._points = [p for p, _ in points]
        self._owners = [m for _, m in points]


# -- the directory service -----------------------------------------------------------------------
class DirectoryError(RuntimeError):
    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def strip_prefix(target: str) -> str:
    return target[len(DIRECTORY_PREFIX):] if target.startswith(DIRECTORY_PREFIX) else target


class DirectoryClient:
    """Ray-free client of the Directory gRPC service (what a GPU worker and the CLI use)."""

    def __init__(self, address: str, *, timeout_s: float = 10.0) -> None:
        self.address = strip_prefix(address)
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(self.address, options=RECONNECT_OPTIONS)   # a directory restarts too
        self._stub = dpb_grpc.DirectoryStub(self._channel)

    def list_workers(self, *, stats: bool = False, wait_for_ready: bool = False,
                     timeout_s: float | None = None) -> dpb.ListWorkersResponse:
        try:
            return self._stub.ListWorkers(dpb.ListWorkersRequest(stats=stats),
                                          timeout=timeout_s or self.timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise DirectoryError(f"maskd directory at {self.address}: {exc.details()}", exc.code()) from exc

    def lookup(self, keys: Sequence[str], suspects: Iterable[str] = (),
               timeout_s: float | None = None) -> dpb.LookupResponse:
        try:
            return self._stub.Lookup(dpb.LookupRequest(keys=list(keys), suspect_addresses=sorted(set(suspects))),
                                     timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise DirectoryError(f"maskd directory at {self.address}: {exc.details()}", exc.code()) from exc

    def owners(self, keys: Sequence[str], suspects: Iterable[str] = ()) -> dict[str, dpb.Worker]:
        """key -> owning worker (id and address)."""
        reply = self.lookup(keys, suspects)
        return {k: reply.workers[i] for k, i in zip(keys, reply.owner)}

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DirectoryClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_directory(target: str, timeout_s: float = 3.0) -> bool:
    """True when the target answers the Directory service (a maskd server answers UNIMPLEMENTED)."""
    try:
        with DirectoryClient(target, timeout_s=timeout_s) as dc:
            dc.list_workers(timeout_s=timeout_s)
        return True
    except DirectoryError:
        return False


# -- routers --------------------------------------------------------------------------------------
class NoOwner(RuntimeError):
    """No live server can take a key now (the caller may retry)."""


class Router(Protocol):
    def place(self, key: str) -> str:
        """The address that should hold a new key (may ask the directory)."""

    def replace(self, suspects: set[str], keys: Sequence[str]) -> dict[str, str]:
        """New owners of ``keys`` when the servers at ``suspects`` cannot be reached."""

    def close(self) -> None: ...


class FixedRouter:
    """One server: every key lives there, and a lost stream reconnects to it."""

    def __init__(self, target: str) -> None:
        self.target = target

    def place(self, key: str) -> str:
        return self.target

    def replace(self, suspects: set[str], keys: Sequence[str]) -> dict[str, str]:
        return {k: self.target for k in keys}

    def close(self) -> None:
        pass


class DirectoryRouter:
    """A cluster: the directory's ring (refreshed every ``refresh_s``), and the directory's answer
    (which probes the suspects and takes dead ones off the ring) when workers are lost. When the
    directory itself is away, the last ring without the suspects."""

    def __init__(self, directory: str, *, timeout_s: float = 30.0, refresh_s: float = 5.0,
                 backoff_s: float = 0.2) -> None:
        self.directory = DirectoryClient(directory, timeout_s=min(timeout_s, 10.0))
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.backoff_s = backoff_s
        self._lock = threading.Lock()
        self._ring: HashRing | None = None
        self._addresses: dict[str, str] = {}   # worker id -> address
        self._at = 0.0
        self.epoch = 0

    def refresh(self) -> None:
        reply = self.directory.list_workers(wait_for_ready=True)
        if reply.ring_hash and reply.ring_hash != RING_HASH:
            log.warning("directory hashes with %s, this client with %s", reply.ring_hash, RING_HASH)
        live = {w.worker_id: w.address for w in reply.workers if w.live and w.address}
        with self._lock:
            self._ring = HashRing(live, vnodes=reply.ring_vnodes or DEFAULT_VNODES)
            self._addresses, self._at, self.epoch = live, time.monotonic(), reply.epoch

    def workers(self) -> dict[str, str]:
        """Live worker id -> address, as last seen."""
        with self._lock:
            return dict(self._addresses)

    def stale(self) -> None:
        with self._lock:
            self._at = 0.0

    def place(self, key: str) -> str:
        deadline = time.monotonic() + self.timeout_s
        delay = self.backoff_s
        while True:
            with self._lock:
                have = bool(self._ring)
                stale = time.monotonic() - self._at > self.refresh_s
            if stale or not have:
                try:
                    self.refresh()
                except DirectoryError:
                    if not have:
                        raise
                    # The directory is not on the hot path: keep placing on the last ring seen.
                    log.warning("cannot refresh the worker list from %s; using the last one", self.directory.address)
                    with self._lock:
                        self._at = time.monotonic()
            with self._lock:
                owner = self._ring.owner(key) if self._ring else None
                if owner is not None:
                    return self._addresses[owner]
            if time.monotonic() > deadline:
                raise NoOwner(f"no live maskd workers in the cluster at {self.directory.address}")
            time.sleep(delay)
            delay = min(2 * delay, 2.0)
            self.stale()

    def replace(self, suspects: set[str], keys: Sequence[str]) -> dict[str, str]:
        if not keys:
            return {}
        try:
            owners = {k: w.address for k, w in self.directory.owners(keys, suspects).items()}
        except DirectoryError as exc:
            if exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or \
                    "no live maskd workers" in str(exc):
                raise NoOwner(str(exc)) from exc
            with self._lock:
                live = {w: a for w, a in self._addresses.items() if a not in suspects}
                vnodes = self._ring.vnodes if self._ring else DEFAULT_VNODES
            if not live:
                raise NoOwner(str(exc)) from exc
            log.warning("directory unavailable (%s): placing on the last known ring without %s", exc, sorted(suspects))
            ring = HashRing(live, vnodes=vnodes)
            return {k: live[ring.owner(k) or ""] for k in keys}
        self.stale()   # the ring changed: reload it on the next placement
        return owners

    def close(self) -> None:
        self.directory.close()
