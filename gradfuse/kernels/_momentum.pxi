# Kernels: DGC's momentum correction (velocity update, momentum factor masking). Included
# by _core.pyx. The math is in _momentum.h and docs/compressors.md ("Momentum
# correction"); tests/ref_momentum.py is its numpy twin, cuda/momentum.cu the GPU twin.

cdef extern from "_momentum.h" nogil:
    void gf_momentum_update(const int64_t* src, const int64_t* offsets, const int64_t* counts,
                            int64_t lo, int64_t hi, const float* u_in, float* u_out, float m,
                            const int64_t* out, float nesterov)
    int64_t gf_momentum_mask(const float* e_in, const float* x, const float* e_out, float* u, int64_t n)

import math as _momentum_math


cdef int _momentum_check_table(str who, str name, Py_ssize_t n, const int64_t[::1] ptrs,
                               const int64_t[::1] offsets, const int64_t[::1] counts,
                               Py_ssize_t lo, Py_ssize_t hi) except -1:
    cdef Py_ssize_t i
    if lo < 0 or lo > hi or hi > offsets.shape[0] or hi > counts.shape[0] or hi > ptrs.shape[0]:
        raise IndexError(f"{who}: table range {lo}:{hi} outside a {name} table of "
                         f"{min(offsets.shape[0], counts.shape[0], ptrs.shape[0])} rows")
    for i in range(lo, hi):
        if counts[i] < 0 or offsets[i] < 0:
            raise ValueError(f"{who}: row {i} has a negative offset or count")
        if offsets[i] + counts[i] > n:
            raise ValueError(f"{who}: velocity of {n} elements too short for row {i} "
                             f"(offset {offsets[i]} + count {counts[i]})")
        if counts[i] > 0 and ptrs[i] == 0:
            raise ValueError(f"{who}: row {i} of the {name} table has a null address")
    return 0


def momentum_update(const int64_t[::1] src_ptrs, const int64_t[::1] offsets, const int64_t[::1] counts,
                    Py_ssize_t lo, Py_ssize_t hi, const float[::1] u_in, float[::1] u_out,
                    double momentum, const int64_t[::1] out_ptrs, double nesterov):
    """The velocity update of table rows lo..hi-1: ``u_out = m * u_in + g`` (float32,
    ``m = (float)momentum``, no FMA), ``g`` read through ``src_ptrs``; ``u_in``/``u_out``
    are indexed by the bucket positions ``offsets[i] + k`` and may be the same array.

    ``out_ptrs`` (same rows, offsets and counts; empty: none) receives ``u_out`` or, when
    ``nesterov`` (a momentum, float32) is not 0, ``nesterov * u_out + g``; it may point at
    the gradients themselves.
    """
    cdef float m = <float> momentum
    cdef float q = <float> nesterov
    cdef Py_ssize_t n = u_out.shape[0]
    cdef const int64_t* op = NULL
    if not _momentum_math.isfinite(m) or not _momentum_math.isfinite(q):
        raise ValueError(f"momentum_update: momentum and nesterov must be finite as float32, got "
                         f"{momentum!r}, {nesterov!r}")
    if u_in.shape[0] != n:
        raise ValueError(f"momentum_update: u_in has {u_in.shape[0]} elements and u_out {n}")
    _momentum_check_table("momentum_update", "gradient", n, src_ptrs, offsets, counts, lo, hi)
    if out_ptrs.shape[0] > 0:
        _momentum_check_table("momentum_update", "output", n, out_ptrs, offsets, counts, lo, hi)
        op = &out_ptrs[0]
    if hi <= lo or n == 0:
        return
    with nogil:
        gf_momentum_update(&src_ptrs[0], &offsets[0], &counts[0], lo, hi, &u_in[0], &u_out[0], m, op, q)


def momentum_mask(const float[::1] e_in, const float[::1] x, const float[::1] e_out, float[::1] u):
    """Momentum factor masking: ``u[j] = 0`` where ``e_out[j] == 0`` and
    ``e_in[j] + x[j] != 0`` (the compressor sent element j's non-zero value). ``x`` is what
    the compressor read (``u`` itself, or the Nesterov values) and may be ``u``. Returns
    the number of elements masked."""
    cdef Py_ssize_t n = u.shape[0]
    cdef int64_t masked
    if e_in.shape[0] != n or x.shape[0] != n or e_out.shape[0] != n:
        raise ValueError(f"momentum_mask: e_in, x, e_out and u must have the same length, got "
                         f"{e_in.shape[0]}, {x.shape[0]}, {e_out.shape[0]}, {n}")
    if n == 0:
        return 0
    with nogil:
        masked = gf_momentum_mask(&e_in[0], &x[0], &e_out[0], &u[0], n)
    return masked
