/*
 * maskd._rowcodec: the per-row work of maskd's row codec, in C.
 *
 * A reply's rows travel as one "row block" (see RowEncoding in proto/maskd/v1/maskd.proto):
 *
 *     kinds[n]            one byte per row: 0 DENSE, 1 ALLOWED_IDS, 2 REJECTED_IDS, 3 DICT_REF
 *     then per row, in order:
 *       DICT_REF          uint16 little-endian: the slot of the stream's row dictionary
 *       DENSE             4 * words bytes: the words, little-endian
 *       ALLOWED_IDS,
 *       REJECTED_IDS      varint L, then L bytes: the sorted ids (of the set, or of the clear bits
 *                         below width), delta-encoded (first id as is, then differences >= 1),
 *                         each an unsigned LEB128 varint
 *
 * Both ends keep the row dictionary by the contract's rule: a row sent other than as DICT_REF is
 * inserted at slot counter % D and counter grows; DICT_REF names a filled slot. The encoder looks a
 * row up by a 64-bit hash and then compares the bytes, so a reference is only ever sent for an
 * equal row. This file has no policy beyond "the smallest encoding" (ties to the lower kind).
 *
 * Built by setuptools as an optional extension; maskd/rowcodec.py has a numpy fallback with the
 * same output, used when this module cannot be built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define K_DENSE 0
#define K_ALLOWED 1
#define K_REJECTED 2
#define K_REF 3
#define MAX_DICT 65535

typedef struct {
    Py_ssize_t words, width, dict_size;
    uint32_t *slots;      /* dict_size * words */
    uint64_t *hashes;     /* dict_size */
    uint64_t counter;     /* insertions so far */
    uint32_t *full;       /* words: the bits below width */
} Dict;

static int dict_init(Dict *d, Py_ssize_t words, Py_ssize_t width, Py_ssize_t dict_size) {
    d->words = words;
    d->width = width;
    d->dict_size = dict_size;
    d->counter = 0;
    d->slots = dict_size ? PyMem_Calloc((size_t)dict_size * words, sizeof(uint32_t)) : NULL;
    d->hashes = dict_size ? PyMem_Calloc((size_t)dict_size, sizeof(uint64_t)) : NULL;
    d->full = PyMem_Calloc((size_t)words, sizeof(uint32_t));
    if ((dict_size && (!d->slots || !d->hashes)) || !d->full) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t whole = width / 32, rest = width % 32;
    for (Py_ssize_t i = 0; i < whole; i++) d->full[i] = 0xFFFFFFFFu;
    if (rest) d->full[whole] = (1u << rest) - 1u;
    return 0;
}

static void dict_free(Dict *d) {
    PyMem_Free(d->slots);
    PyMem_Free(d->hashes);
    PyMem_Free(d->full);
    d->slots = NULL;
    d->hashes = NULL;
    d->full = NULL;
}

/* Four independent lanes over 32-byte blocks: the multiplies of one lane do not wait for the
 * others', so a row hashes at about four times the speed of a single chain. */
static uint64_t row_hash(const uint32_t *row, Py_ssize_t words) {
    uint64_t h[4] = {0x9E3779B97F4A7C15ull ^ (uint64_t)words, 0xC2B2AE3D27D4EB4Full,
                     0x165667B19E3779F9ull, 0x27D4EB2F165667C5ull};
    Py_ssize_t i = 0;
    for (; i + 8 <= words; i += 8) {
        for (int l = 0; l < 4; l++) {
            uint64_t w;
            memcpy(&w, row + i + 2 * l, 8);
            h[l] = (h[l] ^ w) * 0x100000001B3ull;
            h[l] ^= h[l] >> 29;
        }
    }
    uint64_t x = h[0] ^ (h[1] * 0x9E3779B97F4A7C15ull) ^ (h[2] * 0xC2B2AE3D27D4EB4Full) ^ (h[3] * 0x165667B19E3779F9ull);
    for (; i < words; i++) x = (x ^ row[i]) * 0x100000001B3ull;
    return x ^ (x >> 32);
}

static void dict_insert(Dict *d, const uint32_t *row, uint64_t hash) {
    if (!d->dict_size) return;
    Py_ssize_t slot = (Py_ssize_t)(d->counter % (uint64_t)d->dict_size);
    memcpy(d->slots + slot * d->words, row, (size_t)d->words * 4);
    if (d->hashes) d->hashes[slot] = hash;
    d->counter++;
}

static Py_ssize_t dict_filled(const Dict *d) {
    return d->counter < (uint64_t)d->dict_size ? (Py_ssize_t)d->counter : d->dict_size;
}

/* -- varints ------------------------------------------------------------------------------------ */
static inline int varint_len(uint64_t v) {
    int n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}

