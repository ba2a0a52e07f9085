"""Wrappers of ``cuda/sparse.cu``: sparse decompress-and-sum, and top-k / random-k
compress with error feedback (the radix select), as ``_core.sparse_decompress_sum(_array)``,
``topk_compress(_array)``, ``randomk_indices`` and ``randomk_compress(_array)``."""
import numpy as np

from .launch import (OB_WARPS, THREADS, _F32, _I64, _arr, _bad_result, _counter, _grid_flat, _grid_rows,
                     _launch, _ptr, _residuals, _sms, _table)
from .loader import cupy


_SP_MAX_N = 0xFFFFFFFF


def _sparse_payloads(who, values, indices, n):
    """Validate p sparse payload rows like _sparse.pxi; returns (p, k, serial)."""
    cp = cupy()
    _arr(values, _F32, "values", who, ndim=2)
    _arr(indices, np.uint32, "indices", who, ndim=2)
    if values.shape != indices.shape:
        raise ValueError(f"{who}: values shape {values.shape} != indices shape {indices.shape}")
    for a, nm in ((values, "values"), (indices, "indices")):
        if a.size and not a.flags.c_contiguous:
            raise ValueError(f"{who}: {nm} must be C-contiguous")
    if n > _SP_MAX_N:
        raise ValueError(f"{who}: bucket of {n} elements, more than {_SP_MAX_N}")
    p, k = indices.shape
    if p * k == 0:
        return p, k, False
    info = cp.zeros(2, np.uint64)
    info[0] = np.uint64(0xFFFFFFFFFFFFFFFF)
    _launch("gf_sparse_check", _grid_flat(p * k), (indices, _I64(p), _I64(k), _I64(n), info))
    first_bad, nonasc = (int(v) for v in info.get())
    if first_bad != 0xFFFFFFFFFFFFFFFF:
        r, m = divmod(first_bad, k)
        bad = int(indices[r, m].get()) if hasattr(indices[r, m], "get") else int(indices[r, m])
        raise ValueError(f"{who}: index {bad} at indices[{r}, {m}] is out of range "
                         f"for a bucket of {n} elements")
    return p, k, nonasc > 0


def sparse_decompress_sum_array(values, indices, out, divisor):
    """Sum p sparse payloads (row r = rank r) into ``out``, then divide, as
    ``_core.sparse_decompress_sum_array``: 0.0f plus the values in rank order, then
    / (float)divisor unless divisor == 1.0. Every index is checked before anything is
    written. Rows that are not strictly ascending are added serially (in m order)."""
    who = "sparse_decompress_sum_array"
    _arr(out, _F32, "out", who)
    n = out.size
    p, k, serial = _sparse_payloads(who, values, indices, n)
    if n == 0:
        return
    out.fill(0)
    if k:
        for r in range(p):
            if serial:
                _launch("gf_sparse_add_serial", (1,), (values[r], indices[r], _I64(k), out,
                                                      np.uint64(0), np.uint64(0), _I64(0), _I64(0)))
            else:
                _launch("gf_sparse_add_array", _grid_flat(k), (values[r], indices[r], _I64(k), out))
    if float(divisor) != 1.0:
        _launch("gf_sparse_div_array", _grid_flat(n), (out, _I64(n), _F32(divisor)))


def sparse_decompress_sum(values, indices, ptrs, offsets, counts, lo, hi, divisor):
    """``sparse_decompress_sum_array`` into table rows lo..hi-1 (dense offsets), as
    ``_core.sparse_decompress_sum``: every destination element is written."""
    who = "sparse_decompress_sum"
    (tp, to, tc), n, mx = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    p, k, serial = _sparse_payloads(who, values, indices, n)
    if n == 0:
        return
    lo_, hi_ = _I64(lo), _I64(hi)
    grid = _grid_rows(hi - lo, mx)
    _launch("gf_sparse_rows", grid, (tp, tc, lo_, hi_, np.int32(1), _F32(1.0)))
    if k:
        for r in range(p):
            if serial:
                _launch("gf_sparse_add_serial", (1,), (values[r], indices[r], _I64(k), np.uint64(0),
                                                      tp, to, lo_, hi_))
            else:
                _launch("gf_sparse_add_table", _grid_flat(k), (values[r], indices[r], _I64(k), tp, to, lo_, hi_))
    if float(divisor) != 1.0:
        _launch("gf_sparse_rows", grid, (tp, tc, lo_, hi_, np.int32(0), _F32(divisor)))


# ------------------------------------------------------------------ sparse compress (top-k / random-k selection)
#
# GPU twins of _core.topk_compress(_array), randomk_indices, randomk_compress(_array)
# (gradfuse/kernels/_sparse.pxi): same arguments, same bits, same count. The radix select of
# cuda/sparse.cu (docs/gpu.md): level 1 fused into the pass that makes c (top-k) or a
# hash pass (random-k), two more digit levels, then a tile count, a scan and an ordered
# write. Nothing here synchronises except reading the count when count_out is None.

