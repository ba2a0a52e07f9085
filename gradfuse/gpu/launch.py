"""What every kernel wrapper of ``gradfuse.gpu`` shares: argument checks, tables, launches.

Arrays are checked as the CPU kernels check theirs (``_arr``); tables of pointers,
offsets and counts are validated and put on the device by ``_table`` (``Resident`` host
tables once per device); every kernel is launched by ``_launch`` with ``THREADS``
threads per block, on a grid from ``_grid_flat`` or ``_grid_rows``; counts are added
into ``_counter`` arrays. The 1-bit and scaled 2-bit wrappers share their blocked layout
and decode-and-sum launches (``_block_layout``, ``_block_decompress_sum``).
"""
import math

import numpy as np

from .loader import _device, cupy, kernel

THREADS = 256          # every kernel assumes a multiple of 32 (full warps)
OB_WARPS = THREADS // 32

_SMS = {}              # device id -> multiprocessor count

_I64 = np.int64
_F32 = np.float32


def _sms():
    dev = _device()
    if dev not in _SMS:
        _SMS[dev] = cupy().cuda.Device(dev).attributes["MultiProcessorCount"]
    return _SMS[dev]


# ------------------------------------------------------------------ argument checks

def _arr(a, dtype, name, who, ndim=1):
    cp = cupy()
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{who}: {name} must be a cupy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{who}: {name} must be {np.dtype(dtype)}, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{who}: {name} must have {ndim} dimension(s), got shape {a.shape}")
    if ndim == 1 and a.size > 1 and a.strides[0] != a.itemsize:
        raise ValueError(f"{who}: {name} must be contiguous")
    if a.size and a.device.id != _device():
        raise ValueError(f"{who}: {name} is on device {a.device.id}, the current device is {_device()}")
    return a


def _ptr(a):
    """Kernel argument for an optional array: the array, or a NULL pointer."""
    return a if a is not None and a.size else np.uint64(0)


def _f32_nonzero(v, who, name):
    f = _F32(v)
    if not np.isfinite(f) or f == 0:
        raise ValueError(f"{who}: {name} must be finite and non-zero as a float32, got {v!r}")
    return f


def _scale_arg(v, who, name):
    """(scaled, float32) as _cast.pxi's _cast_scale: no division at all when v == 1.0."""
    if float(v) == 1.0:
        return np.int32(0), _F32(1.0)
    return np.int32(1), _f32_nonzero(v, who, name)


def divisor_mode(divisor, who="decompress_sum"):
    """(mode, operand) exactly as _quant.h's gf_q_divide chooses: 0 none, 1 divide by
    (float)divisor, 2 multiply by its exact reciprocal (power-of-two divisors)."""
    if float(divisor) == 1.0:
        return np.int32(0), _F32(1.0)
    f = _f32_nonzero(divisor, who, "divisor")
    m, _ = math.frexp(float(f))
    with np.errstate(all="ignore"):
        r = _F32(1.0) / f
        exact = bool(r != 0 and np.isfinite(r) and r * f == _F32(1.0))
    if m in (0.5, -0.5) and exact:
        return np.int32(2), r
    return np.int32(1), f


class Resident(np.ndarray):
    """A host int64 table that will not change, with its device copies (one per device).

    Make one with ``resident(table)``. The wrappers validate it like any host table but
    upload it once per device instead of at every call; the pipeline keeps its plans'
    offset/count tables this way and uploads each step's pointer tables once.
    """

    def __array_finalize__(self, obj):
        self._dev = {}          # device id -> cupy copy (views and results start empty)


def resident(table):
    """A read-only ``Resident`` view of an int64 host table (see ``Resident``)."""
    r = np.ascontiguousarray(table, dtype=_I64).view(Resident)
    r._dev = {}
    r.flags.writeable = False
    return r


def _memo(table, key, make):
    """``make()`` once per resident host table, ``key`` and device (derived device arrays,
    e.g. the 1-bit layout of a plan's counts); every call for any other table."""
    if not isinstance(table, Resident):
        return make()
    k = ("memo", _device()) + tuple(key)
    v = table._dev.get(k)
    if v is None:
        v = table._dev[k] = make()
    return v


def _host(a):
    """A host (numpy) view or copy of a table that may be a cupy array."""
    return a if isinstance(a, np.ndarray) else a.get()