static inline uint8_t *varint_put(uint8_t *p, uint64_t v) {
    while (v >= 0x80) { *p++ = (uint8_t)(v | 0x80); v >>= 7; }
    *p++ = (uint8_t)v;
    return p;
}

/* Byte size of the delta-varint list of the set bits of (row ^ flip) & full. */
static Py_ssize_t ids_size(const uint32_t *row, const uint32_t *full, Py_ssize_t words, uint32_t flip,
                           Py_ssize_t *count) {
    Py_ssize_t size = 0, n = 0;
    int64_t prev = -1;
    for (Py_ssize_t w = 0; w < words; w++) {
        uint32_t bits = (row[w] ^ flip) & full[w];
        while (bits) {
            int b = __builtin_ctz(bits);
            bits &= bits - 1;
            int64_t id = (int64_t)w * 32 + b;
            size += varint_len((uint64_t)(prev < 0 ? id : id - prev));
            prev = id;
            n++;
        }
    }
    *count = n;
    return size;
}

static uint8_t *ids_put(uint8_t *p, const uint32_t *row, const uint32_t *full, Py_ssize_t words, uint32_t flip) {
    int64_t prev = -1;
    for (Py_ssize_t w = 0; w < words; w++) {
        uint32_t bits = (row[w] ^ flip) & full[w];
        while (bits) {
            int b = __builtin_ctz(bits);
            bits &= bits - 1;
            int64_t id = (int64_t)w * 32 + b;
            p = varint_put(p, (uint64_t)(prev < 0 ? id : id - prev));
            prev = id;
        }
    }
    return p;
}

/* The CPU's popcount instruction where it has one (x86-64 without -mpopcnt would count bits in
 * software); GCC picks the clone at load time. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
__attribute__((target_clones("popcnt", "default")))
#endif
static Py_ssize_t popcount_row(const uint32_t *row, const uint32_t *full, Py_ssize_t words) {
    Py_ssize_t k = 0;
    for (Py_ssize_t w = 0; w < words; w++) k += __builtin_popcount(row[w] & full[w]);
    return k;
}

/* -- Encoder ------------------------------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    Dict d;
    int allowed;          /* bit k set: kind k may be used */
} Encoder;

static int Encoder_init(Encoder *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"words", "width", "dict_size", "kinds", NULL};
    Py_ssize_t words, width, dict_size;
    int kinds = 0xF;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nnn|i", names, &words, &width, &dict_size, &kinds)) return -1;
    if (words <= 0 || width <= 0 || width > words * 32 || dict_size < 0 || dict_size > MAX_DICT) {
        PyErr_SetString(PyExc_ValueError, "bad words/width/dict_size");
        return -1;
    }
    if (!(kinds & 0x7)) {
        PyErr_SetString(PyExc_ValueError, "kinds must include DENSE, ALLOWED_IDS or REJECTED_IDS");
        return -1;
    }
    self->allowed = kinds;
    if (!(kinds & (1 << K_REF))) dict_size = 0;
    dict_free(&self->d);
    return dict_init(&self->d, words, width, dict_size);
}

