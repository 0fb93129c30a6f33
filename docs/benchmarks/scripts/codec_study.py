"""Which row codec: the hand-written one (delta-varint ids + row dictionary) against zstandard.

    .venv/bin/python docs/benchmarks/scripts/codec_study.py --batch 64 --steps 200

The rows are real: B sequences replay MaskBench-dev valid instances (deepseek-v4) through
llguidance in this process, exactly the rows a server sends. Each codec then encodes the stream of
replies step by step (one context per stream, as on a real stream) and decodes it back; bytes per
row and microseconds per row on each end (one thread) are reported, and every decoded reply is
checked against the original. Codecs:

- ``hand``: the codec of contract revision 2 (legacy_rowcodec.py, maskd.rowcodec until it was replaced) (per row: dense, allowed or rejected id lists, or a
  reference into a 256-row dictionary);
- ``zstd-dense``: the dense rows of each reply, one zstd stream per stream (level 1, 64 MiB
  window with long-distance matching), a flush per reply;
- ``zstd-ids``: per row the smaller of its allowed/rejected id lists (delta varints), the lists of
  a reply concatenated, one zstd stream;
- ``dict+zstd``: the dictionary first (repeats cost a reference), the new rows' id lists through
  one zstd stream.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))   # legacy_rowcodec: the codec of revision 2


def capture(batch: int, steps: int, limit: int) -> tuple[list[np.ndarray], int]:
    """Rows of `steps` replies of a batch of `batch` sequences replaying MaskBench instances."""
    import llguidance

    from maskd.server.tokenizers import load_tokenizer
    from maskd.tools.bench import common
    from maskd.tools.replay import load_instances

    tok = load_tokenizer("deepseek-v4")
    pool = load_instances(str(REPO / ".." / "shared" / "maskbench-dev"), tok, limit, 0)
    words = (tok.logits_width + 31) // 32
    execu = llguidance.LLExecutor(num_threads=2)
    templates: dict = {}
    cursor = 0

    def new_slot():
        nonlocal cursor
        while True:
            inst = pool[cursor % len(pool)]
            cursor += 1
            try:
                t = templates.get(inst.schema.name)
                if t is None:
                    g = common.llguidance_grammar(inst.schema.text)
                    t = templates[inst.schema.name] = llguidance.LLMatcher(tok.ll, g, log_level=0)
                return {"m": t.deep_copy(), "inst": inst, "pos": 0}
            except Exception:
                continue

    slots = [new_slot() for _ in range(batch)]
    replies = []
    for _ in range(steps):
        rows = np.zeros((batch, words), dtype=np.int32)
        execu.unsafe_compute_mask_ptr([(s["m"], i) for i, s in enumerate(slots)], rows.ctypes.data, words * 4, batch)
        replies.append(rows)
        for i, s in enumerate(slots):
            toks = s["inst"].tokens
            if s["pos"] >= len(toks) or not s["m"].consume_token(toks[s["pos"]]):
                slots[i] = new_slot()
            else:
                s["pos"] += 1
    return replies, tok.logits_width


# -- codecs: encoder(rows) -> bytes-like payload size; decoder(payload) -> rows ----------------------
class Hand:
    name = "hand"

    def __init__(self, words, width):
        from legacy_rowcodec import RowDecoder, RowEncoder, pb
        self.pb = pb
        self.enc, self.dec = RowEncoder(words, width), RowDecoder(words, width)

    def encode(self, rows):
        reply = self.pb.StepResponse()
        self.enc.encode(rows, reply)
        return reply.SerializeToString()

    def decode(self, data, n):
        return self.dec.decode(self.pb.StepResponse.FromString(data))


class ZstdDense:
    name = "zstd-dense"

    def __init__(self, words, width):
        import zstandard as zstd
        params = zstd.ZstdCompressionParameters.from_level(1, window_log=26, enable_ldm=True)
        self.c = zstd.ZstdCompressor(compression_params=params).compressobj()
        self.d = zstd.ZstdDecompressor(max_window_size=1 << 27).decompressobj()
        self.words, self.zstd = words, zstd

    def encode(self, rows):
        return self.c.compress(rows.tobytes()) + self.c.flush(self.zstd.COMPRESSOBJ_FLUSH_BLOCK)

    def decode(self, data, n):
        return np.frombuffer(self.d.decompress(data), dtype=np.int32).reshape(n, self.words)


def _ids(rows, full):
    """Per row the smaller list (allowed or rejected ids), as (kind flags, varint payloads)."""
    from legacy_rowcodec import _bit_ids, _ids_to_deltas, _popcount, varint_encode
    kinds, parts = [], []
    width = int(full.view(np.uint32).sum())  # unused
    del width
    for r in rows.view(np.uint32):
        k = _popcount(r)
        rej = r ^ full
        nrej = _popcount(rej)
        if k <= nrej:
            kinds.append(0)
            parts.append(varint_encode(_ids_to_deltas(_bit_ids(r, k))))
        else:
            kinds.append(1)
            parts.append(varint_encode(_ids_to_deltas(_bit_ids(rej, nrej))))
    return kinds, parts


class ZstdIds:
    name = "zstd-ids"

    def __init__(self, words, width):
        import zstandard as zstd
        from legacy_rowcodec import _full_row
        self.full = _full_row(words, width)
        self.c = zstd.ZstdCompressor(level=1).compressobj()
        self.d = zstd.ZstdDecompressor().decompressobj()
        self.words, self.width, self.zstd = words, width, zstd

    def encode(self, rows):
        kinds, parts = _ids(rows, self.full)
        lens = np.array([len(p) for p in parts], dtype=np.uint32)
        raw = bytes(kinds) + lens.tobytes() + b"".join(parts)
        return self.c.compress(raw) + self.c.flush(self.zstd.COMPRESSOBJ_FLUSH_BLOCK)

    def decode(self, data, n):
        from legacy_rowcodec import _deltas_to_ids, _set_ids, varint_decode
        raw = self.d.decompress(data)
        kinds = raw[:n]
        lens = np.frombuffer(raw[n:5 * n], dtype=np.uint32)
        out = np.empty((n, self.words), dtype=np.int32)
        pos = 5 * n
        u = out.view(np.uint32)
        for i in range(n):
            ids = _deltas_to_ids(varint_decode(raw[pos:pos + lens[i]]), self.width)
            pos += int(lens[i])
            _set_ids(u[i], ids)
            if kinds[i]:
                np.bitwise_xor(u[i], self.full, out=u[i])
        return out


class DictZstd(ZstdIds):
    name = "dict+zstd"

    def __init__(self, words, width, size=256):
        super().__init__(words, width)
        self.size = size
        self.enc_index: dict[bytes, int] = {}
        self.enc_slots: list = [None] * size
        self.enc_n = 0
        self.dec_slots = np.zeros((size, words), dtype=np.int32)
        self.dec_n = 0

    def encode(self, rows):
        refs = np.full(len(rows), -1, dtype=np.int32)
        new = []
        for i in range(len(rows)):
            key = rows[i].tobytes()
            slot = self.enc_index.get(key)
            if slot is None:
                slot = self.enc_n % self.size
                old = self.enc_slots[slot]
                if old is not None:
                    del self.enc_index[old]
                self.enc_slots[slot] = key
                self.enc_index[key] = slot
                self.enc_n += 1
                new.append(i)
            else:
                refs[i] = slot
        kinds, parts = _ids(rows[new], self.full) if new else ([], [])
        lens = np.array([len(p) for p in parts], dtype=np.uint32)
        raw = refs.tobytes() + bytes(kinds) + lens.tobytes() + b"".join(parts)
        return self.c.compress(raw) + self.c.flush(self.zstd.COMPRESSOBJ_FLUSH_BLOCK)

    def decode(self, data, n):
        from legacy_rowcodec import _deltas_to_ids, _set_ids, varint_decode
        raw = self.d.decompress(data)
        refs = np.frombuffer(raw[:4 * n], dtype=np.int32)
        new = np.flatnonzero(refs < 0)
        m = len(new)
        kinds = raw[4 * n:4 * n + m]
        lens = np.frombuffer(raw[4 * n + m:4 * n + 5 * m], dtype=np.uint32)
        out = np.empty((n, self.words), dtype=np.int32)
        u = out.view(np.uint32)
        pos = 4 * n + 5 * m
        j = 0
        for i in range(n):
            if refs[i] >= 0:
                out[i] = self.dec_slots[refs[i]]
                continue
            ids = _deltas_to_ids(varint_decode(raw[pos:pos + lens[j]]), self.width)
            pos += int(lens[j])
            _set_ids(u[i], ids)
            if kinds[j]:
                np.bitwise_xor(u[i], self.full, out=u[i])
            self.dec_slots[self.dec_n % self.size] = out[i]
            self.dec_n += 1
            j += 1
        return out


def _native():
    import importlib
    return importlib.import_module("maskd._rowcodec")


class Native:
    """maskd._rowcodec: the same choices as ``hand`` in one row block per reply, in C."""
    name = "native"

    def __init__(self, words, width):
        rc = _native()
        self.enc, self.dec = rc.Encoder(words, width, 256), rc.Decoder(words, width, 256)
        self.words = words

    def encode(self, rows):
        return self.enc.encode(rows, len(rows))[0]

    def decode(self, data, n):
        out = np.empty((n, self.words), dtype=np.int32)
        self.dec.decode(data, n, out)
        return out


class NativeZstd(Native):
    """The native row block through one zstd stream per stream (level 1, a flush per reply)."""
    name = "native+zstd"

    def __init__(self, words, width, level=1):
        super().__init__(words, width)
        import zstandard as zstd
        self.c = zstd.ZstdCompressor(level=level).compressobj()
        self.d = zstd.ZstdDecompressor().decompressobj()
        self.zstd = zstd

    def encode(self, rows):
        block = super().encode(rows)
        return self.c.compress(block) + self.c.flush(self.zstd.COMPRESSOBJ_FLUSH_BLOCK)

    def decode(self, data, n):
        return super().decode(self.d.decompress(data), n)


def study(replies, width, codecs) -> dict:
    words = replies[0].shape[1]
    rows_total = sum(len(r) for r in replies)
    out = {}
    for cls in codecs:
        codec = cls(words, width)
        enc_s = dec_s = 0.0
        size = 0
        for rows in replies:
            t0 = time.perf_counter()
            data = codec.encode(rows)
            t1 = time.perf_counter()
            back = codec.decode(data, len(rows))
            t2 = time.perf_counter()
            assert np.array_equal(back, rows), cls.name
            enc_s += t1 - t0
            dec_s += t2 - t1
            size += len(data)
        out[cls.name] = {"bytes_per_row": round(size / rows_total, 1),
                         "encode_us_per_row": round(enc_s / rows_total * 1e6, 2),
                         "decode_us_per_row": round(dec_s / rows_total * 1e6, 2)}
        print(f"  {cls.name:10s} {out[cls.name]}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--limit", type=int, default=None, help="MaskBench files (default all)")
    p.add_argument("--codecs", default="hand,zstd-dense,zstd-ids,dict+zstd,native,native+zstd")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    replies, width = capture(args.batch, args.steps, args.limit)
    print(f"batch {args.batch}: {len(replies)} replies, {sum(len(r) for r in replies)} rows", flush=True)
    table = {c.name: c for c in (Hand, ZstdDense, ZstdIds, DictZstd, Native, NativeZstd)}
    result = study(replies, width, [table[n] for n in args.codecs.split(",")])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"batch": args.batch, "steps": args.steps, **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
