"""GPU kernels (gradfuse.gpu, cuda/*.cu) against the CPU kernels (gradfuse._core), bit for bit.

Every GPU kernel runs on the same inputs as its CPU twin and must give the same bits:
casts, counts and pack/unpack exactly (NaN payloads included, since the cast rules
define them); the 1-bit / 2-bit outputs exactly except NaN payloads, which are not part
of that contract (docs/compressors.md): a NaN must match a NaN.

Skipped without a GPU; a failure without one when GRADFUSE_TEST_GPU=1 (conftest_gpu.py).
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import gen  # noqa: E402
from conftest_gpu import require_gpu  # noqa: E402

import gradfuse._core as core  # noqa: E402

pytestmark = pytest.mark.gpu

F32 = np.float32
U32 = np.uint32
SIZES = [0, 1, 7, 31, 32, 33, 63, 64, 65, 97, 511, 512, 513, 1009, 4097, 65537, (1 << 20) + 13]


@pytest.fixture(scope="module")
def g():
    cp, gpu = require_gpu()
    return cp, gpu


# ------------------------------------------------------------------ helpers

def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    av = a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")
    bv = b.view(np.uint8) if b.dtype.itemsize == 1 else b.view(f"u{b.dtype.itemsize}")
    bad = np.flatnonzero(av.reshape(-1) != bv.reshape(-1))
    assert bad.size == 0, (f"{bad.size} of {a.size} differ; first at {bad[:5].tolist()}: "
                           f"gpu {av.reshape(-1)[bad[:5]].tolist()} cpu {bv.reshape(-1)[bad[:5]].tolist()}")


def same(a, b):
    """Bit-identical; for float32 a NaN matches any NaN (payloads are not in the contract)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == F32 and b.dtype == F32 and a.shape == b.shape:
        na, nb = np.isnan(a), np.isnan(b)
        assert np.array_equal(na, nb), f"NaN positions differ: {np.flatnonzero(na != nb)[:5]}"
        same_bits(a[~na], b[~nb])
    else:
        same_bits(a, b)


