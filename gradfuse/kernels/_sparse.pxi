# Kernels: top-k and random-k sparsification. Included by _core.pyx.
# Math, layouts and orders: docs/compressors.md ("Sparse compressors"); numpy twin: tests/ref_sparse.py.
from libc.stdint cimport uint32_t, uint64_t

cdef extern from "_sparse.h" nogil:
    int gf_sp_test_mode
    int64_t gf_sp_topk(const int64_t* src, const int64_t* offsets, const int64_t* counts,
                       int64_t lo, int64_t hi, int64_t n,
                       const float* e_in, float* e_out, const int64_t* ks,
                       float* values, uint32_t* indices)
    void gf_sp_randomk_draw(uint64_t seed, const int64_t* counts, const int64_t* ks, int64_t rows,
                            uint32_t* out)
    int64_t gf_sp_gather_table(const int64_t* src, const int64_t* offsets, const int64_t* counts,
                               int64_t lo, int64_t hi, const float* e_in, float* e_out,
                               int64_t k, const uint32_t* indices, float* values)
    void gf_sp_decompress_table(const float* values, const uint32_t* indices, int64_t p, int64_t k,
                                const int64_t* dst, const int64_t* offsets, const int64_t* counts,
                                int64_t lo, int64_t hi, double divisor)
    void gf_sp_decompress_shared(const float* values, int64_t vs, const uint32_t* indices, int64_t p, int64_t k,
                                 const int64_t* dst, const int64_t* offsets, const int64_t* counts,
                                 int64_t lo, int64_t hi, double divisor)
    void gf_sp_decompress_array(const float* values, const uint32_t* indices, int64_t p, int64_t k,
                                float* out, int64_t n, double divisor)

DEF _SP_MAX_N = 0xFFFFFFFF      # indices are uint32 positions inside the bucket


cdef Py_ssize_t _sp_table_n(str name, const int64_t[::1] ptrs, const int64_t[::1] offsets,
                            const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi) except -1:
    """Validate a table (rows lo..hi-1, dense offsets, non-null pointers) and return n."""
    cdef Py_ssize_t i
    cdef int64_t pos = 0
    if lo < 0 or lo > hi or hi > ptrs.shape[0] or hi > offsets.shape[0] or hi > counts.shape[0]:
        raise ValueError(f"{name}: table range {lo}:{hi} outside tables of "
                         f"{ptrs.shape[0]}/{offsets.shape[0]}/{counts.shape[0]} rows")
    for i in range(lo, hi):
        if counts[i] < 0:
            raise ValueError(f"{name}: counts[{i}] = {counts[i]} is negative")
        if offsets[i] != pos:
            raise ValueError(f"{name}: offsets[{i}] = {offsets[i]}, expected {pos} (offsets must be dense)")
        if counts[i] > 0 and ptrs[i] == 0:
            raise ValueError(f"{name}: null pointer in row {i}")
        pos += counts[i]
        if pos > _SP_MAX_N:
            raise ValueError(f"{name}: bucket of more than {_SP_MAX_N} elements "
                             "(indices are uint32 positions inside the bucket)")
    return pos


cdef int _sp_check_common(str name, Py_ssize_t n, Py_ssize_t e_in_len, Py_ssize_t e_out_len,
                          Py_ssize_t k, Py_ssize_t nvalues, Py_ssize_t nindices) except -1:
    if n > _SP_MAX_N:
        raise ValueError(f"{name}: bucket of {n} elements, more than {_SP_MAX_N} "
                         "(indices are uint32 positions inside the bucket)")
    if not (e_in_len == 0 and e_out_len == 0) and not (e_in_len == n and e_out_len == n):
        raise ValueError(f"{name}: e_in/e_out must both be empty or both {n} long, "
                         f"got {e_in_len} and {e_out_len}")
    if nvalues != k:
        raise ValueError(f"{name}: values has {nvalues} elements, expected the sum of ks = {k}")
    if nindices != k:
        raise ValueError(f"{name}: indices has {nindices} elements, expected the sum of ks = {k}")
    return 0


cdef Py_ssize_t _sp_check_ks(str name, const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi,
                             const int64_t[::1] ks) except -1:
    """ks: one k per row lo..hi-1 (ks[i - lo]), 0 <= ks[i - lo] <= counts[i]; returns their sum."""
    cdef Py_ssize_t i
    cdef int64_t total = 0
    if ks.shape[0] != hi - lo:
        raise ValueError(f"{name}: ks has {ks.shape[0]} entries, expected one per table row "
                         f"{lo}..{hi - 1} ({hi - lo})")
    for i in range(lo, hi):
        if ks[i - lo] < 0 or ks[i - lo] > counts[i]:
            raise ValueError(f"{name}: ks[{i - lo}] = {ks[i - lo]} outside 0..{counts[i]} "
                             f"(the element count of row {i})")
        total += ks[i - lo]
    return total


