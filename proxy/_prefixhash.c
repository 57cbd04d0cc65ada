/* A prompt's chain of block hashes in one call (proxy/routing/prefix.py's chain_bytes).
 *
 * Routing hashes every whole block of a request's prompt: block i's hash is XXH3-64 of its
 * bytes seeded with block i-1's hash. From Python each block is a loop step, a slice and a
 * call into the xxhash package (~250 ns): ~31 µs for a 2k-token prompt (125 blocks of 64
 * characters), ~0.5 ms for 32k tokens, on every request. Here the whole chain is one call.
 *
 * XXH3-64 with a seed is written out below for inputs of up to 240 bytes (the default block
 * of 64 characters, a 16-token block of 128 bytes), from the algorithm's specification: it
 * uses the specification's default secret, which the seed only offsets at this length. The
 * hashes must be the xxhash package's to the bit (replicas of different builds share one
 * index), so tests/test_prefixhash.py compares the two on every length from 0 to 240 and on
 * many seeds; a longer block is hashed by prefix.py's Python loop through the package
 * (`chain` returns None for it).
 *
 * Built by setup.py beside the mypyc-compiled hot path, and chosen with it (proxy/__init__.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The longest input hashed here; XXH3 derives a secret from the seed past it. */
#define MAX_LEN 240

static const uint64_t P64_1 = 0x9E3779B185EBCA87ULL;
static const uint64_t P64_2 = 0xC2B2AE3D27D4EB4FULL;
static const uint64_t P64_3 = 0x165667B19E3779F9ULL;
static const uint64_t MX1 = 0x165667919E3779F9ULL;
static const uint64_t MX2 = 0x9FB21C651E98DF25ULL;

/* The specification's default secret (kSecret), the 136 of its 192 bytes that inputs of up
 * to 240 bytes read. */
static const uint8_t SECRET[136] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
    0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
    0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
    0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
    0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
    0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
    0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
    0xc3,
};

/* Little-endian reads, whatever the machine's order. */
static inline uint64_t
le64(const uint8_t *p)
{
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
}

static inline uint32_t
le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t
rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint32_t
swap32(uint32_t x)
{
    return ((x << 24) & 0xff000000U) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) |
           ((x >> 24) & 0x000000ffU);
}

static inline uint64_t
swap64(uint64_t x)
{
    return ((uint64_t)swap32((uint32_t)x) << 32) | swap32((uint32_t)(x >> 32));
}

/* The 128-bit product of a and b, its two halves xor-ed. */
static inline uint64_t
fold64(uint64_t a, uint64_t b)
{
#if defined(__SIZEOF_INT128__)
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#else
    uint64_t lo_lo = (a & 0xffffffffULL) * (b & 0xffffffffULL);
    uint64_t hi_lo = (a >> 32) * (b & 0xffffffffULL);
    uint64_t lo_hi = (a & 0xffffffffULL) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xffffffffULL) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xffffffffULL);
    return lower ^ upper;
#endif
}