def host_table(arrs):
    """(ptrs, offsets, counts) of numpy arrays, dense element offsets."""
    ptrs = np.array([a.ctypes.data if a.size else 0 for a in arrs], np.int64)
    counts = np.array([a.size for a in arrs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if arrs else np.zeros(0, np.int64)
    return ptrs, offsets, counts


def dev_table(darrs):
    ptrs = np.array([a.data.ptr if a.size else 0 for a in darrs], np.int64)
    counts = np.array([a.size for a in darrs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if darrs else np.zeros(0, np.int64)
    return ptrs, offsets, counts


def split_sizes(n, seed):
    """Tensor sizes summing to n, with empty, tiny and odd rows."""
    rng = np.random.default_rng(seed)
    sizes, left = [], n
    while left > 0:
        s = int(min(left, rng.choice([0, 1, 2, 5, 31, 33, 100, 513, 4097, left])))
        sizes.append(s)
        left -= s
    sizes.insert(min(1, len(sizes)), 0)
    return sizes


def onebit_sizes(counts, block):
    """Words and scales of a 1-bit payload: every tensor's own words and blocks."""
    counts = [int(c) for c in counts]
    return sum(-(-c // 32) for c in counts), sum(-(-c // block) for c in counts)


def chunks(x, sizes):
    out, pos = [], 0
    for s in sizes:
        out.append(x[pos:pos + s].copy())
        pos += s
    return out


def test_compile_every_kernel(g):
    cp, gpu = g
    names = gpu.compile_all()
    assert len(names) == sum(len(v) for v in gpu.FAMILIES.values())


def test_module_cached_per_device(g):
    cp, gpu = g
    assert gpu.module("onebit") is gpu.module("onebit")
    assert gpu.kernel("gf_pack") is gpu.kernel("gf_pack")


def test_modules_compiled_by_gradfuse_with_its_options_and_kept_on_disk(g, monkeypatch):
    """gradfuse compiles with NVRTC itself (cupy would append -ftz=true); the module file is
    reused by the next process (same source, options, NVRTC) instead of compiled again."""
    cp, gpu = g
    cc = int(cp.cuda.Device().compute_capability)
    path = gpu.module_path("pack", cc)
    assert os.path.exists(path) and path.endswith((".cubin", ".ptx"))
    calls = []
    monkeypatch.setattr(gpu.loader, "compile_family", lambda *a: calls.append(a) or (b"", "cubin"))
    assert gpu.module_path("pack", cc) == path and not calls


def test_subnormals_survive_on_the_device(g):
    """The kernels as loaded keep subnormal inputs and results (no flush to zero)."""
    cp, gpu = g
    gpu.check_subnormals()


def test_flushed_subnormals_are_reported(g, monkeypatch):
    cp, gpu = g

    def flushing_div(x, d):
        x[...] = cp.asarray(np.where(np.abs(x.get()) < np.float32(2.0 ** -126), 0, x.get() / 2).astype(F32))

    monkeypatch.setattr(gpu.verify, "div_f32", flushing_div)
    with pytest.raises(RuntimeError, match="flush subnormals to zero.*compiled with"):
        gpu.check_subnormals()


# ------------------------------------------------------------------ pack / unpack

@pytest.mark.parametrize("seed", range(4))
def test_pack_unpack(g, seed):
    cp, gpu = g
    rng = np.random.default_rng(seed)
    nbs = [int(v) for v in rng.choice([0, 1, 3, 4, 15, 16, 17, 64, 1000, 4096, 65536 + 5], 40)]
    host = [rng.integers(0, 256, nb, dtype=np.uint8) for nb in nbs]
    # unaligned offsets too (a byte table may place rows anywhere)
    offsets = np.zeros(len(nbs), np.int64)
    pos = 3 if seed % 2 else 0
    for i, nb in enumerate(nbs):
        offsets[i] = pos
        pos += nb + (int(rng.integers(0, 3)) if seed % 2 else 0)
    total = pos
    nbytes = np.array(nbs, np.int64)
    buf_c = np.zeros(total, np.uint8)
    core.pack(buf_c, np.array([a.ctypes.data for a in host], np.int64), offsets, nbytes, 0, len(nbs))
    dev = [cp.asarray(a) for a in host]
    dptrs = np.array([a.data.ptr for a in dev], np.int64)
    buf_g = cp.zeros(total, np.uint8)
    gpu.pack(buf_g, dptrs, offsets, nbytes, 0, len(nbs))
    same_bits(buf_g.get(), buf_c)
    # sub-range, with cupy tables
    lo, hi = 5, 30
    buf_g2 = cp.zeros(total, np.uint8)
    buf_c2 = np.zeros(total, np.uint8)
    gpu.pack(buf_g2, cp.asarray(dptrs), cp.asarray(offsets), cp.asarray(nbytes), lo, hi)
    core.pack(buf_c2, np.array([a.ctypes.data for a in host], np.int64), offsets, nbytes, lo, hi)
    same_bits(buf_g2.get(), buf_c2)
    # unpack into fresh destinations
    src = rng.integers(0, 256, total, dtype=np.uint8)
    outs_c = [np.zeros(nb, np.uint8) for nb in nbs]
    core.unpack(src, np.array([a.ctypes.data for a in outs_c], np.int64), offsets, nbytes, 0, len(nbs))
    outs_g = [cp.zeros(nb, np.uint8) for nb in nbs]
    gpu.unpack(cp.asarray(src), np.array([a.data.ptr for a in outs_g], np.int64), offsets, nbytes, 0, len(nbs))
    for a, b in zip(outs_g, outs_c):
        same_bits(a.get(), b)


@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0, 0.5, -7.0, 1e-3, 2.0 ** -126, 3e38])
def test_unpack_div_f32(g, divisor):
    cp, gpu = g
    sizes = [0, 1, 5, 33, 1000, 4097, 0, 70001]
    x = np.concatenate([gen(sum(sizes) // 2, 1, "bits"), gen(sum(sizes) - sum(sizes) // 2, 2, "special")])
    nbytes = np.array(sizes, np.int64) * 4
    offsets = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    outs_c = [np.zeros(s, F32) for s in sizes]
    core.unpack_div(x.view(np.uint8), np.array([a.ctypes.data for a in outs_c], np.int64), offsets, nbytes,
                    0, len(sizes), 2, divisor)
    outs_g = [cp.zeros(s, F32) for s in sizes]
    gpu.unpack_div_f32(cp.asarray(x.view(np.uint8)), np.array([a.data.ptr for a in outs_g], np.int64),
                       offsets, nbytes, 0, len(sizes), divisor)
    for a, b in zip(outs_g, outs_c):
        same_bits(a.get(), b)
    y = cp.asarray(x)
    gpu.div_f32(y, divisor)
    xc = x.copy()
    core.div_inplace(xc.ctypes.data, xc.size, 2, divisor)
    same_bits(y.get(), xc)


@pytest.mark.parametrize("bad", ["offset", "nbytes", "pointer"])
@pytest.mark.parametrize("on_device", [False, True], ids=["host-table", "device-table"])
def test_unpack_div_f32_refuses_misaligned_rows(g, bad, on_device):
    """Whole floats only: a misaligned address would be a sticky CUDA error on a GPU."""
    cp, gpu = g
    buf = cp.zeros(64, cp.uint8)
    out = cp.zeros(8, F32)
    ptrs = np.array([out.data.ptr + (2 if bad == "pointer" else 0)], np.int64)
    offsets = np.array([2 if bad == "offset" else 0], np.int64)
    nbytes = np.array([6 if bad == "nbytes" else 8], np.int64)
    tables = [cp.asarray(t) for t in (ptrs, offsets, nbytes)] if on_device else [ptrs, offsets, nbytes]
    with pytest.raises(ValueError, match="multiples of 4"):
        gpu.unpack_div_f32(buf, *tables, 0, 1, 2.0)


# ------------------------------------------------------------------ casts

def f32_patterns():
    """Every high half with low halves at the rounding boundaries, plus random patterns."""
    hi = np.arange(1 << 16, dtype=U32) << 16
    lows = np.array([0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x3000, 0x7fff, 0x8000, 0x8001,
                     0xefff, 0xf000, 0xffff], U32)
    pats = (hi[:, None] | lows[None, :]).reshape(-1)
    rnd = np.random.default_rng(5).integers(0, 1 << 32, 1 << 21, dtype=np.uint64).astype(U32)
    edges = np.array([0x477ff000, 0x477fefff, 0x477ff001, 0x33000000, 0x33000001, 0x32ffffff,
                      0x7f7f8000, 0x7f7f7fff, 0x00008000, 0x00008001, 0x7f800000, 0x7f800001,
                      0x7fc00000, 0x7fbfffff, 0x7f802000, 0x7f801fff], U32)
    edges = np.concatenate([edges, edges | 0x80000000])
    return np.concatenate([pats, rnd, edges]).view(F32)


@pytest.fixture(scope="module")
def patterns():
    return f32_patterns()


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("prescale", [1.0, 3.0, 0.5, -7.0, 1e-3, 65536.0])
def test_cast_to16(g, patterns, fmt, prescale):
    cp, gpu = g
    x = patterns
    want = np.zeros(x.size, np.uint16)
    cnt_c = core.cast_to16(fmt, x, want, prescale)
    got = cp.zeros(x.size, np.uint16)
    cnt_g = gpu.cast_to16(fmt, cp.asarray(x), got, prescale)
    same_bits(got.get(), want)
    assert cnt_g == cnt_c
    # device-side counts
    out = cp.zeros(2, np.uint64)
    assert gpu.cast_to16(fmt, cp.asarray(x), got, prescale, count_out=out) is out
    assert tuple(int(v) for v in out.get()) == cnt_c


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("divisor", [1.0, 3.0, 0.5, -7.0, 2.0 ** -20])
def test_cast_from16_exhaustive(g, fmt, divisor):
    cp, gpu = g
    h = np.arange(1 << 16, dtype=np.uint16)
    want = np.zeros(h.size, F32)
    core.cast_from16(fmt, h, want, divisor)
    got = cp.zeros(h.size, F32)
    gpu.cast_from16(fmt, cp.asarray(h), got, divisor)
    same_bits(got.get(), want)


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("prescale", [1.0, 4.0, 3.0])
def test_pack_unpack_cast_table(g, fmt, prescale):
    cp, gpu = g
    sizes = split_sizes(300000, fmt * 10 + int(prescale))
    x = np.concatenate([gen(150000, 3, "bits"), gen(150000, 4, "normal") * F32(1e4)])
    arrs = chunks(x, sizes)
    ptrs, offsets, counts = host_table(arrs)
    buf_c = np.zeros(x.size, np.uint16)
    cnt_c = core.pack_cast(fmt, buf_c, ptrs, offsets, counts, 0, len(arrs), prescale)
    darrs = [cp.asarray(a) for a in arrs]
    dptrs, _, _ = dev_table(darrs)
    buf_g = cp.zeros(x.size, np.uint16)
    cnt_g = gpu.pack_cast(fmt, buf_g, dptrs, offsets, counts, 0, len(arrs), prescale)
    same_bits(buf_g.get(), buf_c)
    assert cnt_g == cnt_c
    outs_c = [np.zeros(a.size, F32) for a in arrs]
    core.unpack_cast(fmt, buf_c, host_table(outs_c)[0], offsets, counts, 0, len(arrs), prescale)
    outs_g = [cp.zeros(a.size, F32) for a in arrs]
    gpu.unpack_cast(fmt, buf_g, cp.asarray(dev_table(outs_g)[0]), cp.asarray(offsets), cp.asarray(counts),
                    0, len(arrs), prescale)
    for a, b in zip(outs_g, outs_c):
        same_bits(a.get(), b)


@pytest.mark.parametrize("fmt", [1, 2])
def test_sum16(g, fmt):
    cp, gpu = g
    rng = np.random.default_rng(fmt)
    a = rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint32).astype(np.uint16)
    b = rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint32).astype(np.uint16)
    # every pair of a few interesting patterns (zeros, infs, NaNs, max, subnormals)
    inf, nan = (0x7c00, 0x7e01) if fmt == 1 else (0x7f80, 0x7fc1)
    mx = 0x7bff if fmt == 1 else 0x7f7f
    sp = np.array([0, 0x8000, 1, 0x8001, inf, inf | 0x8000, nan, nan | 0x8000, nan - 0x200 // (1 if fmt == 1 else 8),
                   mx, mx | 0x8000, 0x3c00, 0xbc00], np.uint16)
    a = np.concatenate([a, np.repeat(sp, sp.size)])
    b = np.concatenate([b, np.tile(sp, sp.size)])
    want = b.copy()
    core.sum16(fmt, a, want)
    got = cp.asarray(b)
    gpu.sum16(fmt, cp.asarray(a), got)
    same_bits(got.get(), want)


# ------------------------------------------------------------------ 1-bit

def onebit_cpu(x, e, block, inplace, table_sizes=None):
    n = x.size
    nw, nb = onebit_sizes([n] if table_sizes is None else table_sizes, block)
    bits = np.full(nw, 0xDEADBEEF, U32)
    scales = np.full(nb, 7.0, F32)
    z = np.zeros(0, F32)
    ein = z if e is None else e.copy()
    eout = z if e is None else (ein if inplace else np.full(n, 5.0, F32))
    if table_sizes is None:
        bad = core.onebit_compress_array(x, ein, eout, block, bits, scales)
    else:
        arrs = chunks(x, table_sizes)
        ptrs, offsets, counts = host_table(arrs)
        bad = core.onebit_compress(ptrs, offsets, counts, 0, len(arrs), ein, eout, block, bits, scales)
    return bits, scales, (None if e is None else eout), bad


def onebit_gpu(cp, gpu, x, e, block, inplace, table_sizes=None):
    n = x.size
    nw, nb = onebit_sizes([n] if table_sizes is None else table_sizes, block)
    bits = cp.full(nw, 0xDEADBEEF, U32)
    scales = cp.full(nb, 7.0, F32)
    if e is None:
        ein = eout = cp.zeros(0, F32)
    else:
        ein = cp.asarray(e)
        eout = ein if inplace else cp.full(n, 5.0, F32)
    if table_sizes is None:
        bad = gpu.onebit_compress_array(cp.asarray(x), ein, eout, block, bits, scales)
    else:
        darrs = [cp.asarray(a) for a in chunks(x, table_sizes)]
        ptrs, offsets, counts = dev_table(darrs)
        bad = gpu.onebit_compress(ptrs, offsets, counts, 0, len(darrs), ein, eout, block, bits, scales)
    if e is not None and not inplace:
        same_bits(ein.get(), e)            # e_in never written when e_out differs
    return bits.get(), scales.get(), (None if e is None else eout.get()), bad


def check_onebit(cp, gpu, x, e, block, inplace, table_sizes=None):
    want = onebit_cpu(x, e, block, inplace, table_sizes)
    got = onebit_gpu(cp, gpu, x, e, block, inplace, table_sizes)
    same_bits(got[0], want[0])
    same(got[1], want[1])
    if e is not None:
        same(got[2], want[2])
    assert got[3] == want[3]


# block 1024 is the largest kept in registers (32 words per lane); 2048 and 4096 take the
# re-reading path
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [32, 64, 96, 512, 1024, 2048])
def test_onebit_compress_random(g, n, block):
    cp, gpu = g
    x = gen(n, n * 7 + block)
    e = gen(n, n * 7 + block + 1) * F32(0.1)
    for ee, inplace in [(None, True), (e, True), (e, False)]:
        check_onebit(cp, gpu, x, ee, block, inplace)


@pytest.mark.parametrize("kind", ["zero", "negzero", "special", "nonfinite", "bits"])
@pytest.mark.parametrize("n", [1, 31, 33, 97, 1009, 65537])
@pytest.mark.parametrize("block", [32, 512, 4096])
def test_onebit_compress_special(g, kind, n, block):
    cp, gpu = g
    x = gen(n, 11 + n, kind)
    e = gen(n, 12 + n, kind if kind != "bits" else "special")
    check_onebit(cp, gpu, x, e, block, inplace=False)
    check_onebit(cp, gpu, x, None, block, inplace=True)


def test_onebit_scale_order_matters(g):
    """Inputs whose mean |c| depends on the summation order: only the canonical order matches."""
    cp, gpu = g
    x = np.zeros(512, F32)
    x[0] = 1e8
    x[1::2] = 1.0
    x[2::64] = -3e7
    check_onebit(cp, gpu, x, None, 512, True)
    rng = np.random.default_rng(3)
    y = (rng.standard_normal(1 << 16) * np.exp(rng.uniform(-20, 20, 1 << 16))).astype(F32)
    for block in (32, 512, 1024, 2048):
        check_onebit(cp, gpu, y, None, block, True)


@pytest.mark.parametrize("block", [32, 512, 2048])
@pytest.mark.parametrize("n", [1, 97, 4097, 300001])
def test_onebit_compress_table(g, block, n):
    cp, gpu = g
    x = gen(n, n + 1)
    e = gen(n, n + 2) * F32(0.1)
    sizes = split_sizes(n, n + block)
    check_onebit(cp, gpu, x, e, block, inplace=False, table_sizes=sizes)
    check_onebit(cp, gpu, x, e, block, inplace=True, table_sizes=sizes)
    check_onebit(cp, gpu, x, None, block, inplace=True, table_sizes=sizes)


def test_onebit_table_subrange_and_cupy_tables(g):
    cp, gpu = g
    rng = np.random.default_rng(21)
    sizes = [0, 1, 7, 0, 31, 33, 100, 1, 0, 513, 2, 97]
    arrs = [rng.standard_normal(s).astype(F32) for s in sizes]
    lo, hi = 3, 10
    sub = arrs[lo:hi]
    xs = np.concatenate(sub)
    want = onebit_cpu(xs, None, 64, True, [a.size for a in sub])
    darrs = [cp.asarray(a) for a in arrs]
    sp, so, sc = dev_table(darrs[lo:hi])
    fp = np.concatenate([np.zeros(lo, np.int64), sp])
    fo = np.concatenate([np.full(lo, -99, np.int64), so])
    fc = np.concatenate([np.full(lo, 5, np.int64), sc])
    nw, nb = onebit_sizes(sizes[lo:hi], 64)
    bits = cp.empty(nw, U32)
    scales = cp.empty(nb, F32)
    empty = cp.zeros(0, F32)
    bad = gpu.onebit_compress(cp.asarray(fp), cp.asarray(fo), cp.asarray(fc), lo, hi, empty, empty, 64, bits, scales)
    same_bits(bits.get(), want[0])
    same(scales.get(), want[1])
    assert bad == want[3] == 0
    # the same through a resident host table (the layout is made once and kept with it)
    rc = gpu.resident(fc)
    for _ in range(2):
        bits.fill(0)
        gpu.onebit_compress(gpu.resident(fp), gpu.resident(fo), rc, lo, hi, empty, empty, 64, bits, scales)
    same_bits(bits.get(), want[0])
    same(scales.get(), want[1])
    assert bad == want[3] == 0


def test_onebit_device_count(g):
    cp, gpu = g
    x = gen(10000, 9, "nonfinite")
    want = onebit_cpu(x, None, 64, True)
    out = cp.zeros(1, np.uint64)
    bits = cp.empty(-(-x.size // 32), U32)
    scales = cp.empty(-(-x.size // 64), F32)
    empty = cp.zeros(0, F32)
    r = gpu.onebit_compress_array(cp.asarray(x), empty, empty, 64, bits, scales, count_out=out)
    assert r is out and int(out.get()[0]) == want[3] > 0


def test_small_tensor_next_to_large_keeps_its_own_scale_and_selection(g):
    """Per-tensor formats on the GPU (docs/compressors.md): the 1e-3-scale tensor after a
    unit-scale one gets its own 1-bit scale and words, and its own top-k / random-k k."""
    cp, gpu = g
    rng = np.random.default_rng(14)
    big = rng.standard_normal(700).astype(F32)
    small = (rng.standard_normal(300) * 1e-3).astype(F32)
    x = np.concatenate([big, small])
    check_onebit(cp, gpu, x, None, 512, True, table_sizes=[700, 300])
    _, scales, _, _ = onebit_gpu(cp, gpu, x, None, 512, True, table_sizes=[700, 300])
    assert scales.size == 3
    np.testing.assert_allclose(scales[2], np.abs(small).mean(), rtol=1e-6)
    want = check_sp(cp, gpu, "topk", x, None, [7, 3], sizes=[700, 300])
    assert set(want[1][7:] - 700) == set(np.argsort(-np.abs(small))[:3])
    check_sp(cp, gpu, "randomk", x, None, [7, 3], sizes=[700, 300], seed=5)


DIVISORS = [1.0, 2.0, 3.0, 8.0, 0.25, -4.0, 2.0 ** 100, 2.0 ** -126, 7.1, 2.0 ** 126]


@pytest.mark.parametrize("n", [0, 1, 31, 33, 97, 1009, 4097, 300001])
@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("divisor", DIVISORS)
def test_onebit_decompress_sum(g, n, p, divisor):
    cp, gpu = g
    block = 64
    rng = np.random.default_rng(n + p)
    bits = rng.integers(0, 1 << 32, (p, -(-n // 32)), dtype=np.uint64).astype(U32)
    scales = np.abs(gen(p * -(-n // block), n + 7, "normal")).reshape(p, -1)
    if scales.size:
        scales.reshape(-1)[::17] = 0.0                      # -0 values where the bit is 0
        scales.reshape(-1)[::29] = np.float32(3e38)         # overflow of the sum
    want = np.full(n, 9.0, F32)
    core.onebit_decompress_sum_array(bits, scales, block, want, divisor)
    got = cp.full(n, 9.0, F32)
    gpu.onebit_decompress_sum_array(cp.asarray(bits), cp.asarray(scales), block, got, divisor)
    same(got.get(), want)
    # the same through a table with empty and odd rows (its own per-tensor payload sizes)
    sizes = split_sizes(n, n + 3 * p)
    nw, nb = onebit_sizes(sizes, block)
    bits = rng.integers(0, 1 << 32, (p, nw), dtype=np.uint64).astype(U32)
    scales = np.abs(gen(p * nb, n + 8, "normal")).reshape(p, nb)
    outs_c = [np.full(s, 3.0, F32) for s in sizes]
    pc, oc, cc = host_table(outs_c)
    core.onebit_decompress_sum(bits, scales, block, pc, oc, cc, 0, len(sizes), divisor)
    outs_g = [cp.full(s, 3.0, F32) for s in sizes]
    pg, og, cg = dev_table(outs_g)
    gpu.onebit_decompress_sum(cp.asarray(bits), cp.asarray(scales), block, pg, og, cg, 0, len(sizes), divisor)
    for a, b in zip(outs_g, outs_c):
        same(a.get(), b)


def test_onebit_decompress_strided_rows_and_negzero(g):
    """Payload rows as views of a wire table (row stride > row length), and -0 from v_0."""
    cp, gpu = g
    n, p, block = 5000, 3, 512
    nw, nb = -(-n // 32), -(-n // block)
    rowbytes = 8 + 4 * nw + 4 * nb + 12
    rng = np.random.default_rng(4)
    table = rng.integers(0, 256, (p, rowbytes), dtype=np.uint8)
    table[:, 8 + 4 * nw:8 + 4 * nw + 4 * nb] = np.abs(gen(p * nb, 5)).reshape(p, nb).view(np.uint8)
    bits_c = table[:, 8:8 + 4 * nw].view(U32)
    scales_c = table[:, 8 + 4 * nw:8 + 4 * nw + 4 * nb].view(F32)
    want = np.empty(n, F32)
    core.onebit_decompress_sum_array(bits_c, scales_c, block, want, 3.0)
    dt = cp.asarray(table)
    got = cp.empty(n, F32)
    gpu.onebit_decompress_sum_array(dt[:, 8:8 + 4 * nw].view(U32), dt[:, 8 + 4 * nw:8 + 4 * nw + 4 * nb].view(F32),
                                    block, got, 3.0)
    same(got.get(), want)
    out = cp.ones(40, F32)
    gpu.onebit_decompress_sum_array(cp.zeros((1, 2), U32), cp.zeros((1, 1), F32), 64, out, 1.0)
    o = out.get()
    assert np.all(np.signbit(o)) and np.all(o == 0)


def test_onebit_roundtrip_residual(g):
    """e_out = c - decode(compress(c)) holds on the GPU (the error-feedback identity)."""
    cp, gpu = g
    n, block = 100003, 512
    x = gen(n, 1)
    c = cp.asarray(x)
    e = cp.zeros(n, F32)
    bits = cp.empty(-(-n // 32), U32)
    scales = cp.empty(-(-n // block), F32)
    gpu.onebit_compress_array(c, e, e, block, bits, scales)
    dec = cp.empty(n, F32)
    gpu.onebit_decompress_sum_array(bits[None, :], scales[None, :], block, dec, 1.0)
    same((c - dec).get(), e.get())


# ------------------------------------------------------------------ 2-bit

def twobit_cpu(x, e, t, inplace):
    n = x.size
    codes = np.full(-(-n // 4), 0xAB, np.uint8)
    if e is None:
        bad = core.twobit_compress_array(x, np.zeros(0, F32), np.zeros(0, F32), t, codes)
        return codes, None, bad
    ein = e.copy()
    eout = ein if inplace else np.full(n, 5.0, F32)
    bad = core.twobit_compress_array(x, ein, eout, t, codes)
    return codes, eout, bad


def twobit_gpu(cp, gpu, x, e, t, inplace, table_sizes=None):
    n = x.size
    codes = cp.full(-(-n // 4), 0xAB, np.uint8)
    if e is None:
        ein = eout = cp.zeros(0, F32)
    else:
        ein = cp.asarray(e)
        eout = ein if inplace else cp.full(n, 5.0, F32)
    if table_sizes is None:
        bad = gpu.twobit_compress_array(cp.asarray(x), ein, eout, t, codes)
    else:
        darrs = [cp.asarray(a) for a in chunks(x, table_sizes)]
        ptrs, offsets, counts = dev_table(darrs)
        bad = gpu.twobit_compress(ptrs, offsets, counts, 0, len(darrs), ein, eout, t, codes)
    if e is not None and not inplace:
        same_bits(ein.get(), e)
    return codes.get(), (None if e is None else eout.get()), bad


def check_twobit(cp, gpu, x, e, t, inplace, table_sizes=None):
    want = twobit_cpu(x, e, t, inplace)
    got = twobit_gpu(cp, gpu, x, e, t, inplace, table_sizes)
    same_bits(got[0], want[0])
    if e is not None:
        same(got[1], want[1])
    assert got[2] == want[2]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("t", [0.5, 1e-3, 1.0])
def test_twobit_compress_random(g, n, t):
    cp, gpu = g
    x = gen(n, n + 5)
    e = gen(n, n + 6) * F32(0.1)
    for ee, inplace in [(None, True), (e, True), (e, False)]:
        check_twobit(cp, gpu, x, ee, t, inplace)


@pytest.mark.parametrize("kind", ["zero", "negzero", "special", "nonfinite", "bits"])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 33, 1009, 65537])
def test_twobit_compress_special(g, kind, n):
    cp, gpu = g
    x = gen(n, 21 + n, kind)
    e = gen(n, 22 + n, kind if kind != "bits" else "special")
    for t in (0.5, 1e-38, 65504.0):
        check_twobit(cp, gpu, x, e, t, inplace=False)
        check_twobit(cp, gpu, x, None, t, inplace=True)


@pytest.mark.parametrize("n", [1, 97, 4097, 300001])
def test_twobit_compress_table(g, n):
    cp, gpu = g
    x = gen(n, n + 11)
    e = gen(n, n + 12) * F32(0.1)
    sizes = split_sizes(n, n + 13)
    check_twobit(cp, gpu, x, e, 0.5, inplace=False, table_sizes=sizes)
    check_twobit(cp, gpu, x, e, 0.5, inplace=True, table_sizes=sizes)
    check_twobit(cp, gpu, x, None, 0.5, inplace=True, table_sizes=sizes)


@pytest.mark.parametrize("n", [0, 1, 3, 5, 97, 4097, 300001])
@pytest.mark.parametrize("p", [1, 2, 5])
@pytest.mark.parametrize("divisor", DIVISORS)
def test_twobit_decompress_sum(g, n, p, divisor):
    cp, gpu = g
    t = 0.37
    rng = np.random.default_rng(n * 3 + p)
    codes = rng.integers(0, 256, (p, -(-n // 4)), dtype=np.uint16).astype(np.uint8)   # 0b11 too
    want = np.full(n, 9.0, F32)
    core.twobit_decompress_sum_array(codes, t, want, divisor)
    got = cp.full(n, 9.0, F32)
    gpu.twobit_decompress_sum_array(cp.asarray(codes), t, got, divisor)
    same(got.get(), want)
    sizes = split_sizes(n, n + p)
    outs_c = [np.full(s, 3.0, F32) for s in sizes]
    pc, oc, cc = host_table(outs_c)
    core.twobit_decompress_sum(codes, t, pc, oc, cc, 0, len(sizes), divisor)
    outs_g = [cp.full(s, 3.0, F32) for s in sizes]
    pg, og, cg = dev_table(outs_g)
    gpu.twobit_decompress_sum(cp.asarray(codes), t, pg, og, cg, 0, len(sizes), divisor)
    for a, b in zip(outs_g, outs_c):
        same(a.get(), b)


# ------------------------------------------------------------------ scaled 2-bit (per-tensor blocks)

def tbb_sizes(counts, block):
    return sum(-(-int(c) // 16) for c in counts), sum(-(-int(c) // block) for c in counts)


def tbb_cpu(x, e, block, factor, inplace, table_sizes):
    sizes = table_sizes or [x.size]
    nw, nb = tbb_sizes(sizes, block)
    codes, values = np.full(nw, 0xABABABAB, U32), np.full(nb, 7.0, F32)
    ein = np.zeros(0, F32) if e is None else e.copy()
    eout = ein if (e is None or inplace) else np.full(x.size, 5.0, F32)
    if table_sizes is None:
        bad = core.twobit_block_compress_array(x, ein, eout, block, factor, codes, values)
    else:
        arrs = chunks(x, table_sizes)
        ptrs, offsets, counts = host_table(arrs)
        bad = core.twobit_block_compress(ptrs, offsets, counts, 0, len(arrs), ein, eout, block, factor,
                                         codes, values)
    return codes, values, (None if e is None else eout), bad


def tbb_gpu(cp, gpu, x, e, block, factor, inplace, table_sizes):
    sizes = table_sizes or [x.size]
    nw, nb = tbb_sizes(sizes, block)
    codes, values = cp.full(nw, 0xABABABAB, U32), cp.full(nb, 7.0, F32)
    ein = cp.zeros(0, F32) if e is None else cp.asarray(e)
    eout = ein if (e is None or inplace) else cp.full(x.size, 5.0, F32)
    if table_sizes is None:
        bad = gpu.twobit_block_compress_array(cp.asarray(x), ein, eout, block, factor, codes, values)
    else:
        darrs = [cp.asarray(a) for a in chunks(x, table_sizes)]
        ptrs, offsets, counts = dev_table(darrs)
        bad = gpu.twobit_block_compress(ptrs, offsets, counts, 0, len(darrs), ein, eout, block, factor,
                                        codes, values)
    if e is not None and not inplace:
        same_bits(ein.get(), e)
    return codes.get(), values.get(), (None if e is None else eout.get()), bad


def check_tbb(cp, gpu, x, e, block, factor, inplace, table_sizes=None):
    want = tbb_cpu(x, e, block, factor, inplace, table_sizes)
    got = tbb_gpu(cp, gpu, x, e, block, factor, inplace, table_sizes)
    same_bits(got[0], want[0])
    same(got[1], want[1])
    if e is not None:
        same(got[2], want[2])
    assert got[3] == want[3]


@pytest.mark.parametrize("n", [0, 1, 17, 33, 513, 4097, 65537])
@pytest.mark.parametrize("block,factor", [(32, 1.0), (64, 0.5), (512, 1.5)])
def test_twobit_block_compress_random(g, n, block, factor):
    cp, gpu = g
    x = gen(n, n + 25)
    e = gen(n, n + 26) * F32(0.1)
    for ee, inplace in [(None, True), (e, True), (e, False)]:
        check_tbb(cp, gpu, x, ee, block, factor, inplace)


@pytest.mark.parametrize("kind", ["zero", "negzero", "special", "nonfinite", "bits"])
@pytest.mark.parametrize("n", [5, 1009])
def test_twobit_block_compress_special(g, kind, n):
    cp, gpu = g
    x = gen(n, 41 + n, kind)
    e = gen(n, 42 + n, kind if kind != "bits" else "special")
    for block, factor in [(32, 1.0), (512, 0.7)]:
        check_tbb(cp, gpu, x, e, block, factor, inplace=False)
        check_tbb(cp, gpu, x, None, block, factor, inplace=True)


@pytest.mark.parametrize("n", [97, 4097, 300001])
def test_twobit_block_compress_table(g, n):
    cp, gpu = g
    x = gen(n, n + 31)
    e = gen(n, n + 32) * F32(0.1)
    sizes = split_sizes(n, n + 33)
    for block in (32, 512):
        check_tbb(cp, gpu, x, e, block, 1.0, inplace=False, table_sizes=sizes)
        check_tbb(cp, gpu, x, e, block, 1.0, inplace=True, table_sizes=sizes)
        check_tbb(cp, gpu, x, None, block, 1.0, inplace=True, table_sizes=sizes)


@pytest.mark.parametrize("n", [0, 17, 4097, 300001])
@pytest.mark.parametrize("p", [1, 3])
@pytest.mark.parametrize("divisor", [1.0, 8.0, 7.1])
def test_twobit_block_decompress_sum(g, n, p, divisor):
    cp, gpu = g
    block = 64
    rng = np.random.default_rng(n * 5 + p)
    sizes = split_sizes(n, n + p + 1)
    nw, nb = tbb_sizes(sizes, block)
    codes = rng.integers(0, 1 << 32, (p, nw), dtype=np.uint64).astype(U32)       # 0b11 too
    values = (rng.standard_normal((p, nb)) * 3).astype(F32)
    outs_c = [np.full(s, 3.0, F32) for s in sizes]
    pc, oc, cc = host_table(outs_c)
    core.twobit_block_decompress_sum(codes, values, block, pc, oc, cc, 0, len(sizes), divisor)
    outs_g = [cp.full(s, 3.0, F32) for s in sizes]
    pg, og, cg = dev_table(outs_g)
    gpu.twobit_block_decompress_sum(cp.asarray(codes), cp.asarray(values), block, pg, og, cg, 0, len(sizes),
                                    divisor)
    for a, b in zip(outs_g, outs_c):
        same(a.get(), b)
    nw1, nb1 = tbb_sizes([n], block)
    c1, v1 = codes[:, :nw1] if nw1 <= nw else None, values[:, :nb1] if nb1 <= nb else None
    if c1 is not None and v1 is not None:
        want = np.full(n, 9.0, F32)
        core.twobit_block_decompress_sum_array(np.ascontiguousarray(c1), np.ascontiguousarray(v1), block, want,
                                               divisor)
        got = cp.full(n, 9.0, F32)
        gpu.twobit_block_decompress_sum_array(cp.asarray(c1), cp.asarray(v1), block, got, divisor)
        same(got.get(), want)


# ------------------------------------------------------------------ validation (no device work)

def test_validation_errors(g):
    cp, gpu = g
    x = cp.zeros(100, F32)
    e = cp.zeros(0, F32)
    with pytest.raises(ValueError, match="multiple of 32"):
        gpu.onebit_compress_array(x, e, e, 48, cp.zeros(4, U32), cp.zeros(3, F32))
    with pytest.raises(ValueError, match="ceil"):
        gpu.onebit_compress_array(x, e, e, 64, cp.zeros(3, U32), cp.zeros(2, F32))
    with pytest.raises(ValueError, match="both"):
        gpu.onebit_compress_array(x, cp.zeros(100, F32), e, 64, cp.zeros(4, U32), cp.zeros(2, F32))
    with pytest.raises(ValueError, match="threshold"):
        gpu.twobit_compress_array(x, e, e, 0.0, cp.zeros(25, np.uint8))
    with pytest.raises(ValueError, match="divisor"):
        gpu.onebit_decompress_sum_array(cp.zeros((1, 4), U32), cp.zeros((1, 2), F32), 64, x, 0.0)
    with pytest.raises(ValueError, match="prescale"):
        gpu.cast_to16(1, x, cp.zeros(100, np.uint16), float("inf"))
    with pytest.raises(TypeError, match="cupy"):
        gpu.cast_to16(1, np.zeros(3, F32), cp.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="dense"):
        gpu.onebit_compress(np.array([x.data.ptr, x.data.ptr]), np.array([0, 7]), np.array([5, 5]), 0, 2,
                            e, e, 32, cp.zeros(1, U32), cp.zeros(1, F32))


def test_divisor_mode_matches_cpu_rule():
    """The host picks x / f or x * (1/f) exactly as _quant.h's gf_q_divide does."""
    from gradfuse import gpu
    assert gpu.divisor_mode(1.0)[0] == 0
    assert gpu.divisor_mode(3.0)[0] == 1
    m, r = gpu.divisor_mode(4.0)
    assert m == 2 and r == F32(0.25)
    assert gpu.divisor_mode(2.0 ** 127)[0] == 2          # 1/f = 2^-127 is an exact subnormal
    assert gpu.divisor_mode(2.0 ** -149)[0] == 1         # 1/f overflows to inf
    assert gpu.divisor_mode(2.0 ** -127)[0] == 2
    assert gpu.divisor_mode(-0.5) == (2, F32(-2.0))


# ------------------------------------------------------------------ sparse decompress

def sparse_payloads(n, p, k, seed, same_rows=False, kind="normal"):
    rng = np.random.default_rng(seed)
    idx = np.zeros((p, k), U32)
    for r in range(p):
        if r == 0 or not same_rows:
            row = np.sort(rng.choice(n, k, replace=False)).astype(U32) if k else np.zeros(0, U32)
        idx[r] = row
    vals = gen(p * k, seed + 1, kind).reshape(p, k)
    return np.ascontiguousarray(vals), idx


@pytest.mark.parametrize("n,k", [(1, 1), (7, 0), (7, 3), (100, 100), (4097, 40), (300001, 3000)])
@pytest.mark.parametrize("p", [1, 2, 5])
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0, -4.0, 7.1])
@pytest.mark.parametrize("same_rows", [False, True])
def test_sparse_decompress_sum(g, n, k, p, divisor, same_rows):
    cp, gpu = g
    vals, idx = sparse_payloads(n, p, k, n + p + k, same_rows)
    want = np.full(n, 9.0, F32)
    core.sparse_decompress_sum_array(vals, idx, want, divisor)
    got = cp.full(n, 9.0, F32)
    gpu.sparse_decompress_sum_array(cp.asarray(vals), cp.asarray(idx), got, divisor)
    same(got.get(), want)
    sizes = split_sizes(n, n + 5 * p)
    outs_c = [np.full(s, 3.0, F32) for s in sizes]
    pc, oc, cc = host_table(outs_c)
    core.sparse_decompress_sum(vals, idx, pc, oc, cc, 0, len(sizes), divisor)
    outs_g = [cp.full(s, 3.0, F32) for s in sizes]
    pg, og, cg = dev_table(outs_g)
    gpu.sparse_decompress_sum(cp.asarray(vals), cp.asarray(idx), pg, og, cg, 0, len(sizes), divisor)
    for a, b in zip(outs_g, outs_c):
        same(a.get(), b)


@pytest.mark.parametrize("kind", ["special", "nonfinite", "negzero"])
def test_sparse_decompress_special_and_unsorted(g, kind):
    cp, gpu = g
    n, p, k = 1000, 3, 200
    vals, idx = sparse_payloads(n, p, k, 77, kind=kind)
    idx[1] = idx[1][::-1]                     # not ascending: the serial path
    idx[2, 5] = idx[2, 6]                     # a duplicate: added twice, in m order
    want = np.empty(n, F32)
    core.sparse_decompress_sum_array(vals, idx, want, 3.0)
    got = cp.empty(n, F32)
    gpu.sparse_decompress_sum_array(cp.asarray(vals), cp.asarray(idx), got, 3.0)
    same(got.get(), want)


def test_sparse_decompress_bad_index(g):
    cp, gpu = g
    vals, idx = sparse_payloads(50, 3, 10, 5)
    idx[1, 7] = 50
    idx[2, 0] = 99
    with pytest.raises(ValueError) as cpu_err:
        core.sparse_decompress_sum_array(vals, idx, np.zeros(50, F32), 1.0)
    out = cp.full(50, 4.0, F32)
    with pytest.raises(ValueError) as gpu_err:
        gpu.sparse_decompress_sum_array(cp.asarray(vals), cp.asarray(idx), out, 1.0)
    assert "index 50 at indices[1, 7]" in str(cpu_err.value) and "index 50 at indices[1, 7]" in str(gpu_err.value)
    assert np.all(out.get() == 4.0)           # nothing written


# ------------------------------------------------------------------ sparse compress (top-k / random-k)

def no_double_nan(x, e):
    """e with finite values wherever x is NaN: the NaN of NaN + NaN is the compiler's choice
    of operand order on the CPU (its scalar and AVX2 paths differ), so it is no contract."""
    if e is None:
        return None
    e = e.copy()
    e[np.isnan(x) & np.isnan(e)] = F32(0.5)
    return e


def table_ks(k, sizes):
    """One k per tensor for a bucket-wide k (or an explicit list): k_i = ceil(k n_i / n)."""
    if not isinstance(k, (int, np.integer)):
        return np.asarray(k, np.int64)
    c = np.asarray(sizes, np.int64)
    n = max(int(c.sum()), 1)
    return np.minimum(c, -(-int(k) * c // n)).astype(np.int64)


def sp_cpu(fn, x, e, k, inplace, sizes, seed=None):
    """_core top-k / random-k on host copies: (values, indices, e_out or None, count)."""
    n = x.size
    if sizes is not None:
        k = table_ks(k, sizes)
    kk = int(np.sum(k))
    values = np.full(kk, 7.0, F32)
    indices = np.full(kk, 0xDEADBEEF, U32)
    if e is None:
        ein = eout = np.zeros(0, F32)
    else:
        ein = e.copy()
        eout = ein if inplace else np.full(n, 5.0, F32)
    extra = () if seed is None else (seed,)
    if sizes is None:
        bad = getattr(core, fn + "_compress_array")(x, ein, eout, *extra, k, values, indices)
    else:
        arrs = chunks(x, sizes)
        ptrs, offsets, counts = host_table(arrs)
        bad = getattr(core, fn + "_compress")(ptrs, offsets, counts, 0, len(arrs), ein, eout, *extra, k,
                                              values, indices)
    return values, indices, (None if e is None else eout), bad


def sp_gpu(cp, gpu, fn, x, e, k, inplace, sizes, seed=None, count_out=False):
    n = x.size
    if sizes is not None:
        k = table_ks(k, sizes)
    kk = int(np.sum(k))
    values = cp.full(kk, 7.0, F32)
    indices = cp.full(kk, 0xDEADBEEF, U32)
    if e is None:
        ein = eout = cp.zeros(0, F32)
    else:
        ein = cp.asarray(e)
        eout = ein if inplace else cp.full(n, 5.0, F32)
    extra = () if seed is None else (seed,)
    kw = {"count_out": cp.full(1, 99, np.uint64)} if count_out else {}
    if sizes is None:
        bad = getattr(gpu, fn + "_compress_array")(cp.asarray(x), ein, eout, *extra, k, values, indices, **kw)
    else:
        darrs = [cp.asarray(a) for a in chunks(x, sizes)]
        ptrs, offsets, counts = dev_table(darrs)
        bad = getattr(gpu, fn + "_compress")(ptrs, offsets, counts, 0, len(darrs), ein, eout, *extra, k,
                                             values, indices, **kw)
        for a, h in zip(darrs, chunks(x, sizes)):
            same_bits(a.get(), h)              # the gradients are never written
    if count_out:
        assert bad is kw["count_out"]
        bad = int(bad.get()[0])
    if e is not None and not inplace:
        same_bits(ein.get(), e)                # e_in never written when e_out differs
    return values.get(), indices.get(), (None if e is None else eout.get()), bad


def check_sp(cp, gpu, fn, x, e, k, inplace=False, sizes=None, seed=None, count_out=False):
    e = no_double_nan(x, e)
    want = sp_cpu(fn, x, e, k, inplace, sizes, seed)
    got = sp_gpu(cp, gpu, fn, x, e, k, inplace, sizes, seed, count_out)
    same_bits(got[1], want[1])                 # indices
    same_bits(got[0], want[0])                 # values: bits of c, NaN payloads included
    if e is not None:
        same_bits(got[2], want[2])             # residual: c, 0 at the indices
    assert got[3] == want[3]
    return want


def sp_cases(x, e, k, fn, seed=None, sizes=None):
    """Every residual mode, array and table (a k per tensor: from k, and random ones)."""
    cp, gpu = require_gpu()
    rand = None if sizes is None else np.random.default_rng(k + len(sizes)).integers(0, np.asarray(sizes) + 1)
    for ee, inplace in [(None, False), (e, True), (e, False)]:
        check_sp(cp, gpu, fn, x, ee, k, inplace, None, seed)
        if sizes is not None:
            check_sp(cp, gpu, fn, x, ee, k, inplace, sizes, seed)
            check_sp(cp, gpu, fn, x, ee, rand, inplace, sizes, seed)


SP_SIZES = [0, 1, 31, 32, 33, 1000, 4097, 65537]


def sp_ks(n):
    return sorted({k for k in (0, 1, 2, 3, n // 100, n // 10, n // 2, n - 1, n) if 0 <= k <= n})


@pytest.mark.parametrize("n", SP_SIZES)
def test_topk_compress_sizes(g, n):
    x = gen(n, 100 + n)
    e = gen(n, 200 + n) * F32(0.1)
    for k in sp_ks(n) if n < 65537 else (1, n // 100, n - 1):
        sp_cases(x, e, k, "topk", sizes=split_sizes(n, n + k))


@pytest.mark.parametrize("kind", ["zero", "negzero", "special", "nonfinite", "bits"])
@pytest.mark.parametrize("n", [1, 33, 1000, 4097])
def test_topk_compress_special(g, kind, n):
    x = gen(n, 300 + n, kind)
    e = gen(n, 301 + n, "special" if kind == "bits" else kind)
    for k in (1, 5, n // 3, n - 1, n):
        sp_cases(x, e, max(0, min(k, n)), "topk", sizes=split_sizes(n, n + 7))


@pytest.mark.parametrize("n", [32, 1000, 4097])
def test_topk_ties(g, n):
    """Many equal |c|: the threshold's ties go to the lowest indices, in every tile."""
    cp, gpu = g
    rng = np.random.default_rng(n)
    cases = [
        np.ones(n, F32),                                               # all equal
        np.where(rng.random(n) < 0.5, F32(1.0), F32(-1.0)).astype(F32),  # equal |c|, both signs
        np.where(rng.random(n) < 0.5, F32(0.0), F32(-0.0)).astype(F32),  # +0 / -0
        rng.choice(np.array([0.0, -0.0, 2.0, -2.0, 3.0, 1e-40, -1e-40], F32), n).astype(F32),
        rng.choice(np.array([1.0, -1.0, 1.0000001, np.inf, -np.inf], F32), n).astype(F32),
    ]
    for x in cases:
        for k in sorted({1, 2, 31, 33, n // 3, n // 2, n - 1}):
            if 0 < k < n:
                check_sp(cp, gpu, "topk", x, None, k)
                check_sp(cp, gpu, "topk", x, np.zeros(n, F32), k, inplace=True)
        check_sp(cp, gpu, "topk", x, None, n // 2, sizes=split_sizes(n, 5))


def test_topk_subnormals_and_nan_keys(g):
    """Subnormal keys, and NaN keys ordered by payload above +inf (and the NaN add rule)."""
    cp, gpu = g
    rng = np.random.default_rng(9)
    n = 3000
    sub = rng.integers(1, 1 << 23, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
    x = sub.view(F32).copy()
    x[::7] = 0.0
    for k in (1, 10, 1500, 2999):
        check_sp(cp, gpu, "topk", x, None, k)
    # NaNs with distinct payloads (some signalling), infs; e NaN where x is finite
    y = gen(n, 10)
    pos = rng.choice(n, 60, replace=False)
    y[pos[:40]] = (rng.integers(0x7f800001, 0x80000000, 40, dtype=np.uint64).astype(U32)
                   | (rng.integers(0, 2, 40, dtype=np.uint32) << 31)).view(F32)
    y[pos[40:]] = np.float32(np.inf) * np.where(rng.random(20) < 0.5, 1, -1).astype(F32)
    e = gen(n, 11) * F32(0.1)
    e[rng.choice(n, 30, replace=False)] = np.array([0x7f800005, 0xffa00007], U32).view(F32)[rng.integers(0, 2, 30)]
    e[pos[40:50]] = -y[pos[40:50]]                                   # inf - inf: the default NaN
    for k in (1, 20, 45, 70, 200):
        want = check_sp(cp, gpu, "topk", y, e, k)
        assert want[3] > 0
        check_sp(cp, gpu, "topk", y, e, k, inplace=True, sizes=split_sizes(n, k))


@pytest.mark.parametrize("n", [1, 33, 1000, 4097, 65537])
def test_randomk_indices(g, n):
    cp, gpu = g
    sizes = np.array(split_sizes(n, n), np.int64)
    for seed in (0, 1, 12345, 0x9E3779B97F4A7C15, (1 << 64) - 1, (1 << 64) - 1 - n // 2):
        for k in sp_ks(n):
            for counts, ks in ((np.array([n]), np.array([k])), (sizes, table_ks(k, sizes))):
                want = np.full(int(ks.sum()), 0xDEADBEEF, U32)
                core.randomk_indices(seed, counts.astype(np.int64), ks.astype(np.int64), want)
                got = cp.full(want.size, 0xDEADBEEF, U32)
                assert gpu.randomk_indices(seed, counts, ks, got) is None
                same_bits(got.get(), want)


@pytest.mark.parametrize("n", SP_SIZES)
def test_randomk_compress(g, n):
    x = gen(n, 400 + n)
    e = gen(n, 401 + n) * F32(0.1)
    for seed, k in [(0, min(1, n)), (7, n // 10), ((1 << 64) - 3, n // 2), (99, n), (5, 0)]:
        sp_cases(x, e, k, "randomk", seed=seed, sizes=split_sizes(n, n + k) if n < 65537 else None)


@pytest.mark.parametrize("kind", ["zero", "special", "nonfinite", "bits"])
def test_randomk_compress_special(g, kind):
    n = 1000
    x = gen(n, 500, kind)
    e = gen(n, 501, "special" if kind == "bits" else kind)
    for k in (1, 100, n):
        sp_cases(x, e, k, "randomk", seed=3, sizes=split_sizes(n, 8))


def test_sparse_compress_device_count(g):
    cp, gpu = g
    x = gen(5000, 12, "nonfinite")
    e = gen(5000, 13) * F32(0.1)
    for fn, seed in (("topk", None), ("randomk", 11)):
        want = check_sp(cp, gpu, fn, x, e, 50, count_out=True, seed=seed)
        assert want[3] > 0
        check_sp(cp, gpu, fn, x, e, 50, inplace=True, sizes=split_sizes(5000, 3), count_out=True, seed=seed)


def test_sparse_compress_validation(g):
    cp, gpu = g
    x = cp.zeros(100, F32)
    e0 = cp.zeros(0, F32)
    v, i = cp.zeros(10, F32), cp.zeros(10, U32)
    with pytest.raises(ValueError, match="k = 101"):
        gpu.topk_compress_array(x, e0, e0, 101, cp.zeros(101, F32), cp.zeros(101, U32))
    with pytest.raises(ValueError, match="values"):
        gpu.topk_compress_array(x, e0, e0, 10, cp.zeros(9, F32), i)
    with pytest.raises(ValueError, match="indices"):
        gpu.randomk_compress_array(x, e0, e0, 1, 10, v, cp.zeros(11, U32))
    with pytest.raises(ValueError, match="both"):
        gpu.topk_compress_array(x, cp.zeros(100, F32), e0, 10, v, i)
    with pytest.raises(ValueError, match="both"):
        gpu.randomk_compress_array(x, cp.zeros(100, F32), cp.zeros(99, F32), 0, 10, v, i)
    with pytest.raises(TypeError):
        gpu.topk_compress_array(x, e0, e0, 10, v, cp.zeros(10, np.int32))
    with pytest.raises(TypeError):
        gpu.topk_compress_array(np.zeros(100, F32), e0, e0, 10, v, i)
    one = lambda v: np.array([v], np.int64)        # noqa: E731
    with pytest.raises(ValueError, match=r"ks\[0\] = 5 outside 0..4"):
        gpu.randomk_indices(0, one(4), one(5), cp.zeros(5, U32))
    with pytest.raises(ValueError, match="out has"):
        gpu.randomk_indices(0, one(40), one(5), cp.zeros(4, U32))
    with pytest.raises(ValueError, match="4294967295"):
        gpu.randomk_indices(0, one(1 << 32), one(0), cp.zeros(0, U32))
    with pytest.raises(OverflowError):
        gpu.randomk_indices(-1, one(4), one(1), cp.zeros(1, U32))
    with pytest.raises(ValueError, match="dense"):
        gpu.topk_compress(np.array([x.data.ptr, x.data.ptr]), np.array([0, 7]), np.array([5, 5]), 0, 2,
                          e0, e0, np.array([1, 0]), cp.zeros(1, F32), cp.zeros(1, U32))
    with pytest.raises(ValueError, match="range"):
        gpu.randomk_compress(np.array([x.data.ptr]), np.array([0]), np.array([5]), 0, 2,
                             e0, e0, 0, np.array([1, 0]), cp.zeros(1, F32), cp.zeros(1, U32))
    tp, to, tc = np.array([x.data.ptr, x.data.ptr + 20]), np.array([0, 5]), np.array([5, 5])
    for fn, extra in ((gpu.topk_compress, ()), (gpu.randomk_compress, (3,)), (core.topk_compress, ()),
                      (core.randomk_compress, (3,))):
        host = fn in (core.topk_compress, core.randomk_compress)
        xs = np.zeros(10, F32) if host else x
        tpp = np.array([xs.ctypes.data, xs.ctypes.data + 20]) if host else tp
        z, vv, ii = (np.zeros(0, F32), np.zeros(6, F32), np.zeros(6, U32)) if host else (e0, cp.zeros(6, F32),
                                                                                         cp.zeros(6, U32))
        with pytest.raises(ValueError, match=r"ks\[1\] = 6 outside 0..5 \(the element count of row 1\)"):
            fn(tpp, to, tc, 0, 2, z, z, *extra, np.array([0, 6], np.int64), vv, ii)
        with pytest.raises(ValueError, match="ks has 1 entries"):
            fn(tpp, to, tc, 0, 2, z, z, *extra, np.array([1], np.int64), vv[:1], ii[:1])
    # the CPU raises the same kinds on the same mistakes
    with pytest.raises(ValueError, match="k = 101"):
        core.topk_compress_array(np.zeros(100, F32), np.zeros(0, F32), np.zeros(0, F32), 101,
                                 np.zeros(101, F32), np.zeros(101, U32))
    with pytest.raises(OverflowError):
        core.randomk_indices(-1, one(4), one(1), np.zeros(1, U32))


def test_sparse_compress_roundtrip(g):
    """Top-k, then the GPU decompress: c == decompress + residual, element by element."""
    cp, gpu = g
    n, k = 20000, 200
    x = gen(n, 21)
    c = cp.asarray(x)
    e = cp.zeros(n, F32)
    v, i = cp.empty(k, F32), cp.empty(k, U32)
    assert gpu.topk_compress_array(c, e, e, k, v, i) == 0
    dec = cp.empty(n, F32)
    gpu.sparse_decompress_sum_array(v[None, :], i[None, :], dec, 1.0)
    same_bits((dec + e).get(), x)
    ih = i.get()
    assert np.all(np.diff(ih.astype(np.int64)) > 0)
    assert np.abs(x[ih]).min() >= np.abs(np.delete(x, ih)).max()


def test_sparse_compress_small_grids(g, monkeypatch):
    """Tiny launches: one warp walks many tiles (grid-stride), the one-block scan sums
    runs of several tiles per thread, 32-thread blocks zero and flush the shared
    histograms in strides. Same bits as the CPU."""
    cp, gpu = g
    monkeypatch.setattr(gpu.launch, "THREADS", 32)
    monkeypatch.setattr(gpu.sparse, "_sp_grid_hist", lambda n: 2)
    monkeypatch.setattr(gpu.sparse, "_sp_grid_tiles", lambda ntiles: 1)
    n = 50000                                    # 49 tiles of 1024: 2 per scan thread
    x = gen(n, 31)
    x[::3] = F32(0.25)                           # ties at the threshold in every tile
    e = gen(n, 32) * F32(0.01)
    a = np.abs(x)
    k_tie = int((a > 0.25).sum() + (a == 0.25).sum() // 2)    # T = 0.25, half its ties taken
    check_sp(cp, gpu, "topk", x, None, k_tie)
    for k in (1, 777, n // 3, n - 5):
        check_sp(cp, gpu, "topk", x, None, k)
        check_sp(cp, gpu, "topk", x, e, k, inplace=True, sizes=split_sizes(n, k))
        check_sp(cp, gpu, "randomk", x, e, k, seed=k)
