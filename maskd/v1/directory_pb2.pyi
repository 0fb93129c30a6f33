from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStats(_message.Message):
    __slots__ = ("sequences", "streams", "cache_entries", "compiles", "shared_hits", "shared_misses")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    COMPILES_FIELD_NUMBER: _ClassVar[int]
    SHARED_HITS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MISSES_FIELD_NUMBER: _ClassVar[int]
    sequences: int
    streams: int
    cache_entries: int
    compiles: int
    shared_hits: int
    shared_misses: int
    def __init__(self, sequences: _Optional[int] = ..., streams: _Optional[int] = ..., cache_entries: _Optional[int] = ..., compiles: _Optional[int] = ..., shared_hits: _Optional[int] = ..., shared_misses: _Optional[int] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("worker_id", "address", "live", "incarnation", "restarts", "node_id", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    live: bool
    incarnation: int
    restarts: int
    node_id: str
    stats: WorkerStats
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., live: _Optional[bool] = ..., incarnation: _Optional[int] = ..., restarts: _Optional[int] = ..., node_id: _Optional[str] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class SharedCacheStats(_message.Message):
    __slots__ = ("entries", "bytes", "hits", "misses", "publishes", "waits")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    hits: int
    misses: int
    publishes: int
    waits: int
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., publishes: _Optional[int] = ..., waits: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: bool
    def __init__(self, stats: _Optional[bool] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "epoch", "ring_vnodes", "ring_hash", "cache")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RING_VNODES_FIELD_NUMBER: _ClassVar[int]
    RING_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    epoch: int
    ring_vnodes: int
    ring_hash: str
    cache: SharedCacheStats
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., epoch: _Optional[int] = ..., ring_vnodes: _Optional[int] = ..., ring_hash: _Optional[str] = ..., cache: _Optional[_Union[SharedCacheStats, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "suspect_addresses")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    suspect_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., suspect_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("workers", "owner", "epoch")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    owner: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., owner: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ...) -> None: ...
