"""Wrappers of ``cuda/onebit.cu``: 1-bit compress with error feedback and
decompress-and-sum, as ``_core.onebit_compress(_array)`` and
``_core.onebit_decompress_sum(_array)``.

Blocks restart at every tensor of a table (docs/compressors.md): the kernels take the
rows' block and word prefix sums (``bstart``, ``wstart``), made here from the counts and
kept with a resident counts table (once per plan, bucket, block size and device).
"""
import numpy as np

from .launch import (OB_WARPS, _F32, _I64, _arr, _bad_result, _block_decompress_sum, _block_decompress_sum_array,
                     _block_layout, _block_size, _counter, _launch, _ptr, _residuals, _table)


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
    block = _block_size(block, who)
    (p, o, c), n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    layout = _block_layout(counts, lo, hi, block, 1) if n else (None, None, 0, 0)
    return _onebit_compress(who, (p, o, c, _I64(lo), _I64(hi)), layout, n, e_in, e_out, block,
                            bits, scales, count_out)


def onebit_compress_array(x, e_in, e_out, block, bits, scales, count_out=None):
    """``onebit_compress`` of one contiguous float32 cupy array (one tensor)."""
    who = "onebit_compress_array"
    block = _block_size(block, who)
    _arr(x, _F32, "x", who)
    return _onebit_compress(who, (x,), None, x.size, e_in, e_out, block, bits, scales, count_out)


def onebit_decompress_sum(bits, scales, block, ptrs, offsets, counts, lo, hi, divisor):
    """Decode p 1-bit payloads (row r = rank r; per-tensor blocks), sum in rank order from
    v_0, divide, and write into table rows lo..hi-1, as ``_core.onebit_decompress_sum``."""
    _block_decompress_sum("onebit_decompress_sum", "gf_onebit_decompress_sum", 1, ("bits", "scales"),
                          bits, scales, block, ptrs, offsets, counts, lo, hi, divisor)


def onebit_decompress_sum_array(bits, scales, block, out, divisor):
    """``onebit_decompress_sum`` into one contiguous float32 cupy array (n = out.size)."""
    _block_decompress_sum_array("onebit_decompress_sum_array", "gf_onebit_decompress_sum", 1,
                                ("bits", "scales"), bits, scales, block, out, divisor)
