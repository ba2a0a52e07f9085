# cython: language_level=3
"""CPU kernels of gradfuse.

Contract: Python validates and allocates; these functions only loop. Every kernel
takes a pointer/offset/size table that the fusion plan caches, runs without the
GIL, and costs one call per bucket, whatever the number of tensors in it.

Compiler directives (boundscheck, wraparound, ...) are set once in setup.py;
``GRADFUSE_DEBUG_BUILD=1 pip install -e .`` rebuilds with bounds checks on.
"""
from libc.stdint cimport int64_t, uint8_t, uint16_t, uintptr_t
from libc.string cimport memcpy
from libc.stdlib cimport malloc, realloc, free
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_RECORDS_RO
from cpython.bytes cimport PyBytes_FromStringAndSize

cdef extern from "_half.h" nogil:
    float gf_half_to_float(uint16_t h)
    uint16_t gf_float_to_half(float f)

cdef extern from "_simd.h" nogil:
    int gf_cpu_avx2
    int gf_use_avx2
    void gf_simd_init(int force_scalar)

# dtype codes shared with gradfuse/dtypes.py
DEF C_BAD = 0
DEF C_F16 = 1
DEF C_F32 = 2
DEF C_F64 = 3
DEF C_I32 = 4
DEF C_I64 = 5

# per-tensor flag bits written by scan()
FLAG_READONLY = 1
FLAG_NONCONTIG = 2
FLAG_NOBUFFER = 4
FLAG_BADDTYPE = 8

import sys as _sys
cdef bint _little = _sys.byteorder == "little"


cdef int _dtype_code(const char* fmt, Py_ssize_t itemsize) noexcept:
    """Map a PEP 3118 format string of a native-order scalar to a dtype code."""
    if fmt == NULL:
        return C_BAD                      # unsigned bytes: not a gradient dtype
    if fmt[0] == b'@' or fmt[0] == b'=' or (fmt[0] == b'<' and _little) or (fmt[0] == b'>' and not _little):
        fmt += 1
    if fmt[0] == 0 or fmt[1] != 0:
        return C_BAD
    cdef char c = fmt[0]
    if c == b'e' and itemsize == 2:
        return C_F16
    if c == b'f' and itemsize == 4:
        return C_F32
    if c == b'd' and itemsize == 8:
        return C_F64
    if (c == b'i' or c == b'l' or c == b'q') and itemsize == 4:
        return C_I32
    if (c == b'i' or c == b'l' or c == b'q') and itemsize == 8:
        return C_I64
    return C_BAD


def scan(list objs, int64_t[::1] ptrs, int64_t[::1] nbytes, int64_t[::1] flags):
    """Read pointer, size, dtype and shape of every array through the buffer protocol.

    Fills ``ptrs``, ``nbytes`` and ``flags`` (FLAG_* bits) for each object and returns
    the shape/dtype signature as bytes: for every tensor, int64 words
    ``[dtype_code, ndim, dim0, ..., dimN]``. Objects without the buffer protocol get
    FLAG_NOBUFFER and ``[0, -1]``. This is the steady-state intake: one C loop, no
    Python objects per tensor.
    """
    cdef Py_ssize_t n = len(objs), i, d, cap, used = 0
    cdef Py_buffer view
    cdef int64_t* sig
    cdef int64_t expected, f
    cdef int code
    cdef object o
    if ptrs.shape[0] < n or nbytes.shape[0] < n or flags.shape[0] < n:
        raise ValueError("scan: tables are shorter than the list of arrays")
    cap = 4 * n + 8
    sig = <int64_t*> malloc(cap * sizeof(int64_t))
    if sig == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            o = objs[i]
            if used + 2 + 64 > cap:
                cap = 2 * cap + 66
                sig = <int64_t*> realloc(sig, cap * sizeof(int64_t))
                if sig == NULL:
                    raise MemoryError()
            try:
                PyObject_GetBuffer(o, &view, PyBUF_RECORDS_RO)
            except (TypeError, BufferError, ValueError):
                # not an error here: the caller converts the object through the intake
                ptrs[i] = 0
                nbytes[i] = 0
                flags[i] = FLAG_NOBUFFER
                sig[used] = 0
                sig[used + 1] = -1
                used += 2
                continue
            try:
                f = 0
                if view.readonly:
                    f |= FLAG_READONLY
                code = _dtype_code(view.format, view.itemsize)
                if code == C_BAD:
                    f |= FLAG_BADDTYPE
                expected = view.itemsize
                if view.strides != NULL and view.len > 0:
                    for d in range(view.ndim - 1, -1, -1):
                        if view.shape[d] != 1 and view.strides[d] != expected:
                            f |= FLAG_NONCONTIG
                            break
                        expected *= view.shape[d]
                ptrs[i] = <int64_t> <uintptr_t> view.buf
                nbytes[i] = view.len
                flags[i] = f
                sig[used] = code
                sig[used + 1] = view.ndim
                used += 2
                for d in range(view.ndim):
                    sig[used] = view.shape[d]
                    used += 1
            finally:
                PyBuffer_Release(&view)
        return PyBytes_FromStringAndSize(<char*> sig, used * sizeof(int64_t))
    finally:
        free(sig)


