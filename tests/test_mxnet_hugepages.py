"""gradfuse.mxnet.hugepages: the transparent-huge-page advice for MXNet's CPU arrays
changes no byte, advises each range once, and skips small arrays."""
import ctypes

import numpy as np
import pytest

pytest.importorskip("mxnet")
from gradfuse.mxnet import hugepages  # noqa: E402


def _buffer(nbytes):
    buf = ctypes.create_string_buffer(nbytes)       # plain heap memory the test owns
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    return buf, arr


def test_advice_keeps_bytes_and_runs_once_per_range():
    buf, arr = _buffer(3 * hugepages.MIN_BYTES)
    keep = arr.copy()
    ptrs = np.array([ctypes.addressof(buf)], np.int64)
    nbytes = np.array([arr.nbytes], np.int64)
    hugepages._seen.clear()
    first = hugepages.advise(ptrs, nbytes)
    if hugepages._libc_madvise() is None:
        assert first == 0
        return
    assert first == 1 and len(hugepages._seen) == 1
    assert hugepages.advise(ptrs, nbytes) == 0          # seen: no second system call
    assert np.array_equal(arr, keep)
    lo, hi = next(iter(hugepages._seen))
    assert lo % hugepages.PAGE == 0 and hi % hugepages.PAGE == 0
    assert ptrs[0] <= lo < hi <= ptrs[0] + nbytes[0]


def test_small_and_null_arrays_are_left_alone():
    hugepages._seen.clear()
    small = np.array([hugepages.MIN_BYTES - 1, 1 << 30], np.int64)
    assert hugepages.advise(np.array([4096, 0], np.int64), small) == 0
    assert not hugepages._seen


def test_the_variable_is_parsed_strictly(monkeypatch):
    monkeypatch.setattr(hugepages, "_madvise", [])
    monkeypatch.setenv("GRADFUSE_MXNET_HUGEPAGES", "no")
    with pytest.raises(ValueError, match="GRADFUSE_MXNET_HUGEPAGES"):
        hugepages._libc_madvise()
    monkeypatch.setattr(hugepages, "_madvise", [])
    monkeypatch.setenv("GRADFUSE_MXNET_HUGEPAGES", "0")
    assert hugepages._libc_madvise() is None
    monkeypatch.setattr(hugepages, "_madvise", [])
