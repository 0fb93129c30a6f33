"""A Ray-free client of the Directory gRPC service (what a GPU worker and the CLI use)."""
from __future__ import annotations

from typing import Iterable, Sequence

import grpc

from maskd.v1 import directory_pb2 as dpb
from maskd.v1 import directory_pb2_grpc as dpb_grpc

DIRECTORY_PREFIX = "directory:"


class DirectoryError(RuntimeError):
    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def strip_prefix(target: str) -> str:
    return target[len(DIRECTORY_PREFIX):] if target.startswith(DIRECTORY_PREFIX) else target


class DirectoryClient:
    def __init__(self, address: str, *, timeout_s: float = 10.0) -> None:
        self.address = strip_prefix(address)
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(self.address)
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

    def __enter__(self) -> "DirectoryClient":
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
