# Kernels: fp16/bf16 casts, 16-bit sums, fused pack+cast. Included by _core.pyx.
#
# fmt codes: 1 = fp16 (IEEE binary16), 2 = bf16. The math (rounding, NaN rules,
# overflow/underflow counting, summation rule) is defined in _cast.h and
# docs/compressors.md ("fp16 / bf16 cast compressors"); tests/ref_cast.py is its numpy twin.

cdef extern from "_cast.h" nogil:
    void gf_cast_to16(int fmt, const float* src, uint16_t* dst, int64_t n,
                      int scaled, float p, int64_t* ovf, int64_t* und)
    void gf_cast_from16(int fmt, const uint16_t* src, float* dst, int64_t n, int scaled, float d)
    void gf_sum16(int fmt, const uint16_t* a, uint16_t* b, int64_t n)

CAST_FP16 = 1
CAST_BF16 = 2

import math as _math


cdef int _cast_check_fmt(int fmt, str who) except -1:
    if fmt != 1 and fmt != 2:
        raise ValueError(f"{who}: fmt must be 1 (fp16) or 2 (bf16), got {fmt}")
    return 0


cdef int _cast_scale(double s, str who, str name, float* out) except -1:
    """0 when s == 1.0 (no division at all), else 1 with *out = (float)s."""
    cdef float f = <float> s
    if s == 1.0:
        out[0] = 1.0
        return 0
    if not _math.isfinite(f) or f == 0.0:
        raise ValueError(f"{who}: {name} must be finite and non-zero as a float32, got {s!r}")
    out[0] = f
    return 1


cdef int _cast_check_table(str who, Py_ssize_t buflen, const int64_t[::1] ptrs,
                           const int64_t[::1] offsets, const int64_t[::1] counts,
                           Py_ssize_t lo, Py_ssize_t hi) except -1:
    cdef Py_ssize_t i
    if lo < 0 or lo > hi or hi > offsets.shape[0] or hi > counts.shape[0] or hi > ptrs.shape[0]:
        raise IndexError(f"{who}: table range {lo}:{hi} outside a table of "
                         f"{min(offsets.shape[0], counts.shape[0], ptrs.shape[0])} rows")
    for i in range(lo, hi):
        if counts[i] < 0 or offsets[i] < 0:
            raise ValueError(f"{who}: row {i} has a negative offset or count")
        if offsets[i] + counts[i] > buflen:
            raise ValueError(f"{who}: buffer of {buflen} elements too short for row {i} "
                             f"(offset {offsets[i]} + count {counts[i]})")
        if counts[i] > 0 and ptrs[i] == 0:
            raise ValueError(f"{who}: row {i} has a null tensor address")
    return 0


def cast_to16(int fmt, const float[::1] src, uint16_t[::1] dst, double prescale=1.0):
    """dst[k] = cvt(src[k] / (float)prescale), fmt 1 = fp16, 2 = bf16.

    No division at all when prescale == 1.0. Returns ``(n_overflow, n_underflow)``:
    finite inputs that became +-inf, non-zero finite inputs that became +-0.
    """
    cdef Py_ssize_t n = src.shape[0]
    cdef float p
    cdef int scaled
    cdef int64_t ovf = 0, und = 0
    _cast_check_fmt(fmt, "cast_to16")
    scaled = _cast_scale(prescale, "cast_to16", "prescale", &p)
    if dst.shape[0] < n:
        raise ValueError(f"cast_to16: output of {dst.shape[0]} elements shorter than input of {n}")
    if n > 0:
        with nogil:
            gf_cast_to16(fmt, &src[0], &dst[0], n, scaled, p, &ovf, &und)
    return (ovf, und)


def cast_from16(int fmt, const uint16_t[::1] src, float[::1] dst, double divisor=1.0):
    """dst[k] = to_f32(src[k]) / (float)divisor (no division when divisor == 1.0)."""
    cdef Py_ssize_t n = src.shape[0]
    cdef float d
    cdef int scaled
    _cast_check_fmt(fmt, "cast_from16")
    scaled = _cast_scale(divisor, "cast_from16", "divisor", &d)
    if dst.shape[0] < n:
        raise ValueError(f"cast_from16: output of {dst.shape[0]} elements shorter than input of {n}")
    if n > 0:
        with nogil:
            gf_cast_from16(fmt, &src[0], &dst[0], n, scaled, d)


def cast_f32_to_f16(const float[::1] src, uint16_t[::1] dst):
    """float32 -> fp16 bits, numpy's ``astype(np.float16)`` bits for every input.

    Returns ``(n_overflow, n_underflow)``.
    """
    return cast_to16(1, src, dst, 1.0)


