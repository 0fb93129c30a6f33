"""The hand-written row codec of contract revision 2 (per-row MaskRow messages), kept for
docs/benchmarks/scripts/codec_study.py, which measures the codec that replaced it against it.

Mask rows on the wire: encoder (server) and decoder (client), numpy only.

Both ends of a stream hold one RowEncoder / RowDecoder; the decoder always yields the dense int32
rows (n_rows, words_per_row), whatever the encoding on the wire. The encodings and the row
dictionary rule are the contract's: see ``RowEncoding`` in proto/maskd/v1/maskd.proto. Bits at
positions >= ``width`` are always 0 (the encoder refuses rows that set them, the decoder refuses
replies that would produce them). After a RowCodecError the decoder's dictionary may be out of
step with the encoder's: the stream must be dropped.

All work on a row is vectorized numpy; the per-row Python overhead is a few microseconds.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable

import numpy as np

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from maskd.v1.contract import RowEncoding


def _legacy_messages():
    """MaskRow and the rows of StepResponse as revision 2 had them (field numbers kept), built at
    run time: revision 3 reserved the field and dropped the message."""
    f = descriptor_pb2.FileDescriptorProto(name="maskd_legacy_rows.proto", package="maskd.legacy",
                                           syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto
    row = f.message_type.add(name="MaskRow")
    row.field.add(name="encoding", number=1, type=T.TYPE_INT32, label=T.LABEL_OPTIONAL)
    row.field.add(name="data", number=2, type=T.TYPE_BYTES, label=T.LABEL_OPTIONAL)
    row.field.add(name="ref", number=3, type=T.TYPE_UINT32, label=T.LABEL_OPTIONAL)
    reply = f.message_type.add(name="StepResponse")
    reply.field.add(name="rows", number=2, type=T.TYPE_MESSAGE, type_name=".maskd.legacy.MaskRow",
                    label=T.LABEL_REPEATED)
    reply.field.add(name="words_per_row", number=3, type=T.TYPE_UINT32, label=T.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("maskd.legacy.StepResponse"))


class pb:  # noqa: N801 - stands in for the generated module of revision 2
    StepResponse = _legacy_messages()

DENSE = RowEncoding.DENSE
ALLOWED_IDS = RowEncoding.ALLOWED_IDS
REJECTED_IDS = RowEncoding.REJECTED_IDS
DICT_REF = RowEncoding.DICT_REF

#: Short names, e.g. for metrics labels and ``encoded_sizes``.
ENCODING_NAMES: dict[int, str] = {e.value: e.name.lower() for e in RowEncoding}
ALL_ENCODINGS: tuple[int, ...] = tuple(RowEncoding)
# 256 rows: 4 MB per stream and end for a 129k vocabulary; on MaskBench-dev (batch 64) it cuts the
# mean row from ~350 B (64 rows) to under 200 B (`maskd bench wire` simulates other sizes).
DEFAULT_DICT_SIZE = 256

_MAX_WIDTH = 2**31 - 1          # ids and deltas fit int64 sums with room to spare
_MAX_VARINT_BYTES = 5           # enough for any value < 2**35 (ids are < 2**31)
_ARANGE32 = np.arange(32, dtype=np.int64)
_SPARSE_SET_BITS = 512          # below this many ids, np.add.at beats a packbits pass

_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)

if hasattr(np, "bitwise_count"):  # numpy >= 2.0
    def _popcount(words_u32: np.ndarray) -> int:
        return int(np.bitwise_count(words_u32).sum(dtype=np.int64))
else:  # pragma: no cover - older numpy on a client
    def _popcount(words_u32: np.ndarray) -> int:
        return int(_POP8[words_u32.view(np.uint8)].sum(dtype=np.int64))


class RowCodecError(ValueError):
    """A reply whose rows cannot be decoded (corrupt or from a mismatched server)."""


# -- shared helpers --------------------------------------------------------------------------
def _check_shape(words_per_row: int, width: int) -> tuple[int, int]:
    words_per_row, width = int(words_per_row), int(width)
    if not 0 < width <= _MAX_WIDTH:
        raise ValueError(f"width {width} must be in [1, {_MAX_WIDTH}]")
    if words_per_row * 32 < width:
        raise ValueError(f"{words_per_row} words hold {words_per_row * 32} bits, fewer than width {width}")
    return words_per_row, width


def _full_row(words_per_row: int, width: int) -> np.ndarray:
    """uint32 words with exactly the bits [0, width) set."""
    full = np.zeros(words_per_row, dtype=np.uint32)
    whole, rest = divmod(width, 32)
    full[:whole] = 0xFFFFFFFF
    if rest:
        full[whole] = (1 << rest) - 1
    return full


def _bit_ids(words_u32: np.ndarray, count: int) -> np.ndarray:
    """Sorted positions (int64) of the set bits of little-endian uint32 words."""
    if count == 0:
        return np.empty(0, dtype=np.int64)
    words_u32 = words_u32.astype("<u4", copy=False)
    if count * 8 <= len(words_u32):
        # Sparse: unpack only the nonzero words.
        nz = np.flatnonzero(words_u32 != 0)   # bool input: numpy's fast nonzero path
        bits = np.unpackbits(words_u32[nz].view(np.uint8), bitorder="little").view(bool)
        return (nz[:, None] * 32 + _ARANGE32)[bits.reshape(-1, 32)]
    bits = np.unpackbits(words_u32.view(np.uint8), bitorder="little").view(bool)
    return np.flatnonzero(bits)


def _popcount_rows(words_u32: np.ndarray) -> np.ndarray:
    """Set bits per row of a 2-D uint32 array (int64)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words_u32).sum(axis=1, dtype=np.int64)
    return _POP8[words_u32.view(np.uint8)].reshape(len(words_u32), -1).sum(axis=1, dtype=np.int64)


