"""fp16 / bf16 cast kernels: bit-exact against tests/ref_cast.py (and numpy), on both
the portable scalar path and the AVX2+F16C path."""
import numpy as np
import pytest

import gradfuse._core as c
import ref_cast as ref

FP16, BF16 = ref.FP16, ref.BF16
FMTS = [FP16, BF16]
SIZES = [0, 1, 7, 15, 16, 17, 31, 32, 33, 97, 1009, 65537]


@pytest.fixture(params=[True, False], ids=["scalar", "simd"])
def path(request):
    """Run the test on the scalar path, then on the SIMD path (where the CPU has it)."""
    before = c.simd_info()["using_avx2"]
    c.set_simd(request.param)
    if not request.param and not c.simd_info()["cpu_avx2_f16c"]:
        c.set_simd(not before)
        pytest.skip("CPU without AVX2+F16C: only the scalar path exists")
    assert c.simd_info()["using_avx2"] == (not request.param)
    yield request.param
    c.set_simd(not before)


def f32(u):
    return np.asarray(u, dtype=np.uint32).view(np.float32)


def u32(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


SPECIAL_F32 = np.array(
    [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 65519.996, 65520.0, -65520.0, 65536.0, 1e5, -1e5,
     6e-8, 5.960464477539063e-08, 2.9802322387695312e-08, 2.9802326e-08, 1e-8, -1e-8, 6.1e-5,
     6.103515625e-05, 1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38, 3.4028235e38, -3.4028235e38,
     3.3961775e38, 3.3895314e38, np.inf, -np.inf, np.nan, -np.nan, 1e-30, 9.18e-41],
    dtype=np.float32)

NAN_BITS = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF,
                     0x7F801FFF, 0x7F802000, 0x7FA00000, 0x7F800040, 0x7F80FFFF, 0x7F810000,
                     0x7FBFFFFF, 0x7FC00001, 0xFF9ABCDE], dtype=np.uint32)


def special_f32():
    return np.concatenate([SPECIAL_F32, f32(NAN_BITS)])


def f32_patterns(seed, n_random=1 << 19):
    """Float32 bit patterns: specials, random patterns, ties and near-ties of every
    rounding position at every exponent, both signs."""
    rng = np.random.default_rng(seed)
    parts = [u32(special_f32())]
    parts.append(rng.integers(0, 1 << 32, n_random, dtype=np.uint64).astype(np.uint32))
    exps = np.arange(256, dtype=np.uint32)
    for k in range(1, 24):                                   # tie bit at position k-1
        hi = rng.integers(0, 1 << 23, 256, dtype=np.uint64).astype(np.uint32) & ~np.uint32((1 << k) - 1)
        tie = np.uint32(1 << (k - 1))
        for low in (tie, tie - np.uint32(1) if k > 1 else np.uint32(0), tie + np.uint32(1) if k > 1 else tie):
            m = (hi | low) & np.uint32(0x7FFFFF)
            parts.append((exps << 23) | m)
    # dense sweep around the fp16 overflow and underflow limits, and the bf16 max
    for centre in (0x477FF000, 0x33000000, 0x33800000, 0x38800000, 0x387FE000, 0x7F7F8000, 0x00008000):
        parts.append(np.arange(centre - 4096, centre + 4096, dtype=np.int64).astype(np.uint32))
    u = np.concatenate(parts)
    return f32(np.concatenate([u, u | np.uint32(0x80000000)]))


# ----------------------------------------------------------------- element casts

def test_f16_to_f32_exhaustive(path):
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.full(65536, 7.0, np.float32)
    assert c.cast_f16_to_f32(h, out) is None
    want = h.view(np.float16).astype(np.float32)
    assert np.array_equal(u32(out), u32(want))
    assert np.array_equal(u32(out), u32(ref.f16_to_f32(h)))
    # NaN payloads are kept, signalling NaNs are not quieted
    assert u32(out)[0x7C01] == 0x7F802000 and u32(out)[0xFC01] == 0xFF802000
    # every length and misaligned starts (tails of the SIMD loop)
    for start in (0, 1, 3):
        for n in (1, 7, 8, 9, 15, 16, 17, 33):
            o = np.zeros(n, np.float32)
            c.cast_f16_to_f32(h[0x7BF0 + start:0x7BF0 + start + n], o)
            assert np.array_equal(u32(o), u32(want[0x7BF0 + start:0x7BF0 + start + n]))


