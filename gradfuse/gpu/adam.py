"""Wrappers of ``cuda/adam.cu``: the Adam correction's moment update, its fusion with 1-bit
compression and error feedback, the step after the exchange and plain Adam, as
``_core.adam_moment``, ``adam_onebit_compress``, ``adam_apply`` and ``adam_plain``."""
import numpy as np

from .launch import (OB_WARPS, _F32, _I64, _arr, _bad_result, _block_layout, _block_size, _counter, _grid_rows,
                     _launch, _ptr, _residuals, _table)


def _f32(who, name, value):
    f = _F32(value)
    if not np.isfinite(f):
        raise ValueError(f"{who}: {name} must be finite as a float32, got {value!r}")
    return f


def _state(a, dtype, name, who, n):
    _arr(a, dtype, name, who)
    if a.size != n:
        raise ValueError(f"{who}: {name} has {a.size} elements and the table {n}")
    return a


def adam_moment(src_ptrs, offsets, counts, lo, hi, m, r, b1, c1, x):
    """``x = b1 * m + (c1 * g) * r`` over table rows lo..hi-1, as ``_core.adam_moment``."""
    who = "adam_moment"
    fb1, fc1 = _f32(who, "b1", b1), _f32(who, "c1", c1)
    _arr(x, _F32, "x", who)
    n = x.size
    _state(m, _F32, "m", who, n)
    _state(r, _F32, "r", who, n)
    (p, o, c), _, mx = _table(who, src_ptrs, offsets, counts, lo, hi, buflen=n, align=1)
    if hi > lo and mx > 0:
        _launch("gf_adam_moment", _grid_rows(hi - lo, mx), (p, o, c, _I64(lo), _I64(hi), m, r, fb1, fc1, x))


def adam_onebit_compress(src_ptrs, offsets, counts, lo, hi, m, r, b1, c1, e_in, e_out, block, bits, scales,
                         count_out=None):
    """``onebit_compress`` of ``(b1 * m + (c1 * g) * r) + e_in`` in one pass, as
    ``_core.adam_onebit_compress``; returns the number of non-finite block scales."""
    who = "adam_onebit_compress"
    block = _block_size(block, who)
    fb1, fc1 = _f32(who, "b1", b1), _f32(who, "c1", c1)
    (p, o, c), n, _ = _table(who, src_ptrs, offsets, counts, lo, hi, dense=True)
    _state(m, _F32, "m", who, n)
    _state(r, _F32, "r", who, n)
    e_in, e_out = _residuals(who, e_in, e_out, n)
    _arr(bits, np.uint32, "bits", who)
    _arr(scales, _F32, "scales", who)
    layout = _block_layout(counts, lo, hi, block, 1) if n else (None, None, 0, 0)
    nblocks, nwords = layout[2], layout[3]
    if bits.size != nwords:
        raise ValueError(f"{who}: bits must have {nwords} words (the sum over the tensors of ceil(n_i/32)), "
                         f"got {bits.size}")
    if scales.size != nblocks:
        raise ValueError(f"{who}: scales must have {nblocks} floats (the sum over the tensors of "
                         f"ceil(n_i/block)), got {scales.size}")
    bad, owned = _counter(count_out, 1, who)
    if n:
        _launch("gf_adam_onebit_compress_table", (-(-nblocks // OB_WARPS),),
                (p, o, c, _I64(lo), _I64(hi), layout[0], layout[1], _I64(nblocks), m, r, fb1, fc1, _ptr(e_in),
                 _ptr(e_out), _I64(block), bits, scales, bad))
    return _bad_result(bad, owned)


def adam_apply(dst_ptrs, offsets, counts, lo, hi, m, mask, a):
    """``m = mb``, outputs ``a * mb`` (both 0 where ``mask`` is 0; empty: none) over table
    rows lo..hi-1, as ``_core.adam_apply``."""
    who = "adam_apply"
    fa = _f32(who, "a", a)
    _arr(m, _F32, "m", who)
    n = m.size
    if mask is not None and mask.size:
        _state(mask, np.uint8, "mask", who, n)
    (p, o, c), _, mx = _table(who, dst_ptrs, offsets, counts, lo, hi, buflen=n, align=1)
    if hi > lo and mx > 0:
        _launch("gf_adam_apply", _grid_rows(hi - lo, mx), (p, o, c, _I64(lo), _I64(hi), m, _ptr(mask), fa))


def adam_plain(dst_ptrs, offsets, counts, lo, hi, m, v, b1, c1, b2, c2, a, b, eps, f_new=0.0, f_old=0.0,
               sums=False):
    """Plain Adam over table rows lo..hi-1 of the outputs, as ``_core.adam_plain``; with
    ``sums``, the freeze rule's two sums, taken here with cupy from a copy of the old ``v``
    (they synchronise; the CPU kernel takes them in its pass)."""
    who = "adam_plain"
    k = [_f32(who, name, val) for name, val in (("b1", b1), ("c1", c1), ("b2", b2), ("c2", c2), ("a", a),
                                                ("b", b), ("eps", eps))]
    _arr(m, _F32, "m", who)
    n = m.size
    _state(v, _F32, "v", who, n)
    (p, o, c), _, mx = _table(who, dst_ptrs, offsets, counts, lo, hi, buflen=n, align=1)
    old = v.copy() if sums else None
    if hi > lo and mx > 0:
        _launch("gf_adam_plain", _grid_rows(hi - lo, mx), (p, o, c, _I64(lo), _I64(hi), m, v, *k))
    if not sums:
        return None
    hn = v.astype(np.float64) * f_new
    return float(abs(hn - old.astype(np.float64) * f_old).sum()), float(hn.sum())