_SP_TILE = 1024                   # elements per warp tile of gf_sp_count / gf_sp_write
_SP_LEVELS = ((21, 11), (10, 11), (0, 10))    # (shift, width) of the key's three digits


def _sp_grid_hist(n):
    """Histogram passes: about 8 blocks of 256 per multiprocessor (one 8 KiB shared
    histogram each, flushed once per block), fewer for small buckets."""
    return (max(1, min(-(-n // (THREADS * 8)), 8 * _sms())),)


def _sp_grid_tiles(ntiles):
    return (max(1, min(-(-ntiles // OB_WARPS), 32 * _sms())),)


def _sp_keys(kind, arr=None, table=None, lo=0, hi=0, seed=0):
    """The key-stream arguments of the gf_sp_* kernels (GF_SP_KEY_PARAMS)."""
    z = np.uint64(0)
    p, o, c = table if table is not None else (z, z, z)
    return (np.int32(kind), arr if arr is not None else z, p, o, c, _I64(lo), _I64(hi), np.uint64(seed))


def _sp_table(who, ptrs, offsets, counts, lo, hi):
    """Device table and n, validated like _sparse.pxi's _sp_table_n (ValueError)."""
    lo, hi = int(lo), int(hi)
    if lo < 0 or lo > hi or hi > len(ptrs) or hi > len(offsets) or hi > len(counts):
        raise ValueError(f"{who}: table range {lo}:{hi} outside tables of "
                         f"{len(ptrs)}/{len(offsets)}/{len(counts)} rows")
    dev, n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    if n > _SP_MAX_N:
        raise ValueError(f"{who}: bucket of more than {_SP_MAX_N} elements "
                         "(indices are uint32 positions inside the bucket)")
    return dev, n


def _sp_check(who, n, e_in, e_out, k, values, indices):
    """_sparse.pxi's _sp_check_common: returns (e_in, e_out, k) (residuals None when empty)."""
    _arr(values, _F32, "values", who)
    _arr(indices, np.uint32, "indices", who)
    if n > _SP_MAX_N:
        raise ValueError(f"{who}: bucket of {n} elements, more than {_SP_MAX_N} "
                         "(indices are uint32 positions inside the bucket)")
    e_in, e_out = _residuals(who, e_in, e_out, n)
    k = int(k)
    if k < 0 or k > n:
        raise ValueError(f"{who}: k = {k} outside 0..{n}")
    if values.size != k:
        raise ValueError(f"{who}: values has {values.size} elements, expected k = {k}")
    if indices.size != k:
        raise ValueError(f"{who}: indices has {indices.size} elements, expected k = {k}")
    return e_in, e_out, k


def _sp_select(keys, n, k, hist, indices, values=None, e_zero=None, level1=False):
    """indices <- the k largest keys of the stream (0 < k < n), ties to the lower index,
    ascending; values[m] <- their raw words, e_zero[indices] <- 0 when given. hist: 5120
    zeroed u32 (three levels); level1: its first 2048 already hold the level-1 histogram."""
    cp = cupy()
    state = cp.zeros(2, np.uint64)                  # prefix, count of keys above it
    n64, k64 = _I64(n), _I64(k)
    grid = _sp_grid_hist(n)
    at = 0
    for lv, (shift, width) in enumerate(_SP_LEVELS):
        h = hist[at:at + (1 << width)]
        at += 1 << width
        if lv or not level1:
            _launch("gf_sp_hist", grid, keys + (n64, np.int32(shift), np.int32(width), state, h))
        _launch("gf_sp_select", (1,), (h, np.int32(width), k64, state))
    ntiles = -(-n // _SP_TILE)
    tiles = cp.empty(4 * ntiles, np.uint32)
    counts, pre = tiles[:2 * ntiles], tiles[2 * ntiles:]
    tgrid = _sp_grid_tiles(ntiles)
    _launch("gf_sp_count", tgrid, keys + (n64, state, counts))
    _launch("gf_sp_scan", (1,), (counts, _I64(ntiles), pre))
    _launch("gf_sp_write", tgrid, keys + (n64, state, k64, counts, pre, _ptr(values), indices, _ptr(e_zero)))


def _sp_hist_buffer():
    return cupy().zeros(sum(1 << w for _, w in _SP_LEVELS), np.uint32)


def _topk(who, src, n, e_in, e_out, k, values, indices, count_out):
    e_in, e_out, k = _sp_check(who, n, e_in, e_out, k, values, indices)
    bad, owned = _counter(count_out, 1, who)
    if n:
        mode = 0 if k == 0 else (2 if k == n else 1)
        hist = _sp_hist_buffer() if mode == 1 else None
        _launch("gf_sp_pass1", _sp_grid_hist(n),
                src + (_I64(n), _ptr(e_in), _ptr(e_out), np.int32(mode), _ptr(hist), bad,
                       _ptr(values), _ptr(indices)))
        if mode == 1:
            keys = _sp_keys(0, e_out) if e_out is not None else src   # c lives in e_out
            _sp_select(keys, n, k, hist, indices, values, e_out, level1=True)
    return _bad_result(bad, owned)


def topk_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, k, values, indices, count_out=None):
    """Top-k with error feedback over table rows lo..hi-1 (dense offsets), as
    ``_core.topk_compress``: c = g + e_in (c = g when e_in/e_out are empty); indices <- the
    k positions of the largest bits(c) & 0x7fffffff, ties to the lower position, ascending;
    values <- c there; e_out <- c with 0 at the indices (e_out may be e_in). Returns the
    number of non-finite c (or ``count_out``)."""
    who = "topk_compress"
    table, n = _sp_table(who, ptrs, offsets, counts, lo, hi)
    return _topk(who, _sp_keys(1, None, table, lo, hi), n, e_in, e_out, k, values, indices, count_out)


def topk_compress_array(x, e_in, e_out, k, values, indices, count_out=None):
    """``topk_compress`` of one contiguous float32 cupy array."""
    who = "topk_compress_array"
    _arr(x, _F32, "x", who)
    return _topk(who, _sp_keys(0, x), x.size, e_in, e_out, k, values, indices, count_out)


def _rk_seed(seed, who):
    seed = int(seed)
    if not 0 <= seed <= 0xFFFFFFFFFFFFFFFF:
        raise OverflowError(f"{who}: seed {seed} does not fit in a uint64")
    return seed


def _rk_indices(seed, n, k, out):
    if k == 0:
        return
    if k >= n:
        _launch("gf_sp_iota", _grid_flat(n), (out, _I64(n)))
        return
    _sp_select(_sp_keys(2, seed=seed), n, k, _sp_hist_buffer(), out)


def randomk_indices(seed, n, k, out):
    """out <- the k positions i in 0..n-1 with the smallest h_i, ties to the lower i,
    ascending, as ``_core.randomk_indices`` (h_i = splitmix64_mix(seed + i +
    0x9e3779b97f4a7c15) >> 32, uint64 wrap-around)."""
    who = "randomk_indices"
    seed = _rk_seed(seed, who)
    n, k = int(n), int(k)
    _arr(out, np.uint32, "out", who)
    if n < 0 or n > _SP_MAX_N:
        raise ValueError(f"{who}: n = {n} outside 0..{_SP_MAX_N}")
    if k < 0 or k > n:
        raise ValueError(f"{who}: k = {k} outside 0..{n}")
    if out.size != k:
        raise ValueError(f"{who}: out has {out.size} elements, expected k = {k}")
    _rk_indices(seed, n, k, out)


def _randomk(who, src, n, e_in, e_out, seed, k, values, indices, count_out):
    seed = _rk_seed(seed, who)
    e_in, e_out, k = _sp_check(who, n, e_in, e_out, k, values, indices)
    bad, owned = _counter(count_out, 1, who)
    if n:
        _rk_indices(seed, n, k, indices)
        _launch("gf_sp_pass1", _sp_grid_hist(n),
                src + (_I64(n), _ptr(e_in), _ptr(e_out), np.int32(0), np.uint64(0), bad,
                       np.uint64(0), np.uint64(0)))
        if k:
            _launch("gf_sp_pick", _grid_flat(k), src + (indices, _I64(k), _ptr(e_out), values))
    return _bad_result(bad, owned)


def randomk_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, seed, k, values, indices, count_out=None):
    """Random-k with error feedback over table rows lo..hi-1, as ``_core.randomk_compress``:
    indices <- randomk_indices(seed, n, k); c = g + e_in; values <- c at the indices;
    e_out <- c with 0 there. Returns the number of non-finite c (or ``count_out``)."""
    who = "randomk_compress"
    table, n = _sp_table(who, ptrs, offsets, counts, lo, hi)
    return _randomk(who, _sp_keys(1, None, table, lo, hi), n, e_in, e_out, seed, k, values, indices,
                    count_out)


def randomk_compress_array(x, e_in, e_out, seed, k, values, indices, count_out=None):
    """``randomk_compress`` of one contiguous float32 cupy array."""
    who = "randomk_compress_array"
    _arr(x, _F32, "x", who)
    return _randomk(who, _sp_keys(0, x), x.size, e_in, e_out, seed, k, values, indices, count_out)
