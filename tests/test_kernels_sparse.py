"""Top-k / random-k kernels vs the numpy reference (tests/ref_sparse.py), bit for bit,
on both the scalar and the AVX2 code paths."""
import numpy as np
import pytest

import functools

import gradfuse._core as core
import ref_sparse as ref


@functools.lru_cache(maxsize=None)
def ref_indices(seed, n, k):
    """The numpy reference's draw, computed once for all kernel paths (it is the slow part)."""
    return ref.randomk_indices(seed, [n], [k])

SIZES = [0, 1, 7, 31, 32, 33, 97, 1009, 65537]
SPECIALS = np.array([65504, 65520, 1e5, 6e-8, 1e-8, 1e-40, -1e-45, 0.0, -0.0, 3.4e38,
                     -65504, -6e-8, 1.0, -1.0], dtype=np.float32)


@pytest.fixture(params=[True, False], ids=["scalar", "simd"])
def dpath(request):
    """Scalar or AVX2 path (decompress has no selection)."""
    if not request.param and not core.simd_info()["cpu_avx2_f16c"]:
        pytest.skip("no AVX2 on this CPU")
    core.set_simd(force_scalar=request.param)
    yield request.param
    core.set_simd(force_scalar=False)


@pytest.fixture(params=[(True, 0), (False, 0), (False, 1), (True, 2), (False, 3)],
                ids=["scalar", "simd", "simd-nocand", "scalar-nosmall", "simd-small"])
def path(request):
    """Code path: scalar or AVX2; and the selection's strategy: automatic (0), the
    large-tensor select without candidate buffers for every tensor (1), the large-tensor
    select with them for every tensor (2), the small-tensor select for every tensor (3)."""
    scalar, mode = request.param
    if not scalar and not core.simd_info()["cpu_avx2_f16c"]:
        pytest.skip("no AVX2 on this CPU")
    core.set_simd(force_scalar=scalar)
    core._sparse_select_mode(mode)
    yield request.param
    core.set_simd(force_scalar=False)
    core._sparse_select_mode(0)


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_same(a, b):
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.dtype == np.float32:
        np.testing.assert_array_equal(bits(a), bits(b))
    else:
        np.testing.assert_array_equal(a, b)