def test_bf16_to_f32_exhaustive(path):
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.zeros(65536, np.float32)
    c.cast_bf16_to_f32(h, out)
    assert np.array_equal(u32(out), h.astype(np.uint32) << 16)
    assert np.array_equal(u32(out), u32(ref.bf16_to_f32(h)))


def test_f32_to_f16_patterns(path):
    x = f32_patterns(1)
    h = np.full(len(x), 0xABCD, np.uint16)
    o, u = c.cast_f32_to_f16(x, h)
    assert type(o) is int and type(u) is int
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(h, want)
    assert (o, u) == ref.counts(FP16, x, want)
    assert o > 1000 and u > 1000


def test_f32_to_f16_nan_rules(path):
    x = np.tile(f32(NAN_BITS), 3)                       # 45: SIMD body and tail
    h = np.zeros(len(x), np.uint16)
    assert c.cast_f32_to_f16(x, h) == (0, 0)
    assert np.array_equal(h, ref.f32_to_f16(x))
    got = dict(zip(NAN_BITS.tolist(), h[:len(NAN_BITS)].tolist()))
    assert got[0x7F800001] == 0x7C01          # signalling NaN stays signalling, non-zero
    assert got[0xFF800001] == 0xFC01
    assert got[0x7FC00000] == 0x7E00
    assert got[0x7F802000] == 0x7C01
    assert got[0x7FA00000] == 0x7D00
    assert got[0xFFFFFFFF] == 0xFFFF


def test_f32_to_bf16_patterns(path):
    x = f32_patterns(2)
    h = np.full(len(x), 0xABCD, np.uint16)
    o, u = c.cast_f32_to_bf16(x, h)
    want = ref.f32_to_bf16(x)
    assert np.array_equal(h, want)
    assert (o, u) == ref.counts(BF16, x, want)
    assert o > 100 and u > 1000
    # the definition, on a few hand-checked values
    hv = np.zeros(8, np.uint16)
    c.cast_f32_to_bf16(f32([0x3F808000, 0x3F818000, 0x3F808001, 0x7F7F8000, 0x7F7F7FFF,
                            0x7F800001, 0xFFC12345, 0x00008000]), hv)
    assert hv.tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x7F7F, 0x7FC0, 0xFFC1, 0x0000]


@pytest.mark.parametrize("fmt", FMTS)
def test_counts_by_hand(path, fmt):
    if fmt == FP16:
        x = np.array([65504, 65519.996, 65520, -65520, 1e5, np.inf, -np.inf, np.nan,
                      6e-8, 2.9802322387695312e-08, 1e-8, -1e-8, 1e-45, 0.0, -0.0], np.float32)
        want = (3, 4)          # 65520, -65520, 1e5 | 2^-25, 1e-8, -1e-8, 1e-45
    else:
        x = np.array([3.3895314e38, f32(0x7F7F8000), -f32(0x7F7F8000), np.inf, np.nan,
                      f32(0x8000), f32(0x8001), 1e-45, -1e-45, 0.0, -0.0, 1e-30], np.float32)
        want = (2, 3)
    for reps in (1, 5):                                   # scalar tail, then SIMD body
        xx = np.tile(x, reps)
        h = np.zeros(len(xx), np.uint16)
        got = c.cast_to16(fmt, xx, h)
        assert got == (want[0] * reps, want[1] * reps)
        assert got == ref.counts(fmt, xx, h)


# ----------------------------------------------------------------- sizes, prescale, divisor

