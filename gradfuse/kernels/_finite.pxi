# Kernels: finiteness verdicts over a pointer table (gradfuse.step.jobs:
# input_bound, halves_cannot_fail). Included by _core.pyx; the C is in _finite.h.
# Their numpy twins are the definitions themselves: max |x| (inf when any value is not
# finite), and numpy's count of masked 16-bit words; tests/test_kernels_finite.py.

from libc.stdint cimport uint32_t as _fin_u32

cdef extern from "_finite.h" nogil:
    _fin_u32 gf_fin_absmax_bits(const int64_t* ptrs, const int64_t* counts, int64_t lo, int64_t hi)
    int64_t gf_fin_count_masked16(const uint16_t* w, int64_t n, uint16_t mask)


cdef int _fin_check_table(str who, const int64_t[::1] ptrs, const int64_t[::1] counts,
                          Py_ssize_t lo, Py_ssize_t hi) except -1:
    cdef Py_ssize_t i
    if lo < 0 or lo > hi or hi > ptrs.shape[0] or hi > counts.shape[0]:
        raise IndexError(f"{who}: table range {lo}:{hi} outside a table of "
                         f"{min(ptrs.shape[0], counts.shape[0])} rows")
    for i in range(lo, hi):
        if counts[i] < 0:
            raise ValueError(f"{who}: row {i} has a negative count ({counts[i]})")
        if counts[i] > 0 and ptrs[i] == 0:
            raise ValueError(f"{who}: row {i} has a null address")
    return 0


def table_absmax(const int64_t[::1] ptrs, const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi):
    """max(abs(x)) over the float32 tensors of rows lo..hi-1 as a Python float (0.0 when they
    hold no element), or ``inf`` when any value is an inf or a NaN."""
    _fin_check_table("table_absmax", ptrs, counts, lo, hi)
    cdef _fin_u32 b = 0
    cdef float f
    if hi > lo:
        with nogil:
            b = gf_fin_absmax_bits(&ptrs[0], &counts[0], lo, hi)
    if b >= 0x7f800000u:
        return float("inf")
    memcpy(&f, &b, 4)
    return <double> f


def count_masked16(const uint16_t[::1] words, uint16_t mask):
    """The number of 16-bit words w with ``(w & mask) == mask``: with fp16's 0x7C00 or
    bf16's 0x7F80, the inf/NaN values of a summed payload (numpy's
    ``count_nonzero((words & mask) == mask)``)."""
    cdef int64_t n = words.shape[0], r = 0
    if n > 0:
        with nogil:
            r = gf_fin_count_masked16(&words[0], n, mask)
    return r
