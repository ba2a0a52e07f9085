"""The fusion kernels in _core.pyx against numpy."""
import numpy as np
import pytest

from gradfuse import _core
from gradfuse.fusion.plan import aligned_empty


def table(arrays):
    ptrs = np.array([a.ctypes.data for a in arrays], np.int64)
    nb = np.array([a.nbytes for a in arrays], np.int64)
    off = np.concatenate([[0], np.cumsum(nb)[:-1]]).astype(np.int64) if arrays else np.zeros(0, np.int64)
    return ptrs, off, nb


def test_pack_unpack_round_trip(rng):
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (0, 1, 7, 31, 32, 33, 97, 1009)]
    ptrs, off, nb = table(arrays)
    buf = aligned_empty(int(nb.sum()))
    _core.pack(buf, ptrs, off, nb, 0, len(arrays))
    assert buf.view(np.float32).tobytes() == np.concatenate(arrays).tobytes()
    outs = [np.empty_like(a) for a in arrays]
    optrs, _, _ = table(outs)
    _core.unpack(buf, optrs, off, nb, 0, len(arrays))
    for a, o in zip(arrays, outs):
        assert a.tobytes() == o.tobytes()
    # a sub-range only touches its own rows
    outs2 = [np.zeros_like(a) for a in arrays]
    _core.unpack(buf, table(outs2)[0], off, nb, 2, 4)
    assert not outs2[1].any() and outs2[2].tobytes() == arrays[2].tobytes() and not outs2[4].any()


def test_pack_checks_table():
    a = np.ones(10, np.float32)
    ptrs, off, nb = table([a])
    with pytest.raises(ValueError, match="too small"):
        _core.pack(np.empty(39, np.uint8), ptrs, off, nb, 0, 1)
    with pytest.raises(IndexError):
        _core.pack(np.empty(40, np.uint8), ptrs, off, nb, 0, 2)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0, 7.0])
def test_unpack_div_matches_numpy_division(rng, dtype, divisor):
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 6e-8, 1e-8, 1e30]
    a = np.concatenate([rng.standard_normal(1000) * 1000, specials]).astype(dtype)
    buf = aligned_empty(a.nbytes)
    buf[:] = a.view(np.uint8)
    out = np.empty_like(a)
    code = {np.float16: 1, np.float32: 2, np.float64: 3}[dtype]
    _core.unpack_div(buf, np.array([out.ctypes.data], np.int64), np.zeros(1, np.int64),
                     np.array([a.nbytes], np.int64), 0, 1, code, divisor)
    expected = a / dtype(divisor)
    assert out.view(np.uint8).tobytes() == expected.view(np.uint8).tobytes()
    b = a.copy()
    _core.div_inplace(b.ctypes.data, b.size, code, divisor)
    assert b.tobytes() == expected.tobytes()


def test_div_rejects_ints():
    with pytest.raises(TypeError):
        _core.div_inplace(0, 1, 4, 2.0)


def test_fp16_sum_op_is_float32_add_rounded_once(rng):
    """The MPI user op behind float16 sums (sum16, fmt 1): numpy's own float16 add."""
    a = (rng.standard_normal(5000) * 3000).astype(np.float16)
    b = (rng.standard_normal(5000) * 3000).astype(np.float16)
    inout = b.copy()
    _core.sum16(1, a, inout)
    with np.errstate(all="ignore"):
        assert inout.tobytes() == (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16).tobytes()
        assert inout.tobytes() == (a + b).tobytes()


def test_scan_flags_and_signature():
    objs = [np.ones((2, 3), np.float32), np.ones(4)[::2], np.ones(2, complex), b"xy", 3,
            np.frombuffer(b"abcd", np.float32)]
    n = len(objs)
    ptrs, nb, flags = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    sig = _core.scan(objs, ptrs, nb, flags)
    assert flags[0] == 0 and nb[0] == 24 and ptrs[0] == objs[0].ctypes.data
    assert flags[1] == _core.FLAG_NONCONTIG
    assert flags[2] & _core.FLAG_BADDTYPE
    assert flags[3] & _core.FLAG_BADDTYPE
    assert flags[4] == _core.FLAG_NOBUFFER
    assert flags[5] == _core.FLAG_READONLY
    words = np.frombuffer(sig, np.int64).tolist()
    assert words[:4] == [2, 2, 2, 3]


def test_simd_switch_round_trips():
    before = _core.simd_info()
    _core.set_simd(True)
    assert _core.simd_info()["using_avx2"] is False
    _core.set_simd(False)
    assert _core.simd_info()["using_avx2"] == before["cpu_avx2_f16c"]
