"""Wrappers of ``cuda/powersgd.cu``: PowerSGD's Gram-Schmidt, gather and scatter, as
``_core.psgd_orthogonalize``, ``_core.psgd_gather`` and ``_core.psgd_scatter``."""
import numpy as np

from .launch import (_F32, _I64, _arr, _bad_result, _counter, _grid_rows, _host, _launch, _ptr, _upload,
                     kernel)


def _route_rows(who, ptrs, counts, route, lo, hi, nw, nu):
    """Validated device tables (pointers, counts, route) and the largest row count."""
    lo, hi = int(lo), int(hi)
    p, c, r = (_host(t) for t in (ptrs, counts, route))
    if lo < 0 or lo > hi or hi > len(p) or hi > len(c):
        raise IndexError(f"{who}: table range {lo}:{hi} outside a table of {min(len(p), len(c))} rows")
    if len(r) != hi - lo:
        raise ValueError(f"{who}: route has {len(r)} entries for {hi - lo} rows")
    cs, rs, ps = np.asarray(c[lo:hi]), np.asarray(r), np.asarray(p[lo:hi])
    if (cs < 0).any() or ((cs > 0) & (ps == 0)).any():
        raise ValueError(f"{who}: a row has a negative count or elements at a NULL address")
    w, u = rs >= 0, rs < 0
    if (w & (cs > 0)).any() and int((rs[w] + cs[w]).max()) > nw:
        raise ValueError(f"{who}: a row lies outside W of {nw}")
    if (u & (cs > 0)).any() and int((-1 - rs[u] + cs[u]).max()) > nu:
        raise ValueError(f"{who}: a row lies outside U of {nu}")
    return tuple(_upload(t) for t in (ptrs, counts, route)), int(cs.max()) if len(cs) else 0


def psgd_orthogonalize(base, offsets, rows, cols, eps=0.0):
    """Gram-Schmidt in place on each matrix of ``base`` (cupy float32), as
    ``_core.psgd_orthogonalize``: one warp per matrix."""
    who = "psgd_orthogonalize"
    _arr(base, _F32, "base", who)
    o, n, c = (np.asarray(_host(t), _I64) for t in (offsets, rows, cols))
    if not (len(o) == len(n) == len(c)):
        raise ValueError(f"{who}: offsets, rows and cols must have the same length, got {len(o)}, {len(n)}, {len(c)}")
    if not (eps >= 0.0) or eps == float("inf"):
        raise ValueError(f"{who}: eps must be finite and >= 0, got {eps!r}")
    if len(o) and ((o < 0).any() or (n < 0).any() or (c < 0).any() or int((o + n * c).max()) > base.size):
        raise ValueError(f"{who}: a matrix lies outside the buffer of {base.size} floats")
    if len(o) == 0 or base.size == 0:
        return
    d = tuple(_upload(t) for t in (offsets, rows, cols))
    grid = (max(1, min(len(o), 65535)),)
    kernel("gf_psgd_orthogonalize")(grid, (32,), (base,) + d + (_I64(len(o)), np.float64(eps)))


def psgd_gather(src_ptrs, counts, route, lo, hi, e, W, U, count_out=None):
    """Rows lo..hi-1 into W (with the residual e; empty: none) and U, as
    ``_core.psgd_gather``; returns the number of non-finite values (or ``count_out``)."""
    who = "psgd_gather"
    for a, nm in ((e, "e"), (W, "W"), (U, "U")):
        _arr(a, _F32, nm, who)
    if e.size and e.size != W.size:
        raise ValueError(f"{who}: e has {e.size} elements and W {W.size}")
    (p, c, r), mx = _route_rows(who, src_ptrs, counts, route, lo, hi, W.size, U.size)
    bad, owned = _counter(count_out, 1, who)
    if hi > lo and mx > 0:
        _launch("gf_psgd_gather", _grid_rows(hi - lo, mx),
                (p, c, r, _I64(lo), _I64(hi), _ptr(e), _ptr(W), _ptr(U), bad))
    return _bad_result(bad, owned)


def psgd_scatter(dst_ptrs, counts, route, lo, hi, A, W, e_out, U, divisor):
    """The approximation A (and e_out = W - A) and U / divisor into rows lo..hi-1, as
    ``_core.psgd_scatter``."""
    who = "psgd_scatter"
    for a, nm in ((A, "A"), (W, "W"), (e_out, "e_out"), (U, "U")):
        _arr(a, _F32, nm, who)
    d = _F32(divisor)
    if not np.isfinite(d) or d == 0:
        raise ValueError(f"{who}: divisor must be finite and non-zero as a float32, got {divisor!r}")
    if W.size != A.size or (e_out.size and e_out.size != A.size):
        raise ValueError(f"{who}: A, W and e_out must have the same length, got {A.size}, {W.size}, {e_out.size}")
    (p, c, r), mx = _route_rows(who, dst_ptrs, counts, route, lo, hi, A.size, U.size)
    if hi > lo and mx > 0:
        _launch("gf_psgd_scatter", _grid_rows(hi - lo, mx),
                (p, c, r, _I64(lo), _I64(hi), _ptr(A), _ptr(W), _ptr(e_out), _ptr(U), d))