def _row_deltas(words_u32: np.ndarray):
    """Set-bit ids of every row of a 2-D uint32 array, as (row of each id, delta-encoded ids,
    varint extra bytes): the first id of a row is kept as is, later ones are differences."""
    r, w = np.nonzero(words_u32 != 0)      # bool input: numpy's fast nonzero path
    vals = words_u32[r, w]
    pos = np.flatnonzero(np.unpackbits(vals.astype("<u4").view(np.uint8), bitorder="little").view(bool))
    word = pos >> 5
    ids = w[word].astype(np.int64) * 32 + (pos & 31)
    rid = r[word]
    deltas = np.empty_like(ids)
    if len(ids):
        deltas[0] = ids[0]
        np.subtract(ids[1:], ids[:-1], out=deltas[1:])
        first = np.flatnonzero(rid[1:] != rid[:-1]) + 1
        deltas[first] = ids[first]
    return rid, deltas, _varint_extra(deltas)


_VARINT_LIMITS = np.array([1 << 7, 1 << 14, 1 << 21, 1 << 28], dtype=np.int64)


def _varint_extra(values: np.ndarray) -> np.ndarray:
    """Bytes beyond the first of each value's LEB128 varint (0..4; values < 2**35)."""
    extra = (values >= _VARINT_LIMITS[0]).view(np.int8).astype(np.int64)   # faster than searchsorted
    for limit in _VARINT_LIMITS[1:]:
        extra += values >= limit
    return extra


def _varint_size(values: np.ndarray) -> int:
    """Exact byte count of LEB128 varints of non-negative values (< 2**35)."""
    return len(values) + int(_varint_extra(values).sum()) if len(values) else 0


def varint_encode(values: np.ndarray, extra: np.ndarray | None = None) -> bytes:
    """Unsigned LEB128 varints of non-negative integer values (< 2**35), concatenated.

    ``extra``: ``_varint_extra(values)`` when the caller already has it.
    """
    values = np.asarray(values, dtype=np.int64)
    if len(values) == 0:
        return b""
    if extra is None:
        if int(values.min()) < 0 or int(values.max()) >= 1 << 35:
            raise ValueError("varint values must be in [0, 2**35)")
        extra = _varint_extra(values)
    if not extra.any():
        return values.astype(np.uint8).tobytes()
    # One slot per output byte: the value it belongs to, shifted right by 7 * (its group);
    # the continuation bit is set where more groups remain.
    lengths = extra + 1
    shifted = np.repeat(values, lengths)
    ends = np.cumsum(lengths)
    group = np.arange(len(shifted), dtype=np.int64) - np.repeat(ends - lengths, lengths)
    group *= 7
    shifted >>= group
    return ((shifted & 0x7F) | ((shifted > 0x7F) << 7)).astype(np.uint8).tobytes()


def varint_decode(data: bytes) -> np.ndarray:
    """Values (int64) of concatenated unsigned LEB128 varints; RowCodecError when malformed."""
    b = np.frombuffer(data, dtype=np.uint8)
    n = len(b)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    term = b < 0x80
    if not term[-1]:
        raise RowCodecError("truncated varint at the end of the row data")
    ends = np.flatnonzero(term)
    if len(ends) == n:                       # every value fits one byte
        return b.astype(np.int64)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_VARINT_BYTES:
        raise RowCodecError(f"varint longer than {_MAX_VARINT_BYTES} bytes")
    pos = np.arange(n, dtype=np.int64) - np.repeat(starts, lengths)
    contrib = (b & 0x7F).astype(np.int64) << (7 * pos)
    return np.add.reduceat(contrib, starts)