def mixed_values(rng, n):
    kinds = rng.integers(0, 6, n)
    v = rng.standard_normal(n).astype(np.float32)
    v[kinds == 1] *= np.float32(1e5)
    v[kinds == 2] *= np.float32(1e-7)
    v[kinds == 3] = rng.choice(special_f32(), int((kinds == 3).sum()))
    v[kinds == 4] = f32(rng.integers(0, 1 << 32, int((kinds == 4).sum()), dtype=np.uint64).astype(np.uint32))
    return v


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("prescale", [1.0, 3.0, 0.25, 1e-3, -2.0])
def test_to16_sizes(path, fmt, prescale):
    rng = np.random.default_rng(100 + fmt)
    for n in SIZES:
        x = mixed_values(rng, n + 1)[1:]                   # misaligned start
        h = np.full(n + 3, 0x5555, np.uint16)
        o, u = c.cast_to16(fmt, x, h, prescale)
        wh, wo, wu = ref.cast_to16(fmt, x, prescale)
        assert np.array_equal(h[:n], wh), n
        assert (o, u) == (wo, wu), n
        assert (h[n:] == 0x5555).all()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("divisor", [1.0, 3.0, 7.0, 0.5, 1e-3])
def test_from16_sizes(path, fmt, divisor):
    rng = np.random.default_rng(200 + fmt)
    for n in SIZES:
        h = rng.integers(0, 65536, n + 1, dtype=np.uint32).astype(np.uint16)[1:]
        out = np.full(n + 2, 9.0, np.float32)
        assert c.cast_from16(fmt, h, out, divisor) is None
        assert np.array_equal(u32(out[:n]), u32(ref.cast_from16(fmt, h, divisor))), n
        assert (out[n:] == 9.0).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_all_zero(path, fmt):
    for n in (0, 1, 33, 1009):
        x = np.zeros(n, np.float32)
        x[::2] = -0.0
        h = np.full(n, 0x1234, np.uint16)
        assert c.cast_to16(fmt, x, h) == (0, 0)
        assert np.array_equal(h, np.where(np.signbit(x), 0x8000, 0).astype(np.uint16))
        back = np.full(n, 5.0, np.float32)
        c.cast_from16(fmt, h, back, 4.0)
        assert np.array_equal(u32(back), u32(x))


def test_simd_equals_scalar():
    if not c.simd_info()["cpu_avx2_f16c"]:
        pytest.skip("no AVX2+F16C")
    before = c.simd_info()["using_avx2"]
    rng = np.random.default_rng(7)
    x = mixed_values(rng, 100003)
    hb = rng.integers(0, 65536, 100003, dtype=np.uint32).astype(np.uint16)
    res = {}
    try:
        for force in (True, False):
            c.set_simd(force)
            r = []
            for fmt in FMTS:
                for p in (1.0, 3.0):
                    h = np.empty(len(x), np.uint16)
                    r.append(c.cast_to16(fmt, x, h, p))
                    r.append(h.copy())
                    f = np.empty(len(x), np.float32)
                    c.cast_from16(fmt, hb, f, p)
                    r.append(u32(f).copy())
                y = hb[::-1].copy()
                c.sum16(fmt, hb, y)
                r.append(y)
            res[force] = r
    finally:
        c.set_simd(not before)
    for a, b in zip(res[True], res[False]):
        if isinstance(a, tuple):
            assert a == b
        else:
            assert np.array_equal(a, b)


# ----------------------------------------------------------------- tables

def make_table(arrays_by_bucket):
    """Table rows for several buckets; offsets restart at 0 in each bucket."""
    ptrs, offs, cnts, ranges = [], [], [], []
    for arrays in arrays_by_bucket:
        lo, off = len(ptrs), 0
        for a in arrays:
            ptrs.append(a.ctypes.data if a.size else 0)
            offs.append(off)
            cnts.append(a.size)
            off += a.size
        ranges.append((lo, len(ptrs), off))
    return (np.array(ptrs, np.int64), np.array(offs, np.int64), np.array(cnts, np.int64), ranges)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("prescale", [1.0, 4.0, 0.1])
