# Kernels: PowerSGD (Gram-Schmidt over a bucket's matrices, the gather with the residual,
# the scatter with the new residual). Included by _core.pyx. The math is in _powersgd.h
# and docs/compressors.md ("PowerSGD"); tests/ref_powersgd.py is its numpy twin,
# cuda/powersgd.cu the GPU twin.

cdef extern from "_powersgd.h" nogil:
    void gf_psgd_orthogonalize(float* base, const int64_t* offsets, const int64_t* rows, const int64_t* cols,
                               int64_t count, double eps)
    int64_t gf_psgd_gather(const int64_t* src, const int64_t* counts, const int64_t* route, int64_t lo,
                           int64_t hi, const float* e, float* W, float* U)
    void gf_psgd_scatter(const int64_t* dst, const int64_t* counts, const int64_t* route, int64_t lo,
                         int64_t hi, const float* A, const float* W, float* e_out, const float* U, float divisor)


def psgd_orthogonalize(float[::1] base, const int64_t[::1] offsets, const int64_t[::1] rows,
                       const int64_t[::1] cols, double eps=0.0):
    """Gram-Schmidt, in place, on each matrix ``b`` of ``base``: ``rows[b]`` x ``cols[b]``
    float32, row-major at ``offsets[b]``; the columns become orthonormal, in order. A zero
    column stays zero; ``eps`` is added to every column's norm (torch's
    ``orthogonalization_epsilon``). The sums are in double, in the GPU warp's order
    (``_powersgd.h``)."""
    cdef Py_ssize_t count = offsets.shape[0], b
    cdef Py_ssize_t size = base.shape[0]
    if rows.shape[0] != count or cols.shape[0] != count:
        raise ValueError(f"psgd_orthogonalize: offsets, rows and cols must have the same length, got "
                         f"{count}, {rows.shape[0]}, {cols.shape[0]}")
    if not (eps >= 0.0) or eps == float("inf"):
        raise ValueError(f"psgd_orthogonalize: eps must be finite and >= 0, got {eps!r}")
    for b in range(count):
        if offsets[b] < 0 or rows[b] < 0 or cols[b] < 0 or offsets[b] + rows[b] * cols[b] > size:
            raise ValueError(f"psgd_orthogonalize: matrix {b} ({rows[b]} x {cols[b]} at {offsets[b]}) lies "
                             f"outside the buffer of {size} floats")
    if count == 0 or size == 0:
        return
    with nogil:
        gf_psgd_orthogonalize(&base[0], &offsets[0], &rows[0], &cols[0], count, eps)


cdef int _psgd_check(str who, const int64_t[::1] ptrs, const int64_t[::1] counts, const int64_t[::1] route,
                     Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t nw, Py_ssize_t nu) except -1:
    cdef Py_ssize_t i, to
    if lo < 0 or lo > hi or hi > ptrs.shape[0] or hi > counts.shape[0]:
        raise IndexError(f"{who}: table range {lo}:{hi} outside a table of "
                         f"{min(ptrs.shape[0], counts.shape[0])} rows")
    if route.shape[0] != hi - lo:
        raise ValueError(f"{who}: route has {route.shape[0]} entries for {hi - lo} rows")
    for i in range(lo, hi):
        if counts[i] < 0:
            raise ValueError(f"{who}: row {i} has a negative count")
        if counts[i] == 0:
            continue
        if ptrs[i] == 0:
            raise ValueError(f"{who}: row {i} has a null address")
        to = route[i - lo]
        if to >= 0 and to + counts[i] > nw:
            raise ValueError(f"{who}: row {i} ({counts[i]} floats at W[{to}]) lies outside W of {nw}")
        if to < 0 and -1 - to + counts[i] > nu:
            raise ValueError(f"{who}: row {i} ({counts[i]} floats at U[{-1 - to}]) lies outside U of {nu}")
    return 0


def psgd_gather(const int64_t[::1] src_ptrs, const int64_t[::1] counts, const int64_t[::1] route,
                Py_ssize_t lo, Py_ssize_t hi, const float[::1] e, float[::1] W, float[::1] U):
    """Rows lo..hi-1 of a float32 table into the matrices ``W`` (``route[i - lo] >= 0``: at
    that offset, plus the residual ``e`` at the same offsets; ``e`` empty: none) and the
    uncompressed values ``U`` (``route < 0``: at ``-1 - route``). Returns the number of
    non-finite values written."""
    cdef int64_t bad = 0
    cdef const float* ep = NULL
    cdef float* wp = NULL
    cdef float* up = NULL
    _psgd_check("psgd_gather", src_ptrs, counts, route, lo, hi, W.shape[0], U.shape[0])
    if e.shape[0]:
        if e.shape[0] != W.shape[0]:
            raise ValueError(f"psgd_gather: e has {e.shape[0]} elements and W {W.shape[0]}")
        ep = &e[0]
    if W.shape[0]:
        wp = &W[0]
    if U.shape[0]:
        up = &U[0]
    if hi <= lo:
        return 0
    with nogil:
        bad = gf_psgd_gather(&src_ptrs[0], &counts[0], &route[0], lo, hi, ep, wp, up)
    return bad