def _upload(t):
    """The device copy of host table ``t`` (cached on ``Resident`` tables)."""
    if isinstance(t, Resident) and t.ndim == 1 and t.flags.c_contiguous:
        dev = _device()
        d = t._dev.get(dev)
        if d is None:
            d = t._dev[dev] = cupy().asarray(t.view(np.ndarray))
        return d
    return cupy().asarray(t)


def _table(who, ptrs, offsets, counts, lo, hi, dense=False, buflen=None, align=1):
    """Device copies of a table and the largest row count of rows lo..hi-1. ``align``:
    pointers, offsets and counts of those rows must be multiples of it (a kernel that
    moves whole floats would fault on a misaligned address: a sticky CUDA error)."""
    cp = cupy()
    lo, hi = int(lo), int(hi)
    host = not isinstance(counts, cp.ndarray)
    if host:
        ptrs, offsets, counts = (t if isinstance(t, Resident) else np.ascontiguousarray(t, dtype=_I64)
                                 for t in (ptrs, offsets, counts))
    if lo < 0 or lo > hi or hi > len(ptrs) or hi > len(offsets) or hi > len(counts):
        raise IndexError(f"{who}: table range {lo}:{hi} outside tables of "
                         f"{len(ptrs)}/{len(offsets)}/{len(counts)} rows")
    if host:
        c, o, p = counts[lo:hi], offsets[lo:hi], ptrs[lo:hi]
        if (c < 0).any() or (o < 0).any():
            raise ValueError(f"{who}: a row has a negative offset or count")
        if ((c > 0) & (p == 0)).any():
            raise ValueError(f"{who}: a row has elements and a NULL pointer")
        if dense and len(c) and not np.array_equal(o, np.concatenate([[0], np.cumsum(c)[:-1]])):
            raise ValueError(f"{who}: offsets are not dense from 0")
        if buflen is not None and len(c) and int((o + c).max()) > buflen:
            raise ValueError(f"{who}: buffer of {buflen} elements too short for the table")
        misaligned = bool(((p | o | c) & (align - 1)).any())
        n = int(c.sum())
        mx = int(c.max()) if len(c) else 0
        dev = tuple(_upload(t) for t in (ptrs, offsets, counts))
    else:
        for t, nm in ((ptrs, "ptrs"), (offsets, "offsets"), (counts, "counts")):
            _arr(t, _I64, nm, who)
        if hi > lo:
            c = counts[lo:hi]
            bits = (ptrs[lo:hi] | offsets[lo:hi] | c) & (align - 1)
            stats = cp.stack([c.sum(), c.max(), bits.max()]).get()    # one device read
            n, mx, misaligned = int(stats[0]), int(stats[1]), bool(stats[2])
        else:
            n = mx = 0
            misaligned = False
        dev = (ptrs, offsets, counts)
    if misaligned:
        raise ValueError(f"{who}: pointers, offsets and byte counts must be multiples of {align}")
    return dev, n, mx


