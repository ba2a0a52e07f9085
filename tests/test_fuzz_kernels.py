"""Hypothesis fuzzing of the local kernels in gradfuse._core against the numpy references.

Random sizes, random values (including every float bit pattern), random table sub-ranges,
both SIMD paths, and random wrong-sized outputs (which must raise ValueError/IndexError,
never crash or write out of bounds). Deterministic: see tests/fuzz_common.py.
"""
import os
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import ref_cast  # noqa: E402
import ref_quant  # noqa: E402
import ref_sparse  # noqa: E402
from fuzz_common import COUNTS, KINDS, fuzz_settings, seeds, sizes, values  # noqa: E402

import gradfuse._core as core  # noqa: E402
from gradfuse.fusion.plan import aligned_empty  # noqa: E402

F32 = np.float32
AVX2 = core.simd_info()["cpu_avx2_f16c"]
EMPTY = np.zeros(0, F32)
N = 200                 # cases per test (about 3 s for the file)
CODES = {np.float16: 1, np.float32: 2, np.float64: 3, np.int32: 4, np.int64: 5}


@pytest.fixture(autouse=True, scope="module")
def _report():
    yield
    print("\nkernel fuzz cases: " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items()))
          + f"; total {sum(COUNTS.values())}")
    core.set_simd(force_scalar=False)


def simd(scalar):
    core.set_simd(force_scalar=bool(scalar) or not AVX2)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype.kind == "f":
        nan = np.isnan(a)
        assert np.array_equal(nan, np.isnan(b))
        assert a[~nan].tobytes() == b[~nan].tobytes()
    else:
        assert np.array_equal(a, b)


def table(arrs, byte_sizes=True):
    ptrs = np.array([a.ctypes.data if a.size else 0 for a in arrs], np.int64)
    cnt = np.array([a.nbytes if byte_sizes else a.size for a in arrs], np.int64)
    off = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.int64) if arrs else np.zeros(0, np.int64)
    return ptrs, off, cnt


@st.composite
def tensor_lists(draw, dtypes=tuple(CODES), max_tensors=8, max_n=600):
    dt = draw(st.sampled_from(dtypes))
    k = draw(st.integers(0, max_tensors))
    kind = draw(st.sampled_from(KINDS))
    seed = draw(seeds())
    ns = [draw(sizes(max_n)) for _ in range(k)]
    return dt, [values(kind, n, seed + i, dt) for i, n in enumerate(ns)]


# ------------------------------------------------------------------ fusion kernels

@fuzz_settings(N)
@given(tl=tensor_lists(), data=st.data())
def test_pack_unpack(tl, data):
    COUNTS["pack_unpack"] += 1
    dt, arrs = tl
    lo = data.draw(st.integers(0, len(arrs)))
    hi = data.draw(st.integers(lo, len(arrs)))
    ptrs, off, nb = table(arrs)
    total = int(nb.sum())
    buf = aligned_empty(total)
    buf[:] = 0xAB
    core.pack(buf, ptrs, off, nb, lo, hi)
    want = b"".join(a.tobytes() for a in arrs[lo:hi])
    start = int(off[lo]) if lo < len(arrs) else total
    assert buf[start:start + len(want)].tobytes() == want
    outs = [np.full_like(a, 3) for a in arrs]
    core.unpack(buf, table(outs)[0], off, nb, lo, hi)
    for i, (a, o) in enumerate(zip(arrs, outs)):
        assert o.tobytes() == (a.tobytes() if lo <= i < hi else np.full_like(a, 3).tobytes())


@fuzz_settings(N)
@given(tl=tensor_lists(dtypes=(np.float16, np.float32, np.float64)), divisor=st.integers(1, 64),
       scalar=st.booleans())
