"""Wrappers of ``cuda/twobit.cu``: 2-bit threshold compress with error feedback and
decompress-and-sum, as ``_core.twobit_compress(_array)`` and
``_core.twobit_decompress_sum(_array)``."""
import numpy as np

from .launch import (_F32, _I64, _arr, _bad_result, _counter, _grid_flat, _grid_rows, _launch, _ptr,
                     _residuals, _rows, _table, divisor_mode)


def _threshold(t, who):
    t32 = _F32(t)
    if not (t32 > 0) or not np.isfinite(t32):
        raise ValueError(f"{who}: threshold must be finite and > 0 as a float32, got {t}")
    return t32


def _twobit_compress(who, src_args, table_kernel, n, e_in, e_out, threshold, codes, count_out):
    t = _threshold(threshold, who)
    e_in, e_out = _residuals(who, e_in, e_out, n)
    _arr(codes, np.uint8, "codes", who)
    if codes.size != -(-n // 4):
        raise ValueError(f"{who}: codes must have ceil(n/4) = {-(-n // 4)} bytes, got {codes.size}")
    bad, owned = _counter(count_out, 1, who)
    if n:
        name = "gf_twobit_compress_table" if table_kernel else "gf_twobit_compress_array"
        _launch(name, _grid_flat(n), src_args + (_I64(n), _ptr(e_in), _ptr(e_out), t, codes, bad))
    return _bad_result(bad, owned)


def twobit_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, threshold, codes, count_out=None):
    """2-bit threshold compress with error feedback over table rows lo..hi-1, as
    ``_core.twobit_compress``; returns the number of non-finite c."""
    who = "twobit_compress"
    (p, o, c), n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    return _twobit_compress(who, (p, o, c, _I64(lo), _I64(hi)), True, n, e_in, e_out,
                            threshold, codes, count_out)


def twobit_compress_array(x, e_in, e_out, threshold, codes, count_out=None):
    """``twobit_compress`` of one contiguous float32 cupy array."""
    who = "twobit_compress_array"
    _arr(x, _F32, "x", who)
    return _twobit_compress(who, (x,), False, x.size, e_in, e_out, threshold, codes, count_out)


def _twobit_decompress(who, codes, threshold, n, divisor):
    t = _threshold(threshold, who)
    mode, f = divisor_mode(divisor, who)
    p = codes.shape[0] if getattr(codes, "ndim", 0) == 2 else 0
    if p < 1:
        raise ValueError(f"{who}: need at least one payload row (codes of shape (p, ceil(n/4)))")
    stride = _rows(codes, np.uint8, "codes", who, -(-n // 4))
    return (codes, stride, _I64(p), t), mode, f


def twobit_decompress_sum(codes, threshold, ptrs, offsets, counts, lo, hi, divisor):
    """Decode p 2-bit payloads, sum in rank order from v_0, divide, write into table rows
    lo..hi-1, as ``_core.twobit_decompress_sum``."""
    who = "twobit_decompress_sum"
    (tp, to, tc), n, mx = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    args, mode, f = _twobit_decompress(who, codes, threshold, n, divisor)
    if n:
        _launch("gf_twobit_decompress_sum_table", _grid_rows(hi - lo, mx),
                args + (tp, to, tc, _I64(lo), _I64(hi), mode, f))


def twobit_decompress_sum_array(codes, threshold, out, divisor):
    """``twobit_decompress_sum`` into one contiguous float32 cupy array."""
    who = "twobit_decompress_sum_array"
    _arr(out, _F32, "out", who)
    args, mode, f = _twobit_decompress(who, codes, threshold, out.size, divisor)
    if out.size:
        _launch("gf_twobit_decompress_sum_array", _grid_flat(out.size),
                args + (out, _I64(out.size), mode, f))