cdef inline const float* _sp_fptr(const float[::1] a) noexcept:
    return &a[0] if a.shape[0] > 0 else NULL


cdef inline float* _sp_wfptr(float[::1] a) noexcept:
    return &a[0] if a.shape[0] > 0 else NULL


cdef inline uint32_t* _sp_uptr(uint32_t[::1] a) noexcept:
    return &a[0] if a.shape[0] > 0 else NULL


cdef int64_t _sp_dummy_i64 = 0


def topk_compress(const int64_t[::1] src_ptrs, const int64_t[::1] offsets, const int64_t[::1] counts,
                  Py_ssize_t lo, Py_ssize_t hi, const float[::1] e_in, float[::1] e_out,
                  const int64_t[::1] ks, float[::1] values, uint32_t[::1] indices):
    """Top-k with error feedback, per tensor, over table rows lo..hi-1 (one bucket of n elements).

    c = g + e_in (c = g when e_in/e_out are empty). Row i selects its own ks[i - lo]
    elements: the positions of its largest ``|c|`` (as ``bits(c) & 0x7fffffff``), ties to the
    lower position. indices <- those bucket positions, row after row (so ascending);
    values[m] <- c[indices[m]]; e_out <- c with e_out[indices] = 0. e_out may be e_in;
    e_in is never written otherwise. Returns the number of non-finite c values.
    """
    cdef Py_ssize_t n = _sp_table_n("topk_compress", src_ptrs, offsets, counts, lo, hi)
    cdef Py_ssize_t k = _sp_check_ks("topk_compress", counts, lo, hi, ks)
    cdef int64_t rc
    _sp_check_common("topk_compress", n, e_in.shape[0], e_out.shape[0], k,
                     values.shape[0], indices.shape[0])
    cdef const int64_t* sp = &src_ptrs[0] if src_ptrs.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* op = &offsets[0] if offsets.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* cp = &counts[0] if counts.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* kp = &ks[0] if ks.shape[0] > 0 else &_sp_dummy_i64
    cdef const float* ei = _sp_fptr(e_in)
    cdef float* eo = _sp_wfptr(e_out)
    cdef float* vp = _sp_wfptr(values)
    cdef uint32_t* ip = _sp_uptr(indices)
    with nogil:
        rc = gf_sp_topk(sp, op, cp, lo, hi, n, ei, eo, kp, vp, ip)
    if rc < 0:
        raise MemoryError("topk_compress: out of memory for the selection scratch")
    return rc


def topk_compress_array(const float[::1] x, const float[::1] e_in, float[::1] e_out,
                        Py_ssize_t k, float[::1] values, uint32_t[::1] indices):
    """topk_compress of one contiguous float32 array (a 1-row table, k elements)."""
    if k < 0 or k > x.shape[0]:
        raise ValueError(f"topk_compress_array: k = {k} outside 0..{x.shape[0]}")
    cdef int64_t[::1] tab = _sp_one_row(x, k)
    cdef Py_ssize_t rows = 1 if x.shape[0] > 0 else 0
    return topk_compress(tab[0:1], tab[1:2], tab[2:3], 0, rows, e_in, e_out, tab[3:3 + rows],
                         values, indices)


cdef int64_t[::1] _sp_one_row(const float[::1] x, Py_ssize_t k):
    import numpy as _np
    t = _np.zeros(4, dtype=_np.int64)
    cdef int64_t[::1] tab = t
    tab[0] = <int64_t> <uintptr_t> &x[0] if x.shape[0] > 0 else 0
    tab[1] = 0
    tab[2] = x.shape[0]
    tab[3] = k
    return tab


def randomk_indices(uint64_t seed, const int64_t[::1] counts, const int64_t[::1] ks, uint32_t[::1] out):
    """out <- the random-k positions of a bucket of tensors with element counts ``counts``
    (dense, in order), ks[t] of tensor t, as bucket positions, tensor after tensor
    (ascending).

    The t-th non-empty tensor (t = 0, 1, ...; empty ones are not counted) draws from
    s_t = splitmix64_mix(seed + (t + 1) * 0x9e3779b97f4a7c15): stratum
    m of its n elements is [floor(m n / k), floor((m + 1) n / k)), and its position is
    start + ((h * length) >> 32), h = splitmix64_mix(s_t + (m + 1) * 0x9e3779b97f4a7c15) >> 32.
    """
    cdef Py_ssize_t t, rows = counts.shape[0]
    cdef int64_t n = 0, total = 0
    if ks.shape[0] != rows:
        raise ValueError(f"randomk_indices: ks has {ks.shape[0]} entries, counts {rows}")
    for t in range(rows):
        if counts[t] < 0:
            raise ValueError(f"randomk_indices: counts[{t}] = {counts[t]} is negative")
        if ks[t] < 0 or ks[t] > counts[t]:
            raise ValueError(f"randomk_indices: ks[{t}] = {ks[t]} outside 0..{counts[t]}")
        n += counts[t]
        total += ks[t]
    if n > _SP_MAX_N:
        raise ValueError(f"randomk_indices: bucket of {n} elements, more than {_SP_MAX_N} "
                         "(indices are uint32 positions inside the bucket)")
    if out.shape[0] != total:
        raise ValueError(f"randomk_indices: out has {out.shape[0]} elements, expected the sum of ks = {total}")
    if total == 0:
        return
    with nogil:
        gf_sp_randomk_draw(seed, &counts[0], &ks[0], rows, &out[0])