def test_unpack_div_and_div_inplace(tl, divisor, scalar):
    COUNTS["unpack_div"] += 1
    simd(scalar)
    dt, arrs = tl
    ptrs, off, nb = table(arrs)
    buf = aligned_empty(int(nb.sum()))
    core.pack(buf, ptrs, off, nb, 0, len(arrs))
    outs = [np.empty_like(a) for a in arrs]
    core.unpack_div(buf, table(outs)[0], off, nb, 0, len(arrs), CODES[dt], float(divisor))
    with np.errstate(all="ignore"):
        for a, o in zip(arrs, outs):
            same_bits(o, a / dt(divisor))
            b = a.copy()
            if b.size:
                core.div_inplace(b.ctypes.data, b.size, CODES[dt], float(divisor))
            same_bits(b, a / dt(divisor))


class _NoBuffer:
    pass


@st.composite
def scan_objects(draw):
    objs, want = [], []
    for _ in range(draw(st.integers(0, 10))):
        what = draw(st.sampled_from(["array", "noncontig", "readonly", "baddtype", "nobuffer",
                                     "bytes", "scalar0d", "bigendian"]))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
        dt = draw(st.sampled_from(list(CODES)))
        a = np.zeros(shape, dt)
        if what == "noncontig":
            a = np.zeros(shape + (2,), dt)[..., 0]
            # a view is contiguous when it has at most one element
            flag = core.FLAG_NONCONTIG if a.size > 1 else 0
        elif what == "readonly":
            a.setflags(write=False)
            flag = core.FLAG_READONLY
        elif what == "baddtype":
            a = np.zeros(shape, draw(st.sampled_from([np.uint8, np.bool_, np.complex64, np.int16])))
            flag = core.FLAG_BADDTYPE
        elif what == "bigendian":
            a = np.zeros(shape, np.dtype(dt).newbyteorder(">"))
            flag = core.FLAG_BADDTYPE
        elif what == "nobuffer":
            a = draw(st.sampled_from([None, 3, [1.0], _NoBuffer()]))
            flag = core.FLAG_NOBUFFER
        elif what == "bytes":
            a = b"abcd"
            flag = core.FLAG_BADDTYPE | core.FLAG_READONLY
        elif what == "scalar0d":
            a = np.array(1.5, dt)
            flag = 0
        else:
            flag = 0
        objs.append(a)
        want.append(flag)
    return objs, want


@fuzz_settings(N)
@given(case=scan_objects())
def test_scan(case):
    COUNTS["scan"] += 1
    objs, want = case
    n = len(objs)
    ptrs, nbytes, flags = (np.empty(n, np.int64) for _ in range(3))
    sig = core.scan(objs, ptrs, nbytes, flags)
    words = np.frombuffer(sig, np.int64).tolist()
    pos = 0
    for o, f, p, nb, fl in zip(objs, want, ptrs, nbytes, flags):
        assert fl == f, (o, f, fl)
        if f & core.FLAG_NOBUFFER:
            assert words[pos:pos + 2] == [0, -1] and p == 0 and nb == 0
            pos += 2
            continue
        arr = np.asarray(memoryview(o))
        assert nb == arr.nbytes
        code = 0 if f & core.FLAG_BADDTYPE else CODES[arr.dtype.type]
        assert words[pos:pos + 2 + arr.ndim] == [code, arr.ndim, *arr.shape]
        pos += 2 + arr.ndim
    assert pos == len(words)
    with pytest.raises(ValueError):
        core.scan(objs + [np.zeros(1)], ptrs, nbytes, flags)


# ------------------------------------------------------------------ casts

@fuzz_settings(N)
@given(fmt=st.sampled_from([1, 2]), n=sizes(), kind=st.sampled_from(KINDS), seed=seeds(),
       prescale=st.sampled_from([1.0, 2.0, 3.0, 0.25, 1e-3, -2.0, 7.0]), scalar=st.booleans(),
       slack=st.integers(-2, 2))