def _grid_flat(n):
    """Grid-stride launch for n elements: at most 32 CTAs per multiprocessor."""
    return (max(1, min(-(-n // THREADS), 32 * _sms())),)


def _grid_rows(rows, maxcount, unit=1):
    """Rows on y (<= 65535, strided), a row's elements (in `unit`s) on x."""
    gy = max(1, min(rows, 65535))
    gx = max(1, min(-(-maxcount // (THREADS * unit)), 32 * _sms()))
    gx = max(1, min(gx, (1 << 22) // gy))    # bound the empty CTAs of short rows
    return (gx, gy)


def _counter(count_out, k, who):
    cp = cupy()
    if count_out is None:
        return cp.zeros(k, np.uint64), True
    _arr(count_out, np.uint64, "count_out", who)
    if count_out.size != k:
        raise ValueError(f"{who}: count_out must have {k} element(s)")
    count_out.fill(0)
    return count_out, False


def _launch(name, grid, args):
    kernel(name)(grid, (THREADS,), args)


# ------------------------------------------------------------------ compressor families (1-bit, 2-bit, sparse)

def _residuals(who, e_in, e_out, n):
    e_in = None if e_in is None or e_in.size == 0 else _arr(e_in, _F32, "e_in", who)
    e_out = None if e_out is None or e_out.size == 0 else _arr(e_out, _F32, "e_out", who)
    if e_in is None and e_out is None:
        return None, None
    if e_in is None or e_out is None or e_in.size != n or e_out.size != n:
        raise ValueError(f"{who}: e_in and e_out must both be empty (no error feedback) or both "
                         f"have the bucket's {n} elements")
    return e_in, e_out


def _bad_result(bad, owned):
    return int(bad.get()[0]) if owned else bad


def _rows(a, dtype, name, who, ncols):
    _arr(a, dtype, name, who, ndim=2)
    if a.shape[1] != ncols:
        raise ValueError(f"{who}: {name} rows must have {ncols} elements, got {a.shape[1]}")
    item = a.itemsize
    if ncols > 1 and a.strides[1] != item:
        raise ValueError(f"{who}: {name} rows must be contiguous (element stride {a.strides[1]})")
    if a.strides[0] % item or a.strides[0] < 0:
        raise ValueError(f"{who}: {name} row stride {a.strides[0]} is not a positive multiple of {item}")
    return _I64(a.strides[0] // item)


# ------------------------------------------------------------------ blocked 1-bit and 2-bit payloads
# The 1-bit and the scaled 2-bit formats share a layout (cuda/common.cuh): per tensor, codes
# of ``bits`` bits (1 or 2) packed 32 // bits to a uint32 word from a new word, and one
# float per block of ``block`` elements, blocks restarting at every tensor. Their wrappers
# share the block-size check, the layout's prefix sums and the decode-and-sum launches
# here. ``kernel``: the family's decode-and-sum kernels without their ``_table`` /
# ``_array`` suffix (``"gf_onebit_decompress_sum"``); ``names``: its payload arrays as the
# messages call them (``("bits", "scales")``, ``("codes", "values")``).

def _block_size(block, who):
    block = int(block)
    if block < 32 or block % 32:
        raise ValueError(f"{who}: block size must be a multiple of 32 and >= 32, got {block}")
    return block


def _block_layout(counts, lo, hi, block, bits):
    """(bstart, wstart on the device, total blocks, total words) of rows lo..hi-1: the
    prefix sums of the rows' ceil(count/block) blocks and ceil(count/(32/bits)) words."""
    per_word = 32 // bits

    def make():
        c = np.asarray(_host(counts[lo:hi]), np.int64)
        bs = np.concatenate([[0], np.cumsum(-(-c // block))]).astype(np.int64)
        ws = np.concatenate([[0], np.cumsum(-(-c // per_word))]).astype(np.int64)
        cp = cupy()
        return cp.asarray(bs), cp.asarray(ws), int(bs[-1]), int(ws[-1])
    return _memo(counts, ("blocked", bits, int(lo), int(hi), block), make)


def _block_payloads(who, names, words, vals, block, nwords, nblocks, divisor):
    """The p payload rows checked: the kernels' leading arguments, the divisor mode, operand."""
    mode, f = divisor_mode(divisor, who)
    wname, vname = names
    p = words.shape[0] if getattr(words, "ndim", 0) == 2 else 0
    if p < 1:
        raise ValueError(f"{who}: need at least one payload row ({wname} of shape (p, words))")
    if vals.shape[0] != p:
        raise ValueError(f"{who}: {wname} has {p} rows but {vname} has {vals.shape[0]}")
    ws = _rows(words, np.uint32, wname, who, nwords)
    vs = _rows(vals, _F32, vname, who, nblocks)
    return (words, ws, vals, vs, _I64(p), _I64(block)), mode, f


def _block_decompress_sum(who, kernel, bits, names, words, vals, block, ptrs, offsets, counts, lo, hi,
                          divisor):
    """Decode p payloads of ``bits``-bit codes (row r = rank r), sum them in rank order from
    v_0, divide, and write into table rows lo..hi-1 (dense offsets)."""
    block = _block_size(block, who)
    (tp, to, tc), n, mx = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    layout = _block_layout(counts, lo, hi, block, bits) if n else (None, None, 0, 0)
    args, mode, f = _block_payloads(who, names, words, vals, block, layout[3], layout[2], divisor)
    if n:
        _launch(kernel + "_table", _grid_rows(hi - lo, mx),
                args + (tp, tc, _I64(lo), _I64(hi), layout[0], layout[1], mode, f))


def _block_decompress_sum_array(who, kernel, bits, names, words, vals, block, out, divisor):
    """``_block_decompress_sum`` into one contiguous float32 cupy array (n = out.size)."""
    block = _block_size(block, who)
    _arr(out, _F32, "out", who)
    n = out.size
    args, mode, f = _block_payloads(who, names, words, vals, block, -(-n // (32 // bits)), -(-n // block),
                                    divisor)
    if n:
        _launch(kernel + "_array", _grid_flat(n), args + (out, _I64(n), mode, f))
