"""The finiteness kernels of the step's verdicts (gradfuse.step.jobs) against their
numpy definitions: ``table_absmax`` is max |x| with inf for any non-finite value (the
step's bound, input_bound, and halves_cannot_fail), ``count_masked16`` numpy's count of
masked 16-bit words."""
import numpy as np
import pytest

import gradfuse._core as core

# the AVX2 loop's edges (16 lanes), the kernel's 4096-element blocks, ResNet-50's largest tensor
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


@pytest.mark.parametrize("scale", [1.0, 1e-30, 3e38])
def test_absmax_is_numpys_max_abs_at_every_size(scale):
    rng = np.random.default_rng(3)
    for n in SIZES:
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        ptrs, counts = table([x])
        want = float(np.abs(x).max()) if n else 0.0
        assert core.table_absmax(ptrs, counts, 0, 1) == want, n
        if n:
            x[rng.integers(n)] = np.nan          # anywhere, at any size: inf
            assert core.table_absmax(ptrs, counts, 0, 1) == float("inf"), n


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
        core.table_absmax(ptrs, counts, 0, 3)
    counts[1] = -1
    with pytest.raises(ValueError, match="row 1 has a negative count"):
        core.table_absmax(ptrs, counts, 0, 2)
    counts[1] = 4
    ptrs[1] = 0
    with pytest.raises(ValueError, match="row 1 has a null address"):
        core.table_absmax(ptrs, counts, 0, 2)


def test_count_masked16_is_numpys_count():
    rng = np.random.default_rng(2)
    for n in (0, 1, 4095, 4096, 4097, 100003):
        w = rng.integers(0, 1 << 16, size=n).astype(np.uint16)
        for mask in (0x7C00, 0x7F80):
            assert core.count_masked16(w, mask) == np.count_nonzero((w & mask) == mask)
    assert core.count_masked16(np.full(70000, 0x7C00, np.uint16), 0x7C00) == 70000
