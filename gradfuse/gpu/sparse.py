"""Wrappers of ``cuda/sparse.cu``: sparse decompress-and-sum, and top-k / random-k
compress with error feedback (the radix select), as ``_core.sparse_decompress_sum(_array)``,
``topk_compress(_array)``, ``randomk_indices`` and ``randomk_compress(_array)``."""
import numpy as np

from .launch import (OB_WARPS, THREADS, _F32, _I64, _arr, _bad_result, _counter, _grid_flat, _grid_rows,
                     _host, _launch, _ptr, _residuals, _sms, _table)
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
# (gradfuse/kernels/_sparse.pxi): same arguments, same bits, same count. Every tensor
# selects its own k (ks, one per table row). top-k: the radix select of cuda/sparse.cu
# (docs/gpu.md) on all the tensors of a bucket at once: a c pass, three digit levels
# (histogram + select), then a tile count, a scan and an ordered write, with the tensors
# as segments on the grid's y axis (segment tables made here, on the host, from the
# counts); random-k: the stratified draw, a c pass and a gather. Nothing here
# synchronises except reading the count when count_out is None.

_SP_TILE = 1024                   # elements per warp tile of gf_sp_count / gf_sp_write
_SP_LEVELS = ((21, 11), (10, 11), (0, 10))    # (shift, width) of the key's three digits
_SP_HSEG = 5120                   # histogram words per segment (the three levels)
_SP_SEG = 5                       # int64 words per segment: j0, n, k, first slot, first tile
_SP_GROUP = 1024                  # segments per launch group (20 MiB of histograms at most)