def _ids_to_deltas(ids: np.ndarray) -> np.ndarray:
    deltas = np.empty_like(ids)
    if len(ids):
        deltas[0] = ids[0]
        np.subtract(ids[1:], ids[:-1], out=deltas[1:])
    return deltas


def _deltas_to_ids(values: np.ndarray, width: int) -> np.ndarray:
    n = len(values)
    if n == 0:
        return values
    if n > width:
        raise RowCodecError(f"{n} ids for a row of width {width}")
    if n > 1 and not values[1:].all():
        raise RowCodecError("ids are not strictly increasing (a delta of 0)")
    if int(values.max()) >= width:
        raise RowCodecError(f"id or delta {int(values.max())} out of range for width {width}")
    ids = np.cumsum(values)                  # < width * width <= 2**62: no overflow
    if int(ids[-1]) >= width:
        raise RowCodecError(f"id {int(ids[-1])} out of range for width {width}")
    return ids


def _set_ids(dst_u32: np.ndarray, ids: np.ndarray) -> None:
    """dst_u32[:] = the row with exactly the bits at ids set (ids sorted, unique, in range)."""
    if len(ids) < _SPARSE_SET_BITS:
        dst_u32[:] = 0
        if len(ids):
            np.add.at(dst_u32, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
        return
    bits = np.zeros(len(dst_u32) * 32, dtype=np.uint8)
    bits[ids] = 1
    dst_u32[:] = np.packbits(bits, bitorder="little").view("<u4")


def _as_row_u32(row: np.ndarray, words_per_row: int, full: np.ndarray, width: int) -> np.ndarray:
    row = np.ascontiguousarray(row)
    if row.dtype.kind not in "iu" or row.dtype.itemsize != 4:
        raise ValueError(f"rows must be int32/uint32 words, got {row.dtype}")
    if row.shape != (words_per_row,):
        raise ValueError(f"row has shape {row.shape}, expected ({words_per_row},)")
    if not (row.dtype.byteorder == "<" or (row.dtype.byteorder in "=|" and sys.byteorder == "little")):
        row = row.astype(row.dtype.newbyteorder("<"))
    u = row.view("<u4")
    tail = width // 32
    if tail < words_per_row and (u[tail:] & ~full[tail:]).any():
        raise ValueError(f"row sets bits at positions >= width {width}")
    return u


def _sizes_for(u: np.ndarray, full: np.ndarray, width: int) -> dict[str, int]:
    k = _popcount(u)
    rejected = full ^ u
    return {
        "dense": 4 * len(u),
        "allowed_ids": _varint_size(_ids_to_deltas(_bit_ids(u, k))),
        "rejected_ids": _varint_size(_ids_to_deltas(_bit_ids(rejected, width - k))),
    }


def encoded_sizes(row: np.ndarray, width: int) -> dict[str, int]:
    """Bytes of ``data`` each non-REF encoding would take for one row (int32 words).

    Keys: ``"dense"``, ``"allowed_ids"``, ``"rejected_ids"``.
    """
    row = np.asarray(row)
    words = row.shape[-1] if row.ndim else 0
    words, width = _check_shape(words, width)
    full = _full_row(words, width)
    return _sizes_for(_as_row_u32(row, words, full, width), full, width)


# -- encoder ---------------------------------------------------------------------------------
class RowEncoder:
    """Encodes the rows of one stream, each in the smallest allowed encoding.

    ``encodings``: the encodings this encoder may use (default: all four); at least one of
    DENSE / ALLOWED_IDS / REJECTED_IDS. ``dict_size``: rows in the stream's dictionary
    (0, or DICT_REF left out of ``encodings``, disables it). The encoder keeps the bytes of
    up to ``dict_size`` rows (256 * 16 KB = 4 MB for a 129k vocabulary).

    After ``encode``, ``last_encodings`` lists the encoding of each row it sent;
    ``counts`` accumulates rows per encoding over the stream.
    """

    def __init__(self, words_per_row: int, width: int, *, dict_size: int = DEFAULT_DICT_SIZE,
                 encodings: Iterable[int] | None = None) -> None:
        self.words_per_row, self.width = _check_shape(words_per_row, width)
        allowed = frozenset(ALL_ENCODINGS if encodings is None else (int(e) for e in encodings))
        unknown = allowed - set(ALL_ENCODINGS)
        if unknown:
            raise ValueError(f"unknown row encodings {sorted(unknown)}")
        if not allowed & {DENSE, ALLOWED_IDS, REJECTED_IDS}:
            raise ValueError("encodings must include at least one of DENSE, ALLOWED_IDS, REJECTED_IDS")
        if dict_size < 0:
            raise ValueError("dict_size must be >= 0")
        self.encodings = allowed
        self.dict_size = int(dict_size) if DICT_REF in allowed else 0
        self._full = _full_row(self.words_per_row, self.width)
        self._slots: list[bytes | None] = [None] * self.dict_size
        self._index: dict[bytes, int] = {}
        self._counter = 0
        self.last_encodings: list[int] = []
        self.counts: dict[int, int] = {e: 0 for e in ALL_ENCODINGS}

    @property
    def last_encoding_names(self) -> list[str]:
        return [ENCODING_NAMES[e] for e in self.last_encodings]

    def encode(self, rows: np.ndarray, reply: pb.StepResponse) -> list[int]:
        """Appends one MaskRow per row to reply.rows; returns the bytes per row sent.

        The size of a row is ``len(data)``, or for DICT_REF the bytes of its ``ref`` varint.
        The dictionary is walked row by row (it is sequential by definition); the id lists of
        all new rows are then built at once, vectorized over the whole reply.
        """
        u = self._as_rows_u32(rows)
        n = len(u)
        keys = [u[i].tobytes() for i in range(n)]
        refs: list[int | None] = [None] * n
        if self.dict_size > 0:
            index = self._index
            for i, key in enumerate(keys):
                slot = index.get(key)
                if slot is not None:
                    refs[i] = slot
                else:
                    self._insert(key)
        new = [i for i in range(n) if refs[i] is None]
        encs, payloads = self._encode_batch(u, new, keys)
        add = reply.rows.add
        sizes: list[int] = []
        chosen: list[int] = []
        j = 0
        for i in range(n):
            slot = refs[i]
            if slot is not None:
                add(encoding=DICT_REF, ref=slot)
                sizes.append(max(1, (slot.bit_length() + 6) // 7))
                chosen.append(DICT_REF)
            else:
                enc, data = encs[j], payloads[j]
                j += 1
                add(encoding=enc, data=data)
                sizes.append(len(data))
                chosen.append(enc)
        self.last_encodings = chosen
        for enc in chosen:
            self.counts[enc] += 1
        return sizes

    def _as_rows_u32(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows)
        if rows.ndim != 2 or rows.shape[1] != self.words_per_row:
            raise ValueError(f"rows must be 2-D (n, {self.words_per_row}), got shape {rows.shape}")
        if rows.dtype.kind not in "iu" or rows.dtype.itemsize != 4:
            raise ValueError(f"rows must be int32/uint32 words, got {rows.dtype}")
        if not (rows.dtype.byteorder == "<" or (rows.dtype.byteorder in "=|" and sys.byteorder == "little")):
            rows = rows.astype(rows.dtype.newbyteorder("<"))
        u = rows.view("<u4")
        tail = self.width // 32
        if len(u) and tail < self.words_per_row and (u[:, tail:] & ~self._full[tail:]).any():
            raise ValueError(f"row sets bits at positions >= width {self.width}")
        return u

    def _encode_batch(self, u: np.ndarray, new: list[int], keys: list[bytes]):
        """Smallest encoding of each new row (ties to the lower enum value), all rows at once."""
        if not new:
            return [], []
        allowed = self.encodings
        sel = u[new]
        m = len(new)
        pop = _popcount_rows(sel)
        inf = np.int64(1 << 62)
        best_size = np.full(m, 4 * self.words_per_row if DENSE in allowed else inf, dtype=np.int64)
        best_enc = np.full(m, DENSE if DENSE in allowed else 99, dtype=np.int64)
        lists = {}
        for enc, lower in ((ALLOWED_IDS, pop), (REJECTED_IDS, self.width - pop)):
            if enc not in allowed:
                continue
            # Each id costs at least one byte: rows whose id count cannot win are skipped.
            cand = np.flatnonzero((lower < best_size) | ((lower == best_size) & (enc < best_enc)))
            if not len(cand):
                continue
            words = sel[cand] if enc == ALLOWED_IDS else (sel[cand] ^ self._full)
            rid, deltas, extra = _row_deltas(words)
            size = np.bincount(rid, weights=extra + 1, minlength=len(cand)).astype(np.int64)
            wins = (size < best_size[cand]) | ((size == best_size[cand]) & (enc < best_enc[cand]))
            best_size[cand[wins]] = size[wins]
            best_enc[cand[wins]] = enc
            lists[enc] = (cand, rid, deltas, extra)
        payloads: list[bytes | None] = [None] * m
        for enc, (cand, rid, deltas, extra) in lists.items():
            mine = best_enc[cand] == enc
            if not mine.any():
                continue
            keep = mine[rid]
            blob = varint_encode(deltas[keep], extra[keep])
            offsets = np.concatenate(([0], np.cumsum(best_size[cand[mine]])))
            for k, row in enumerate(cand[mine].tolist()):
                payloads[row] = blob[offsets[k]:offsets[k + 1]]
        encs = best_enc.tolist()
        for k in range(m):
            if encs[k] == DENSE:
                payloads[k] = keys[new[k]]
        return encs, payloads

    def _insert(self, key: bytes) -> None:
        slot = self._counter % self.dict_size
        old = self._slots[slot]
        if old is not None:
            del self._index[old]      # a row is in at most one slot: hits are never inserted
        self._slots[slot] = key
        self._index[key] = slot
        self._counter += 1


# -- decoder ---------------------------------------------------------------------------------
class RowDecoder:
    """Decodes the rows of one stream into dense int32 words.

    ``dict_size`` must equal the server's (``InfoResponse.row_dictionary_size``).
    """

    def __init__(self, words_per_row: int, width: int, *, dict_size: int = DEFAULT_DICT_SIZE) -> None:
        self.words_per_row, self.width = _check_shape(words_per_row, width)
        if dict_size < 0:
            raise ValueError("dict_size must be >= 0")
        self.dict_size = int(dict_size)
        self._full = _full_row(self.words_per_row, self.width)
        self._dict: np.ndarray | None = None   # (dict_size, words) uint32, allocated on first insert
        self._counter = 0
        self.last_encodings: list[int] = []

    def decode(self, reply: pb.StepResponse, out: np.ndarray | None = None) -> np.ndarray:
        n = len(reply.rows)
        words = self.words_per_row
        if reply.words_per_row and reply.words_per_row != words:
            raise RowCodecError(f"reply has {reply.words_per_row} words per row, this client expects {words}")
        if out is None:
            out = np.empty((n, words), dtype=np.int32)
        elif out.dtype != np.int32 or out.ndim != 2 or out.shape[0] < n or out.shape[1] != words:
            raise ValueError(f"out must be int32 of shape (>= {n}, {words}), got {out.dtype} {out.shape}")
        out_u = out.view(np.uint32)
        row_bytes = words * 4
        width = self.width
        tail = width // 32
        chosen = []
        for i, row in enumerate(reply.rows):
            enc = row.encoding
            data = row.data
            chosen.append(enc)
            dst = out_u[i]
            try:
                if enc == DICT_REF:
                    if data:
                        raise RowCodecError("a DICT_REF row carries data")
                    ref = row.ref
                    filled = min(self._counter, self.dict_size)
                    if ref >= filled:
                        raise RowCodecError(f"DICT_REF to slot {ref}, but only {filled} of "
                                            f"{self.dict_size} dictionary slots are filled")
                    assert self._dict is not None   # filled > 0
                    dst[:] = self._dict[ref]
                    continue
                if row.ref:
                    raise RowCodecError(f"ref {row.ref} set on a row with encoding {enc}")
                if enc == DENSE:
                    if len(data) != row_bytes:
                        raise RowCodecError(f"dense row of {len(data)} bytes, expected {row_bytes}")
                    dst[:] = np.frombuffer(data, dtype="<u4")
                    if tail < words and (dst[tail:] & ~self._full[tail:]).any():
                        raise RowCodecError(f"dense row sets bits at positions >= width {width}")
                elif enc == ALLOWED_IDS:
                    _set_ids(dst, _deltas_to_ids(varint_decode(data), width))
                elif enc == REJECTED_IDS:
                    _set_ids(dst, _deltas_to_ids(varint_decode(data), width))
                    np.bitwise_xor(dst, self._full, out=dst)
                else:
                    raise RowCodecError(f"unknown encoding {enc}")
            except RowCodecError as exc:
                raise RowCodecError(f"row {i}: {exc}") from None
            if self.dict_size:
                if self._dict is None:
                    self._dict = np.zeros((self.dict_size, words), dtype=np.uint32)
                self._dict[self._counter % self.dict_size] = dst
                self._counter += 1
        self.last_encodings = chosen
        return out
