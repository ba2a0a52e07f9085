"""Bit-exact tests of the 1-bit / 2-bit quantization kernels against tests/ref_quant.py,
on both the scalar and the AVX2 path."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import SPECIAL, gen  # noqa: E402
import ref_quant as ref  # noqa: E402

import gradfuse._core as core  # noqa: E402

F32 = np.float32
PATHS = [True, False] if core.simd_info()["cpu_avx2_f16c"] else [True]
SIZES = [0, 1, 7, 31, 32, 33, 63, 64, 65, 97, 511, 512, 513, 1009, 4097, 65537]


@pytest.fixture(params=PATHS, ids=lambda s: "scalar" if s else "avx2")
def path(request):
    core.set_simd(force_scalar=request.param)
    yield request.param
    core.set_simd(force_scalar=False)


def same(a, b):
    """Bit-identical arrays; NaN matches NaN (payloads are not part of the contract)."""
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype == F32:
        nan = np.isnan(a)
        assert np.array_equal(nan, np.isnan(b))
        assert np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))
    else:
        assert np.array_equal(a, b)


def table(arrs):
    ptrs = np.array([a.ctypes.data if a.size else 0 for a in arrs], dtype=np.int64)
    counts = np.array([a.size for a in arrs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if arrs else \
        np.zeros(0, np.int64)
    return ptrs, offsets, counts


def split(x, sizes):
    out, pos = [], 0
    for s in sizes:
        out.append(x[pos:pos + s].copy())
        pos += s
    out.append(x[pos:].copy())
    return out


EMPTY = np.zeros(0, F32)


# ------------------------------------------------------------------ 1-bit

def onebit_run(x, e, block, inplace=True):
    n = len(x)
    bits = np.full(-(-n // 32), 0xDEADBEEF, np.uint32)
    scales = np.full(-(-n // block), 7.0, F32)
    if e is None:
        nbad = core.onebit_compress_array(x, EMPTY, EMPTY, block, bits, scales)
        return bits, scales, None, nbad
    ein = e.copy()
    eout = ein if inplace else np.full(n, 5.0, F32)
    nbad = core.onebit_compress_array(x, ein, eout, block, bits, scales)
    if not inplace:
        same(ein, e)                       # e_in never written when e_out differs
    return bits, scales, eout, nbad


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [32, 64, 96, 512])
def test_onebit_random(path, n, block):
    x = gen(n, n * 7 + block)
    e = gen(n, n * 7 + block + 1) * F32(0.1)
    for ee, inplace in [(None, True), (e, True), (e, False)]:
        got = onebit_run(x, ee, block, inplace)
        want = ref.onebit_compress(x, ee, block)
        same(got[0], want[0])
        same(got[1], want[1])
        if ee is None:
            assert want[2] is None
        else:
            same(got[2], want[2])
        assert got[3] == want[3] == 0


@pytest.mark.parametrize("kind", ["zero", "negzero", "special"])
@pytest.mark.parametrize("n", [1, 31, 33, 97, 1009])
def test_onebit_special(path, kind, n):
    x = gen(n, 11 + n, kind)
    e = gen(n, 12 + n, kind)
    got = onebit_run(x, e, 64, inplace=False)
    want = ref.onebit_compress(x, e, 64)
    for a, b in zip(got[:3], want[:3]):
        same(a, b)
    assert got[3] == want[3]
    if kind in ("zero", "negzero"):
        # c = +-0: every bit is 1 (-0 >= 0), scale 0, residual c - 0
        assert np.all(got[1] == 0)
        assert np.array_equal(ref.onebit_decode(got[0], got[1], 64, n) == 0, np.ones(n, bool))
        assert np.all(np.unpackbits(got[0].view(np.uint8), bitorder="little")[:n] == 1)


def test_onebit_zero_sign_bits(path):
    x = np.array([0.0, -0.0, 1.0, -1.0, np.nan, -np.nan, np.inf, -np.inf] * 4, F32)
    bits, scales, _, nbad = onebit_run(x, None, 32)
    expect = (x >= 0)
    assert np.array_equal(np.unpackbits(bits.view(np.uint8), bitorder="little").astype(bool),
                          expect)
    assert np.isnan(scales[0]) and nbad == 1


def test_onebit_nonfinite_count(path):
    n, block = 1000, 64
    x = gen(n, 3)
    x[5] = np.nan          # block 0
    x[200] = np.inf        # block 3
    x[201] = -np.inf       # block 3
    x[999] = np.nan        # last (short) block
    e = gen(n, 4)
    got = onebit_run(x, e, block, inplace=False)
    want = ref.onebit_compress(x, e, block)
    for a, b in zip(got[:3], want[:3]):
        same(a, b)
    assert got[3] == want[3] == 3
    assert not np.isfinite(got[1][[0, 3, 15]]).any()
    # overflow of the finite sum also gives a non-finite scale
    big = np.full(64, 3e38, F32)
    assert onebit_run(big, None, 64)[3] == 1


def test_onebit_padding_bits_zero(path):
    x = np.ones(33, F32)
    bits, _, _, _ = onebit_run(x, None, 32)
    assert bits.tolist() == [0xFFFFFFFF, 1]
    x = -np.ones(33, F32)
    assert onebit_run(x, None, 32)[0].tolist() == [0, 0]


def test_onebit_packbits_layout(path):
    x = gen(1000, 9)
    bits = onebit_run(x, None, 128)[0]
    pad = np.zeros(1024, bool)
    pad[:1000] = x >= 0
    assert np.array_equal(bits, np.packbits(pad, bitorder="little").view("<u4"))


def test_onebit_scale_order_matters(path):
    # 1e8 then 511 ones: a sequential float32 sum loses every +1 (ulp(1e8) = 8) and gives
    # 1e8; the canonical order loses only lane 0's 15 ones: 1e8 + 31 * 16.
    x = np.ones(512, F32)
    x[0] = 1e8
    x[100] = -1.0                                    # signs do not matter for |c|
    s = onebit_run(x, None, 512)[1][0]
    assert s == F32(F32(1e8 + 496) / F32(512))
    seq = F32(0)
    for v in np.abs(x):
        seq = F32(seq + v)
    assert seq == F32(1e8) and s != F32(seq / F32(512))
    same(np.array([s]), ref.onebit_scales(x, 512))


@pytest.mark.parametrize("block", [32, 64, 512])
def test_onebit_table(path, block):
    rng = np.random.default_rng(21)
    sizes = [0, 1, 7, 0, 31, 33, 100, 1, 0, 513, 2, 97]
    arrs = [rng.standard_normal(s).astype(F32) for s in sizes] + [np.zeros(0, F32)]
    ptrs, offsets, counts = table(arrs)
    x = np.concatenate(arrs)
    n = len(x)
    e = (rng.standard_normal(n) * 0.1).astype(F32)
    ein = e.copy()
    eout = np.empty(n, F32)
    nw, nb = ref.onebit_sizes(counts, block)        # per-tensor words and blocks
    bits = np.empty(nw, np.uint32)
    scales = np.empty(nb, F32)
    nbad = core.onebit_compress(ptrs, offsets, counts, 0, len(arrs), ein, eout, block, bits,
                                scales)
    want = ref.onebit_compress(x, e, block, counts)
    same(bits, want[0])
    same(scales, want[1])
    same(eout, want[2])
    same(ein, e)
    assert nbad == 0
    # a sub-range lo..hi of a bigger table (offsets restart at 0 at row lo)
    lo, hi = 3, 10
    sub = arrs[lo:hi]
    sp, so, sc = table(sub)
    fp = np.concatenate([np.zeros(lo, np.int64), sp])
    fo = np.concatenate([np.full(lo, -99, np.int64), so])
    fc = np.concatenate([np.full(lo, 5, np.int64), sc])
    xs = np.concatenate(sub)
    m = len(xs)
    nw2, nb2 = ref.onebit_sizes(sc, block)
    bits2 = np.empty(nw2, np.uint32)
    scales2 = np.empty(nb2, F32)
    core.onebit_compress(fp, fo, fc, lo, hi, EMPTY, EMPTY, block, bits2, scales2)
    w2 = ref.onebit_compress(xs, None, block, sc)
    same(bits2, w2[0])
    same(scales2, w2[1])


@pytest.mark.parametrize("n", [0, 1, 31, 33, 97, 1009, 4097])
@pytest.mark.parametrize("p", [1, 2, 5])
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0, 8.0, 0.25, -4.0, 2.0 ** 100, 2.0 ** -126, 7.1])
def test_onebit_decompress_sum(path, n, p, divisor):
    block = 64
    rows = [ref.onebit_compress(gen(n, 100 * n + r), None, block) for r in range(p)]
    bits = np.stack([r[0] for r in rows]) if n else np.zeros((p, 0), np.uint32)
    scales = np.stack([r[1] for r in rows]) if n else np.zeros((p, 0), F32)
    out = np.full(n, 9.0, F32)
    core.onebit_decompress_sum_array(bits, scales, block, out, divisor)
    same(out, ref.onebit_decompress_sum(bits, scales, block, n, divisor) if n else out)
    if n and p == 1 and divisor == 1.0:
        same(out, ref.onebit_decode(bits[0], scales[0], block, n))


def test_onebit_decompress_negzero_and_table(path):
    # zero scale, bit 0: v = -0.0, and a single rank keeps -0.0 (the sum starts from v_0)
    bits = np.zeros((1, 2), np.uint32)
    scales = np.zeros((1, 1), F32)
    out = np.ones(40, F32)
    core.onebit_decompress_sum_array(bits, scales, 64, out, 1.0)
    assert np.all(np.signbit(out)) and np.all(out == 0)
    core.onebit_decompress_sum_array(bits, scales, 64, out, 2.0)
    assert np.all(np.signbit(out))
    # scatter into a table with empty and odd rows
    rng = np.random.default_rng(8)
    sizes = [0, 5, 0, 64, 1, 200, 0]
    n = sum(sizes)
    p = 3
    rows = [ref.onebit_compress(rng.standard_normal(n).astype(F32), None, 32, sizes) for _ in range(p)]
    b = np.stack([r[0] for r in rows])
    s = np.stack([r[1] for r in rows])
    dst = [np.full(k, 3.0, F32) for k in sizes]
    ptrs, offsets, counts = table(dst)
    core.onebit_decompress_sum(b, s, 32, ptrs, offsets, counts, 0, len(dst), 3.0)
    same(np.concatenate(dst), ref.onebit_decompress_sum(b, s, 32, n, 3.0, sizes))


def test_onebit_blocks_restart_at_every_tensor(path):
    """No block spans two tensors: a 1e-3-scale tensor after a unit-scale one of 700
    elements gets its own scale (its own blocks), and its bits start on a new word."""
    rng = np.random.default_rng(14)
    big = rng.standard_normal(700).astype(F32)
    small = (rng.standard_normal(300) * 1e-3).astype(F32)
    ptrs, offsets, counts = table([big, small])
    bits = np.empty(22 + 10, np.uint32)             # ceil(700/32) + ceil(300/32) words
    scales = np.empty(2 + 1, F32)                   # ceil(700/512) + ceil(300/512) scales
    core.onebit_compress(ptrs, offsets, counts, 0, 2, EMPTY, EMPTY, 512, bits, scales)
    np.testing.assert_allclose(scales, [np.abs(big[:512]).mean(), np.abs(big[512:]).mean(),
                                        np.abs(small).mean()], rtol=1e-6)
    # element k of the small tensor: bit k % 32 of word 22 + k // 32; padding bits 0
    want = np.packbits(np.concatenate([small >= 0, np.zeros(20, bool)]), bitorder="little").view("<u4")
    same(bits[22:], want)
    assert bits[21] >> 28 == 0                      # the big tensor's last word: 700 = 21*32 + 28
    out = [np.empty(700, F32), np.empty(300, F32)]
    dp, do, dc = table(out)
    core.onebit_decompress_sum(bits[None], scales[None], 512, dp, do, dc, 0, 2, 1.0)
    np.testing.assert_allclose(np.abs(out[1]), np.abs(small).mean(), rtol=1e-6)
    # as the flat array of one tensor, the small one would take the big one's first scale
    flat = np.concatenate([big, small])
    fb, fs = np.empty(32, np.uint32), np.empty(2, F32)
    core.onebit_compress_array(flat, EMPTY, EMPTY, 512, fb, fs)
    assert fs[1] > 100 * scales[2]


def test_onebit_roundtrip_error_feedback(path):
    # compress(g) then decode + residual == c exactly? not exactly (rounding), but close,
    # and the residual is what makes it so: v + e == c within one ulp of |c| + s.
    x = gen(4096, 77)
    e = gen(4096, 78) * F32(0.01)
    bits, scales, res, _ = onebit_run(x, e, 256)
    v = ref.onebit_decode(bits, scales, 256, 4096)
    c = x + e
    assert np.allclose(v + res, c, rtol=1e-6, atol=1e-6)


def test_onebit_validation():
    x = np.ones(64, F32)
    b = np.empty(2, np.uint32)
    s = np.empty(2, F32)
    for blk in (0, 16, 33, 100, -32):
        with pytest.raises(ValueError, match="multiple of 32"):
            core.onebit_compress_array(x, EMPTY, EMPTY, blk, b, s)
    with pytest.raises(ValueError, match="words"):
        core.onebit_compress_array(x, EMPTY, EMPTY, 32, np.empty(3, np.uint32), s)
    with pytest.raises(ValueError, match="scales"):
        core.onebit_compress_array(x, EMPTY, EMPTY, 32, b, np.empty(1, F32))
    with pytest.raises(ValueError, match="e_in and e_out"):
        core.onebit_compress_array(x, np.zeros(64, F32), EMPTY, 32, b, s)
    with pytest.raises(ValueError, match="e_in and e_out"):
        core.onebit_compress_array(x, np.zeros(63, F32), np.zeros(63, F32), 32, b, s)
    ptrs, offsets, counts = table([x, x])
    with pytest.raises(ValueError, match="dense"):
        core.onebit_compress(ptrs, np.array([0, 60], np.int64), counts, 0, 2, EMPTY, EMPTY,
                             32, np.empty(4, np.uint32), np.empty(4, F32))
    with pytest.raises(ValueError, match="range"):
        core.onebit_compress(ptrs, offsets, counts, 0, 3, EMPTY, EMPTY, 32, b, s)
    with pytest.raises(ValueError, match="rows"):
        core.onebit_decompress_sum_array(np.zeros((2, 2), np.uint32), np.zeros((1, 2), F32),
                                         32, np.empty(64, F32), 1.0)
    with pytest.raises(ValueError, match="payload"):
        core.onebit_decompress_sum_array(np.zeros((0, 2), np.uint32), np.zeros((0, 2), F32),
                                         32, np.empty(64, F32), 1.0)
    with pytest.raises(ValueError, match="divisor"):
        core.onebit_decompress_sum_array(np.zeros((1, 2), np.uint32), np.zeros((1, 2), F32),
                                         32, np.empty(64, F32), 0.0)
    # empty bucket: nothing to do, returns 0
    assert core.onebit_compress_array(EMPTY, EMPTY, EMPTY, 32, np.empty(0, np.uint32),
                                      np.empty(0, F32)) == 0


# ------------------------------------------------------------------ 2-bit

def twobit_run(x, e, t, inplace=True):
    n = len(x)
    codes = np.full(-(-n // 4), 0xAA, np.uint8)
    if e is None:
        nbad = core.twobit_compress_array(x, EMPTY, EMPTY, t, codes)
        return codes, None, nbad
    ein = e.copy()
    eout = ein if inplace else np.full(n, 5.0, F32)
    nbad = core.twobit_compress_array(x, ein, eout, t, codes)
    if not inplace:
        same(ein, e)
    return codes, eout, nbad


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("t", [0.5, 1e-3])
def test_twobit_random(path, n, t):
    x = gen(n, n * 3 + 1)
    e = gen(n, n * 3 + 2) * F32(0.3)
    for ee, inplace in [(None, True), (e, True), (e, False)]:
        got = twobit_run(x, ee, t, inplace)
        want = ref.twobit_compress(x, ee, t)
        same(got[0], want[0])
        if ee is not None:
            same(got[1], want[1])
        assert got[2] == want[2] == 0


@pytest.mark.parametrize("kind", ["zero", "negzero", "special"])
@pytest.mark.parametrize("n", [1, 7, 33, 1009])
def test_twobit_special(path, kind, n):
    x = gen(n, 31 + n, kind)
    e = gen(n, 32 + n, kind)
    for t in (1.0, 65504.0, 1e-8, 1.4e-45):
        got = twobit_run(x, e, t, inplace=False)
        want = ref.twobit_compress(x, e, t)
        same(got[0], want[0])
        same(got[1], want[1])
        assert got[2] == want[2]


def test_twobit_codes_and_nan(path):
    t = 1.0
    x = np.array([0.0, -0.0, 1.0, -1.0, 0.999, -0.999, 2.0, -2.0, np.nan, np.inf, -np.inf],
                 F32)
    e = np.full_like(x, -0.0)                           # c = x + -0 == x, -0 included
    codes, res, nbad = twobit_run(x, e, t, inplace=False)
    k = [(codes[j // 4] >> (2 * (j % 4))) & 3 for j in range(len(x))]
    assert k == [0, 0, 1, 2, 0, 0, 1, 2, 0, 1, 2]
    assert nbad == 3
    assert np.isnan(res[8]) and res[9] == np.inf and res[10] == -np.inf
    assert np.signbit(res[1]) and res[1] == 0          # -0 - 0 stays -0
    assert res[6] == 1.0 and res[7] == -1.0
    assert codes[-1] >> 6 == 0                          # padding codes are 0
    want = ref.twobit_compress(x, e, t)
    same(codes, want[0])
    same(res, want[1])


def test_twobit_table(path):
    rng = np.random.default_rng(41)
    sizes = [0, 1, 7, 0, 31, 33, 100, 1, 0, 5000, 2, 97, 0]
    arrs = [rng.standard_normal(s).astype(F32) for s in sizes]
    ptrs, offsets, counts = table(arrs)
    x = np.concatenate(arrs)
    n = len(x)
    e = (rng.standard_normal(n) * 0.5).astype(F32)
    ein = e.copy()
    eout = np.empty(n, F32)
    codes = np.empty(-(-n // 4), np.uint8)
    nbad = core.twobit_compress(ptrs, offsets, counts, 0, len(arrs), ein, eout, 0.7, codes)
    want = ref.twobit_compress(x, e, 0.7)
    same(codes, want[0])
    same(eout, want[1])
    same(ein, e)
    assert nbad == 0


@pytest.mark.parametrize("n", [0, 1, 3, 5, 33, 1009, 9000])
@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("divisor", [1.0, 3.0, 4.0, 2.0 ** 127])
def test_twobit_decompress_sum(path, n, p, divisor):
    t = 0.37
    rng = np.random.default_rng(n + p)
    codes = rng.integers(0, 256, size=(p, -(-n // 4)), dtype=np.uint8)   # includes 0b11
    out = np.full(n, 9.0, F32)
    core.twobit_decompress_sum_array(codes, t, out, divisor)
    if n:
        same(out, ref.twobit_decompress_sum(codes, t, n, divisor))
    # table version
    sizes = [0, n // 3, 0, n - n // 3 - 1, 1] if n else [0]
    sizes = [s for s in sizes if s >= 0]
    if sum(sizes) == n:
        dst = [np.full(k, 2.0, F32) for k in sizes]
        ptrs, offsets, counts = table(dst)
        core.twobit_decompress_sum(codes, t, ptrs, offsets, counts, 0, len(dst), divisor)
        same(np.concatenate(dst), out)


def test_twobit_roundtrip():
    x = gen(1001, 5)
    codes, res, _ = twobit_run(x, np.zeros_like(x), 0.25)
    v = ref.twobit_decode(codes, 0.25, 1001)
    out = np.empty(1001, F32)
    core.twobit_decompress_sum_array(codes[None, :], 0.25, out, 1.0)
    same(out, v)
    assert np.allclose(v + res, x, rtol=1e-6, atol=1e-7)
    assert np.all(np.abs(res[v == 0]) < 0.25)


def test_twobit_validation():
    x = np.ones(8, F32)
    c = np.empty(2, np.uint8)
    for t in (0.0, -1.0, float("nan"), float("inf"), 1e-50):
        with pytest.raises(ValueError, match="threshold"):
            core.twobit_compress_array(x, EMPTY, EMPTY, t, c)
    with pytest.raises(ValueError, match="bytes"):
        core.twobit_compress_array(x, EMPTY, EMPTY, 1.0, np.empty(3, np.uint8))
    with pytest.raises(ValueError, match="e_in and e_out"):
        core.twobit_compress_array(x, np.zeros(8, F32), np.zeros(7, F32), 1.0, c)
    with pytest.raises(ValueError, match="bytes"):
        core.twobit_decompress_sum_array(np.zeros((2, 3), np.uint8), 1.0, np.empty(8, F32), 1.0)
    assert core.twobit_compress_array(EMPTY, EMPTY, EMPTY, 1.0, np.empty(0, np.uint8)) == 0


@pytest.mark.parametrize("divisor", [2.0, 4.0, 2.0 ** 100, 2.0 ** 127, 2.0 ** -126, 2.0 ** -127,
                                     2.0 ** -149, -2.0, 3.0])
def test_decompress_divisor_rounding(path, divisor):
    # power-of-two divisors take a multiply-by-exact-reciprocal path: must equal division
    # also for subnormal, overflowing, zero, inf and NaN results
    rng = np.random.default_rng(99)
    n, block = 640, 32
    vals = np.concatenate([SPECIAL, np.array([np.inf, np.nan, 3 * 1.4e-45, 5e-39, 3.4e38],
                                             F32)])
    scales = rng.choice(vals, size=(2, n // block)).astype(F32)
    bits = rng.integers(0, 2 ** 32, size=(2, n // 32), dtype=np.uint32)
    for p in (1, 2):
        out = np.empty(n, F32)
        with np.errstate(all="ignore"):
            core.onebit_decompress_sum_array(bits[:p], scales[:p], block, out, divisor)
            same(out, ref.onebit_decompress_sum(bits[:p], scales[:p], block, n, divisor))
    codes = rng.integers(0, 256, size=(2, n // 4), dtype=np.uint8)
    for t in (1.4e-45, 1e-40, 3.4e38, 1.0):
        out = np.empty(n, F32)
        with np.errstate(all="ignore"):
            core.twobit_decompress_sum_array(codes, t, out, divisor)
            same(out, ref.twobit_decompress_sum(codes, t, n, divisor))


def test_readonly_inputs(path):
    x = gen(100, 1)
    x.flags.writeable = False
    bits = np.empty(4, np.uint32)
    scales = np.empty(2, F32)
    assert core.onebit_compress_array(x, EMPTY, EMPTY, 64, bits, scales) == 0
    same(bits, ref.onebit_compress(x, None, 64)[0])
    codes = np.empty(25, np.uint8)
    assert core.twobit_compress_array(x, EMPTY, EMPTY, 0.5, codes) == 0
    same(codes, ref.twobit_compress(x, None, 0.5)[0])
    bits.flags.writeable = False
    scales.flags.writeable = False
    out = np.empty(100, F32)
    core.onebit_decompress_sum_array(bits[None], scales[None], 64, out, 1.0)
    same(out, ref.onebit_decode(bits, scales, 64, 100))


hyp = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=0, max_size=8),
       block=st.sampled_from([32, 64, 96, 128, 1024]),
       seed=st.integers(0, 2 ** 31), special=st.booleans(), scalar=st.booleans(),
       p=st.integers(1, 3))
def test_property_tables(sizes, block, seed, special, scalar, p):
    core.set_simd(force_scalar=scalar or len(PATHS) == 1)
    try:
        rng = np.random.default_rng(seed)
        n = sum(sizes)
        x = gen(n, seed, "special" if special else "normal")
        arrs = split(x, sizes)[:-1] + [np.zeros(0, F32)]
        ptrs, offsets, counts = table(arrs)
        e = (rng.standard_normal(n) * 0.1).astype(F32)
        eout = np.empty(n, F32)
        nw, nb = ref.onebit_sizes(counts, block)
        bits = np.empty(nw, np.uint32)
        scales = np.empty(nb, F32)
        with np.errstate(all="ignore"):
            nbad = core.onebit_compress(ptrs, offsets, counts, 0, len(arrs), e, eout, block,
                                        bits, scales)
            want = ref.onebit_compress(x, e, block, counts)
        same(bits, want[0])
        same(scales, want[1])
        same(eout, want[2])
        assert nbad == want[3]
        codes = np.empty(-(-n // 4), np.uint8)
        with np.errstate(all="ignore"):
            nbad = core.twobit_compress(ptrs, offsets, counts, 0, len(arrs), e, eout, 0.3,
                                        codes)
            want2 = ref.twobit_compress(x, e, 0.3)
        same(codes, want2[0])
        same(eout, want2[1])
        assert nbad == want2[2]
        # decompress-sum of p copies into the same table layout
        dst = [np.full(a.size, 4.0, F32) for a in arrs]
        dp, do, dc = table(dst)
        b2 = np.repeat(bits[None], p, axis=0)
        s2 = np.repeat(scales[None], p, axis=0)
        with np.errstate(all="ignore"):
            core.onebit_decompress_sum(b2, s2, block, dp, do, dc, 0, len(dst), float(p))
            if n:
                same(np.concatenate(dst), ref.onebit_decompress_sum(b2, s2, block, n, float(p), counts))
            c2 = np.repeat(codes[None], p, axis=0)
            core.twobit_decompress_sum(c2, 0.3, dp, do, dc, 0, len(dst), float(p))
            if n:
                same(np.concatenate(dst), ref.twobit_decompress_sum(c2, 0.3, n, float(p)))
    finally:
        core.set_simd(force_scalar=False)


def _offset_views(sizes, misalign):
    """float32 outputs of ``sizes``: 16-byte aligned (the streamed path's condition) or, with
    ``misalign``, 4 bytes past an aligned address (never streamed)."""
    outs = []
    for s in sizes:
        raw = np.full(s + 8, 9.0, F32)
        skip = (-raw.ctypes.data // 4) % 4 + (1 if misalign else 0)
        outs.append(raw[skip:skip + s])
    return outs


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_streamed_decode_same_bits(path, p, divisor, misalign):
    # tensors of at least set_stream_bytes() bytes are written with non-temporal stores
    # (AVX2 path): the same bits as the plain stores and as the numpy twins, for every
    # tensor of a table (short last blocks and words, odd sizes, an empty row), with the
    # threshold at 0 (every aligned tensor streamed), at its default and never
    sizes = [70001, 0, 5, 65536 + 32, 1000]          # 70001 floats: 273 KiB, above the default
    n, block = sum(sizes), 512
    rng = np.random.default_rng(p * 10 + int(divisor))
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.4e-45, 3.4e38], F32)
    scales = rng.standard_normal((p, ref.onebit_sizes(sizes, block)[1])).astype(F32)
    scales[:, :len(special)] = special[:scales.shape[1]]
    bits = rng.integers(0, 1 << 32, (p, ref.onebit_sizes(sizes, block)[0]), dtype=np.uint64).astype(np.uint32)
    nw2, nb2 = ref.twobit_block_sizes(sizes, block)
    codes = rng.integers(0, 1 << 32, (p, nw2), dtype=np.uint64).astype(np.uint32)
    values = (rng.standard_normal((p, nb2)) * 3).astype(F32)
    values[:, :len(special)] = special[:nb2]
    want1 = ref.onebit_decompress_sum(bits, scales, block, n, divisor, sizes)
    want2 = ref.twobit_block_decompress_sum(codes, values, block, n, divisor, sizes)
    old = core.set_stream_bytes(None)
    try:
        for threshold in (0, None, 1 << 62):
            core.set_stream_bytes(threshold)
            dst = _offset_views(sizes, misalign)
            ptrs, offsets, counts = table(dst)
            with np.errstate(all="ignore"):
                core.onebit_decompress_sum(bits, scales, block, ptrs, offsets, counts, 0, len(dst), divisor)
            same(np.concatenate(dst), want1)
            dst = _offset_views(sizes, misalign)
            ptrs, offsets, counts = table(dst)
            with np.errstate(all="ignore"):
                core.twobit_block_decompress_sum(codes, values, block, ptrs, offsets, counts, 0, len(dst), divisor)
            same(np.concatenate(dst), want2)
    finally:
        core.set_stream_bytes(old)
    assert core.set_stream_bytes(None) == old
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        core.set_stream_bytes(-1)
