# Kernels: finiteness verdicts over a pointer table (gradfuse.compressors.jobs:
# inputs_finite, halves_cannot_fail). Included by _core.pyx; the C is in _finite.h.
# Their numpy twins are the definitions themselves: np.add.reduce(x, dtype=np.float32)
# per tensor, and max |x| (inf when any value is not finite); tests/test_kernels_finite.py.

from libc.stdint cimport uint32_t as _fin_u32

cdef extern from "_finite.h" nogil:
    int64_t gf_fin_first_bad_sum(const int64_t* ptrs, const int64_t* counts, int64_t lo, int64_t hi)
    _fin_u32 gf_fin_absmax_bits(const int64_t* ptrs, const int64_t* counts, int64_t lo, int64_t hi)
    float gf_fin_sum(const float* a, int64_t n)
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


def table_first_bad_sum(const int64_t[::1] ptrs, const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi):
    """The first row of lo..hi-1 (float32 tensors at ``ptrs``, ``counts`` elements each)
    whose float32 sum, numpy's pairwise ``np.add.reduce(x, dtype=np.float32)`` bit for
    bit (at numpy's default buffer size of 8192), is not finite; -1 when every row's sum
    is finite."""
    _fin_check_table("table_first_bad_sum", ptrs, counts, lo, hi)
    cdef int64_t r = -1
    if hi > lo:
        with nogil:
            r = gf_fin_first_bad_sum(&ptrs[0], &counts[0], lo, hi)
    return r


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


def pairwise_sum_f32(const float[::1] x):
    """Tests only: the float32 sum ``table_first_bad_sum`` judges (numpy's
    ``np.add.reduce(x, dtype=np.float32)`` at the default buffer size) of ``x``, as a
    Python float holding the float32 value."""
    cdef float s = 0.0
    cdef Py_ssize_t c = x.shape[0]
    if c > 0:
        with nogil:
            s = gf_fin_sum(&x[0], c)
    return <double> s


def count_masked16(const uint16_t[::1] words, uint16_t mask):
    """The number of 16-bit words w with ``(w & mask) == mask``: with fp16's 0x7C00 or
    bf16's 0x7F80, the inf/NaN values of a summed payload (numpy's
    ``count_nonzero((words & mask) == mask)``)."""
    cdef int64_t n = words.shape[0], r = 0
    if n > 0:
        with nogil:
            r = gf_fin_count_masked16(&words[0], n, mask)
    return r