def _sp_grid_hist(n):
    """Histogram passes: about 8 blocks of 256 per multiprocessor (one 8 KiB shared
    histogram each, flushed once per block), fewer for small buckets."""
    return max(1, min(-(-n // (THREADS * 8)), 8 * _sms()))


def _sp_grid_tiles(ntiles):
    return max(1, min(-(-ntiles // OB_WARPS), 32 * _sms()))


def _sp_keys(kind, arr=None, table=None, lo=0, hi=0):
    """The key-stream arguments of the gf_sp_* kernels (GF_SP_KEY_PARAMS)."""
    z = np.uint64(0)
    p, o, c = table if table is not None else (z, z, z)
    return (np.int32(kind), arr if arr is not None else z, p, o, c, _I64(lo), _I64(hi))


def _sp_table(who, ptrs, offsets, counts, lo, hi):
    """Device table, n, and the rows' host counts; validated like _sparse.pxi's _sp_table_n."""
    lo, hi = int(lo), int(hi)
    if lo < 0 or lo > hi or hi > len(ptrs) or hi > len(offsets) or hi > len(counts):
        raise ValueError(f"{who}: table range {lo}:{hi} outside tables of "
                         f"{len(ptrs)}/{len(offsets)}/{len(counts)} rows")
    dev, n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    if n > _SP_MAX_N:
        raise ValueError(f"{who}: bucket of more than {_SP_MAX_N} elements "
                         "(indices are uint32 positions inside the bucket)")
    return dev, n, np.asarray(_host(counts[lo:hi]), np.int64)


def _sp_ks(who, counts, ks):
    """ks (one per row, host int64) validated like _sparse.pxi's _sp_check_ks."""
    ks = np.ascontiguousarray(_host(ks), np.int64).reshape(-1)
    if ks.size != counts.size:
        raise ValueError(f"{who}: ks has {ks.size} entries, expected one per table row ({counts.size})")
    bad = np.flatnonzero((ks < 0) | (ks > counts))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{who}: ks[{i}] = {int(ks[i])} outside 0..{int(counts[i])} "
                         f"(the element count of row {i})")
    return ks


def _sp_check(who, n, e_in, e_out, k, values, indices):
    """_sparse.pxi's _sp_check_common: returns (e_in, e_out) (residuals None when empty)."""
    _arr(values, _F32, "values", who)
    _arr(indices, np.uint32, "indices", who)
    if n > _SP_MAX_N:
        raise ValueError(f"{who}: bucket of {n} elements, more than {_SP_MAX_N} "
                         "(indices are uint32 positions inside the bucket)")
    e_in, e_out = _residuals(who, e_in, e_out, n)
    if values.size != k:
        raise ValueError(f"{who}: values has {values.size} elements, expected the sum of ks = {k}")
    if indices.size != k:
        raise ValueError(f"{who}: indices has {indices.size} elements, expected the sum of ks = {k}")
    return e_in, e_out


def _sp_segments(counts, ks):
    """Host segment tables (rows of j0, n, k, first slot, first tile): the tensors that need
    a selection (0 < k < n) and those that take everything (k == n > 0)."""
    j0 = np.cumsum(counts) - counts
    slot = np.cumsum(ks) - ks
    sel = (ks > 0) & (ks < counts)
    take = (ks > 0) & (ks == counts)
    tiles = np.where(sel, -(-counts // _SP_TILE), 0)
    t0 = np.cumsum(tiles) - tiles
    seg = np.stack([j0, counts, ks, slot, t0], axis=1).astype(np.int64)
    return seg[sel], seg[take]


def _sp_grid_y(nseg, gx):
    gy = max(1, min(nseg, 65535))
    return (max(1, min(gx, (1 << 22) // gy)), gy)


def _sp_select(keys, seg, values, indices, e_zero):
    """indices[slot..] <- the k largest keys of every segment (ties to the lower index),
    bucket positions, ascending; values <- their raw words; e_zero[indices] <- 0 (when given)."""
    cp = cupy()
    for g0 in range(0, len(seg), _SP_GROUP):
        sg = seg[g0:g0 + _SP_GROUP].copy()
        sg[:, 4] -= sg[0, 4]                                  # tiles of this group from 0
        nseg = len(sg)
        ntiles = -(-sg[:, 1] // _SP_TILE)
        d_seg, nseg64 = cp.asarray(sg.reshape(-1)), _I64(nseg)
        hist = cp.zeros(nseg * _SP_HSEG, np.uint32)
        state = cp.zeros(2 * nseg, np.uint64)                 # per segment: prefix, count above it
        grid = _sp_grid_y(nseg, _sp_grid_hist(int(sg[:, 1].max())))
        sgrid = (max(1, min(nseg, 65535)),)
        at = 0
        for shift, width in _SP_LEVELS:
            h = hist[at:]
            at += 1 << width
            _launch("gf_sp_hist", grid, keys + (d_seg, nseg64, np.int32(shift), np.int32(width), state, h))
            _launch("gf_sp_select", sgrid, (h, np.int32(width), d_seg, nseg64, state))
        total = int(ntiles.sum())
        tiles = cp.empty(4 * total, np.uint32)
        counts, pre = tiles[:2 * total], tiles[2 * total:]
        tgrid = _sp_grid_y(nseg, _sp_grid_tiles(int(ntiles.max())))
        _launch("gf_sp_count", tgrid, keys + (d_seg, nseg64, state, counts))
        _launch("gf_sp_scan", sgrid, (counts, d_seg, nseg64, pre))
        _launch("gf_sp_write", tgrid, keys + (d_seg, nseg64, state, counts, pre, _ptr(values), indices,
                                             _ptr(e_zero)))


def _topk(who, src, n, counts, e_in, e_out, ks, values, indices, count_out):
    k = int(ks.sum())
    e_in, e_out = _sp_check(who, n, e_in, e_out, k, values, indices)
    bad, owned = _counter(count_out, 1, who)
    if n:
        _launch("gf_sp_pass1", (_sp_grid_hist(n),), src + (_I64(n), _ptr(e_in), _ptr(e_out), bad))
        keys = _sp_keys(0, e_out) if e_out is not None else src   # c lives in e_out
        sel, take = _sp_segments(counts, ks)
        if len(take):
            _launch("gf_sp_take", _sp_grid_y(len(take), _grid_flat(int(take[:, 1].max()))[0]),
                    keys + (cupy().asarray(take.reshape(-1)), _I64(len(take)), _ptr(values), indices,
                            _ptr(e_out)))
        if len(sel):
            _sp_select(keys, sel, values, indices, e_out)
    return _bad_result(bad, owned)


def topk_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, ks, values, indices, count_out=None):
    """Top-k with error feedback over table rows lo..hi-1 (dense offsets), per tensor, as
    ``_core.topk_compress``: c = g + e_in (c = g when e_in/e_out are empty); row i selects
    the ks[i - lo] positions of its largest bits(c) & 0x7fffffff, ties to the lower
    position; indices <- those bucket positions, row after row; values <- c there; e_out <-
    c with 0 at the indices (e_out may be e_in). Returns the number of non-finite c (or
    ``count_out``)."""
    who = "topk_compress"
    table, n, rows = _sp_table(who, ptrs, offsets, counts, lo, hi)
    ks = _sp_ks(who, rows, ks)
    return _topk(who, _sp_keys(1, None, table, lo, hi), n, rows, e_in, e_out, ks, values, indices, count_out)


def _one_tensor(who, n, k):
    k = int(k)
    if k < 0 or k > n:
        raise ValueError(f"{who}: k = {k} outside 0..{n}")
    return (np.array([n], np.int64), np.array([k], np.int64)) if n else (np.zeros(0, np.int64),) * 2


def topk_compress_array(x, e_in, e_out, k, values, indices, count_out=None):
    """``topk_compress`` of one contiguous float32 cupy array (one tensor, k elements)."""
    who = "topk_compress_array"
    _arr(x, _F32, "x", who)
    counts, ks = _one_tensor(who, x.size, k)
    return _topk(who, _sp_keys(0, x), x.size, counts, e_in, e_out, ks, values, indices, count_out)


def _rk_seed(seed, who):
    seed = int(seed)
    if not 0 <= seed <= 0xFFFFFFFFFFFFFFFF:
        raise OverflowError(f"{who}: seed {seed} does not fit in a uint64")
    return seed


def _rk_draw(seed, counts, ks, out):
    """out <- the stratified draw of every tensor (cuda/sparse.cu gf_sp_rk_draw)."""
    if not int(ks.sum()):
        return
    rk = np.stack([np.cumsum(counts) - counts, counts, ks, np.cumsum(ks) - ks], axis=1).astype(np.int64)
    rk = rk[counts > 0]                 # t: the index among the non-empty tensors
    grid = _sp_grid_y(len(rk), _grid_flat(int(ks.max()))[0])
    _launch("gf_sp_rk_draw", grid, (np.uint64(seed), cupy().asarray(rk.reshape(-1)), _I64(len(rk)), out))


def randomk_indices(seed, counts, ks, out):
    """out <- the random-k positions of tensors with element counts ``counts`` (dense, in
    order), ks[t] of tensor t, as bucket positions, as ``_core.randomk_indices``: the t-th
    non-empty tensor draws from s_t = splitmix64_mix(seed + (t + 1) * 0x9e3779b97f4a7c15), one position in
    each stratum [floor(m n / k), floor((m + 1) n / k)), start + ((h * length) >> 32) with
    h = splitmix64_mix(s_t + (m + 1) * 0x9e3779b97f4a7c15) >> 32."""
    who = "randomk_indices"
    seed = _rk_seed(seed, who)
    _arr(out, np.uint32, "out", who)
    counts = np.ascontiguousarray(_host(counts), np.int64).reshape(-1)
    ks = np.ascontiguousarray(_host(ks), np.int64).reshape(-1)
    if ks.size != counts.size:
        raise ValueError(f"{who}: ks has {ks.size} entries, counts {counts.size}")
    neg = np.flatnonzero(counts < 0)
    if neg.size:
        raise ValueError(f"{who}: counts[{int(neg[0])}] = {int(counts[neg[0]])} is negative")
    bad = np.flatnonzero((ks < 0) | (ks > counts))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{who}: ks[{i}] = {int(ks[i])} outside 0..{int(counts[i])}")
    if int(counts.sum()) > _SP_MAX_N:
        raise ValueError(f"{who}: bucket of {int(counts.sum())} elements, more than {_SP_MAX_N} "
                         "(indices are uint32 positions inside the bucket)")
    if out.size != int(ks.sum()):
        raise ValueError(f"{who}: out has {out.size} elements, expected the sum of ks = {int(ks.sum())}")
    _rk_draw(seed, counts, ks, out)


def _randomk(who, src, n, counts, e_in, e_out, seed, ks, values, indices, count_out):
    seed = _rk_seed(seed, who)
    k = int(ks.sum())
    e_in, e_out = _sp_check(who, n, e_in, e_out, k, values, indices)
    bad, owned = _counter(count_out, 1, who)
    if n:
        _rk_draw(seed, counts, ks, indices)
        _launch("gf_sp_pass1", (_sp_grid_hist(n),), src + (_I64(n), _ptr(e_in), _ptr(e_out), bad))
        if k:
            _launch("gf_sp_pick", _grid_flat(k), src + (indices, _I64(k), _ptr(e_out), values))
    return _bad_result(bad, owned)


def randomk_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, seed, ks, values, indices, count_out=None):
    """Random-k with error feedback over table rows lo..hi-1, per tensor, as
    ``_core.randomk_compress``: indices <- randomk_indices(seed, counts[lo:hi], ks); c = g +
    e_in; values <- c at the indices; e_out <- c with 0 there. Returns the number of
    non-finite c (or ``count_out``)."""
    who = "randomk_compress"
    table, n, rows = _sp_table(who, ptrs, offsets, counts, lo, hi)
    ks = _sp_ks(who, rows, ks)
    return _randomk(who, _sp_keys(1, None, table, lo, hi), n, rows, e_in, e_out, seed, ks, values, indices,
                    count_out)


def randomk_compress_array(x, e_in, e_out, seed, k, values, indices, count_out=None):
    """``randomk_compress`` of one contiguous float32 cupy array (one tensor, tensor 0)."""
    who = "randomk_compress_array"
    _arr(x, _F32, "x", who)
    counts, ks = _one_tensor(who, x.size, k)
    return _randomk(who, _sp_keys(0, x), x.size, counts, e_in, e_out, seed, ks, values, indices, count_out)