def test_cast_round_trip(fmt, n, kind, seed, prescale, scalar, slack):
    COUNTS["casts"] += 1
    simd(scalar)
    x = values(kind, n, seed)
    h = np.full(max(n + slack, 0), 0x5555, np.uint16)
    if len(h) < n:
        with pytest.raises(ValueError):
            core.cast_to16(fmt, x, h, prescale)
        return
    o, u = core.cast_to16(fmt, x, h, prescale)
    wh, wo, wu = ref_cast.cast_to16(fmt, x, prescale)
    assert np.array_equal(h[:n], wh) and (o, u) == (wo, wu)
    assert (h[n:] == 0x5555).all()
    back = np.full(n + max(slack, 0), 9.0, F32)
    core.cast_from16(fmt, h[:n], back, prescale)
    same_bits(back[:n], ref_cast.cast_from16(fmt, h[:n], prescale))
    assert (back[n:] == 9.0).all()
    if fmt == 1 and prescale == 1.0:
        h2 = np.empty(n, np.uint16)
        core.cast_f32_to_f16(x, h2)
        assert np.array_equal(h2, ref_cast.f32_to_f16(x))


@fuzz_settings(N)
@given(fmt=st.sampled_from([1, 2]), tl=tensor_lists(dtypes=(np.float32,)), scalar=st.booleans(),
       prescale=st.sampled_from([1.0, 2.0, 3.0]))
def test_pack_cast_unpack_cast(fmt, tl, scalar, prescale):
    COUNTS["pack_cast"] += 1
    simd(scalar)
    _, arrs = tl
    ptrs, off, cnt = table(arrs, byte_sizes=False)
    buf = np.empty(int(cnt.sum()), np.uint16)
    o, u = core.pack_cast(fmt, buf, ptrs, off, cnt, 0, len(arrs), prescale)
    wh, wo, wu = ref_cast.pack_cast(fmt, arrs, prescale)
    assert np.array_equal(buf, wh) and (o, u) == (wo, wu)
    outs = [np.empty_like(a) for a in arrs]
    core.unpack_cast(fmt, buf, table(outs, False)[0], off, cnt, 0, len(arrs), prescale)
    for got, want in zip(outs, ref_cast.unpack_cast(fmt, buf, [a.size for a in arrs], prescale)):
        same_bits(got, want)


@fuzz_settings(N)
@given(fmt=st.sampled_from([1, 2]), n=sizes(), seed=seeds(), scalar=st.booleans())
def test_sum16(fmt, n, seed, scalar):
    COUNTS["sum16"] += 1
    simd(scalar)
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 65536, n, dtype=np.uint32).astype(np.uint16)
    b = rng.integers(0, 65536, n, dtype=np.uint32).astype(np.uint16)
    y = b.copy()
    core.sum16(fmt, a, y)
    assert np.array_equal(y, ref_cast.sum16(fmt, a, b))


# ------------------------------------------------------------------ 1-bit / 2-bit

@fuzz_settings(N)
@given(n=sizes(), kind=st.sampled_from(KINDS), seed=seeds(), block=st.sampled_from([32, 64, 96, 256, 1024]),
       feedback=st.booleans(), p=st.integers(1, 4), divisor=st.integers(1, 8), scalar=st.booleans())
