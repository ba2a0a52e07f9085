# Kernels: the Adam correction (the moment update in the frozen preconditioner's units,
# fused with 1-bit compression and error feedback; the step after the exchange; plain Adam). Included by _core.pyx. The math is
# in _adam.h and docs/compressors.md ("The Adam correction"); tests/ref_adam.py is its numpy
# twin, cuda/adam.cu the GPU twin.

cdef extern from "_adam.h" nogil:
    ctypedef struct gf_adam_coef:
        float b1, c1, b2, c2, a, b, eps
        double f_new, f_old
    void gf_adam_moment(const int64_t* src, const int64_t* offsets, const int64_t* counts,
                        int64_t lo, int64_t hi, const float* m, const float* r, float b1, float c1, float* x)
    int64_t gf_adam_onebit_compress(const int64_t* ptrs, const int64_t* counts, int64_t lo, int64_t hi,
                                    int64_t n, const float* m, const float* r, float b1, float c1,
                                    const float* e_in, float* e_out, int64_t block,
                                    uint32_t* bits, float* scales)
    void gf_adam_apply(const int64_t* dst, const int64_t* offsets, const int64_t* counts, int64_t lo, int64_t hi,
                       float* m, const uint8_t* mask, float a)
    void gf_adam_plain(const int64_t* dst, const int64_t* offsets, const int64_t* counts, int64_t lo, int64_t hi,
                       float* m, float* v, const gf_adam_coef* k8, double* sums)

import math as _adam_math


cdef float _adam_f32(str who, str name, double value) except? -1.0:
    cdef float f = <float> value
    if not _adam_math.isfinite(f):
        raise ValueError(f"{who}: {name} must be finite as a float32, got {value!r}")
    return f


cdef int _adam_check_state(str who, str name, Py_ssize_t size, Py_ssize_t n) except -1:
    if size != n:
        raise ValueError(f"{who}: {name} has {size} elements and the table {n}")
    return 0


def adam_moment(const int64_t[::1] src_ptrs, const int64_t[::1] offsets, const int64_t[::1] counts,
                Py_ssize_t lo, Py_ssize_t hi, const float[::1] m, const float[::1] r, double b1, double c1,
                float[::1] x):
    """The moment update of table rows lo..hi-1 into ``x``, in the frozen preconditioner's
    units: ``x = b1 * m + (c1 * g) * r`` (float32 ``b1``, ``c1``; ``c1 * g``, times ``r``,
    ``b1 * m``, the sum; no FMA). ``m``, ``r`` and ``x`` are indexed by the bucket positions
    ``offsets[i] + k``; ``x`` may be ``m``."""
    cdef float fb1 = _adam_f32("adam_moment", "b1", b1), fc1 = _adam_f32("adam_moment", "c1", c1)
    cdef Py_ssize_t n = x.shape[0]
    _adam_check_state("adam_moment", "m", m.shape[0], n)
    _adam_check_state("adam_moment", "r", r.shape[0], n)
    _momentum_check_table("adam_moment", "gradient", n, src_ptrs, offsets, counts, lo, hi)
    if hi <= lo or n == 0:
        return
    with nogil:
        gf_adam_moment(&src_ptrs[0], &offsets[0], &counts[0], lo, hi, &m[0], &r[0], fb1, fc1, &x[0])