def pack(uint8_t[::1] buf, const int64_t[::1] src, const int64_t[::1] offsets,
         const int64_t[::1] nbytes, Py_ssize_t lo, Py_ssize_t hi):
    """Copy tensors lo..hi-1 of the table into ``buf`` at their offsets."""
    cdef Py_ssize_t i
    cdef uint8_t* base = &buf[0] if buf.shape[0] > 0 else NULL
    _check_table(buf.shape[0], offsets, nbytes, lo, hi)
    with nogil:
        for i in range(lo, hi):
            if nbytes[i] > 0:
                memcpy(base + offsets[i], <const void*> <uintptr_t> src[i], nbytes[i])


def unpack(const uint8_t[::1] buf, const int64_t[::1] dst, const int64_t[::1] offsets,
           const int64_t[::1] nbytes, Py_ssize_t lo, Py_ssize_t hi):
    """Copy tensors lo..hi-1 out of ``buf`` into their destinations."""
    cdef Py_ssize_t i
    cdef const uint8_t* base = &buf[0] if buf.shape[0] > 0 else NULL
    _check_table(buf.shape[0], offsets, nbytes, lo, hi)
    with nogil:
        for i in range(lo, hi):
            if nbytes[i] > 0:
                memcpy(<void*> <uintptr_t> dst[i], base + offsets[i], nbytes[i])


cdef int _check_table(Py_ssize_t buflen, const int64_t[::1] offsets, const int64_t[::1] nbytes,
                      Py_ssize_t lo, Py_ssize_t hi) except -1:
    if lo < 0 or hi > offsets.shape[0] or hi > nbytes.shape[0] or lo > hi:
        raise IndexError(f"table range {lo}:{hi} outside a table of {offsets.shape[0]}")
    if hi > lo and offsets[hi - 1] + nbytes[hi - 1] > buflen:
        raise ValueError("fusion buffer too small for its table")
    return 0


cdef void _div_run(int code, void* p, const void* q, Py_ssize_t count, double divisor) noexcept nogil:
    """p[i] = q[i] / divisor in the dtype's arithmetic (fp16: in float32, rounded once)."""
    cdef Py_ssize_t i
    cdef float fdiv = <float> divisor
    cdef float* pf
    cdef const float* qf
    cdef double* pd
    cdef const double* qd
    cdef uint16_t* ph
    cdef const uint16_t* qh
    if code == C_F32:
        pf = <float*> p
        qf = <const float*> q
        for i in range(count):
            pf[i] = qf[i] / fdiv
    elif code == C_F64:
        pd = <double*> p
        qd = <const double*> q
        for i in range(count):
            pd[i] = qd[i] / divisor
    elif code == C_F16:
        ph = <uint16_t*> p
        qh = <const uint16_t*> q
        for i in range(count):
            ph[i] = gf_float_to_half(gf_half_to_float(qh[i]) / fdiv)


cdef int _check_float(int code) except -1:
    if code != C_F16 and code != C_F32 and code != C_F64:
        raise TypeError(f"division kernel needs a float dtype code, got {code}")
    return 0


def unpack_div(const uint8_t[::1] buf, const int64_t[::1] dst, const int64_t[::1] offsets,
               const int64_t[::1] nbytes, Py_ssize_t lo, Py_ssize_t hi, int code, double divisor):
    """Unpack tensors lo..hi-1 and divide them by ``divisor`` in the same pass.

    This is how averaging is done: the reduction sums, the unpack divides, so the
    order is always sum-then-divide, and float16 is divided in float32 and rounded
    once (the same bits as numpy's ``float16 / float16``).
    """
    cdef Py_ssize_t i, itemsize = 2 if code == C_F16 else (4 if code == C_F32 else 8)
    cdef const uint8_t* base = &buf[0] if buf.shape[0] > 0 else NULL
    _check_float(code)
    _check_table(buf.shape[0], offsets, nbytes, lo, hi)
    with nogil:
        for i in range(lo, hi):
            _div_run(code, <void*> <uintptr_t> dst[i], base + offsets[i], nbytes[i] // itemsize, divisor)


def div_inplace(int64_t ptr, Py_ssize_t count, int code, double divisor):
    """Divide ``count`` elements at address ``ptr`` by ``divisor`` in place."""
    _check_float(code)
    if count <= 0:
        return
    with nogil:
        _div_run(code, <void*> <uintptr_t> ptr, <const void*> <uintptr_t> ptr, count, divisor)


def set_simd(bint force_scalar):
    """Choose the kernels' code path: portable scalar (True) or the best the CPU has."""
    gf_simd_init(force_scalar)


def simd_info():
    """Which SIMD path the kernels use now, and what the CPU offers."""
    return {"cpu_avx2_f16c": bool(gf_cpu_avx2), "using_avx2": bool(gf_use_avx2)}


def _init_simd_from_env():
    import os
    raw = os.environ.get("GRADFUSE_FORCE_SCALAR")
    if raw is None:
        force = False
    elif raw.strip() in ("0", "1"):
        force = raw.strip() == "1"
    else:
        raise ValueError(f"GRADFUSE_FORCE_SCALAR={raw!r}: expected 0 or 1")
    gf_simd_init(force)


_init_simd_from_env()

# Compressor kernels, one include per family (each with a numpy twin in tests/).
include "kernels/_cast.pxi"
include "kernels/_quant.pxi"
include "kernels/_twobit.pxi"
include "kernels/_sparse.pxi"
include "kernels/_momentum.pxi"
include "kernels/_adam.pxi"
include "kernels/_powersgd.pxi"
include "kernels/_finite.pxi"
include "kernels/_peer.pxi"
