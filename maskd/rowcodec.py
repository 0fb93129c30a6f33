"""Mask rows on the wire: one row block per reply, through one zstandard stream per Session stream.

The block format and the row-dictionary rule are the contract's (``RowEncoding`` in
proto/maskd/v1/maskd.proto): per row the smallest of dense words, delta-varint allowed or rejected
ids, or a reference to a row the stream carried before. The per-row work (finding repeats, id lists
and varints, and back) is C (``maskd._rowcodec``, built with the package); where it could not be
built, the same bytes come from numpy here, slower. The block then goes through the stream's zstd
compressor (level 1, a block flush per reply): repeats and id lists compress well, e.g. ~31 B per
row on MaskBench-dev at batch 64 against ~200 B for the block alone (docs/benchmarks.md, "Wire";
docs/decisions/0001-row-codec.md).

``RowBlockEncoder`` (server) and ``RowBlockDecoder`` (client) each belong to one stream: both keep
the dictionary and the zstd context in step, so a reply must be decoded exactly once, in order, and
a RowCodecError means the stream is out of step and must be dropped (the client reconnects, which
starts both ends afresh).
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from maskd.v1.contract import RowEncoding

try:
    from maskd import _rowcodec as _native  # type: ignore[attr-defined]
except ImportError:   # no compiler when the package was installed: the numpy path below
    _native = None

DENSE, ALLOWED_IDS, REJECTED_IDS, DICT_REF = (RowEncoding.DENSE, RowEncoding.ALLOWED_IDS,
                                              RowEncoding.REJECTED_IDS, RowEncoding.DICT_REF)
ENCODING_NAMES: dict[int, str] = {e.value: e.name.lower() for e in RowEncoding}
ALL_ENCODINGS: tuple[int, ...] = tuple(RowEncoding)
# 256 rows: 4 MB per stream and end for a 129k vocabulary.
DEFAULT_DICT_SIZE = 256
MAX_DICT_SIZE = 65535
ZSTD_LEVEL = 1
NATIVE = _native is not None


class RowCodecError(ValueError):
    """A reply whose rows cannot be decoded (corrupt, or from a stream out of step)."""


def _check_shape(words: int, width: int, dict_size: int) -> tuple[int, int, int]:
    words, width, dict_size = int(words), int(width), int(dict_size)
    if not 0 < width <= 2**31 - 1:
        raise ValueError(f"width {width} must be in [1, 2**31 - 1]")
    if words * 32 < width:
        raise ValueError(f"{words} words hold {words * 32} bits, fewer than width {width}")
    if not 0 <= dict_size <= MAX_DICT_SIZE:
        raise ValueError(f"dict_size must be in [0, {MAX_DICT_SIZE}]")
    return words, width, dict_size


def full_row(words: int, width: int) -> np.ndarray:
    """uint32 words with exactly the bits [0, width) set."""
    full = np.zeros(words, dtype=np.uint32)
    whole, rest = divmod(width, 32)
    full[:whole] = 0xFFFFFFFF
    if rest:
        full[whole] = (1 << rest) - 1
    return full


def _as_rows(rows: np.ndarray, words: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows)
    if rows.ndim != 2 or rows.shape[1] != words:
        raise ValueError(f"rows must be 2-D (n, {words}), got shape {rows.shape}")
    if rows.dtype.kind not in "iu" or rows.dtype.itemsize != 4:
        raise ValueError(f"rows must be int32/uint32 words, got {rows.dtype}")
    if not (rows.dtype.byteorder == "<" or (rows.dtype.byteorder in "=|" and sys.byteorder == "little")):
        rows = rows.astype(rows.dtype.newbyteorder("<"))
    return rows.view("<u4")


class RowBlockEncoder:
    """Encodes the rows of one stream's replies. ``encodings``: the kinds it may use (at least one
    of DENSE / ALLOWED_IDS / REJECTED_IDS; without DICT_REF it keeps no dictionary)."""

    def __init__(self, words_per_row: int, width: int, *, dict_size: int = DEFAULT_DICT_SIZE,
                 encodings: Any = None, compress: bool = True) -> None:
        self.words, self.width, dict_size = _check_shape(words_per_row, width, dict_size)
        kinds = frozenset(ALL_ENCODINGS if encodings is None else (int(e) for e in encodings))
        if kinds - set(ALL_ENCODINGS):
            raise ValueError(f"unknown row encodings {sorted(kinds - set(ALL_ENCODINGS))}")
        if not kinds & {DENSE, ALLOWED_IDS, REJECTED_IDS}:
            raise ValueError("encodings must include at least one of DENSE, ALLOWED_IDS, REJECTED_IDS")
        self.dict_size = dict_size if DICT_REF in kinds else 0
        mask = sum(1 << k for k in kinds)
        self._core = (_native.Encoder(self.words, self.width, dict_size, mask) if _native is not None
                      else _PyEncoder(self.words, self.width, self.dict_size, kinds))
        self._z: Any = None
        if compress:
            import zstandard
            self._z = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj()
            self._flush = zstandard.COMPRESSOBJ_FLUSH_BLOCK
        self.last_kinds = np.empty(0, dtype=np.uint8)
        self.last_sizes = np.empty(0, dtype=np.uint32)

    @property
    def compression(self) -> str:
        return "zstd" if self._z is not None else ""

    def encode(self, rows: np.ndarray) -> bytes:
        """The reply's row block (compressed). ``last_kinds`` / ``last_sizes``: each row's encoding
        and its bytes in the block (before compression)."""
        u = _as_rows(rows, self.words)
        block, sizes = self._core.encode(u, len(u))
        n = len(u)
        self.last_kinds = np.frombuffer(block, dtype=np.uint8, count=n)
        self.last_sizes = np.frombuffer(sizes, dtype=np.uint32) if isinstance(sizes, bytes) else sizes
        if self._z is None:
            return block
        return self._z.compress(block) + self._z.flush(self._flush)


class RowBlockDecoder:
    """Decodes the row blocks of one stream into dense int32 rows (``dict_size`` and
    ``compression`` are the server's: InfoResponse.row_dictionary_size / row_compression)."""

    def __init__(self, words_per_row: int, width: int, *, dict_size: int = DEFAULT_DICT_SIZE,
                 compression: str = "zstd") -> None:
        self.words, self.width, self.dict_size = _check_shape(words_per_row, width, dict_size)
        self._core = (_native.Decoder(self.words, self.width, self.dict_size) if _native is not None
                      else _PyDecoder(self.words, self.width, self.dict_size))
        if compression not in ("zstd", ""):
            raise ValueError(f"unknown row compression {compression!r}")
        self._z: Any = None
        if compression == "zstd":
            import zstandard
            self._z = zstandard.ZstdDecompressor().decompressobj()

    def decode(self, data: bytes, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """n rows from a reply's row block (into ``out`` when given: int32, >= n rows)."""
        words = self.words
        if out is None:
            out = np.empty((n, words), dtype=np.int32)
        elif out.dtype != np.int32 or out.ndim != 2 or out.shape[0] < n or out.shape[1] != words \
                or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"out must be C-contiguous int32 of shape (>= {n}, {words}), got {out.dtype} {out.shape}")
        try:
            block = self._z.decompress(data) if self._z is not None else data
        except Exception as exc:   # zstandard.ZstdError: a corrupt or out-of-step stream
            raise RowCodecError(f"cannot decompress the row block: {exc}") from None
        try:
            self._core.decode(block, n, out)
        except ValueError as exc:
            raise RowCodecError(str(exc)) from None
        return out[:n]


# -- the numpy path (no C extension): the same block, row by row --------------------------------------
def _varint_lengths(values: np.ndarray) -> np.ndarray:
    n = np.ones(len(values), dtype=np.int64)
    for limit in (1 << 7, 1 << 14, 1 << 21, 1 << 28):
        n += values >= limit
    return n


def _varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128 varints of non-negative values (< 2**35), concatenated."""
    values = np.asarray(values, dtype=np.int64)
    if not len(values):
        return b""
    lengths = _varint_lengths(values)
    shifted = np.repeat(values, lengths)
    ends = np.cumsum(lengths)
    group = (np.arange(len(shifted), dtype=np.int64) - np.repeat(ends - lengths, lengths)) * 7
    shifted >>= group
    return ((shifted & 0x7F) | ((shifted > 0x7F) << 7)).astype(np.uint8).tobytes()


def _varint(value: int) -> bytes:
    return _varints(np.array([value]))


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(5):
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint longer than 5 bytes")


def _ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


class _PyEncoder:
    def __init__(self, words: int, width: int, dict_size: int, kinds: frozenset) -> None:
        self.words, self.width, self.dict_size, self.kinds = words, width, dict_size, kinds
        self.full = full_row(words, width)
        self.slots: list[bytes | None] = [None] * dict_size
        self.index: dict[bytes, int] = {}
        self.counter = 0

    def encode(self, u: np.ndarray, n: int) -> tuple[bytes, np.ndarray]:
        tail = self.width // 32
        if n and tail < self.words and (u[:, tail:] & ~self.full[tail:]).any():
            bad = int(np.flatnonzero((u[:, tail:] & ~self.full[tail:]).any(axis=1))[0])
            raise ValueError(f"row {bad} sets bits at positions >= width {self.width}")
        kinds, bodies = bytearray(), []
        sizes = np.empty(n, dtype=np.uint32)
        for i in range(n):
            key = u[i].tobytes()
            slot = self.index.get(key) if self.dict_size else None
            if slot is not None:
                kinds.append(DICT_REF)
                bodies.append(slot.to_bytes(2, "little"))
                sizes[i] = 2
                continue
            best: int | None = None
            body, kind = b"", DENSE
            if DENSE in self.kinds:
                best, body = 4 * self.words, key
            for k, row in ((ALLOWED_IDS, u[i]), (REJECTED_IDS, u[i] ^ self.full)):
                if k not in self.kinds:
                    continue
                ids = _ids(row)
                if best is not None and len(ids) + 1 >= best:
                    continue
                deltas = np.diff(ids, prepend=0) if len(ids) else ids
                data = _varints(deltas)
                cand = _varint(len(data)) + data
                if best is None or len(cand) < best:
                    best, body, kind = len(cand), cand, k
            kinds.append(kind)
            bodies.append(body)
            sizes[i] = best or 0
            if self.dict_size:
                s = self.counter % self.dict_size
                old = self.slots[s]
                if old is not None:
                    del self.index[old]
                self.slots[s], self.index[key] = key, s
                self.counter += 1
        return bytes(kinds) + b"".join(bodies), sizes


class _PyDecoder:
    def __init__(self, words: int, width: int, dict_size: int) -> None:
        self.words, self.width, self.dict_size = words, width, dict_size
        self.full = full_row(words, width)
        self.slots = np.zeros((dict_size, words), dtype=np.uint32)
        self.counter = 0

    def decode(self, block: bytes, n: int, out: np.ndarray) -> None:
        if len(block) < n:
            raise ValueError(f"row block of {len(block)} bytes for {n} rows")
        u = out.view(np.uint32)
        pos = n
        tail = self.width // 32
        for i in range(n):
            kind = block[i]
            dst = u[i]
            if kind == DICT_REF:
                if pos + 2 > len(block):
                    raise ValueError(f"row {i}: truncated reference")
                slot = int.from_bytes(block[pos:pos + 2], "little")
                pos += 2
                filled = min(self.counter, self.dict_size)
                if slot >= filled:
                    raise ValueError(f"row {i}: reference to slot {slot}, but {filled} of {self.dict_size} "
                                     "dictionary slots are filled")
                dst[:] = self.slots[slot]
                continue
            if kind == DENSE:
                if pos + 4 * self.words > len(block):
                    raise ValueError(f"row {i}: truncated dense row")
                dst[:] = np.frombuffer(block, dtype="<u4", count=self.words, offset=pos)
                pos += 4 * self.words
                if tail < self.words and (dst[tail:] & ~self.full[tail:]).any():
                    raise ValueError(f"row {i}: dense row sets bits at positions >= width {self.width}")
            elif kind in (ALLOWED_IDS, REJECTED_IDS):
                length, pos = _read_varint(block, pos)
                if pos + length > len(block):
                    raise ValueError(f"row {i}: truncated id list")
                body, pos = block[pos:pos + length], pos + length
                values, p = [], 0
                while p < len(body):
                    v, p = _read_varint(body, p)
                    values.append(v)
                deltas = np.array(values, dtype=np.int64)
                if len(deltas) > 1 and not deltas[1:].all():
                    raise ValueError(f"row {i}: ids are not strictly increasing (a delta of 0)")
                ids = np.cumsum(deltas)
                if len(ids) and int(ids[-1]) >= self.width:
                    raise ValueError(f"row {i}: id {int(ids[-1])} out of range for width {self.width}")
                bits = np.zeros(self.words * 32, dtype=np.uint8)
                bits[ids] = 1
                dst[:] = np.packbits(bits, bitorder="little").view("<u4")
                if kind == REJECTED_IDS:
                    np.bitwise_xor(dst, self.full, out=dst)
            else:
                raise ValueError(f"row {i}: unknown encoding {kind}")
            if self.dict_size:
                self.slots[self.counter % self.dict_size] = dst
                self.counter += 1
        if pos != len(block):
            raise ValueError(f"{len(block) - pos} bytes left after {n} rows")
