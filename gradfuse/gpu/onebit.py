"""Wrappers of ``cuda/onebit.cu``: 1-bit compress with error feedback and
decompress-and-sum, as ``_core.onebit_compress(_array)`` and
``_core.onebit_decompress_sum(_array)``.

Blocks restart at every tensor of a table (docs/compressors.md): the kernels take the
rows' block and word prefix sums (``bstart``, ``wstart``), made here from the counts and
kept with a resident counts table (once per plan, bucket, block size and device).
"""
import numpy as np

from .launch import (OB_WARPS, _F32, _I64, _arr, _bad_result, _counter, _grid_flat, _grid_rows, _host,
                     _launch, _memo, _ptr, _residuals, _rows, _table, divisor_mode)
from .loader import cupy


def _block(block, who):
    block = int(block)
    if block < 32 or block % 32:
        raise ValueError(f"{who}: block size must be a multiple of 32 and >= 32, got {block}")
    return block


def _layout(counts, lo, hi, block):
    """(bstart, wstart on the device, total blocks, total words) of rows lo..hi-1."""
    def make():
        c = np.asarray(_host(counts[lo:hi]), np.int64)
        bs = np.concatenate([[0], np.cumsum(-(-c // block))]).astype(np.int64)
        ws = np.concatenate([[0], np.cumsum((c + 31) // 32)]).astype(np.int64)
        cp = cupy()
        return cp.asarray(bs), cp.asarray(ws), int(bs[-1]), int(ws[-1])
    return _memo(counts, ("onebit", int(lo), int(hi), block), make)


def _onebit_compress(who, src_args, layout, n, e_in, e_out, block, bits, scales, count_out):
    e_in, e_out = _residuals(who, e_in, e_out, n)
    _arr(bits, np.uint32, "bits", who)
    _arr(scales, _F32, "scales", who)
    if layout is None:
        nwords, nblocks = -(-n // 32), -(-n // block)
    else:
        nblocks, nwords = layout[2], layout[3]
    if bits.size != nwords:
        raise ValueError(f"{who}: bits must have {nwords} words (the sum over the tensors of ceil(n_i/32)), "
                         f"got {bits.size}")
    if scales.size != nblocks:
        raise ValueError(f"{who}: scales must have {nblocks} floats (the sum over the tensors of "
                         f"ceil(n_i/block)), got {scales.size}")
    bad, owned = _counter(count_out, 1, who)
    if n:
        grid = (-(-nblocks // OB_WARPS),)
        if layout is None:
            _launch("gf_onebit_compress_array", grid,
                    src_args + (_I64(n), _ptr(e_in), _ptr(e_out), _I64(block), bits, scales, bad))
        else:
            _launch("gf_onebit_compress_table", grid,
                    src_args + (layout[0], layout[1], _I64(nblocks), _ptr(e_in), _ptr(e_out), _I64(block),
                                bits, scales, bad))
    return _bad_result(bad, owned)


def onebit_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, block, bits, scales, count_out=None):
    """1-bit compress with error feedback over table rows lo..hi-1 (dense offsets), blocks
    per tensor, as ``_core.onebit_compress``; returns the number of non-finite block scales."""
    who = "onebit_compress"
    block = _block(block, who)
    (p, o, c), n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    layout = _layout(counts, lo, hi, block) if n else (None, None, 0, 0)
    return _onebit_compress(who, (p, o, c, _I64(lo), _I64(hi)), layout, n, e_in, e_out, block,
                            bits, scales, count_out)


def onebit_compress_array(x, e_in, e_out, block, bits, scales, count_out=None):
    """``onebit_compress`` of one contiguous float32 cupy array (one tensor)."""
    who = "onebit_compress_array"
    block = _block(block, who)
    _arr(x, _F32, "x", who)
    return _onebit_compress(who, (x,), None, x.size, e_in, e_out, block, bits, scales, count_out)


def _onebit_decompress(who, bits, scales, block, nwords, nblocks, divisor):
    mode, f = divisor_mode(divisor, who)
    p = bits.shape[0] if getattr(bits, "ndim", 0) == 2 else 0
    if p < 1:
        raise ValueError(f"{who}: need at least one payload row (bits of shape (p, words))")
    if scales.shape[0] != p:
        raise ValueError(f"{who}: bits has {p} rows but scales has {scales.shape[0]}")
    ws = _rows(bits, np.uint32, "bits", who, nwords)
    ss = _rows(scales, _F32, "scales", who, nblocks)
    return (bits, ws, scales, ss, _I64(p), _I64(block)), mode, f


def onebit_decompress_sum(bits, scales, block, ptrs, offsets, counts, lo, hi, divisor):
    """Decode p 1-bit payloads (row r = rank r; per-tensor blocks), sum in rank order from
    v_0, divide, and write into table rows lo..hi-1, as ``_core.onebit_decompress_sum``."""
    who = "onebit_decompress_sum"
    block = _block(block, who)
    (tp, to, tc), n, mx = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    layout = _layout(counts, lo, hi, block) if n else (None, None, 0, 0)
    args, mode, f = _onebit_decompress(who, bits, scales, block, layout[3], layout[2], divisor)
    if n:
        _launch("gf_onebit_decompress_sum_table", _grid_rows(hi - lo, mx),
                args + (tp, tc, _I64(lo), _I64(hi), layout[0], layout[1], mode, f))


def onebit_decompress_sum_array(bits, scales, block, out, divisor):
    """``onebit_decompress_sum`` into one contiguous float32 cupy array (n = out.size)."""
    who = "onebit_decompress_sum_array"
    block = _block(block, who)
    _arr(out, _F32, "out", who)
    n = out.size
    args, mode, f = _onebit_decompress(who, bits, scales, block, -(-n // 32), -(-n // block), divisor)
    if n:
        _launch("gf_onebit_decompress_sum_array", _grid_flat(n), args + (out, _I64(n), mode, f))
