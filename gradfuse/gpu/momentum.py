"""Wrappers of ``cuda/momentum.cu``: DGC's velocity update and momentum factor masking,
as ``_core.momentum_update`` and ``_core.momentum_mask``."""
import numpy as np

from .launch import _F32, _I64, _arr, _grid_flat, _grid_rows, _launch, _table


def momentum_update(src_ptrs, offsets, counts, lo, hi, u_in, u_out, momentum, out_ptrs, nesterov):
    """``u_out = m * u_in + g`` over table rows lo..hi-1 (``out_ptrs``: rows that receive
    ``u_out``, or when ``nesterov`` (a momentum) is not 0 ``nesterov * u_out + g``; empty:
    none), as
    ``_core.momentum_update``. Arrays are cupy float32 on the current device."""
    who = "momentum_update"
    m, q = _F32(momentum), _F32(nesterov)
    if not (np.isfinite(m) and np.isfinite(q)):
        raise ValueError(f"{who}: momentum and nesterov must be finite as float32, got {momentum!r}, "
                         f"{nesterov!r}")
    _arr(u_out, _F32, "u_out", who)
    _arr(u_in, _F32, "u_in", who)
    n = u_out.size
    if u_in.size != n:
        raise ValueError(f"{who}: u_in has {u_in.size} elements and u_out {n}")
    (p, o, c), _, mx = _table(who, src_ptrs, offsets, counts, lo, hi, buflen=n, align=1)
    out = np.uint64(0)
    if len(out_ptrs):
        (out, _, _), _, _ = _table(who, out_ptrs, offsets, counts, lo, hi, buflen=n, align=1)
    if hi > lo and mx > 0:
        _launch("gf_momentum_update", _grid_rows(hi - lo, mx),
                (p, o, c, _I64(lo), _I64(hi), u_in, u_out, m, out, q))


def momentum_mask(e_in, x, e_out, u):
    """``u[j] = 0`` where ``e_out[j] == 0`` and ``e_in[j] + x[j] != 0``, as
    ``_core.momentum_mask``; returns None (the CPU kernel's count is not read back)."""
    who = "momentum_mask"
    for a, name in ((e_in, "e_in"), (x, "x"), (e_out, "e_out"), (u, "u")):
        _arr(a, _F32, name, who)
    n = u.size
    if not (e_in.size == x.size == e_out.size == n):
        raise ValueError(f"{who}: e_in, x, e_out and u must have the same length, got "
                         f"{e_in.size}, {x.size}, {e_out.size}, {n}")
    if n:
        _launch("gf_momentum_mask", _grid_flat(n), (e_in, x, e_out, u, _I64(n)))
