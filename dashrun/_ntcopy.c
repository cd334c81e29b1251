/*
 * dashrun._ntcopy: the rank's staging copy with non-temporal (streaming) stores.
 *
 * A snapshot's bytes are written once into the shared-memory staging buffer and
 * never read again by the rank. An ordinary copy first reads every destination
 * line into the cache (a third more memory traffic) and evicts the training's own
 * data to make room; streaming stores do neither. On the build machine this takes
 * a 257 MiB staging copy from ~50 to ~33 ms of CPU on the training core.
 *
 * Optional: when it cannot be built, dashrun stages with torch's copy_.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMING 1
/* Below this, the copy stays in the cache anyway and memcpy is as good. */
#define MIN_STREAM 65536

static void stream_copy(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;  /* movntdq needs an aligned destination */
    if (n < MIN_STREAM + head) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (size_t blocks = n / 64; blocks; blocks--) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        src += 64;
        dst += 64;
    }
    /* Streaming stores are weakly ordered: make them visible before the rank tells the agent. */
    _mm_sfence();
    memcpy(dst, src, n % 64);
}
#else
#define STREAMING 0
static void stream_copy(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
#endif

static PyObject *copy(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KKn:copy", &dst, &src, &n))
        return NULL;
    if (n < 0 || !dst || !src) {
        PyErr_SetString(PyExc_ValueError, "copy needs two addresses and a length >= 0");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst_address, src_address, nbytes): copy bytes between non-overlapping buffers, "
     "bypassing the cache for the destination. The caller vouches for both ranges."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dashrun._ntcopy",
    "The staging copy with non-temporal stores (see dashrun.staging).", -1, methods,
};

PyMODINIT_FUNC PyInit__ntcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
