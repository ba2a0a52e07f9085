"""The finiteness kernels of the step's verdicts (gradfuse.compressors.jobs) against their
numpy definitions: ``table_first_bad_sum`` is np.add.reduce(x, dtype=np.float32) per
tensor, bit for bit (its overflow decides the spare-buffer path), ``table_absmax`` is
max |x| with inf for any non-finite value (halves_cannot_fail)."""
import numpy as np
import pytest

import gradfuse._core as core

CHUNK = 8192          # numpy 1.x's default buffer size (np.getbufsize())
SIZES = list(range(0, 140)) + [255, 256, 257, 1000, 8191, 8192, 8193, 16384, 16391, 100003, 1 << 20, 2359296]


@pytest.fixture(autouse=True, params=[True, False], ids=["scalar", "simd"])
def dpath(request):
    """Every test on the scalar and on the AVX2 path (the same bits)."""
    if not request.param and not core.simd_info()["cpu_avx2_f16c"]:
        pytest.skip("no AVX2 on this CPU")
    core.set_simd(force_scalar=request.param)
    yield request.param
    core.set_simd(force_scalar=False)


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def table(arrays):
    ptrs = np.array([a.ctypes.data if a.size else 0 for a in arrays], np.int64)
    counts = np.array([a.size for a in arrays], np.int64)
    return ptrs, counts


def np_sum(x):
    """numpy 1.x's ``np.add.reduce(x, dtype=np.float32)`` on a float32 array, the kernel's rule,
    on any numpy: its buffered reduction adds the pairwise sums of 8192-element chunks in order,
    0 + pw(x[:8192]) + pw(x[8192:16384]) + ... (numpy 2 sums such an array unbuffered, in another
    order, above 8192 elements; a chunk of at most 8192 is one pairwise sum in both)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if x.size <= CHUNK:
            return np.add.reduce(x, dtype=np.float32)
        acc = np.float32(0.0)
        for i in range(0, x.size, CHUNK):
            acc = np.float32(acc + np.add.reduce(x[i:i + CHUNK], dtype=np.float32))
        return acc


@pytest.mark.parametrize("scale", [1.0, 1e36, 3e38])
def test_sum_is_numpys_pairwise_float32_sum_bit_for_bit(scale):
    rng = np.random.default_rng(int(scale) % 1000)
    for n in SIZES:
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        want, got = np_sum(x), np.float32(core.pairwise_sum_f32(x))
        assert bits(got) == bits(want) or (np.isnan(got) and np.isnan(want)), n


def test_first_bad_sum_follows_numpys_overflow():
    # alternating blocks of 8 of +-3e38: every pairwise partial sum cancels, so numpy's
    # sum is finite although a running sum would overflow; all 3e38: it overflows
    huge = np.tile(np.repeat(np.float32([3e38, -3e38]), 8), 4)
    big = np.full(64, 3e38, np.float32)
    assert np.isfinite(np_sum(huge)) and not np.isfinite(np_sum(big))
    ok = np.ones(9000, np.float32)
    nan = ok.copy()
    nan[8500] = np.nan
    arrays = [ok, huge, np.zeros(0, np.float32), big, nan]
    ptrs, counts = table(arrays)
    assert core.table_first_bad_sum(ptrs, counts, 0, 3) == -1
    assert core.table_first_bad_sum(ptrs, counts, 0, 5) == 3
    assert core.table_first_bad_sum(ptrs, counts, 4, 5) == 4
    assert core.table_first_bad_sum(ptrs, counts, 2, 2) == -1
    rng = np.random.default_rng(5)
    for _ in range(200):          # random mixes of huge values: the verdict is numpy's
        n = int(rng.integers(1, 20000))
        x = rng.choice(np.float32([3e38, -3e38, 1e38, -2e38, 1.0]), n).astype(np.float32)
        p, c = table([x])
        assert (core.table_first_bad_sum(p, c, 0, 1) == -1) == bool(np.isfinite(np_sum(x)))


def test_absmax_and_nonfinite():
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (3, 0, 5000, 70000)]
    ptrs, counts = table(arrays)
    assert core.table_absmax(ptrs, counts, 0, 4) == max(float(np.abs(a).max()) for a in arrays if a.size)
    assert core.table_absmax(ptrs, counts, 1, 2) == 0.0
    assert core.table_absmax(ptrs, counts, 0, 0) == 0.0
    arrays[0][:] = [-65504.0, 1.0, -0.0]
    assert core.table_absmax(ptrs, counts, 0, 1) == 65504.0
    for bad in (np.inf, -np.inf, np.nan):
        arrays[3][69999] = bad
        assert core.table_absmax(ptrs, counts, 0, 4) == float("inf")
        assert core.table_absmax(ptrs, counts, 0, 3) < float("inf")


def test_table_errors_name_the_row():
    x = np.ones(4, np.float32)
    ptrs, counts = table([x, x])
    with pytest.raises(IndexError, match="table range 0:3 outside a table of 2 rows"):
        core.table_first_bad_sum(ptrs, counts, 0, 3)
    counts[1] = -1
    with pytest.raises(ValueError, match="row 1 has a negative count"):
        core.table_absmax(ptrs, counts, 0, 2)
    counts[1] = 4
    ptrs[1] = 0
    with pytest.raises(ValueError, match="row 1 has a null address"):
        core.table_first_bad_sum(ptrs, counts, 0, 2)


def test_count_masked16_is_numpys_count():
    rng = np.random.default_rng(2)
    for n in (0, 1, 4095, 4096, 4097, 100003):
        w = rng.integers(0, 1 << 16, size=n).astype(np.uint16)
        for mask in (0x7C00, 0x7F80):
            assert core.count_masked16(w, mask) == np.count_nonzero((w & mask) == mask)
    assert core.count_masked16(np.full(70000, 0x7C00, np.uint16), 0x7C00) == 70000
