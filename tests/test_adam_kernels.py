"""The Adam correction's CPU kernels (gradfuse/kernels/_adam.h) against their numpy twins
(tests/ref_adam.py), bit for bit, on the scalar and the AVX2 paths: the moment update in
the preconditioner's units, the fused moment + 1-bit pass (also against the moment kernel
followed by onebit_compress), the step after the exchange with and without a mask, and
plain Adam (with the freeze rule's sums)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import ref_adam as ref  # noqa: E402

import gradfuse._core as core  # noqa: E402

F32 = np.float32
EMPTY = np.zeros(0, F32)
SIZES = [(1,), (5, 0, 33, 700, 1), (0, 4097, 256), (1031,)]
B1, C1, B2, C2 = 0.9, F32(1) - F32(0.9), 0.999, F32(1) - F32(0.999)


@pytest.fixture(params=["scalar", "avx2"])
def simd(request):
    if request.param == "avx2" and not core.simd_info()["cpu_avx2_f16c"]:
        pytest.skip("no AVX2 on this CPU")
    core.set_simd(request.param == "scalar")
    yield request.param
    core._init_simd_from_env()


def same(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    na, nb = np.isnan(a), np.isnan(b)
    assert np.array_equal(na, nb)
    assert a[~na].tobytes() == b[~nb].tobytes(), np.flatnonzero(a != b)[:5]


def tensors(sizes, seed, scale=3.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * scale).astype(F32) for s in sizes]


def table(arrs):
    ptrs = np.array([a.ctypes.data if a.size else 0 for a in arrs], np.int64)
    counts = np.array([a.size for a in arrs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return ptrs, offsets, counts


def precond(n, seed):
    """A preconditioner as the freeze makes one: 1 / (b sqrt(v) + eps), 0 where v is 0."""
    v = (np.random.default_rng(seed).standard_normal(n) * 0.01).astype(F32) ** 2
    v[::5] = 0
    return ref.freeze(np.zeros(n, F32), v, 1.3, 1e-8)[1]


@pytest.mark.parametrize("sizes", SIZES)
def test_moment(simd, sizes):
    gs = tensors(sizes, 1)
    n = sum(sizes)
    m = np.random.default_rng(2).standard_normal(n).astype(F32)
    r = precond(n, 3)
    x = np.full(n, np.nan, F32)
    p, o, c = table(gs)
    core.adam_moment(p, o, c, 0, len(gs), m, r, B1, C1, x)
    same(x, ref.moment(np.concatenate(gs) if n else EMPTY, m, r, B1, C1))
    core.adam_moment(p, o, c, 0, len(gs), m, r, B1, C1, m)        # in place
    same(m, x)


@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("block", [32, 512])
@pytest.mark.parametrize("sizes", SIZES)
def test_onebit_fused_equals_moment_then_onebit(simd, sizes, block, ef):
    gs = tensors(sizes, 3)
    if gs[-1].size > 3:
        gs[-1][3] = -0.0
    n = sum(sizes)
    rng = np.random.default_rng(4)
    m = rng.standard_normal(n).astype(F32)
    r = precond(n, 5)
    e = rng.standard_normal(n).astype(F32) * F32(0.1) if ef else EMPTY
    p, o, c = table(gs)
    nw = sum((s + 31) // 32 for s in sizes)
    ns = sum(-(-s // block) for s in sizes)
    bits, scales = np.zeros(nw, np.uint32), np.zeros(ns, F32)
    e_out = np.full(n, np.nan, F32) if ef else EMPTY
    bad = core.adam_onebit_compress(p, o, c, 0, len(gs), m, r, B1, C1, e, e_out, block, bits, scales)
    # the twin: numpy, and the two-pass path of the kernels
    rb, rs, rres, rbad = ref.onebit_compress(np.concatenate(gs), m, r, B1, C1, e if ef else None, block, sizes)
    same(bits, rb)
    same(scales, rs)
    if ef:
        same(e_out, rres)
    assert bad == rbad == 0
    x = np.empty(n, F32)
    core.adam_moment(p, o, c, 0, len(gs), m, r, B1, C1, x)
    b2, s2 = np.zeros_like(bits), np.zeros_like(scales)
    e2 = np.full(n, np.nan, F32) if ef else EMPTY
    xp, xo, xc = table([x[a:b] for a, b in zip(np.cumsum([0] + list(sizes))[:-1], np.cumsum(sizes))])
    core.onebit_compress(xp, xo, xc, 0, len(sizes), e, e2, block, b2, s2)
    same(b2, bits)
    same(s2, scales)
    if ef:
        same(e2, e_out)


def test_onebit_fused_nonfinite_and_in_place(simd):
    g = tensors([700], 5)[0]
    g[17] = np.inf
    m = np.zeros(700, F32)
    r = np.ones(700, F32)
    e = np.ones(700, F32)
    bits, scales = np.zeros(22, np.uint32), np.zeros(2, F32)
    p, o, c = table([g])
    assert core.adam_onebit_compress(p, o, c, 0, 1, m, r, B1, C1, e, e, 512, bits, scales) == 1
    rb, rs, rres, rbad = ref.onebit_compress(g, m, r, B1, C1, np.ones(700, F32), 512)
    same(e, rres)
    assert rbad == 1


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("sizes", SIZES)
def test_apply(simd, sizes, masked):
    outs = tensors(sizes, 6)
    n = sum(sizes)
    mask = (np.random.default_rng(7).random(n) > 0.2).astype(np.uint8) if masked else np.zeros(0, np.uint8)
    mb = np.concatenate(outs) if n else EMPTY
    m = np.full(n, np.nan, F32)
    p, o, c = table(outs)
    core.adam_apply(p, o, c, 0, len(outs), m, mask, 1.7)
    rm, rout = ref.apply(mb, mask if masked else None, 1.7)
    same(m, rm)
    same(np.concatenate(outs) if n else EMPTY, rout)
    if masked:
        assert not np.any(rout[mask == 0]) and not np.any(m[mask == 0])


def test_freeze_without_eps_has_no_nan():
    """eps 0 and v 0: the preconditioner is 0 there (masked), not 1/0."""
    mask, r, m = ref.freeze(np.ones(4, F32), np.array([0, 1, 4, 0], F32), 1.0, 0.0)
    assert mask.tolist() == [0, 1, 1, 0] and r.tolist() == [0, 1, 0.5, 0] and m.tolist() == [0, 1, 0.5, 0]


@pytest.mark.parametrize("sizes", SIZES)
def test_plain(simd, sizes):
    outs = tensors(sizes, 8, scale=0.01)
    n = sum(sizes)
    rng = np.random.default_rng(9)
    m = rng.standard_normal(n).astype(F32) * F32(0.01)
    v = (rng.standard_normal(n) * 0.01).astype(F32) ** 2
    g = np.concatenate(outs) if n else EMPTY
    rm, rv, rout = ref.plain(g, m, v, B1, C1, B2, C2, 3.2, 0.7, 1e-8)
    v_old = v.copy()
    p, o, c = table(outs)
    sums = core.adam_plain(p, o, c, 0, len(outs), m, v, B1, C1, B2, C2, 3.2, 0.7, 1e-8, 1.5, 1.25, True)
    same(m, rm)
    same(v, rv)
    same(np.concatenate(outs) if n else EMPTY, rout)
    want = ref.plain_sums(v_old, rv, 1.5, 1.25)
    assert sums == pytest.approx(want, rel=1e-12, abs=1e-300)
    assert core.adam_plain(p, o, c, 0, len(outs), m, v, B1, C1, B2, C2, 3.2, 0.7, 1e-8) is None


def test_errors():
    g = np.ones(4, F32)
    p, o, c = table([g])
    z4 = np.zeros(4, F32)
    with pytest.raises(ValueError, match="m has 3 elements and the table 4"):
        core.adam_moment(p, o, c, 0, 1, np.zeros(3, F32), z4, B1, C1, z4.copy())
    with pytest.raises(ValueError, match="r has 3 elements and the table 4"):
        core.adam_moment(p, o, c, 0, 1, z4, np.zeros(3, F32), B1, C1, z4.copy())
    with pytest.raises(ValueError, match="b1 must be finite"):
        core.adam_moment(p, o, c, 0, 1, z4, z4, np.inf, C1, z4.copy())
    with pytest.raises(ValueError, match="mask has 3 elements"):
        core.adam_apply(p, o, c, 0, 1, z4, np.ones(3, np.uint8), 1)
    with pytest.raises(ValueError, match="bits must have 1 words"):
        core.adam_onebit_compress(p, o, c, 0, 1, z4, z4, B1, C1, EMPTY, EMPTY, 32,
                                  np.zeros(2, np.uint32), np.zeros(1, F32))