def test_pack_unpack_cast_table(path, fmt, prescale):
    rng = np.random.default_rng(300 + fmt)
    sizes_a = [5, 0, 31]
    sizes_b = [0, 1, 7, 0, 33, 97, 1009, 0, 17, 65537, 2]
    bucket_a = [mixed_values(rng, n) for n in sizes_a]
    bucket_b = [mixed_values(rng, n) for n in sizes_b]
    bucket_b[2][:] = 0.0                                   # an all-zero tensor
    ptrs, offs, cnts, ranges = make_table([bucket_a, bucket_b])
    for arrays, (lo, hi, n) in zip([bucket_a, bucket_b], ranges):
        buf = np.full(n + 5, 0x7777, np.uint16)
        o, u = c.pack_cast(fmt, buf, ptrs, offs, cnts, lo, hi, prescale)
        wh, wo, wu = ref.pack_cast(fmt, arrays, prescale)
        assert np.array_equal(buf[:n], wh)
        assert (o, u) == (wo, wu)
        assert (buf[n:] == 0x7777).all()
        # unpack into fresh tensors through the same table shape
        outs = [np.full(a.size, 3.0, np.float32) for a in arrays]
        optrs = ptrs.copy()
        optrs[lo:hi] = [a.ctypes.data if a.size else 0 for a in outs]
        for divisor in (1.0, 3.0):
            c.unpack_cast(fmt, buf, optrs, offs, cnts, lo, hi, divisor)
            for got, want in zip(outs, ref.unpack_cast(fmt, buf[:n], [a.size for a in arrays], divisor)):
                assert np.array_equal(u32(got), u32(want))
    # the sources were read only
    assert all(a.flags.c_contiguous for a in bucket_b)


def test_pack_cast_empty_bucket():
    ptrs = np.zeros(3, np.int64)
    offs = np.zeros(3, np.int64)
    cnts = np.zeros(3, np.int64)
    buf = np.zeros(0, np.uint16)
    assert c.pack_cast(FP16, buf, ptrs, offs, cnts, 1, 1, 1.0) == (0, 0)
    assert c.pack_cast(BF16, buf, ptrs, offs, cnts, 0, 3, 2.0) == (0, 0)
    c.unpack_cast(FP16, buf, ptrs, offs, cnts, 0, 3, 1.0)


def test_validation():
    x = np.ones(10, np.float32)
    h = np.zeros(10, np.uint16)
    ptrs, offs, cnts, ((lo, hi, n),) = make_table([[x, x[:3]]])
    with pytest.raises(ValueError, match="too short"):
        c.pack_cast(FP16, np.zeros(12, np.uint16), ptrs, offs, cnts, lo, hi, 1.0)
    with pytest.raises(ValueError, match="too short"):
        c.unpack_cast(BF16, np.zeros(12, np.uint16), ptrs, offs, cnts, lo, hi, 1.0)
    with pytest.raises(IndexError):
        c.pack_cast(FP16, np.zeros(13, np.uint16), ptrs, offs, cnts, 0, 3, 1.0)
    with pytest.raises(IndexError):
        c.pack_cast(FP16, np.zeros(13, np.uint16), ptrs, offs, cnts, 2, 1, 1.0)
    with pytest.raises(ValueError, match="fmt"):
        c.pack_cast(3, np.zeros(13, np.uint16), ptrs, offs, cnts, lo, hi, 1.0)
    for bad in (0.0, float("nan"), float("inf"), 1e300, 1e-300):
        with pytest.raises(ValueError, match="prescale"):
            c.pack_cast(FP16, np.zeros(13, np.uint16), ptrs, offs, cnts, lo, hi, bad)
        with pytest.raises(ValueError, match="divisor"):
            c.unpack_cast(FP16, np.zeros(13, np.uint16), ptrs, offs, cnts, lo, hi, bad)
    nullp = ptrs.copy()
    nullp[1] = 0
    with pytest.raises(ValueError, match="null"):
        c.pack_cast(BF16, np.zeros(13, np.uint16), nullp, offs, cnts, lo, hi, 1.0)
    with pytest.raises(ValueError, match="shorter"):
        c.cast_f32_to_f16(x, h[:9])
    with pytest.raises(ValueError, match="shorter"):
        c.cast_bf16_to_f32(h, x[:9])
    with pytest.raises(ValueError, match="fmt"):
        c.cast_to16(0, x, h)
    with pytest.raises(ValueError):
        c.sum16(FP16, b"abc", bytearray(4))
    with pytest.raises(ValueError, match="shorter"):
        c.sum16(BF16, bytes(8), bytearray(6))
    with pytest.raises((ValueError, BufferError, TypeError)):
        c.sum16(FP16, bytes(8), bytes(8))                  # read-only in/out buffer
    with pytest.raises(ValueError, match="fmt"):
        c.sum16(5, bytes(8), bytearray(8))
    # a valid call after all that
    buf = np.zeros(13, np.uint16)
    assert c.pack_cast(FP16, buf, ptrs, offs, cnts, lo, hi, 1.0) == (0, 0)
    assert (buf == 0x3C00).all()


