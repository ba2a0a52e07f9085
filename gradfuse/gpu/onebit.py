"""Wrappers of ``cuda/onebit.cu``: 1-bit compress with error feedback and
decompress-and-sum, as ``_core.onebit_compress(_array)`` and
``_core.onebit_decompress_sum(_array)``."""
import numpy as np

from .launch import (OB_WARPS, _F32, _I64, _arr, _bad_result, _counter, _grid_flat, _grid_rows, _launch,
                     _ptr, _residuals, _rows, _table, divisor_mode)


def _block(block, who):
    block = int(block)
    if block < 32 or block % 32:
        raise ValueError(f"{who}: block size must be a multiple of 32 and >= 32, got {block}")
    return block


def _onebit_compress(who, src_args, table_kernel, n, e_in, e_out, block, bits, scales, count_out):
    block = _block(block, who)
    e_in, e_out = _residuals(who, e_in, e_out, n)
    _arr(bits, np.uint32, "bits", who)
    _arr(scales, _F32, "scales", who)
    nwords, nblocks = -(-n // 32), -(-n // block)
    if bits.size != nwords:
        raise ValueError(f"{who}: bits must have ceil(n/32) = {nwords} words, got {bits.size}")
    if scales.size != nblocks:
        raise ValueError(f"{who}: scales must have ceil(n/block) = {nblocks} floats, got {scales.size}")
    bad, owned = _counter(count_out, 1, who)
    if n:
        grid = (-(-nblocks // OB_WARPS),)
        name = "gf_onebit_compress_table" if table_kernel else "gf_onebit_compress_array"
        _launch(name, grid, src_args + (_I64(n), _ptr(e_in), _ptr(e_out), _I64(block), bits, scales, bad))
    return _bad_result(bad, owned)


def onebit_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, block, bits, scales, count_out=None):
    """1-bit compress with error feedback over table rows lo..hi-1 (dense offsets), as
    ``_core.onebit_compress``; returns the number of non-finite block scales."""
    who = "onebit_compress"
    (p, o, c), n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    return _onebit_compress(who, (p, o, c, _I64(lo), _I64(hi)), True, n, e_in, e_out, block,
                            bits, scales, count_out)


def onebit_compress_array(x, e_in, e_out, block, bits, scales, count_out=None):
    """``onebit_compress`` of one contiguous float32 cupy array."""
    who = "onebit_compress_array"
    _arr(x, _F32, "x", who)
    return _onebit_compress(who, (x,), False, x.size, e_in, e_out, block, bits, scales, count_out)


def _onebit_decompress(who, bits, scales, block, n, divisor):
    block = _block(block, who)
    mode, f = divisor_mode(divisor, who)
    p = bits.shape[0] if getattr(bits, "ndim", 0) == 2 else 0
    if p < 1:
        raise ValueError(f"{who}: need at least one payload row (bits of shape (p, ceil(n/32)))")
    if scales.shape[0] != p:
        raise ValueError(f"{who}: bits has {p} rows but scales has {scales.shape[0]}")
    ws = _rows(bits, np.uint32, "bits", who, -(-n // 32))
    ss = _rows(scales, _F32, "scales", who, -(-n // block))
    return (bits, ws, scales, ss, _I64(p), _I64(block)), mode, f


def onebit_decompress_sum(bits, scales, block, ptrs, offsets, counts, lo, hi, divisor):
    """Decode p 1-bit payloads (row r = rank r), sum in rank order from v_0, divide, and
    write into table rows lo..hi-1, as ``_core.onebit_decompress_sum``."""
    who = "onebit_decompress_sum"
    (tp, to, tc), n, mx = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    args, mode, f = _onebit_decompress(who, bits, scales, block, n, divisor)
    if n:
        _launch("gf_onebit_decompress_sum_table", _grid_rows(hi - lo, mx),
                args + (tp, to, tc, _I64(lo), _I64(hi), mode, f))


def onebit_decompress_sum_array(bits, scales, block, out, divisor):
    """``onebit_decompress_sum`` into one contiguous float32 cupy array (n = out.size)."""
    who = "onebit_decompress_sum_array"
    _arr(out, _F32, "out", who)
    args, mode, f = _onebit_decompress(who, bits, scales, block, out.size, divisor)
    if out.size:
        _launch("gf_onebit_decompress_sum_array", _grid_flat(out.size),
                args + (out, _I64(out.size), mode, f))