def psgd_scatter(const int64_t[::1] dst_ptrs, const int64_t[::1] counts, const int64_t[::1] route,
                 Py_ssize_t lo, Py_ssize_t hi, const float[::1] A, const float[::1] W, float[::1] e_out,
                 const float[::1] U, double divisor):
    """The step's results into rows lo..hi-1: ``route >= 0`` rows get the approximation
    ``A`` (and ``e_out = W - A`` at the same offsets; ``e_out`` empty: none), ``route < 0``
    rows ``U / divisor`` (float32)."""
    cdef float d = <float> divisor
    cdef float* eo = NULL
    cdef const float* ap = NULL
    cdef const float* wp = NULL
    cdef const float* up = NULL
    if not (d == d) or d == 0 or d == float("inf"):
        raise ValueError(f"psgd_scatter: divisor must be finite and non-zero as a float32, got {divisor!r}")
    _psgd_check("psgd_scatter", dst_ptrs, counts, route, lo, hi, A.shape[0], U.shape[0])
    if W.shape[0] != A.shape[0]:
        raise ValueError(f"psgd_scatter: A has {A.shape[0]} elements and W {W.shape[0]}")
    if e_out.shape[0]:
        if e_out.shape[0] != A.shape[0]:
            raise ValueError(f"psgd_scatter: e_out has {e_out.shape[0]} elements and A {A.shape[0]}")
        eo = &e_out[0]
    if A.shape[0]:
        ap, wp = &A[0], &W[0]
    if U.shape[0]:
        up = &U[0]
    if hi <= lo:
        return
    with nogil:
        gf_psgd_scatter(&dst_ptrs[0], &counts[0], &route[0], lo, hi, ap, wp, eo, up, d)


cdef extern from "_psgd_mm.h" nogil:
    int GF_PSGD_MM_MAX_RANK
    int gf_psgd_products(int kind, const int64_t* mats, int64_t count, const float* W, float* P, float* Q,
                         float* A)
    int gf_psgd_scatter_approx(const int64_t* dst, const int64_t* counts, const int64_t* route,
                               const int64_t* mrow, int64_t lo, int64_t hi, const int64_t* mats,
                               const float* P, const float* Q, const float* W, float* e_out, const float* U,
                               float divisor)

PSGD_PRODUCTS_MAX_RANK = GF_PSGD_MM_MAX_RANK
_PSGD_KINDS = {"P": 0, "Q": 1, "A": 2}


def psgd_products(str kind, const int64_t[::1] mats, const float[::1] W, float[::1] P, float[::1] Q,
                  float[::1] A):
    """PowerSGD's products for every matrix of ``mats`` (6 int64 per matrix: ``w, n, m, r,
    p, q``; M = ``W[w:]`` n x m, P = ``P[p:]`` n x r, Q = ``Q[q:]`` m x r, all row-major),
    without BLAS, on this thread: ``kind`` ``"P"``: P = M Q, ``"Q"``: Q = M^T P, ``"A"``:
    ``A[w:]`` = P Q^T. Ranks 1 to ``PSGD_PRODUCTS_MAX_RANK``; float32 sums in a fixed order
    (``_psgd_mm.h``)."""
    cdef int k
    cdef Py_ssize_t b, count, w, n, m, r, po, qo
    cdef int rc
    cdef float* ap = NULL
    if kind not in _PSGD_KINDS:
        raise ValueError(f"psgd_products: kind must be 'P', 'Q' or 'A', got {kind!r}")
    k = _PSGD_KINDS[kind]
    if mats.shape[0] % 6:
        raise ValueError(f"psgd_products: mats must hold 6 int64 per matrix, got {mats.shape[0]}")
    count = mats.shape[0] // 6
    for b in range(count):
        w, n, m, r, po, qo = mats[6 * b], mats[6 * b + 1], mats[6 * b + 2], mats[6 * b + 3], mats[6 * b + 4], \
            mats[6 * b + 5]
        if n < 0 or m < 0 or r < 1 or r > GF_PSGD_MM_MAX_RANK:
            raise ValueError(f"psgd_products: matrix {b} is {n} x {m} at rank {r}; the kernels take "
                             f"ranks 1 to {GF_PSGD_MM_MAX_RANK}")
        if w < 0 or w + n * m > W.shape[0]:
            raise ValueError(f"psgd_products: matrix {b} ({n} x {m} at {w}) lies outside W of {W.shape[0]} floats")
        if k == 2 and w + n * m > A.shape[0]:
            raise ValueError(f"psgd_products: matrix {b}'s approximation ({n} x {m} at {w}) lies outside A of "
                             f"{A.shape[0]} floats")
        if po < 0 or po + n * r > P.shape[0]:
            raise ValueError(f"psgd_products: matrix {b}'s P ({n} x {r} at {po}) lies outside P of "
                             f"{P.shape[0]} floats")
        if qo < 0 or qo + m * r > Q.shape[0]:
            raise ValueError(f"psgd_products: matrix {b}'s Q ({m} x {r} at {qo}) lies outside Q of "
                             f"{Q.shape[0]} floats")
    if count == 0 or W.shape[0] == 0 or P.shape[0] == 0 or Q.shape[0] == 0 or (k == 2 and A.shape[0] == 0):
        return
    if k == 2:
        ap = &A[0]
    with nogil:
        rc = gf_psgd_products(k, &mats[0], count, &W[0], &P[0], &Q[0], ap)
    if rc:
        raise MemoryError("psgd_products: no memory for the products' scratch (r m floats)")