def randomk_compress(const int64_t[::1] src_ptrs, const int64_t[::1] offsets, const int64_t[::1] counts,
                     Py_ssize_t lo, Py_ssize_t hi, const float[::1] e_in, float[::1] e_out,
                     uint64_t seed, const int64_t[::1] ks, float[::1] values, uint32_t[::1] indices):
    """Random-k with error feedback, per tensor, over table rows lo..hi-1.

    indices <- randomk_indices(seed, counts[lo:hi], ks) (row i is tensor i - lo); c = g + e_in;
    values[m] <- c[indices[m]]; e_out <- c with e_out[indices] = 0. Returns the number of
    non-finite c values.
    """
    cdef Py_ssize_t n = _sp_table_n("randomk_compress", src_ptrs, offsets, counts, lo, hi)
    cdef Py_ssize_t k = _sp_check_ks("randomk_compress", counts, lo, hi, ks)
    cdef int64_t rc = 0
    _sp_check_common("randomk_compress", n, e_in.shape[0], e_out.shape[0], k,
                     values.shape[0], indices.shape[0])
    cdef const int64_t* sp = &src_ptrs[0] if src_ptrs.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* op = &offsets[0] if offsets.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* cp = &counts[0] if counts.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* kp = &ks[0] if ks.shape[0] > 0 else &_sp_dummy_i64
    cdef const float* ei = _sp_fptr(e_in)
    cdef float* eo = _sp_wfptr(e_out)
    cdef float* vp = _sp_wfptr(values)
    cdef uint32_t* ip = _sp_uptr(indices)
    with nogil:
        if k > 0:
            gf_sp_randomk_draw(seed, cp + lo, kp, hi - lo, ip)
        rc = gf_sp_gather_table(sp, op, cp, lo, hi, ei, eo, k, ip, vp)
    return rc


def randomk_compress_array(const float[::1] x, const float[::1] e_in, float[::1] e_out,
                           uint64_t seed, Py_ssize_t k, float[::1] values, uint32_t[::1] indices):
    """randomk_compress of one contiguous float32 array (a 1-row table, tensor 0, k elements)."""
    if k < 0 or k > x.shape[0]:
        raise ValueError(f"randomk_compress_array: k = {k} outside 0..{x.shape[0]}")
    cdef int64_t[::1] tab = _sp_one_row(x, k)
    cdef Py_ssize_t rows = 1 if x.shape[0] > 0 else 0
    return randomk_compress(tab[0:1], tab[1:2], tab[2:3], 0, rows, e_in, e_out, seed, tab[3:3 + rows],
                            values, indices)


cdef int _sp_check_payloads(str name, const float[:, ::1] values, const uint32_t[:, ::1] indices,
                            Py_ssize_t n) except -1:
    cdef Py_ssize_t p = indices.shape[0], k = indices.shape[1], r, m
    cdef uint32_t bad = 0
    cdef Py_ssize_t bad_r = -1, bad_m = -1
    if values.shape[0] != p or values.shape[1] != k:
        raise ValueError(f"{name}: values shape ({values.shape[0]}, {values.shape[1]}) "
                         f"!= indices shape ({p}, {k})")
    if n > _SP_MAX_N:
        raise ValueError(f"{name}: bucket of {n} elements, more than {_SP_MAX_N}")
    with nogil:
        for r in range(p):
            for m in range(k):
                if indices[r, m] >= n:
                    bad = indices[r, m]
                    bad_r = r
                    bad_m = m
                    break
            if bad_r >= 0:
                break
    if bad_r >= 0:
        raise ValueError(f"{name}: index {bad} at indices[{bad_r}, {bad_m}] is out of range "
                         f"for a bucket of {n} elements")
    return 0