# ----------------------------------------------------------------- 16-bit sums

def special16(fmt):
    if fmt == FP16:
        v = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF,
             0x7C00, 0xFC00, 0x7C01, 0xFC01, 0x7E00, 0xFE00, 0x7DFF, 0x7FFF, 0xFFFF, 0x3C01, 0x1400]
    else:
        v = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F,
             0x7F80, 0xFF80, 0x7F81, 0xFF81, 0x7FC0, 0xFFC0, 0x7FBF, 0x7FFF, 0xFFFF, 0x3F81, 0x3B80]
    return np.array(v, np.uint16)


@pytest.mark.parametrize("fmt", FMTS)
def test_sum16(path, fmt):
    rng = np.random.default_rng(400 + fmt)
    sp = special16(fmt)
    pa, pb = np.meshgrid(sp, sp)
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    a = np.concatenate([pa.ravel(), every, every, rng.integers(0, 65536, 100001, dtype=np.uint32).astype(np.uint16)])
    b = np.concatenate([pb.ravel(), rng.permutation(every), every[::-1],
                        rng.integers(0, 65536, 100001, dtype=np.uint32).astype(np.uint16)])
    want = ref.sum16(fmt, a, b)
    y = b.copy()
    assert c.sum16(fmt, a, y) is None
    assert np.array_equal(y, want)
    # the explicit NaN rule
    q = 0x0200 if fmt == FP16 else 0x0040
    an, bn = ref.isnan16(fmt, a), ref.isnan16(fmt, b)
    assert np.array_equal(y[an], a[an] | q)
    assert np.array_equal(y[~an & bn], b[~an & bn] | q)
    # fp16: numpy's own formula wherever the NaN order question does not arise
    if fmt == FP16:
        with np.errstate(all="ignore"):
            npy = (a.view(np.float16).astype(np.float32) + b.view(np.float16).astype(np.float32)).astype(np.float16)
        ok = ~(an & bn)
        assert np.array_equal(y[ok], npy.view(np.uint16)[ok])
        inf = np.array([0x7C00] * 20, np.uint16)
        z = inf | 0x8000
        c.sum16(fmt, inf, z)
        assert (z == 0xFE00).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_sum16_sizes_and_buffers(path, fmt):
    rng = np.random.default_rng(500 + fmt)
    for n in SIZES:
        a = rng.integers(0, 65536, n, dtype=np.uint32).astype(np.uint16)
        b = rng.integers(0, 65536, n, dtype=np.uint32).astype(np.uint16)
        want = ref.sum16(fmt, a, b)
        # numpy arrays, bytes + bytearray, memoryviews: all read as raw bytes
        y = b.copy()
        c.sum16(fmt, a, y)
        assert np.array_equal(y, want), n
        ba = bytearray(b.tobytes() + b"\x11\x22")          # longer in/out buffer
        c.sum16(fmt, a.tobytes(), ba)
        assert np.array_equal(np.frombuffer(bytes(ba[:2 * n]), np.uint16), want)
        assert ba[2 * n:] == b"\x11\x22"
        y2 = b.copy()
        c.sum16(fmt, memoryview(a), memoryview(y2.view(np.uint8)))
        assert np.array_equal(y2, want)
    # a real float sum: 1 + 1 = 2, and rounding of the float32 sum happens once
    if fmt == FP16:
        a = np.array([1, 2048, 0.1] * 11, np.float16)
        b = np.array([1, 1, 0.2] * 11, np.float16)
        y = b.view(np.uint16).copy()
        c.sum16(fmt, a.view(np.uint16), y)
        assert np.array_equal(y.view(np.float16), (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16))
        assert y.view(np.float16)[1] == 2048                # 2049 ties to even