def psgd_scatter_approx(const int64_t[::1] dst_ptrs, const int64_t[::1] counts, const int64_t[::1] route,
                        const int64_t[::1] mrow, Py_ssize_t lo, Py_ssize_t hi, const int64_t[::1] mats,
                        const float[::1] P, const float[::1] Q, const float[::1] W, float[::1] e_out,
                        const float[::1] U, double divisor):
    """``psgd_products("A", ...)`` then ``psgd_scatter`` in one pass, the same bits without
    the approximation array: a row with ``route >= 0`` is matrix ``mrow[i - lo]`` of
    ``mats`` (6 int64 per matrix, as ``psgd_products``) and receives P Q^T (and ``e_out =
    W - P Q^T`` at its W offset; ``e_out`` empty: none); ``route < 0`` rows ``U / divisor``
    (float32). Ranks 1 to ``PSGD_PRODUCTS_MAX_RANK``."""
    cdef float d = <float> divisor
    cdef float* eo = NULL
    cdef const float* up = NULL
    cdef Py_ssize_t i, j, count
    cdef int rc
    if not (d == d) or d == 0 or d == float("inf"):
        raise ValueError(f"psgd_scatter_approx: divisor must be finite and non-zero as a float32, got {divisor!r}")
    _psgd_check("psgd_scatter_approx", dst_ptrs, counts, route, lo, hi, W.shape[0], U.shape[0])
    if mrow.shape[0] != hi - lo:
        raise ValueError(f"psgd_scatter_approx: mrow has {mrow.shape[0]} entries for {hi - lo} rows")
    if mats.shape[0] % 6:
        raise ValueError(f"psgd_scatter_approx: mats must hold 6 int64 per matrix, got {mats.shape[0]}")
    count = mats.shape[0] // 6
    for i in range(lo, hi):
        if route[i - lo] < 0 or counts[i] == 0:
            continue
        j = mrow[i - lo]
        if j < 0 or j >= count:
            raise ValueError(f"psgd_scatter_approx: row {i} names matrix {j} of {count}")
        if mats[6 * j] != route[i - lo] or mats[6 * j + 1] * mats[6 * j + 2] != counts[i]:
            raise ValueError(f"psgd_scatter_approx: row {i} ({counts[i]} floats at W[{route[i - lo]}]) is not "
                             f"matrix {j} ({mats[6 * j + 1]} x {mats[6 * j + 2]} at W[{mats[6 * j]}])")
        if mats[6 * j + 3] < 1 or mats[6 * j + 3] > GF_PSGD_MM_MAX_RANK:
            raise ValueError(f"psgd_scatter_approx: matrix {j} has rank {mats[6 * j + 3]}; the kernels take ranks "
                             f"1 to {GF_PSGD_MM_MAX_RANK}")
        if mats[6 * j + 4] < 0 or mats[6 * j + 4] + mats[6 * j + 1] * mats[6 * j + 3] > P.shape[0]:
            raise ValueError(f"psgd_scatter_approx: matrix {j}'s P lies outside P of {P.shape[0]} floats")
        if mats[6 * j + 5] < 0 or mats[6 * j + 5] + mats[6 * j + 2] * mats[6 * j + 3] > Q.shape[0]:
            raise ValueError(f"psgd_scatter_approx: matrix {j}'s Q lies outside Q of {Q.shape[0]} floats")
    if e_out.shape[0]:
        if e_out.shape[0] != W.shape[0]:
            raise ValueError(f"psgd_scatter_approx: e_out has {e_out.shape[0]} elements and W {W.shape[0]}")
        eo = &e_out[0]
    if U.shape[0]:
        up = &U[0]
    if hi <= lo:
        return
    cdef const float* pp = &P[0] if P.shape[0] else NULL
    cdef const float* qp = &Q[0] if Q.shape[0] else NULL
    cdef const float* wp = &W[0] if W.shape[0] else NULL
    cdef const int64_t* mp = &mats[0] if mats.shape[0] else NULL
    with nogil:
        rc = gf_psgd_scatter_approx(&dst_ptrs[0], &counts[0], &route[0], &mrow[0], lo, hi, mp, pp, qp, wp, eo, up, d)
    if rc:
        raise MemoryError("psgd_scatter_approx: no memory for the scratch (r m floats)")