def sparse_decompress_sum(const float[:, ::1] values, const uint32_t[:, ::1] indices,
                          const int64_t[::1] dst_ptrs, const int64_t[::1] offsets,
                          const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi, double divisor):
    """Sum p sparse payloads (row r = rank r) into the table's tensors, then divide.

    For every bucket element j: 0.0f, plus values[r, m] for each (r, m) with
    indices[r, m] == j in the order r = 0..p-1, m = 0..k-1 (float32 adds), then
    / (float)divisor unless divisor == 1.0. Every destination element is written.
    """
    cdef Py_ssize_t n = _sp_table_n("sparse_decompress_sum", dst_ptrs, offsets, counts, lo, hi)
    _sp_check_payloads("sparse_decompress_sum", values, indices, n)
    cdef Py_ssize_t p = indices.shape[0], k = indices.shape[1]
    cdef const float* vp = &values[0, 0] if p > 0 and k > 0 else NULL
    cdef const uint32_t* ip = &indices[0, 0] if p > 0 and k > 0 else NULL
    cdef const int64_t* dp = &dst_ptrs[0] if dst_ptrs.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* op = &offsets[0] if offsets.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* cp = &counts[0] if counts.shape[0] > 0 else &_sp_dummy_i64
    if k == 0:
        p = 0
    with nogil:
        gf_sp_decompress_table(vp, ip, p, k, dp, op, cp, lo, hi, divisor)


def sparse_decompress_shared(const float[:, :] values, const uint32_t[::1] indices,
                             const int64_t[::1] dst_ptrs, const int64_t[::1] offsets,
                             const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi, double divisor):
    """``sparse_decompress_sum`` when every row shares the positions ``indices`` (k strictly
    ascending bucket positions: random-k's draw): the same bits as passing that row p
    times, without the p copies and their comparison. ``values``: p rows of k float32,
    each contiguous, the rows at any distance (the rows of the receive buffer as they
    lie). Every destination element is written: 0.0f / divisor, and at ``indices[m]``
    ``((0.0f + values[0, m]) + values[1, m]) + ...``, / divisor.
    """
    cdef Py_ssize_t n = _sp_table_n("sparse_decompress_shared", dst_ptrs, offsets, counts, lo, hi)
    cdef Py_ssize_t p = values.shape[0], k = indices.shape[0], m
    cdef Py_ssize_t bad_m = -1
    cdef int64_t vs = k
    if values.shape[1] != k:
        raise ValueError(f"sparse_decompress_shared: values have {values.shape[1]} columns, indices {k}")
    if p > 0 and k > 0:
        if values.strides[1] != sizeof(float) or values.strides[0] % sizeof(float) != 0 or values.strides[0] < 0:
            raise ValueError("sparse_decompress_shared: each row of values must be contiguous float32")
        vs = values.strides[0] // sizeof(float)
    cdef const uint32_t* ip = &indices[0] if k > 0 else NULL
    with nogil:
        for m in range(k):
            if ip[m] >= n or (m > 0 and ip[m] <= ip[m - 1]):
                bad_m = m
                break
    if bad_m >= 0:
        raise ValueError(f"sparse_decompress_shared: indices[{bad_m}] = {indices[bad_m]} is not strictly "
                         f"ascending inside a bucket of {n} elements")
    cdef const float* vp = &values[0, 0] if p > 0 and k > 0 else NULL
    cdef const int64_t* dp = &dst_ptrs[0] if dst_ptrs.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* op = &offsets[0] if offsets.shape[0] > 0 else &_sp_dummy_i64
    cdef const int64_t* cp = &counts[0] if counts.shape[0] > 0 else &_sp_dummy_i64
    if k == 0:
        p = 0
    with nogil:
        gf_sp_decompress_shared(vp, vs, ip, p, k, dp, op, cp, lo, hi, divisor)


def sparse_decompress_sum_array(const float[:, ::1] values, const uint32_t[:, ::1] indices,
                                float[::1] out, double divisor):
    """sparse_decompress_sum into one contiguous float32 array of n = len(out) elements."""
    cdef Py_ssize_t n = out.shape[0]
    _sp_check_payloads("sparse_decompress_sum_array", values, indices, n)
    cdef Py_ssize_t p = indices.shape[0], k = indices.shape[1]
    cdef const float* vp = &values[0, 0] if p > 0 and k > 0 else NULL
    cdef const uint32_t* ip = &indices[0, 0] if p > 0 and k > 0 else NULL
    if k == 0:
        p = 0
    if n == 0:
        return
    with nogil:
        gf_sp_decompress_array(vp, ip, p, k, &out[0], n, divisor)


def _sparse_select_mode(int mode):
    """Tests only: 0 automatic; 1 forces the large-tensor select's scratch-free path (every
    level a pass over the source, as large ties, e.g. an all-zero tensor, take) for every
    tensor; 2 the large-tensor select with its candidate buffers for every tensor (no
    small-tensor path); 3 the small-tensor select for every tensor that fits it (at most
    4096 elements)."""
    global gf_sp_test_mode
    if mode not in (0, 1, 2, 3):
        raise ValueError(f"_sparse_select_mode: mode {mode} not in 0, 1, 2, 3")
    gf_sp_test_mode = mode