def make_data(n, kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "zeros":
        return np.zeros(n, np.float32)
    if kind == "ties":      # few distinct magnitudes, both signs: ties everywhere
        return (rng.integers(-3, 4, n) * np.float32(0.5)).astype(np.float32)
    if kind == "special":
        x = rng.standard_normal(n).astype(np.float32) * np.float32(1e3)
        if n:
            pos = rng.integers(0, n, max(1, n // 4))
            x[pos] = rng.choice(SPECIALS, len(pos))
        return x
    if kind == "binclash":  # same top 16 bits, different low bits: exercises level 2
        base = np.float32(1.5).view(np.uint32) & np.uint32(0xFFFF0000)
        low = rng.integers(0, 8, n).astype(np.uint32)
        x = (base | low).view(np.float32)
        return (x * rng.choice(np.array([-1, 1], np.float32), n)).astype(np.float32)
    if kind == "nonfinite":
        x = rng.standard_normal(n).astype(np.float32)
        if n:
            x[rng.integers(0, n, max(1, n // 8))] = np.float32("inf")
            x[rng.integers(0, n, max(1, n // 8))] = np.float32("-inf")
            x[rng.integers(0, n, max(1, n // 8))] = np.float32("nan")
            x[rng.integers(0, n, max(1, n // 16))] = np.array([0x7FC00001], np.uint32).view(np.float32)[0]
        return x
    raise ValueError(kind)


KINDS = ["normal", "zeros", "ties", "special", "binclash", "nonfinite"]


def ks_for(n):
    return sorted({0, min(1, n), n // 100, n // 3, max(n - 1, 0), n})


def ks_table(counts, how, seed=0):
    """One k per tensor: a ratio's k_i (as the compressors take it), or random k_i in 0..n_i."""
    counts = np.asarray(counts, np.int64)
    if how == "random":
        rng = np.random.default_rng(seed)
        return np.array([rng.integers(0, c + 1) for c in counts], np.int64)
    return np.array([ref.k_for(how, int(c)) for c in counts], np.int64)


KS_HOW = [0.01, 0.1, 0.5, 1.0, "random"]


def split_table(x, sizes):
    """Copies of x cut into tensors of the given sizes (the last takes the rest)."""
    parts, pos = [], 0
    for s in sizes:
        parts.append(x[pos:pos + s].copy())
        pos += s
    parts.append(x[pos:].copy())
    ptrs = np.array([p.ctypes.data for p in parts], np.int64)
    counts = np.array([len(p) for p in parts], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return parts, ptrs, offsets, counts


# ---------------------------------------------------------------------------- top-k

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_topk_array(path, n, kind):
    g = make_data(n, kind, 1000 + n)
    e = make_data(n, "normal", 2000 + n) * np.float32(0.01)
    for k in ks_for(n):
        for with_e in (True, False):
            ein = e.copy() if with_e else np.zeros(0, np.float32)
            eout = np.full(n if with_e else 0, 7.0, np.float32)
            vals = np.full(k, -1.0, np.float32)
            idx = np.zeros(k, np.uint32)
            ein_before = ein.copy()
            bad = core.topk_compress_array(g, ein, eout, k, vals, idx)
            rv, ri, re, rbad = ref.topk(g, ein if with_e else None, k)
            assert_same(idx, ri)
            assert_same(vals, rv)
            assert bad == rbad
            if with_e:
                assert_same(eout, re)
                assert_same(ein, ein_before)      # e_in untouched when e_out differs
            assert np.all(np.diff(idx.astype(np.int64)) > 0)


def test_topk_inplace_residual(path):
    n = 1009
    g = make_data(n, "special", 5)
    e = make_data(n, "normal", 6)
    for k in (0, 10, 500, n):
        e_alias = e.copy()
        vals = np.zeros(k, np.float32)
        idx = np.zeros(k, np.uint32)
        core.topk_compress_array(g, e_alias, e_alias, k, vals, idx)
        rv, ri, re, _ = ref.topk(g, e, k)
        assert_same(idx, ri)
        assert_same(vals, rv)
        assert_same(e_alias, re)


def test_topk_ties_lower_index_first(path):
    g = np.array([1, -2, 2, 0, -2, 2, 1], np.float32)
    vals = np.zeros(3, np.float32)
    idx = np.zeros(3, np.uint32)
    core.topk_compress_array(g, np.zeros(0, np.float32), np.zeros(0, np.float32), 3, vals, idx)
    assert idx.tolist() == [1, 2, 4]
    assert vals.tolist() == [-2, 2, -2]
    # -0.0 and +0.0 tie: lower index wins
    g = np.array([0.0, -0.0, 0.0, -0.0], np.float32)
    vals = np.zeros(2, np.float32)
    idx = np.zeros(2, np.uint32)
    core.topk_compress_array(g[::-1].copy(), np.zeros(0, np.float32), np.zeros(0, np.float32), 2, vals, idx)
    assert idx.tolist() == [0, 1]
    assert bits(vals).tolist() == [0x80000000, 0]


def test_topk_nan_above_inf(path):
    g = np.array([1.0, np.inf, np.nan, -np.inf, 5.0], np.float32)
    vals = np.zeros(2, np.float32)
    idx = np.zeros(2, np.uint32)
    bad = core.topk_compress_array(g, np.zeros(0, np.float32), np.zeros(0, np.float32), 2, vals, idx)
    assert bad == 3
    assert idx.tolist() == [1, 2]


def test_topk_large_threshold_in_dense_bin(path):
    # 300k elements, 95% of them in one level-1 bin: level 2 and ties decide
    rng = np.random.default_rng(77)
    n = 300_000
    g = make_data(n, "binclash", 8)
    g[rng.integers(0, n, 15_000)] = rng.standard_normal(15_000).astype(np.float32) * 10
    e = make_data(n, "normal", 9) * np.float32(1e-3)
    for k in (3000, 20_000, 150_000):
        vals = np.zeros(k, np.float32)
        idx = np.zeros(k, np.uint32)
        eout = np.zeros(n, np.float32)
        bad = core.topk_compress_array(g, e, eout, k, vals, idx)
        rv, ri, re, rbad = ref.topk(g, e, k)
        assert_same(idx, ri)
        assert_same(vals, rv)
        assert_same(eout, re)
        assert bad == rbad == 0


TABLE_CUTS = [[0, 3, 0, 0, 31, 1, 5], [7], [0], [33, 0, 64, 2]]


@pytest.mark.parametrize("cuts", TABLE_CUTS)
@pytest.mark.parametrize("kind", ["normal", "ties", "special", "nonfinite"])
def test_topk_table(path, cuts, kind):
    """Every tensor of the table selects its own k (docs/compressors.md): bucket positions,
    tensor after tensor."""
    n = 1009
    x = make_data(n, kind, 31)
    e = make_data(n, "normal", 32)
    parts, ptrs, offsets, counts = split_table(x, cuts)
    # the table as rows 2..: pad two foreign rows in front to test lo/hi
    ptrs = np.concatenate([[123, 456], ptrs]).astype(np.int64)
    offsets = np.concatenate([[0, 99], offsets]).astype(np.int64)
    counts = np.concatenate([[99, 1], counts]).astype(np.int64)
    lo, hi = 2, len(ptrs)
    for how in KS_HOW + [0.0]:
        ks = ks_table(counts[lo:], how, len(cuts)) if how else np.zeros(hi - lo, np.int64)
        k = int(ks.sum())
        for with_e in (True, False):
            ein = e.copy() if with_e else np.zeros(0, np.float32)
            eout = np.zeros(n if with_e else 0, np.float32)
            vals = np.zeros(k, np.float32)
            idx = np.zeros(k, np.uint32)
            bad = core.topk_compress(ptrs, offsets, counts, lo, hi, ein, eout, ks, vals, idx)
            rv, ri, re, rbad = ref.topk(x, ein if with_e else None, ks, counts[lo:])
            assert_same(idx, ri)
            assert_same(vals, rv)
            assert bad == rbad
            if with_e:
                assert_same(eout, re)
    for p, orig in zip(parts, np.split(x, np.cumsum(counts[2:])[:-1])):
        assert_same(p, orig)                          # gradients untouched


def test_topk_small_tensor_keeps_its_own_k(path):
    """A 1e-3-scale tensor next to a unit-scale one: its k_i largest are its own (over the
    whole bucket, every one of the k would have come from the large tensor)."""
    rng = np.random.default_rng(4)
    big = rng.standard_normal(5000).astype(np.float32)
    small = (rng.standard_normal(300) * 1e-3).astype(np.float32)
    x = np.concatenate([big, small])
    parts, ptrs, offsets, counts = split_table(x, [5000])
    ks = np.array([50, 3], np.int64)
    vals, idx = np.zeros(53, np.float32), np.zeros(53, np.uint32)
    z = np.zeros(0, np.float32)
    core.topk_compress(ptrs, offsets, counts, 0, 2, z, z, ks, vals, idx)
    assert set(idx[50:] - 5000) == set(np.argsort(-np.abs(small))[:3])
    assert set(idx[:50]) == set(np.argsort(-np.abs(big))[:50])
    assert_same(vals, x[idx])


def test_topk_empty_table(path):
    z = np.zeros(0, np.float32)
    e64 = np.zeros(0, np.int64)
    assert core.topk_compress(e64, e64, e64, 0, 0, z, z, e64, z, np.zeros(0, np.uint32)) == 0
    assert core.randomk_compress(e64, e64, e64, 0, 0, z, z, 5, e64, z, np.zeros(0, np.uint32)) == 0


# ---------------------------------------------------------------------------- random-k

SEEDS = [0, 1, 12345, 2**63, 2**64 - 1, 2**64 - 5]


def rk_indices(seed, counts, ks):
    out = np.zeros(int(np.sum(ks)), np.uint32)
    core.randomk_indices(seed, np.asarray(counts, np.int64), np.asarray(ks, np.int64), out)
    return out


@pytest.mark.parametrize("n", SIZES + [300_000])
def test_randomk_indices(path, n):
    for seed in SEEDS if n < 100_000 else SEEDS[:2] + SEEDS[-1:]:
        for k in ks_for(n):
            out = rk_indices(seed, [n], [k])
            assert_same(out, ref_indices(seed, n, k))
            assert np.all(np.diff(out.astype(np.int64)) > 0) and (k == 0 or out[-1] < n)


def test_randomk_indices_per_tensor_strata():
    """Tensor t draws k_t positions of its own, one in each stratum
    [floor(m n / k), floor((m + 1) n / k)), as bucket positions after the tensors before it."""
    counts, ks = [0, 1000, 7, 0, 300, 64], [0, 10, 7, 0, 3, 1]
    out = rk_indices(99, counts, ks)
    assert_same(out, ref.randomk_indices(99, counts, ks))
    starts = np.cumsum([0] + counts[:-1])
    o = 0
    for a, n, k in zip(starts, counts, ks):
        pos = out[o:o + k].astype(np.int64) - a
        for m in range(k):
            assert m * n // k <= pos[m] < (m + 1) * n // k
        o += k
    # the t-th non-empty tensor's draw depends on t, not on the other tensors' sizes, and
    # empty tensors are not counted: the 1000-element tensor is tensor 0
    assert_same(rk_indices(99, [1000], [10]), out[:10])
    assert_same(rk_indices(99, [5, 6, 300], [0, 0, 3]) - 11, out[17:20] - 1007)   # tensor 2: the same
    assert not np.array_equal(rk_indices(99, [300], [3]), out[17:20] - 1007)  # as tensor 0: another draw


def test_randomk_known_values_and_uniformity():
    # splitmix64 with state 0: the first output is 0xe220a8397b1dcdaf (reference sequence)
    assert ref.tensor_seed(0, 0) == 0xE220A8397B1DCDAF
    # seed + (t + 1) * golden wraps around 2**64
    assert ref.tensor_seed(2**64 - 0x9E3779B97F4A7C15, 0) == 0
    # every position of a stratum is about equally likely (n = 1000, k = 10: strata of 100)
    hits = np.zeros(1000, np.int64)
    for seed in range(3000):
        hits[rk_indices(seed, [1000], [10])] += 1
    assert hits.sum() == 30000 and hits.min() > 10 and hits.max() < 60        # mean 30


def test_randomk_indices_differ_by_seed():
    assert not np.array_equal(rk_indices(1, [10_000], [100]), rk_indices(2, [10_000], [100]))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["normal", "special", "nonfinite", "zeros"])
def test_randomk_array(path, n, kind):
    g = make_data(n, kind, 300 + n)
    e = make_data(n, "normal", 400 + n)
    for k in ks_for(n):
        for with_e in (True, False):
            seed = 99 + k
            ein = e.copy() if with_e else np.zeros(0, np.float32)
            eout = np.full(n if with_e else 0, 3.0, np.float32)
            vals = np.zeros(k, np.float32)
            idx = np.zeros(k, np.uint32)
            bad = core.randomk_compress_array(g, ein, eout, seed, k, vals, idx)
            rv, ri, re, rbad = ref.randomk(g, ein if with_e else None, seed, k)
            assert_same(idx, ri)
            assert_same(vals, rv)
            assert bad == rbad
            if with_e:
                assert_same(eout, re)
                assert_same(ein, e)


@pytest.mark.parametrize("cuts", TABLE_CUTS)
def test_randomk_table(path, cuts):
    n = 1009
    x = make_data(n, "special", 41)
    e = make_data(n, "normal", 42)
    parts, ptrs, offsets, counts = split_table(x, cuts)
    for how in KS_HOW:
        ks = ks_table(counts, how, 3)
        k = int(ks.sum())
        ealias = e.copy()
        vals = np.zeros(k, np.float32)
        idx = np.zeros(k, np.uint32)
        bad = core.randomk_compress(ptrs, offsets, counts, 0, len(ptrs), ealias, ealias, 7, ks, vals, idx)
        rv, ri, re, rbad = ref.randomk(x, e, 7, ks, counts)
        assert_same(idx, ri)
        assert_same(vals, rv)
        assert_same(ealias, re)
        assert bad == rbad
        vals2 = np.zeros(k, np.float32)
        z = np.zeros(0, np.float32)
        core.randomk_compress(ptrs, offsets, counts, 0, len(ptrs), z, z, 7, ks, vals2, idx)
        assert_same(vals2, x[ri])


# ---------------------------------------------------------------------------- decompress

def payloads(n, p, k, seed, same_rows=False, kind="special"):
    vals = np.stack([make_data(k, kind, seed + r) for r in range(p)]) if p else np.zeros((0, k), np.float32)
    rng = np.random.default_rng(seed)
    if same_rows:
        idx = np.tile(np.sort(rng.permutation(n)[:k]), (p, 1))
    else:
        idx = np.stack([np.sort(rng.permutation(n)[:k]) for r in range(p)]) if p else np.zeros((0, k))
    return np.ascontiguousarray(vals, np.float32), np.ascontiguousarray(idx, np.uint32)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("divisor", [1.0, 3.0, -2.0, 0.1])
def test_decompress_array(dpath, n, divisor):
    for p in (0, 1, 2, 5):
        for k in ks_for(n):
            for same in (False, True):
                vals, idx, want = decompress_case(n, p, k, same, divisor)
                out = np.full(n, 9.0, np.float32)
                core.sparse_decompress_sum_array(vals, idx, out, divisor)
                assert_same(out, want)


@functools.lru_cache(maxsize=None)
def decompress_case(n, p, k, same, divisor):
    """Payloads and the reference's sum, once for both kernel paths."""
    vals, idx = payloads(n, p, k, 10 * n + p + k, same)
    return vals, idx, ref.decompress_sum(vals, idx, n, divisor)


def test_decompress_sum_order_and_zero(dpath):
    # rank order matters in float32: (1e8 + 1) - 1e8 = 0, but 1e8 + (1 - 1e8) = 1 ...
    vals = np.array([[1e8], [1.0], [-1e8]], np.float32)
    idx = np.array([[2], [2], [2]], np.uint32)
    out = np.zeros(4, np.float32)
    core.sparse_decompress_sum_array(vals, idx, out, 1.0)
    assert out.tolist() == [0, 0, 0, 0]           # ((0 + 1e8) + 1) - 1e8 == 0 in float32
    vals = np.array([[-0.0], [-0.0]], np.float32)
    idx = np.array([[1], [1]], np.uint32)
    core.sparse_decompress_sum_array(vals, idx, out, 1.0)
    assert bits(out).tolist() == [0, 0, 0, 0]     # 0.0f + -0.0f == +0.0f
    core.sparse_decompress_sum_array(vals, idx, out, -4.0)
    assert bits(out).tolist() == [0x80000000] * 4  # 0/-4 = -0 everywhere
    # duplicates inside one row are added in m order
    vals = np.array([[1.0, 2.0, 3.0]], np.float32)
    idx = np.array([[0, 0, 3]], np.uint32)
    core.sparse_decompress_sum_array(vals, idx, out, 1.0)
    assert out.tolist() == [3, 0, 0, 3]


@pytest.mark.parametrize("cuts", TABLE_CUTS + [[0, 0, 1009]])
@pytest.mark.parametrize("divisor", [1.0, 3.0, -2.0, 0.1, 0.0])
def test_decompress_table(dpath, cuts, divisor):
    n = 1009
    for p in (1, 3):
        for k in (0, 1, 100, n):
            for same in (False, True):
                vals, idx = payloads(n, p, k, p + k, same)
                parts, ptrs, offsets, counts = split_table(np.full(n, 5.0, np.float32), cuts)
                core.sparse_decompress_sum(vals, idx, ptrs, offsets, counts, 0, len(ptrs), divisor)
                got = np.concatenate(parts)
                assert_same(got, ref.decompress_sum(vals, idx, n, divisor))
                # rows with the same ascending positions (random-k) take the one-write path
                # (the untouched elements get 0.0f / divisor: -0 for -2, NaN for 0)


@pytest.mark.parametrize("divisor", [1.0, 2.0, -2.0, 0.0])
def test_decompress_shared_large_tensors_streamed(dpath, divisor):
    """Tensors of at least 256 KiB with the rows' shared ascending positions: the AVX2 path
    writes them with non-temporal stores, chunk by chunk from a 64-byte boundary (plain
    stores for the head and the tail, and for a tensor that is not even float-aligned);
    the same bits as the reference and the scalar path wherever the tensors start and
    wherever the positions fall (head, chunk edges, tail)."""
    counts = [70001, 65536, 3, 131075, 65540]
    n = sum(counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rng = np.random.default_rng(5)
    pos = set(rng.choice(n, 2000, replace=False).tolist())
    for a, c in zip(starts, counts):       # head, around the 1024-float chunks, tail of every tensor
        pos |= {a + j for j in (0, 1, 7, 15, 16, 17, 1023, 1024, 1025, 2047, c - 17, c - 16, c - 1) if 0 <= j < c}
    idx1 = np.array(sorted(pos), np.uint32)
    k = idx1.size
    for p in (1, 2, 3):
        vals = np.ascontiguousarray(np.stack([make_data(k, "special", 40 + r) for r in range(p)]), np.float32)
        idx = np.ascontiguousarray(np.tile(idx1, (p, 1)))
        want = ref.decompress_sum(vals, idx, n, divisor)
        for shift in (0, 1, 5, 15):         # where the tensors start against a 64-byte line
            raw = np.full(n + 16 * len(counts) + 16, 7.0, np.float32)
            parts, at = [], shift
            for c in counts:
                parts.append(raw[at:at + c])
                at += c + 3
            if shift == 5:                  # one tensor not even float-aligned (bytes at an odd address)
                buf = np.zeros(4 * counts[0] + 1, np.uint8)
                parts[0] = np.frombuffer(buf.data, np.float32, counts[0], offset=1)
            ptrs = np.array([x.ctypes.data for x in parts], np.int64)
            offsets = np.array(starts, np.int64)
            core.sparse_decompress_sum(vals, idx, ptrs, offsets, np.array(counts, np.int64), 0, len(counts), divisor)
            assert_same(np.concatenate(parts), want)
            gaps = [raw[:shift]] + [raw[shift + sum(counts[:i + 1]) + 3 * i:shift + sum(counts[:i + 1]) + 3 * i + 3]
                                    for i in range(len(counts))]
            assert all((gap == 7.0).all() for gap in gaps)          # nothing written outside the tensors


@pytest.mark.parametrize("divisor", [1.0, 2.0, -2.0, 0.0])
def test_decompress_shared_takes_one_row_of_positions_and_strided_rows(dpath, divisor):
    """sparse_decompress_shared: the rows' one shared row of positions and the rows where
    they lie (a receive buffer's rows, wider than k apart) give sparse_decompress_sum's
    bits with the row repeated p times; positions that are not strictly ascending or out
    of range are refused before anything is written."""
    cuts = [0, 3, 70001, 0, 5, 65536]
    n = 70001 + 65536 + 2000
    rng = np.random.default_rng(9)
    idx1 = np.sort(rng.choice(n, 3000, replace=False)).astype(np.uint32)
    k = idx1.size
    for p in (1, 2, 3):
        wide = np.full((p, k + 37), 11.0, np.float32)            # rows k + 37 apart
        wide[:, :k] = np.stack([make_data(k, "special", 60 + r) for r in range(p)])
        vals = wide[:, :k]
        parts, ptrs, offsets, counts = split_table(np.full(n, 5.0, np.float32), cuts)
        core.sparse_decompress_shared(vals, idx1, ptrs, offsets, counts, 0, len(ptrs), divisor)
        want = ref.decompress_sum(np.ascontiguousarray(vals), np.tile(idx1, (p, 1)), n, divisor)
        assert_same(np.concatenate(parts), want)
    parts, ptrs, offsets, counts = split_table(np.full(n, 5.0, np.float32), cuts)
    for bad in (np.array([3, 3], np.uint32), np.array([5, 2], np.uint32), np.array([0, n], np.uint32)):
        with pytest.raises(ValueError, match="strictly ascending"):
            core.sparse_decompress_shared(np.ones((2, 2), np.float32), bad, ptrs, offsets, counts, 0,
                                          len(ptrs), 1.0)
    assert (np.concatenate(parts) == 5.0).all()
    with pytest.raises(ValueError, match="contiguous"):
        core.sparse_decompress_shared(np.ones((2, 4), np.float32)[:, ::2], np.array([0, 1], np.uint32), ptrs,
                                      offsets, counts, 0, len(ptrs), 1.0)


def test_decompress_table_unsorted_indices(dpath):
    n = 1009
    rng = np.random.default_rng(3)
    idx = np.stack([rng.permutation(n)[:200] for _ in range(3)]).astype(np.uint32)
    vals = rng.standard_normal((3, 200)).astype(np.float32)
    parts, ptrs, offsets, counts = split_table(np.zeros(n, np.float32), [0, 3, 0, 0, 31, 1, 5])
    core.sparse_decompress_sum(vals, idx, ptrs, offsets, counts, 0, len(ptrs), 2.0)
    assert_same(np.concatenate(parts), ref.decompress_sum(vals, idx, n, 2.0))


def test_decompress_bad_index_raises_and_writes_nothing():
    vals = np.ones((2, 3), np.float32)
    idx = np.array([[0, 1, 2], [0, 5, 1]], np.uint32)
    out = np.full(5, 7.0, np.float32)
    with pytest.raises(ValueError, match=r"index 5 at indices\[1, 1\]"):
        core.sparse_decompress_sum_array(vals, idx, out, 1.0)
    assert out.tolist() == [7.0] * 5
    parts, ptrs, offsets, counts = split_table(np.full(5, 7.0, np.float32), [2])
    with pytest.raises(ValueError, match="index 5"):
        core.sparse_decompress_sum(vals, idx, ptrs, offsets, counts, 0, len(ptrs), 1.0)
    assert np.concatenate(parts).tolist() == [7.0] * 5
    with pytest.raises(ValueError, match="shape"):
        core.sparse_decompress_sum_array(vals, idx[:, :2].copy(), out, 1.0)


# ---------------------------------------------------------------------------- validation

def test_validation_errors():
    z = np.zeros(0, np.float32)
    g = np.ones(10, np.float32)
    v = np.zeros(3, np.float32)
    i = np.zeros(3, np.uint32)
    with pytest.raises(ValueError, match="k = 11"):
        core.topk_compress_array(g, z, z, 11, np.zeros(11, np.float32), np.zeros(11, np.uint32))
    with pytest.raises(ValueError, match="k = -1"):
        core.topk_compress_array(g, z, z, -1, v, i)
    with pytest.raises(ValueError, match="e_in/e_out"):
        core.topk_compress_array(g, np.zeros(10, np.float32), z, 3, v, i)
    with pytest.raises(ValueError, match="e_in/e_out"):
        core.randomk_compress_array(g, np.zeros(9, np.float32), np.zeros(9, np.float32), 1, 3, v, i)
    with pytest.raises(ValueError, match="values"):
        core.topk_compress_array(g, z, z, 4, v, np.zeros(4, np.uint32))
    with pytest.raises(ValueError, match="indices"):
        core.randomk_compress_array(g, z, z, 0, 3, v, np.zeros(4, np.uint32))
    one = lambda v: np.array([v], np.int64)        # noqa: E731
    with pytest.raises(ValueError, match=r"ks\[0\] = 3 outside 0..2"):
        core.randomk_indices(0, one(2), one(3), i)
    with pytest.raises(ValueError, match="out has 3 elements, expected the sum of ks = 2"):
        core.randomk_indices(0, one(10), one(2), i)
    with pytest.raises(ValueError, match=r"counts\[0\] = -1"):
        core.randomk_indices(0, one(-1), one(0), np.zeros(0, np.uint32))
    with pytest.raises(ValueError, match="4294967295"):
        core.randomk_indices(0, one(2**32), one(0), np.zeros(0, np.uint32))
    with pytest.raises(ValueError, match="ks has 2 entries, counts 1"):
        core.randomk_indices(0, one(5), np.zeros(2, np.int64), i)
    # ks: one per table row, each within its row's count
    tp, to, tc = np.array([g.ctypes.data, g.ctypes.data], np.int64), np.array([0, 5], np.int64), np.array([5, 5], np.int64)
    with pytest.raises(ValueError, match=r"ks has 1 entries, expected one per table row 0..1 \(2\)"):
        core.topk_compress(tp, to, tc, 0, 2, z, z, np.array([1], np.int64), v[:1], i[:1])
    with pytest.raises(ValueError, match=r"ks\[1\] = 6 outside 0..5 \(the element count of row 1\)"):
        core.randomk_compress(tp, to, tc, 0, 2, z, z, 1, np.array([0, 6], np.int64), np.zeros(6, np.float32),
                              np.zeros(6, np.uint32))
    with pytest.raises(ValueError, match="values has 3 elements, expected the sum of ks = 2"):
        core.topk_compress(tp, to, tc, 0, 2, z, z, np.array([1, 1], np.int64), v, i[:2])
    # a bucket of 2**32 elements is refused before any pointer is touched
    big = np.array([2**31, 2**31], np.int64)
    with pytest.raises(ValueError, match="uint32"):
        core.topk_compress(np.array([8, 8], np.int64), np.array([0, 2**31], np.int64), big, 0, 2,
                           z, z, np.zeros(2, np.int64), z, np.zeros(0, np.uint32))
    with pytest.raises(ValueError, match="uint32"):
        core.sparse_decompress_sum(np.zeros((1, 0), np.float32), np.zeros((1, 0), np.uint32),
                                   np.array([8, 8], np.int64), np.array([0, 2**31], np.int64),
                                   big, 0, 2, 1.0)
    # offsets not dense / bad table range
    with pytest.raises(ValueError, match="dense"):
        core.topk_compress(np.array([g.ctypes.data, g.ctypes.data], np.int64), np.array([0, 4], np.int64),
                           np.array([5, 5], np.int64), 0, 2, z, z, np.zeros(2, np.int64), z, np.zeros(0, np.uint32))
    with pytest.raises(ValueError, match="table range"):
        core.topk_compress(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), 0, 2,
                           z, z, np.zeros(2, np.int64), z, np.zeros(0, np.uint32))


def test_topk_table_long_tensor(path):
    # a tensor longer than the 2**20-element blocks the selection streams the table in
    n = 2**20 + 37
    x = make_data(n, "normal", 55)
    parts, ptrs, offsets, counts = split_table(x, [5, 0])
    z = np.zeros(0, np.float32)
    for k in (1000, (n - 5) // 3):
        ks = np.array([2, 0, k], np.int64)
        vals = np.zeros(k + 2, np.float32)
        idx = np.zeros(k + 2, np.uint32)
        core.topk_compress(ptrs, offsets, counts, 0, len(ptrs), z, z, ks, vals, idx)
        rv, ri, _, _ = ref.topk(x, None, ks, counts)
        assert_same(idx, ri)
        assert_same(vals, rv)
