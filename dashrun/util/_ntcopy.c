/*
 * dashrun.util._ntcopy: a copy with non-temporal (streaming) stores that checksums as it copies: the rank's
 * staging copy, and dash-memd's move of received bytes from its landing buffer into its RAM buffers.
 *
 * A snapshot's bytes are written once into the shared-memory staging buffer and
 * never read again by the rank. An ordinary copy first reads every destination
 * line into the cache (a third more memory traffic) and evicts the training's own
 * data to make room; streaming stores do neither (scripts/bench_staging.py
 * measures what that saves the training core).
 *
 * The same loop computes the bytes' CRC-32C from the registers it copied them
 * through, in three independent chains whose results are combined: the checksum
 * then costs the rank nothing measurable and dash-agent no pass of its own over
 * the segment.
 *
 * x86-64 with SSE4.2 only (STREAMING says so at import). Optional: where it is
 * not built or not usable, dashrun stages with torch's copy_ and the agent
 * checksums.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#include <nmmintrin.h>
#define X86_64 1
/* Below this, the copy stays in the cache anyway and memcpy is as good. */
#define MIN_STREAM 65536

/* CRC-32C (Castagnoli), reflected, as the crc32c package and dashrun's wire format compute it. */
#define POLY 0x82f63b78u

/* a * b modulo the polynomial, and x^(2^k) tables: zlib's crc32_combine, for CRC-32C. */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

static uint32_t x2n_table[32];

static void init_x2n(void)
{
    uint32_t p = (uint32_t)1 << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++)
        x2n_table[n] = p = multmodp(p, p);
}

static uint32_t x2nmodp(size_t n, unsigned k)
{
    uint32_t p = (uint32_t)1 << 31; /* x^0 */
    while (n) {
        if (n & 1)
            p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

/* The CRC of A followed by B, from crc(A), crc(B) and B's length. */
static uint32_t crc_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b)
{
    return multmodp(x2nmodp(len_b, 3), crc_a) ^ crc_b;
}


static int usable;  /* the CPU has SSE4.2 (CRC-32C), checked once at import */

__attribute__((target("sse4.2")))
static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n)
{
    uint64_t c = ~crc & 0xffffffffu;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
    }
    while (n--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}

/* 64 bytes: copied with streaming stores and fed to one CRC chain. */
__attribute__((target("sse4.2")))
static inline uint64_t block64(char *dst, const char *src, uint64_t c)
{
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i x = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), x);
    _mm_stream_si128((__m128i *)(dst + 48), d);
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(a));
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(a, a)));
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(b));
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(b, b)));
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(x));
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(x, x)));
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(d));
    c = _mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(d, d)));
    return c;
}

/* Copy n bytes and return crc extended over them. Three stripes in one loop: one CRC chain
 * alone (3 cycles per 8 bytes) would be slower than the memory; three keep up with it. */
__attribute__((target("sse4.2")))
static uint32_t stream_copy_crc(char *dst, const char *src, size_t n, uint32_t crc)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (n < MIN_STREAM + head) {
        memcpy(dst, src, n);
        return crc_hw(crc, (const unsigned char *)dst, n);
    }
    memcpy(dst, src, head);
    crc = crc_hw(crc, (const unsigned char *)dst, head);
    dst += head;
    src += head;
    n -= head;
    size_t stripe = (n / 3) & ~(size_t)63;  /* stripes a and b; c takes the rest */
    uint64_t ca = ~crc & 0xffffffffu, cb = 0xffffffffu, cc = 0xffffffffu;
    for (size_t off = 0; off < stripe; off += 64) {
        ca = block64(dst + off, src + off, ca);
        cb = block64(dst + stripe + off, src + stripe + off, cb);
        cc = block64(dst + 2 * stripe + off, src + 2 * stripe + off, cc);
    }
    /* Streaming stores are weakly ordered: make them visible before the rank tells the agent. */
    _mm_sfence();
    /* What is left after the three stripes' blocks (under 3 x 64 bytes) continues chain c. */
    memcpy(dst + 3 * stripe, src + 3 * stripe, n - 3 * stripe);
    uint32_t crc_c = crc_hw(~(uint32_t)cc, (const unsigned char *)dst + 3 * stripe, n - 3 * stripe);
    uint32_t crc_ab = crc_combine(~(uint32_t)ca, ~(uint32_t)cb, stripe);
    return crc_combine(crc_ab, crc_c, n - 2 * stripe);
}
#else
#define X86_64 0
static int usable;
#endif

static PyObject *copy_crc(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t n;
    unsigned int crc;
    if (!PyArg_ParseTuple(args, "KKnI:copy_crc", &dst, &src, &n, &crc))
        return NULL;
    if (n < 0 || !dst || !src) {
        PyErr_SetString(PyExc_ValueError, "copy_crc needs two addresses and a length >= 0");
        return NULL;
    }
    if (!usable) {
        PyErr_SetString(PyExc_RuntimeError, "not an x86-64 CPU with SSE4.2 (see STREAMING)");
        return NULL;
    }
    uint32_t out = crc;
#if X86_64
    Py_BEGIN_ALLOW_THREADS
    out = stream_copy_crc((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n, crc);
    Py_END_ALLOW_THREADS
#endif
    return PyLong_FromUnsignedLong(out);
}

static PyMethodDef methods[] = {
    {"copy_crc", copy_crc, METH_VARARGS,
     "copy_crc(dst_address, src_address, nbytes, crc) -> crc: copy bytes between non-overlapping buffers, "
     "bypassing the cache for the destination, and return the running CRC-32C ``crc`` extended over them. "
     "The caller vouches for both ranges."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dashrun.util._ntcopy",
    "The staging copy with non-temporal stores (see dashrun.rank.staging and dashrun.wire.channel).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ntcopy(void)
{
#if X86_64
    init_x2n();
    __builtin_cpu_init();
    usable = __builtin_cpu_supports("sse4.2") != 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "STREAMING", usable) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