def test_onebit(n, kind, seed, block, feedback, p, divisor, scalar):
    COUNTS["onebit"] += 1
    simd(scalar)
    rows = []
    for r in range(p):
        x = values(kind, n, seed + r)
        e = values("normal", n, seed + 99 + r) * F32(0.1) if feedback else None
        bits = np.full(-(-n // 32), 0xDEADBEEF, np.uint32)
        scales = np.full(-(-n // block), 7.0, F32)
        eout = e.copy() if feedback else EMPTY
        nbad = core.onebit_compress_array(x, eout if feedback else EMPTY, eout, block, bits, scales)
        wb, ws, we, wbad = ref_quant.onebit_compress(x, e, block)
        same_bits(bits, wb)
        same_bits(scales, ws)
        assert nbad == wbad
        if feedback:
            same_bits(eout, we)
        rows.append((bits, scales))
    B = np.ascontiguousarray(np.stack([r[0] for r in rows]))
    S = np.ascontiguousarray(np.stack([r[1] for r in rows]))
    out = np.full(n, 5.0, F32)
    core.onebit_decompress_sum_array(B, S, block, out, float(divisor))
    if n:
        same_bits(out, ref_quant.onebit_decompress_sum(B, S, block, n, float(divisor)))


@fuzz_settings(N)
@given(n=sizes(), kind=st.sampled_from(KINDS), seed=seeds(),
       threshold=st.floats(float(F32(1e-6)), float(F32(1e6)), width=32), feedback=st.booleans(), p=st.integers(1, 4),
       divisor=st.integers(1, 8), scalar=st.booleans())
def test_twobit(n, kind, seed, threshold, feedback, p, divisor, scalar):
    COUNTS["twobit"] += 1
    simd(scalar)
    rows = []
    for r in range(p):
        x = values(kind, n, seed + r)
        e = values("normal", n, seed + 99 + r) * F32(0.1) if feedback else None
        codes = np.full(-(-n // 4), 0xFF, np.uint8)
        eout = e.copy() if feedback else EMPTY
        nbad = core.twobit_compress_array(x, eout, eout, threshold, codes)
        wc, we, wbad = ref_quant.twobit_compress(x, e, threshold)
        assert np.array_equal(codes, wc) and nbad == wbad
        if feedback:
            same_bits(eout, we)
        rows.append(codes)
    C = np.ascontiguousarray(np.stack(rows))
    out = np.full(n, 5.0, F32)
    core.twobit_decompress_sum_array(C, threshold, out, float(divisor))
    if n:
        same_bits(out, ref_quant.twobit_decompress_sum(C, threshold, n, float(divisor)))


# ------------------------------------------------------------------ top-k / random-k

@fuzz_settings(N)
@given(n=sizes(), kind=st.sampled_from(KINDS), seed=seeds(), kfrac=st.floats(0, 1),
       feedback=st.booleans(), randomk=st.booleans(), p=st.integers(1, 3),
       divisor=st.integers(1, 8), scalar=st.booleans())
def test_sparse(n, kind, seed, kfrac, feedback, randomk, p, divisor, scalar):
    COUNTS["topk_randomk"] += 1
    simd(scalar)
    k = int(round(kfrac * n))
    V, I = [], []
    for r in range(p):
        g = values(kind, n, seed + r)
        e = values("normal", n, seed + 77 + r) * F32(0.01) if feedback else None
        ein = e.copy() if feedback else EMPTY
        eout = np.full(n if feedback else 0, 7.0, F32)
        vals = np.full(k, -1.0, F32)
        idx = np.zeros(k, np.uint32)
        if randomk:
            bad = core.randomk_compress_array(g, ein, eout, seed + r, k, vals, idx)
            wv, wi, we, wbad = ref_sparse.randomk(g, e, seed + r, k)
        else:
            bad = core.topk_compress_array(g, ein, eout, k, vals, idx)
            wv, wi, we, wbad = ref_sparse.topk(g, e, k)
        same_bits(idx, wi)
        same_bits(vals, wv)
        assert bad == wbad
        if feedback:
            same_bits(eout, we)
            same_bits(ein, e)
        V.append(vals)
        I.append(idx)
    V = np.ascontiguousarray(np.stack(V))
    I = np.ascontiguousarray(np.stack(I))
    out = np.full(n, 5.0, F32)
    core.sparse_decompress_sum_array(V, I, out, float(divisor))
    same_bits(out, ref_sparse.decompress_sum(V, I, n, float(divisor)))
    if n:
        bad_idx = I.copy()
        if bad_idx.size:
            bad_idx.flat[-1] = n                      # one index past the end
            with pytest.raises(ValueError, match="out of range"):
                core.sparse_decompress_sum_array(V, bad_idx, out, 1.0)


@fuzz_settings(N)
@given(tl=tensor_lists(dtypes=(np.float32,)), data=st.data(), feedback=st.booleans(), randomk=st.booleans(),
       block=st.sampled_from([32, 64, 96, 512]), scalar=st.booleans())
def test_per_tensor_tables(tl, data, feedback, randomk, block, scalar):
    """Tables of tensors: 1-bit blocks and top-k/random-k selections per tensor (random k_i)."""
    COUNTS["per_tensor_tables"] += 1
    simd(scalar)
    _, arrs = tl
    ptrs, off, cnt = table(arrs, byte_sizes=False)
    counts = [a.size for a in arrs]
    x = np.concatenate(arrs) if arrs else EMPTY
    n = x.size
    seed = data.draw(seeds())
    e = values("normal", n, seed) * F32(0.01) if feedback else None
    eout = np.full(n if feedback else 0, 7.0, F32)
    ks = np.array([data.draw(st.integers(0, c)) for c in counts], np.int64)
    k = int(ks.sum())
    vals, idx = np.full(k, -1.0, F32), np.zeros(k, np.uint32)
    ein = e.copy() if feedback else EMPTY
    with np.errstate(all="ignore"):
        if randomk:
            bad = core.randomk_compress(ptrs, off, cnt, 0, len(arrs), ein, eout, seed, ks, vals, idx)
            wv, wi, we, wbad = ref_sparse.randomk(x, e, seed, ks, counts)
        else:
            bad = core.topk_compress(ptrs, off, cnt, 0, len(arrs), ein, eout, ks, vals, idx)
            wv, wi, we, wbad = ref_sparse.topk(x, e, ks, counts)
    same_bits(idx, wi)
    same_bits(vals, wv)
    assert bad == wbad
    if feedback:
        same_bits(eout, we)
    nw, nb = ref_quant.onebit_sizes(counts, block)
    bits, scales = np.full(nw, 0xDEADBEEF, np.uint32), np.full(nb, 7.0, F32)
    ein = e.copy() if feedback else EMPTY
    with np.errstate(all="ignore"):
        nbad = core.onebit_compress(ptrs, off, cnt, 0, len(arrs), ein, eout, block, bits, scales)
        wb, ws, we, wbad = ref_quant.onebit_compress(x, e, block, counts)
    assert np.array_equal(bits, wb) and nbad == wbad
    same_bits(scales, ws)
    if feedback:
        same_bits(eout, we)


# ------------------------------------------------------------------ wrong shapes never crash

@fuzz_settings(N)
@given(n=sizes(300), d_bits=st.integers(-2, 2), d_scales=st.integers(-2, 2), d_e=st.integers(-2, 2),
       d_codes=st.integers(-2, 2), d_k=st.integers(-2, 2), block=st.sampled_from([0, 16, 31, 32, 64]),
       lo=st.integers(-1, 3), hi=st.integers(-1, 4))
def test_wrong_sizes_raise_cleanly(n, d_bits, d_scales, d_e, d_codes, d_k, block, lo, hi):
    """Mis-sized outputs, bad blocks and bad table ranges: a correct result or a clean error."""
    COUNTS["wrong_sizes"] += 1
    x = values("normal", n, n)
    ok = (ValueError, IndexError, OverflowError)
    bsz = block if block else 32
    bits = np.zeros(max(-(-n // 32) + d_bits, 0), np.uint32)
    scales = np.zeros(max(-(-n // bsz) + d_scales, 0), F32)
    e = np.zeros(max(n + d_e, 0), F32) if d_e else EMPTY
    try:
        core.onebit_compress_array(x, e, e, block, bits, scales)
        assert d_bits == 0 and d_scales == 0 and block in (32, 64) and (d_e == 0 or n + d_e == 0)
    except ok:
        pass
    codes = np.zeros(max(-(-n // 4) + d_codes, 0), np.uint8)
    try:
        core.twobit_compress_array(x, e, e, 0.5, codes)
    except ok:
        pass
    k = max(min(n, 5) + d_k, 0)
    try:
        core.topk_compress_array(x, EMPTY, EMPTY, k, np.zeros(max(min(n, 5), 0), F32),
                                 np.zeros(max(min(n, 5), 0), np.uint32))
        assert d_k == 0 or k == min(n, 5)
    except ok:
        pass
    arrs = [x, x[: n // 2].copy(), x[: n // 3].copy()]
    ptrs, off, nb = table(arrs)
    buf = aligned_empty(max(int(nb.sum()) + d_bits, 0))
    try:
        core.pack(buf, ptrs, off, nb, lo, hi)
        assert 0 <= lo <= hi <= 3
    except ok:
        pass
    try:
        core.unpack(buf, ptrs, off, nb, lo, hi)
    except ok:
        pass