static void Encoder_dealloc(Encoder *self) {
    dict_free(&self->d);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* encode(rows: buffer of n*words uint32, n) -> (block: bytes, sizes: bytes of n uint32 payload sizes) */
static PyObject *Encoder_encode(Encoder *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*n", &view, &n)) return NULL;
    Dict *d = &self->d;
    Py_ssize_t words = d->words;
    if (n < 0 || view.len != n * words * 4) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "rows must be n * words little-endian uint32 words");
        return NULL;
    }
    const uint32_t *rows = (const uint32_t *)view.buf;
    Py_ssize_t tail = d->width / 32;
    for (Py_ssize_t i = 0; i < n; i++) {      /* bits past the width must be 0 */
        const uint32_t *r = rows + i * words;
        for (Py_ssize_t w = tail; w < words; w++) {
            if (r[w] & ~d->full[w]) {
                PyBuffer_Release(&view);
                PyErr_Format(PyExc_ValueError, "row %zd sets bits at positions >= width %zd", i, d->width);
                return NULL;
            }
        }
    }
    /* Pass 1: kinds and sizes (the GIL is released: only this stream's memory is touched). */
    uint8_t *kinds = PyMem_Malloc(n ? (size_t)n : 1);
    uint32_t *sizes = PyMem_Malloc(n ? (size_t)n * 4 : 4);
    int32_t *refs = PyMem_Malloc(n ? (size_t)n * 4 : 4);
    Py_ssize_t *lens = PyMem_Malloc(n ? (size_t)n * sizeof(Py_ssize_t) : sizeof(Py_ssize_t));
    if (!kinds || !sizes || !refs || !lens) {
        PyMem_Free(kinds); PyMem_Free(sizes); PyMem_Free(refs); PyMem_Free(lens);
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    Py_ssize_t total = n;
    int allowed = self->allowed;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint32_t *r = rows + i * words;
        uint64_t h = row_hash(r, words);
        refs[i] = -1;
        if (d->dict_size) {
            Py_ssize_t filled = dict_filled(d);
            for (Py_ssize_t s = 0; s < filled; s++) {
                if (d->hashes[s] == h && !memcmp(d->slots + s * words, r, (size_t)words * 4)) {
                    refs[i] = (int32_t)s;
                    break;
                }
            }
        }
        if (refs[i] >= 0) {
            kinds[i] = K_REF;
            sizes[i] = 2;
            total += 2;
            continue;
        }
        Py_ssize_t k = popcount_row(r, d->full, words);
        Py_ssize_t best = -1, cnt, body;
        int kind = K_DENSE;
        if (allowed & (1 << K_DENSE)) best = words * 4;
        /* A list costs at least its length byte and a byte per id: skip one that cannot win. */
        if ((allowed & (1 << K_ALLOWED)) && (best < 0 || k + 1 < best)) {
            body = ids_size(r, d->full, words, 0u, &cnt);
            Py_ssize_t s = body + varint_len((uint64_t)body);
            if (best < 0 || s < best) { best = s; kind = K_ALLOWED; lens[i] = body; }
        }
        if ((allowed & (1 << K_REJECTED)) && (best < 0 || d->width - k + 1 < best)) {
            body = ids_size(r, d->full, words, 0xFFFFFFFFu, &cnt);
            Py_ssize_t s = body + varint_len((uint64_t)body);
            if (best < 0 || s < best) { best = s; kind = K_REJECTED; lens[i] = body; }
        }
        kinds[i] = (uint8_t)kind;
        sizes[i] = (uint32_t)best;
        total += best;
        dict_insert(d, r, h);
    }
    Py_END_ALLOW_THREADS
    /* Pass 2: the block. */
    PyObject *block = PyBytes_FromStringAndSize(NULL, total);
    PyObject *size_bytes = PyBytes_FromStringAndSize((const char *)sizes, n * 4);
    if (!block || !size_bytes) {
        Py_XDECREF(block); Py_XDECREF(size_bytes);
        PyMem_Free(kinds); PyMem_Free(sizes); PyMem_Free(refs); PyMem_Free(lens);
        PyBuffer_Release(&view);
        return NULL;
    }
    uint8_t *start = (uint8_t *)PyBytes_AS_STRING(block);
    uint8_t *p = start;
    Py_BEGIN_ALLOW_THREADS
    memcpy(p, kinds, (size_t)n);
    p += n;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint32_t *r = rows + i * words;
        switch (kinds[i]) {
        case K_REF:
            *p++ = (uint8_t)(refs[i] & 0xFF);
            *p++ = (uint8_t)(refs[i] >> 8);
            break;
        case K_DENSE:
            memcpy(p, r, (size_t)words * 4);
            p += words * 4;
            break;
        default:
            p = varint_put(p, (uint64_t)lens[i]);
            p = ids_put(p, r, d->full, words, kinds[i] == K_REJECTED ? 0xFFFFFFFFu : 0u);
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(kinds); PyMem_Free(sizes); PyMem_Free(refs); PyMem_Free(lens);
    PyBuffer_Release(&view);
    if (p != start + total) {
        Py_DECREF(block); Py_DECREF(size_bytes);
        PyErr_SetString(PyExc_RuntimeError, "row block size mismatch (a bug in maskd._rowcodec)");
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, block, size_bytes);
    Py_DECREF(block);
    Py_DECREF(size_bytes);
    return out;
}