def adam_onebit_compress(const int64_t[::1] src_ptrs, const int64_t[::1] offsets, const int64_t[::1] counts,
                         Py_ssize_t lo, Py_ssize_t hi, const float[::1] m, const float[::1] r, double b1, double c1,
                         const float[::1] e_in, float[::1] e_out, int block, uint32_t[::1] bits, float[::1] scales):
    """``onebit_compress`` of ``c = (b1 * m + (c1 * g) * r) + e_in`` in one pass: the bits of
    ``adam_moment`` into x followed by ``onebit_compress`` of x (same format, blocks,
    residual). ``m`` and ``r`` are indexed by bucket position; e_in/e_out empty: no error
    feedback. Returns the number of blocks whose scale is not finite."""
    cdef float fb1 = _adam_f32("adam_onebit_compress", "b1", b1)
    cdef float fc1 = _adam_f32("adam_onebit_compress", "c1", c1)
    cdef int64_t n = _q_table_n("adam_onebit_compress", src_ptrs, offsets, counts, lo, hi)
    cdef int64_t nwords, nblocks, ret
    cdef const float* ein = NULL
    cdef float* eout = NULL
    _adam_check_state("adam_onebit_compress", "m", m.shape[0], n)
    _adam_check_state("adam_onebit_compress", "r", r.shape[0], n)
    _q_check_block("adam_onebit_compress", block)
    _q_block_sizes(&counts[0] if counts.shape[0] else NULL, lo, hi, block, 1, &nwords, &nblocks)
    _q_check_residual("adam_onebit_compress", e_in, e_out, n)
    if bits.shape[0] != nwords:
        raise ValueError(f"adam_onebit_compress: bits must have {nwords} words (the sum over the tensors of "
                         f"ceil(n_i/32)), got {bits.shape[0]}")
    if scales.shape[0] != nblocks:
        raise ValueError(f"adam_onebit_compress: scales must have {nblocks} floats (the sum over the tensors "
                         f"of ceil(n_i/block)), got {scales.shape[0]}")
    if n == 0:
        return 0
    if e_in.shape[0] > 0:
        ein = &e_in[0]
        eout = &e_out[0]
    with nogil:
        ret = gf_adam_onebit_compress(&src_ptrs[0], &counts[0], lo, hi, n, &m[0], &r[0], fb1, fc1, ein, eout,
                                      block, &bits[0], &scales[0])
    if ret < 0:
        raise MemoryError("adam_onebit_compress: cannot allocate the staging buffer")
    return ret


def adam_apply(const int64_t[::1] dst_ptrs, const int64_t[::1] offsets, const int64_t[::1] counts,
               Py_ssize_t lo, Py_ssize_t hi, float[::1] m, const uint8_t[::1] mask, double a):
    """After the exchange, over table rows lo..hi-1 of the outputs (they hold the exchanged
    moment ``mb``): ``m = mb`` and the outputs ``a * mb``, or both 0 where ``mask`` is 0
    (``mask`` empty: none). ``m`` and ``mask`` are indexed by bucket position."""
    cdef float fa = _adam_f32("adam_apply", "a", a)
    cdef Py_ssize_t n = m.shape[0]
    cdef const uint8_t* mk = NULL
    if mask.shape[0]:
        _adam_check_state("adam_apply", "mask", mask.shape[0], n)
        mk = &mask[0]
    _momentum_check_table("adam_apply", "output", n, dst_ptrs, offsets, counts, lo, hi)
    if hi <= lo or n == 0:
        return
    with nogil:
        gf_adam_apply(&dst_ptrs[0], &offsets[0], &counts[0], lo, hi, &m[0], mk, fa)


def adam_plain(const int64_t[::1] dst_ptrs, const int64_t[::1] offsets, const int64_t[::1] counts,
               Py_ssize_t lo, Py_ssize_t hi, float[::1] m, float[::1] v, double b1, double c1, double b2,
               double c2, double a, double b, double eps, double f_new=0.0, double f_old=0.0, bint sums=False):
    """Plain Adam over table rows lo..hi-1 of the outputs (they hold the averaged gradient g
    and receive the step): ``m = b1 * m + c1 * g``, ``v = b2 * v + c2 * (g * g)``, outputs
    ``(a * m) / (b * sqrt(v) + eps)``, in place. With ``sums``, returns ``(sum |v_new * f_new -
    v_old * f_old|, sum v_new * f_new)`` in float64 (the freeze rule's relative change of the
    bias-corrected v; not bit-exact across SIMD paths), else None."""
    cdef gf_adam_coef k8
    cdef double acc[2]
    cdef Py_ssize_t n = m.shape[0]
    k8.b1 = _adam_f32("adam_plain", "b1", b1)
    k8.c1 = _adam_f32("adam_plain", "c1", c1)
    k8.b2 = _adam_f32("adam_plain", "b2", b2)
    k8.c2 = _adam_f32("adam_plain", "c2", c2)
    k8.a = _adam_f32("adam_plain", "a", a)
    k8.b = _adam_f32("adam_plain", "b", b)
    k8.eps = _adam_f32("adam_plain", "eps", eps)
    k8.f_new, k8.f_old = f_new, f_old
    acc[0] = acc[1] = 0.0
    _adam_check_state("adam_plain", "v", v.shape[0], n)
    _momentum_check_table("adam_plain", "output", n, dst_ptrs, offsets, counts, lo, hi)
    if hi > lo and n > 0:
        with nogil:
            gf_adam_plain(&dst_ptrs[0], &offsets[0], &counts[0], lo, hi, &m[0], &v[0], &k8,
                          acc if sums else NULL)
    return (acc[0], acc[1]) if sums else None