def cast_f16_to_f32(const uint16_t[::1] src, float[::1] dst):
    """fp16 bits -> float32, numpy's ``astype(np.float32)`` bits (NaNs not quieted)."""
    cast_from16(1, src, dst, 1.0)


def cast_f32_to_bf16(const float[::1] src, uint16_t[::1] dst):
    """float32 -> bf16 bits, round to nearest even, NaN -> (u >> 16) | 0x40.

    Returns ``(n_overflow, n_underflow)``.
    """
    return cast_to16(2, src, dst, 1.0)


def cast_bf16_to_f32(const uint16_t[::1] src, float[::1] dst):
    """bf16 bits -> float32 (u << 16, exact)."""
    cast_from16(2, src, dst, 1.0)


def pack_cast(int fmt, uint16_t[::1] buf, const int64_t[::1] src_ptrs, const int64_t[::1] offsets,
              const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi, double prescale):
    """Fused pack + cast of table rows lo..hi-1 (float32 tensors) into ``buf``.

    ``buf[offsets[i] + k] = cvt(src_i[k] / (float)prescale)``, no division when
    prescale == 1.0; fmt 1 = fp16, 2 = bf16. Returns ``(n_overflow, n_underflow)``
    summed over the rows (counted on the inputs src_i[k], see cast_to16).
    """
    cdef Py_ssize_t i
    cdef float p
    cdef int scaled
    cdef int64_t ovf = 0, und = 0
    cdef uint16_t* base
    _cast_check_fmt(fmt, "pack_cast")
    scaled = _cast_scale(prescale, "pack_cast", "prescale", &p)
    _cast_check_table("pack_cast", buf.shape[0], src_ptrs, offsets, counts, lo, hi)
    if buf.shape[0] == 0:
        return (0, 0)
    base = &buf[0]
    with nogil:
        for i in range(lo, hi):
            if counts[i] > 0:
                gf_cast_to16(fmt, <const float*> <uintptr_t> src_ptrs[i], base + offsets[i],
                             counts[i], scaled, p, &ovf, &und)
    return (ovf, und)


def unpack_cast(int fmt, const uint16_t[::1] buf, const int64_t[::1] dst_ptrs, const int64_t[::1] offsets,
                const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi, double divisor):
    """Fused unpack + cast of table rows lo..hi-1 out of ``buf`` into float32 tensors.

    ``dst_i[k] = to_f32(buf[offsets[i] + k]) / (float)divisor``, no division when
    divisor == 1.0; fmt 1 = fp16, 2 = bf16.
    """
    cdef Py_ssize_t i
    cdef float d
    cdef int scaled
    cdef const uint16_t* base
    _cast_check_fmt(fmt, "unpack_cast")
    scaled = _cast_scale(divisor, "unpack_cast", "divisor", &d)
    _cast_check_table("unpack_cast", buf.shape[0], dst_ptrs, offsets, counts, lo, hi)
    if buf.shape[0] == 0:
        return
    base = &buf[0]
    with nogil:
        for i in range(lo, hi):
            if counts[i] > 0:
                gf_cast_from16(fmt, base + offsets[i], <float*> <uintptr_t> dst_ptrs[i],
                               counts[i], scaled, d)


def sum16(int fmt, inbuf, inoutbuf):
    """inout[i] = cvt(to_f32(in[i]) + to_f32(inout[i])): the fp16 / bf16 MPI sum.

    One float32 add rounded once. NaN rule (deterministic, independent of operand
    order): a NaN ``in`` gives ``in`` quieted, else a NaN ``inout`` gives ``inout``
    quieted, else inf + -inf gives 0xfe00 (fp16) / 0xffc0 (bf16). Buffers are any
    buffer-protocol objects (mpi4py passes its own), read as bytes.
    """
    _cast_check_fmt(fmt, "sum16")
    cdef const uint8_t[::1] a = memoryview(inbuf).cast("B")
    cdef uint8_t[::1] b = memoryview(inoutbuf).cast("B")
    cdef Py_ssize_t n = a.shape[0] // 2
    if a.shape[0] % 2:
        raise ValueError(f"sum16: input of {a.shape[0]} bytes is not a whole number of 16-bit elements")
    if b.shape[0] < 2 * n:
        raise ValueError(f"sum16: in/out buffer of {b.shape[0]} bytes shorter than input of {a.shape[0]}")
    if n == 0:
        return
    with nogil:
        gf_sum16(fmt, <const uint16_t*> &a[0], <uint16_t*> &b[0], n)