static inline uint64_t
avalanche64(uint64_t h) /* XXH64's final mix, which the shortest inputs end with */
{
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t
avalanche(uint64_t h)
{
    h ^= h >> 37;
    h *= MX1;
    return h ^ (h >> 32);
}

static inline uint64_t
rrmxmx(uint64_t h, uint64_t len)
{
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= MX2;
    h ^= (h >> 35) + len;
    h *= MX2;
    return h ^ (h >> 28);
}

static inline uint64_t
mix16(const uint8_t *in, const uint8_t *secret, uint64_t seed)
{
    return fold64(le64(in) ^ (le64(secret) + seed), le64(in + 8) ^ (le64(secret + 8) - seed));
}

/* XXH3-64 of in[0:len] with `seed`, for len <= MAX_LEN. */
static uint64_t
xxh3(const uint8_t *in, size_t len, uint64_t seed)
{
    if (len == 0)
        return avalanche64(seed ^ (le64(SECRET + 56) ^ le64(SECRET + 64)));
    if (len <= 3) {
        uint32_t combined = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24) |
                            (uint32_t)in[len - 1] | ((uint32_t)len << 8);
        uint64_t bitflip = (uint64_t)(le32(SECRET) ^ le32(SECRET + 4)) + seed;
        return avalanche64((uint64_t)combined ^ bitflip);
    }
    if (len <= 8) {
        seed ^= (uint64_t)swap32((uint32_t)seed) << 32;
        uint64_t bitflip = (le64(SECRET + 8) ^ le64(SECRET + 16)) - seed;
        uint64_t joined = (uint64_t)le32(in + len - 4) + ((uint64_t)le32(in) << 32);
        return rrmxmx(joined ^ bitflip, len);
    }
    if (len <= 16) {
        uint64_t lo = le64(in) ^ ((le64(SECRET + 24) ^ le64(SECRET + 32)) + seed);
        uint64_t hi = le64(in + len - 8) ^ ((le64(SECRET + 40) ^ le64(SECRET + 48)) - seed);
        return avalanche(len + swap64(lo) + hi + fold64(lo, hi));
    }
    uint64_t acc = len * P64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += mix16(in + 48, SECRET + 96, seed);
                    acc += mix16(in + len - 64, SECRET + 112, seed);
                }
                acc += mix16(in + 32, SECRET + 64, seed);
                acc += mix16(in + len - 48, SECRET + 80, seed);
            }
            acc += mix16(in + 16, SECRET + 32, seed);
            acc += mix16(in + len - 32, SECRET + 48, seed);
        }
        acc += mix16(in, SECRET, seed);
        acc += mix16(in + len - 16, SECRET + 16, seed);
        return avalanche(acc);
    }
    /* 129 to 240 bytes: eight rounds, a mix, the rest of the 16-byte rounds from an offset
     * of 3 into the secret, and the last 16 bytes against its bytes 119 to 134. */
    size_t rounds = len / 16;
    for (size_t i = 0; i < 8; i++)
        acc += mix16(in + 16 * i, SECRET + 16 * i, seed);
    acc = avalanche(acc);
    for (size_t i = 8; i < rounds; i++)
        acc += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3, seed);
    acc += mix16(in + len - 16, SECRET + 136 - 17, seed);
    return avalanche(acc);
}

/* chain(h0, data, block, max_blocks) -> list[int] | None: prefix.chain_bytes's answer (the
 * chain of XXH3-64 hashes of data's whole blocks of `block` bytes, each seeded with the last,
 * the first with h0, at most max_blocks of them), or None where `block` is over MAX_LEN. */
static PyObject *
chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "chain(h0, data, block, max_blocks) takes 4 arguments");
        return NULL;
    }
    uint64_t h = PyLong_AsUnsignedLongLong(args[0]);
    if (h == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t block = PyLong_AsSsize_t(args[2]);
    Py_ssize_t most = PyLong_AsSsize_t(args[3]);
    PyObject *out = NULL;
    if ((block == -1 || most == -1) && PyErr_Occurred())
        goto done;
    if (block <= 0) {
        PyErr_SetString(PyExc_ValueError, "chain: block must be positive");
        goto done;
    }
    if (block > MAX_LEN) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t n = view.len / block;
    if (most < n)
        n = most < 0 ? 0 : most;
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    const uint8_t *p = (const uint8_t *)view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        h = xxh3(p + i * block, (size_t)block, h);
        PyObject *item = PyLong_FromUnsignedLongLong(h);
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
    }
done:
    PyBuffer_Release(&view);
    return out;
}

/* xxh3_64(data, seed) -> int: one hash, for the tests' comparison with the xxhash package
 * (inputs of up to 240 bytes). */
static PyObject *
xxh3_64(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "xxh3_64(data, seed) takes 2 arguments");
        return NULL;
    }
    uint64_t seed = PyLong_AsUnsignedLongLong(args[1]);
    if (seed == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    if (view.len > MAX_LEN)
        PyErr_Format(PyExc_ValueError, "xxh3_64: %zd bytes, at most %d here", view.len, MAX_LEN);
    else
        out = PyLong_FromUnsignedLongLong(xxh3((const uint8_t *)view.buf, (size_t)view.len, seed));
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(h0, data, block, max_blocks) -> list[int] | None: as "
     "proxy.routing.prefix.chain_bytes, or None for a block over 240 bytes."},
    {"xxh3_64", (PyCFunction)(void (*)(void))xxh3_64, METH_FASTCALL,
     "xxh3_64(data, seed) -> int: XXH3-64 of at most 240 bytes (as xxhash.xxh3_64_intdigest)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "proxy._prefixhash",
    .m_doc = "A prompt's chain of block hashes in C (proxy/routing/prefix.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__prefixhash(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (m != NULL && PyModule_AddIntConstant(m, "MAX_BLOCK", MAX_LEN) < 0)
        Py_CLEAR(m);
    return m;
}
