"""The scaled 2-bit kernels (_twobit.h through _core.twobit_block_*) against their numpy
twin (tests/ref_quant.py, twobit_block_*), bit for bit, on the scalar and AVX2 paths; the
format's promises (per-tensor blocks, the value sent is the selected mean) and the
argument checks."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import gen  # noqa: E402
import ref_quant as ref  # noqa: E402

import gradfuse._core as core  # noqa: E402

F32 = np.float32
U32 = np.uint32
EMPTY = np.zeros(0, F32)
PATHS = [True, False] if core.simd_info()["cpu_avx2_f16c"] else [True]


@pytest.fixture(params=PATHS, ids=lambda s: "scalar" if s else "avx2")
def path(request):
    core.set_simd(force_scalar=request.param)
    yield request.param
    core.set_simd(force_scalar=False)


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype == F32:
        nan = np.isnan(a)
        assert np.array_equal(nan, np.isnan(b))
        assert np.array_equal(a[~nan].view(U32), b[~nan].view(U32))
    else:
        assert np.array_equal(a, b)


def table(arrs):
    ptrs = np.array([a.ctypes.data if a.size else 0 for a in arrs], dtype=np.int64)
    counts = np.array([a.size for a in arrs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if arrs else np.zeros(0, np.int64)
    return ptrs, offsets, counts


def pieces(x, sizes):
    out, pos = [], 0
    for s in sizes:
        out.append(x[pos:pos + s].copy())
        pos += s
    return out


def compress(x, e, block, factor, sizes=None, inplace=False):
    sizes = list(sizes) if sizes is not None else [x.size]
    nw, nb = ref.twobit_block_sizes(sizes, block)
    codes, values = np.full(nw, 0xABABABAB, U32), np.full(nb, 7.0, F32)
    ein = EMPTY if e is None else e.copy()
    eout = ein if (e is None or inplace) else np.full(x.size, 5.0, F32)
    arrs = pieces(x, sizes)
    ptrs, offsets, counts = table(arrs)
    bad = core.twobit_block_compress(ptrs, offsets, counts, 0, len(arrs), ein, eout, block, factor, codes, values)
    return codes, values, (None if e is None else eout), bad


def check(x, e, block, factor, sizes=None):
    want = ref.twobit_block_compress(x, e, block, factor, sizes)
    for inplace in (False, True):
        got = compress(x, e, block, factor, sizes, inplace)
        same(got[0], want[0])
        same(got[1], want[1])
        if e is not None:
            same(got[2], want[2])
        assert got[3] == want[3]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 97, 511, 512, 513, 1009, 4097])
@pytest.mark.parametrize("block,factor", [(32, 1.0), (64, 0.5), (512, 1.0), (512, 1.7), (96, 0.0)])
def test_matches_reference(path, n, block, factor):
    x = gen(n, n + 1)
    e = gen(n, n + 2) * F32(0.1)
    check(x, e, block, factor)
    check(x, None, block, factor)


@pytest.mark.parametrize("kind", ["zero", "negzero", "special", "nonfinite", "bits"])
@pytest.mark.parametrize("n", [1, 5, 33, 1009])
def test_special_values(path, kind, n):
    x = gen(n, 40 + n, kind)
    e = gen(n, 50 + n, kind if kind != "bits" else "special")
    for block, factor in [(32, 1.0), (512, 0.7)]:
        check(x, e, block, factor)
        check(x, None, block, factor)


def test_table_blocks_restart_per_tensor(path):
    sizes = [37, 0, 1, 512, 513, 16, 17, 2000]
    rng = np.random.default_rng(3)
    x = np.concatenate([(rng.standard_normal(s) * 10.0 ** rng.integers(-4, 2)).astype(F32) for s in sizes])
    e = (rng.standard_normal(x.size) * 0.01).astype(F32)
    for block in (32, 512):
        check(x, e, block, 1.0, sizes)
    # a tiny tensor next to a large one keeps its own scale: decoded at its own magnitude
    small = (rng.standard_normal(100) * 1e-3).astype(F32)
    big = rng.standard_normal(1000).astype(F32)
    codes, values, _, _ = compress(np.concatenate([big, small]), None, 512, 1.0, [1000, 100])
    dec = ref.twobit_block_decode(codes, values, 512, 1100, [1000, 100])
    nz = dec[1000:][dec[1000:] != 0]
    assert nz.size and np.all(np.abs(nz) < 0.01)


def test_value_is_the_mean_of_the_selected():
    x = np.array([0.1, -0.2, 3.0, -5.0, 0.0, 0.05, 1.0, -1.0] * 4, F32)
    codes, values, res, _ = compress(x, np.zeros_like(x), 32, 1.0)
    s = np.abs(x).mean(dtype=np.float64)
    sel = np.abs(x) >= s
    assert values[0] == pytest.approx(np.abs(x[sel]).mean(), rel=1e-6)
    dec = ref.twobit_block_decode(codes, values, 32, x.size)
    assert np.sum(np.abs(dec)) == pytest.approx(np.sum(np.abs(x[sel])), rel=1e-6)
    same(res, (x - dec).astype(F32))
    z = np.zeros(64, F32)       # nothing selected: value 0, codes 0, residual unchanged
    codes, values, res, bad = compress(z, z.copy(), 32, 1.0)
    assert not codes.any() and not values.any() and bad == 0
    same(res, z)


@pytest.mark.parametrize("n,p,divisor", [(0, 1, 1.0), (1, 1, 1.0), (97, 2, 2.0), (4097, 3, 3.0), (1009, 5, 7.1)])
def test_decompress_sum_matches_reference(path, n, p, divisor):
    sizes = [n // 3, 0, n - n // 3] if n else [0]
    block = 64
    nw, nb = ref.twobit_block_sizes(sizes, block)
    rng = np.random.default_rng(n + p)
    codes = rng.integers(0, 1 << 32, (p, nw), dtype=np.uint64).astype(U32)     # 0b11 included
    values = (rng.standard_normal((p, nb)) * 3).astype(F32)
    dst = [np.full(s, 9.0, F32) for s in sizes]
    ptrs, offsets, counts = table(dst)
    core.twobit_block_decompress_sum(codes, values, block, ptrs, offsets, counts, 0, len(dst), divisor)
    same(np.concatenate(dst), ref.twobit_block_decompress_sum(codes, values, block, n, divisor, sizes))
    nw1, nb1 = ref.twobit_block_sizes([n], block)
    c1 = rng.integers(0, 1 << 32, (p, nw1), dtype=np.uint64).astype(U32)
    v1 = rng.standard_normal((p, nb1)).astype(F32)
    out = np.full(n, 9.0, F32)
    core.twobit_block_decompress_sum_array(c1, v1, block, out, divisor)
    same(out, ref.twobit_block_decompress_sum(c1, v1, block, n, divisor))


def test_roundtrip_residual_is_what_was_not_sent():
    x = gen(1001, 5)
    codes, values, res, _ = compress(x, np.zeros_like(x), 512, 1.0)
    out = np.empty(1001, F32)
    core.twobit_block_decompress_sum_array(codes[None, :], values[None, :], 512, out, 1.0)
    same(res, (x - out).astype(F32))


def test_validation():
    x = np.zeros(100, F32)
    c, v = np.zeros(7, U32), np.zeros(2, F32)
    with pytest.raises(ValueError, match="multiple of 32"):
        core.twobit_block_compress_array(x, EMPTY, EMPTY, 48, 1.0, c, v)
    for f in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="factor"):
            core.twobit_block_compress_array(x, EMPTY, EMPTY, 64, f, c, v)
    with pytest.raises(ValueError, match=r"codes must have 7 words"):
        core.twobit_block_compress_array(x, EMPTY, EMPTY, 64, 1.0, np.zeros(6, U32), v)
    with pytest.raises(ValueError, match=r"values must have 2 floats"):
        core.twobit_block_compress_array(x, EMPTY, EMPTY, 64, 1.0, c, np.zeros(3, F32))
    with pytest.raises(ValueError, match="both"):
        core.twobit_block_compress_array(x, np.zeros(100, F32), EMPTY, 64, 1.0, c, v)
    with pytest.raises(ValueError, match="values has 1"):
        core.twobit_block_decompress_sum_array(np.zeros((2, 7), U32), np.zeros((1, 2), F32), 64, x, 1.0)
    with pytest.raises(ValueError, match="divisor"):
        core.twobit_block_decompress_sum_array(np.zeros((1, 7), U32), np.zeros((1, 2), F32), 64, x, 0.0)
    assert core.twobit_block_compress_array(EMPTY, EMPTY, EMPTY, 64, 1.0, np.zeros(0, U32), np.zeros(0, F32)) == 0
