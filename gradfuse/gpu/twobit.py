"""Wrappers of ``cuda/twobit.cu``: 2-bit compress with error feedback and
decompress-and-sum in both formats, as ``_core.twobit_compress(_array)`` /
``_core.twobit_decompress_sum(_array)`` (MXNet's absolute threshold) and
``_core.twobit_block_*`` (the scaled format, per-tensor blocks)."""
import numpy as np

from .launch import (OB_WARPS, _F32, _I64, _arr, _bad_result, _block_decompress_sum, _block_decompress_sum_array,
                     _block_layout, _block_size, _counter, _grid_flat, _grid_rows, _launch, _ptr, _residuals,
                     _rows, _table, divisor_mode)


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


# ------------------------------------------------------------------ scaled 2-bit
# The default format (per-tensor blocks, a value per block): twins of
# ``_core.twobit_block_*``. Table kernels take the rows' block and word prefix sums.

def _factor(factor, who):
    f = _F32(factor)
    if not (f >= 0) or not np.isfinite(f):
        raise ValueError(f"{who}: factor must be finite and >= 0 as a float32, got {factor}")
    return f


def _tbb_compress(who, src_args, layout, n, e_in, e_out, block, factor, codes, values, count_out):
    f = _factor(factor, who)
    e_in, e_out = _residuals(who, e_in, e_out, n)
    _arr(codes, np.uint32, "codes", who)
    _arr(values, _F32, "values", who)
    if layout is None:
        nwords, nblocks = -(-n // 16), -(-n // block)
    else:
        nblocks, nwords = layout[2], layout[3]
    if codes.size != nwords:
        raise ValueError(f"{who}: codes must have {nwords} words (the sum over the tensors of ceil(n_i/16)), "
                         f"got {codes.size}")
    if values.size != nblocks:
        raise ValueError(f"{who}: values must have {nblocks} floats (the sum over the tensors of "
                         f"ceil(n_i/block)), got {values.size}")
    bad, owned = _counter(count_out, 1, who)
    if n:
        grid = (-(-nblocks // OB_WARPS),)
        if layout is None:
            _launch("gf_twobit_block_compress_array", grid,
                    src_args + (_I64(n), _ptr(e_in), _ptr(e_out), _I64(block), f, codes, values, bad))
        else:
            _launch("gf_twobit_block_compress_table", grid,
                    src_args + (layout[0], layout[1], _I64(nblocks), _ptr(e_in), _ptr(e_out), _I64(block), f,
                                codes, values, bad))
    return _bad_result(bad, owned)


def twobit_block_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, block, factor, codes, values,
                          count_out=None):
    """Scaled 2-bit compress with error feedback over table rows lo..hi-1 (dense offsets),
    blocks per tensor, as ``_core.twobit_block_compress``; returns the number of blocks
    whose mean |c| is not finite."""
    who = "twobit_block_compress"
    block = _block_size(block, who)
    (p, o, c), n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    layout = _block_layout(counts, lo, hi, block, 2) if n else (None, None, 0, 0)
    return _tbb_compress(who, (p, o, c, _I64(lo), _I64(hi)), layout, n, e_in, e_out, block, factor,
                         codes, values, count_out)


def twobit_block_compress_array(x, e_in, e_out, block, factor, codes, values, count_out=None):
    """``twobit_block_compress`` of one contiguous float32 cupy array (one tensor)."""
    who = "twobit_block_compress_array"
    block = _block_size(block, who)
    _arr(x, _F32, "x", who)
    return _tbb_compress(who, (x,), None, x.size, e_in, e_out, block, factor, codes, values, count_out)


def twobit_block_decompress_sum(codes, values, block, ptrs, offsets, counts, lo, hi, divisor):
    """Decode p scaled 2-bit payloads (row r = rank r), sum in rank order from v_0, divide,
    write into table rows lo..hi-1, as ``_core.twobit_block_decompress_sum``."""
    _block_decompress_sum("twobit_block_decompress_sum", "gf_twobit_block_decompress_sum", 2,
                          ("codes", "values"), codes, values, block, ptrs, offsets, counts, lo, hi, divisor)


def twobit_block_decompress_sum_array(codes, values, block, out, divisor):
    """``twobit_block_decompress_sum`` into one contiguous float32 cupy array (n = out.size)."""
    _block_decompress_sum_array("twobit_block_decompress_sum_array", "gf_twobit_block_decompress_sum", 2,
                                ("codes", "values"), codes, values, block, out, divisor)