static PyMethodDef Encoder_methods[] = {
    {"encode", (PyCFunction)Encoder_encode, METH_VARARGS,
     "encode(rows, n) -> (block, sizes): n rows of words uint32 into a row block; sizes: uint32 per row"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "maskd._rowcodec.Encoder",
    .tp_basicsize = sizeof(Encoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Encoder_init,
    .tp_dealloc = (destructor)Encoder_dealloc,
    .tp_methods = Encoder_methods,
    .tp_doc = "Row block encoder of one stream (keeps its row dictionary).",
};

/* -- Decoder ------------------------------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    Dict d;
} Decoder;

static int Decoder_init(Decoder *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"words", "width", "dict_size", NULL};
    Py_ssize_t words, width, dict_size;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nnn", names, &words, &width, &dict_size)) return -1;
    if (words <= 0 || width <= 0 || width > words * 32 || dict_size < 0 || dict_size > MAX_DICT) {
        PyErr_SetString(PyExc_ValueError, "bad words/width/dict_size");
        return -1;
    }
    dict_free(&self->d);
    return dict_init(&self->d, words, width, dict_size);
}

static void Decoder_dealloc(Decoder *self) {
    dict_free(&self->d);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int varint_get(const uint8_t **pp, const uint8_t *end, uint64_t *v) {
    const uint8_t *p = *pp;
    uint64_t x = 0;
    for (int shift = 0; shift < 35; shift += 7) {
        if (p >= end) return -1;
        uint8_t b = *p++;
        x |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) { *pp = p; *v = x; return 0; }
    }
    return -2;
}

#define FAIL(...) do { snprintf(err, sizeof(err), __VA_ARGS__); goto done; } while (0)

/* decode(block, n, out: writable buffer of n*words uint32) -> None; ValueError when malformed.
   The GIL is released while rows are written: another thread of the caller can run meanwhile. */
static PyObject *Decoder_decode(Decoder *self, PyObject *args) {
    Py_buffer in, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*nw*", &in, &n, &out)) return NULL;
    char err[200] = "";
    Dict *d = &self->d;
    Py_ssize_t words = d->words;
    const uint8_t *p = (const uint8_t *)in.buf, *end = p + in.len;
    uint32_t *rows = (uint32_t *)out.buf;
    PyThreadState *ts = PyEval_SaveThread();
    if (n < 0 || out.len < n * words * 4) FAIL("out holds fewer than %zd rows", n);
    if (in.len < n) FAIL("row block of %zd bytes for %zd rows", in.len, n);
    const uint8_t *kinds = p;
    p += n;
    Py_ssize_t tail = d->width / 32;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t *r = rows + i * words;
        switch (kinds[i]) {
        case K_REF: {
            if (end - p < 2) FAIL("row %zd: truncated reference", i);
            Py_ssize_t slot = p[0] | (p[1] << 8);
            p += 2;
            if (slot >= dict_filled(d))
                FAIL("row %zd: reference to slot %zd, but %zd of %zd dictionary slots are filled", i, slot,
                     dict_filled(d), d->dict_size);
            memcpy(r, d->slots + slot * words, (size_t)words * 4);
            continue;
        }
        case K_DENSE:
            if (end - p < words * 4) FAIL("row %zd: truncated dense row", i);
            memcpy(r, p, (size_t)words * 4);
            p += words * 4;
            for (Py_ssize_t w = tail; w < words; w++)
                if (r[w] & ~d->full[w]) FAIL("row %zd: dense row sets bits at positions >= width %zd", i, d->width);
            break;
        case K_ALLOWED:
        case K_REJECTED: {
            uint64_t len;
            if (varint_get(&p, end, &len)) FAIL("row %zd: bad length varint", i);
            if ((uint64_t)(end - p) < len) FAIL("row %zd: truncated id list", i);
            const uint8_t *q = p, *qend = p + len;
            p = qend;
            if (kinds[i] == K_ALLOWED) memset(r, 0, (size_t)words * 4);
            else memcpy(r, d->full, (size_t)words * 4);
            int64_t prev = -1;
            while (q < qend) {
                uint64_t v;
                int rc = varint_get(&q, qend, &v);
                if (rc == -2) FAIL("row %zd: varint longer than 5 bytes", i);
                if (rc) FAIL("row %zd: truncated varint", i);
                if (prev >= 0 && v == 0) FAIL("row %zd: ids are not strictly increasing (a delta of 0)", i);
                int64_t id = prev < 0 ? (int64_t)v : prev + (int64_t)v;
                if (id >= d->width) FAIL("row %zd: id %lld out of range for width %zd", i, (long long)id, d->width);
                r[id >> 5] ^= 1u << (id & 31);
                prev = id;
            }
            break;
        }
        default:
            FAIL("row %zd: unknown encoding %d", i, (int)kinds[i]);
        }
        dict_insert(d, r, 0);
    }
    if (p != end) FAIL("%zd bytes left after %zd rows", (Py_ssize_t)(end - p), n);
done:
    PyEval_RestoreThread(ts);
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    if (err[0]) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Decoder_methods[] = {
    {"decode", (PyCFunction)Decoder_decode, METH_VARARGS,
     "decode(block, n, out) -> None: a row block into n dense rows of out (uint32 words)"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "maskd._rowcodec.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Decoder_init,
    .tp_dealloc = (destructor)Decoder_dealloc,
    .tp_methods = Decoder_methods,
    .tp_doc = "Row block decoder of one stream (keeps its row dictionary).",
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "maskd._rowcodec",
                                    "The per-row work of maskd's row codec (see maskd/rowcodec.py).", -1, NULL,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rowcodec(void) {
    if (PyType_Ready(&EncoderType) < 0 || PyType_Ready(&DecoderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&EncoderType);
    Py_INCREF(&DecoderType);
    if (PyModule_AddObject(m, "Encoder", (PyObject *)&EncoderType) < 0 ||
        PyModule_AddObject(m, "Decoder", (PyObject *)&DecoderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
