"""gradfuse.intake: buffer protocol, DLPack capsules, CUDA array interface."""
import gc

import numpy as np
import pytest

import gradfuse
from gradfuse import intake
from gradfuse.comm import SingleProcessCommunicator


def test_numpy_passes_through():
    a = np.ones(3)
    assert intake.as_array(a) is a


def test_buffer_protocol_is_zero_copy():
    b = bytearray(8)
    v = intake.as_array(memoryview(b).cast("f"))
    v[:] = 1.5
    assert np.frombuffer(b, np.float32).tolist() == [1.5, 1.5]


def test_dlpack_object_gives_writable_zero_copy_view():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = intake.as_array(a, "a")          # ndarray itself...
    cap = a.__dlpack__()                 # ...and a raw capsule
    w = intake.from_dlpack_capsule(cap, "a")
    assert w.flags.writeable and w.shape == (2, 3) and w.ctypes.data == a.ctypes.data
    w[0, 0] = 42
    assert a[0, 0] == 42 and v[0, 0] == 42
    with pytest.raises(TypeError, match="not an unused 'dltensor'"):
        intake.from_dlpack_capsule(cap, "a")      # consumed once only
    del w
    gc.collect()
    assert a[0, 0] == 42                            # the producer's memory is still fine


class FakeMXNet:
    """Stands in for an MXNet 1.9.1 NDArray: no buffer protocol, only dlpack capsules."""

    def __init__(self, arr):
        self._arr = arr
        self.waited = False

    def to_dlpack_for_write(self):
        self.waited = True
        return self._arr.__dlpack__()


def test_to_dlpack_for_write_objects_are_written_in_place():
    store = np.ones(5, np.float32)
    nd = FakeMXNet(store)
    pipe = gradfuse.Pipeline(comm=SingleProcessCommunicator(), average=False)
    pipe.allreduce_([nd])
    assert nd.waited
    got = pipe.allreduce({"x": FakeMXNet(store)})
    assert np.array_equal(got["x"], store)


class FakeCuda:
    def __init__(self):
        self.__cuda_array_interface__ = {"shape": (4, 2), "typestr": "<f4", "data": (12345, False),
                                         "version": 3, "strides": None}


def test_cuda_array_interface_becomes_device_array():
    d = intake.as_array(FakeCuda(), "g")
    assert isinstance(d, intake.DeviceArray)
    assert d.ptr == 12345 and d.shape == (4, 2) and d.dtype == np.float32 and d.nbytes == 32
    with pytest.raises(TypeError, match="tensor 'g' is a CUDA array, and the GPU path needs cupy"):
        gradfuse.Pipeline(comm=SingleProcessCommunicator()).allreduce({"g": FakeCuda()})


def test_unknown_object_error_names_tensor():
    with pytest.raises(TypeError, match="tensor 'w': builtins.object is not an array"):
        intake.as_array(object(), "w")


def test_real_mxnet_ndarray_zero_copy_in_place():
    mx = pytest.importorskip("mxnet")
    nd = mx.nd.arange(6, dtype="float32").reshape((2, 3)) * 2      # pending engine op
    view = intake.as_array(nd, "w")
    assert view.flags.writeable and view.shape == (2, 3) and view.dtype == np.float32
    view[0, 0] = 100.0
    assert nd.asnumpy()[0, 0] == 100.0                               # same memory, no copy
    pipe = gradfuse.Pipeline(comm=SingleProcessCommunicator(), average=False)
    grads = [mx.nd.ones((3,), dtype="float16"), mx.nd.full((4,), 2.0, dtype="float64")]
    out = pipe.allreduce_(grads)
    assert out is grads and grads[1].asnumpy().tolist() == [2.0] * 4
