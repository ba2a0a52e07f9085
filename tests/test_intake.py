"""gradfuse.fusion.intake: buffer protocol, DLPack capsules, CUDA array interface."""
import gc
import os
import sys

import numpy as np
import pytest

import gradfuse
from gradfuse.fusion import tables
from gradfuse.fusion import intake
from gradfuse.comm import SingleProcessCommunicator

sys.path.insert(0, os.path.dirname(__file__))
from dlpack_capsules import IS_COPIED, READ_ONLY, capsule_name, host_capsule  # noqa: E402


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


def _no_cupy():
    raise ImportError("No module named 'cupy'")


def test_cuda_array_interface_becomes_device_array(monkeypatch):
    d = intake.as_array(FakeCuda(), "g")
    assert isinstance(d, intake.DeviceArray)
    assert d.ptr == 12345 and d.shape == (4, 2) and d.dtype == np.float32 and d.nbytes == 32
    # as without cupy, also where cupy (or the emulator's, after GPU tests) is importable:
    # the GPU path must not run on FakeCuda's made-up pointer
    from gradfuse import gpu
    monkeypatch.setattr(gpu, "cupy", _no_cupy)
    with pytest.raises(TypeError, match="tensor 'g' is a CUDA array, and the GPU path needs cupy"):
        gradfuse.Pipeline(comm=SingleProcessCommunicator()).allreduce({"g": FakeCuda()})


# --- DLPack capsules: legacy "dltensor" and DLPack 1.x "dltensor_versioned" ----------

@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_host_capsules_of_both_kinds(versioned):
    """Zero-copy writable view, the capsule renamed as DLPack asks, the deleter called once
    when the view dies (not before, not by the capsule as well)."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    cap, rec = host_capsule(a, versioned=versioned)
    assert capsule_name(cap) == ("dltensor_versioned" if versioned else "dltensor")
    assert intake.capsule_device(cap) == (1, 0)
    w = intake.from_dlpack_capsule(cap, "a")
    assert capsule_name(cap) == ("used_dltensor_versioned" if versioned else "used_dltensor")
    assert intake.capsule_device(cap) is None
    assert w.flags.writeable and w.shape == (2, 3) and w.ctypes.data == a.ctypes.data
    w[1, 2] = 42
    assert a[1, 2] == 42
    with pytest.raises(TypeError, match="tensor 'a': not an unused 'dltensor' or 'dltensor_versioned'"):
        intake.from_dlpack_capsule(cap, "a")      # consumed once only
    gc.collect()
    assert rec.deleted == 0
    del w
    gc.collect()
    assert rec.deleted == 1
    del cap
    gc.collect()
    assert rec.deleted == 1                      # the used capsule does not free it again


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_host_capsules_as_inputs_and_outputs(versioned):
    pipe = gradfuse.Pipeline(comm=SingleProcessCommunicator(), average=False)
    src = np.arange(5, dtype=np.float32)
    dst = np.zeros(5, np.float32)
    cap, rec = host_capsule(dst, versioned=versioned)
    out = pipe.allreduce({"w": src}, out={"w": cap})
    assert dst.tolist() == src.tolist() and out["w"] is cap
    cap, _ = host_capsule(src, versioned=versioned)
    got = pipe.allreduce([cap], names=["w"])
    assert got[0].tolist() == src.tolist()
    del out, got, cap
    gc.collect()
    assert rec.deleted == 1


@pytest.mark.parametrize("flag", [READ_ONLY, IS_COPIED], ids=["read-only", "is-copied"])
def test_versioned_read_only_flag(flag):
    """A read-only versioned capsule, or a copy the producer made (results written into it
    would be lost), is read, but refused as an output (also in place)."""
    a = np.arange(4, dtype=np.float64)
    cap, rec = host_capsule(a, flags=flag)
    v = intake.from_dlpack_capsule(cap, "r")
    assert not v.flags.writeable and v.ctypes.data == a.ctypes.data
    with pytest.raises(ValueError):
        v[0] = 1
    del v
    gc.collect()
    assert rec.deleted == 1
    pipe = gradfuse.Pipeline(comm=SingleProcessCommunicator(), average=False)
    got = pipe.allreduce({"r": host_capsule(a, flags=flag)[0]})
    assert got["r"].tolist() == a.tolist()
    with pytest.raises(ValueError, match="tensor 'r' is read-only; the results cannot be written into it"):
        pipe.allreduce({"r": a}, out={"r": host_capsule(np.zeros(4), flags=flag)[0]})
    with pytest.raises(ValueError, match="tensor 'r' is read-only; the results cannot be written into it"):
        pipe.allreduce_({"r": host_capsule(a, flags=flag)[0]})
    assert a.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("version", [(2, 0), (0, 9)])
def test_versioned_capsule_of_another_major_version_refused(version):
    a = np.ones(3, np.float32)
    cap, rec = host_capsule(a, version=version)
    assert intake.capsule_device(cap) is None
    with pytest.raises(TypeError, match=rf"tensor 'g': DLPack {version[0]}\.{version[1]} capsule; "
                                        r"gradfuse reads DLPack 1\.x"):
        intake.from_dlpack_capsule(cap, "g")
    assert capsule_name(cap) == "dltensor_versioned"        # not consumed...
    pipe = gradfuse.Pipeline(comm=SingleProcessCommunicator())
    with pytest.raises(TypeError, match=rf"tensor 'g': DLPack {version[0]}\.{version[1]} capsule"):
        pipe.allreduce({"g": cap})
    assert capsule_name(cap) == "dltensor_versioned" and rec.deleted == 0
    del cap
    pipe.allreduce({"g": a})     # the communication thread lets go of the refused step
    gc.collect()
    assert rec.deleted == 1                                  # ...so its producer freed it


def _numpy_versioned(arr):
    """numpy's versioned capsule of ``arr``; None where numpy has no ``max_version``."""
    try:
        return arr.__dlpack__(max_version=(1, 0))
    except TypeError:
        return None


class Producer:
    """A DLPack producer without the buffer protocol (a framework tensor on the host)."""

    def __init__(self, arr, old_signature=False):
        self.arr, self.calls = arr, []
        if old_signature:
            self.__dlpack__ = self._old

    def __dlpack__(self, **kw):
        self.calls.append(kw)
        return self.arr.__dlpack__(**kw)

    def _old(self, stream=None):            # before DLPack 1.0: no max_version
        self.calls.append({"stream": stream})
        return self.arr.__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)


def test_producers_are_asked_for_versioned_capsules():
    """max_version=(1, 0) first; producers without it (numpy 1.x, older frameworks) are
    asked again for a legacy capsule. Works on numpy 1.x and 2.x."""
    a = np.arange(4, dtype=np.float32)
    p = Producer(a)
    v = intake.as_array(p, "p")
    assert v.flags.writeable and v.ctypes.data == a.ctypes.data
    assert p.calls[0] == {"max_version": (1, 0)}
    numpy_has_it = _numpy_versioned(np.ones(1)) is not None
    assert len(p.calls) == (1 if numpy_has_it else 2) and p.calls[-1] == ({"max_version": (1, 0)} if numpy_has_it
                                                                          else {})
    old = Producer(a, old_signature=True)
    assert intake.as_array(old, "p").ctypes.data == a.ctypes.data and old.calls == [{"stream": None}]
    pipe = gradfuse.Pipeline(comm=SingleProcessCommunicator(), average=False)
    out = np.zeros(4, np.float32)
    pipe.allreduce([Producer(a)], out=[Producer(out)])
    assert out.tolist() == a.tolist()


def test_numpy_versioned_capsules_where_numpy_makes_them():
    """numpy 2's __dlpack__(max_version=(1, 0)) exports DLPack 1.0 capsules, read-only
    arrays with the read-only flag (skipped where numpy does not take max_version)."""
    a = np.arange(3, dtype=np.int64)
    cap = _numpy_versioned(a)
    if cap is None:
        pytest.skip(f"numpy {np.__version__} has no __dlpack__(max_version=)")
    assert capsule_name(cap) == "dltensor_versioned" and intake.capsule_device(cap) == (1, 0)
    w = intake.from_dlpack_capsule(cap, "a")
    assert w.flags.writeable and w.ctypes.data == a.ctypes.data
    assert capsule_name(cap) == "used_dltensor_versioned"
    ro = np.arange(3, dtype=np.int64)
    ro.flags.writeable = False
    v = intake.as_array(Producer(ro), "ro")
    assert not v.flags.writeable and v.ctypes.data == ro.ctypes.data
    pipe = gradfuse.Pipeline(comm=SingleProcessCommunicator(), average=False)
    with pytest.raises(ValueError, match="tensor 'ro' is read-only"):
        pipe.allreduce({"ro": a}, out={"ro": Producer(ro)})


class RaisingCAI:
    """PyTorch's CUDA tensor that requires grad: its __cuda_array_interface__ raises
    RuntimeError (which hasattr() lets through)."""

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad.")


class RaisingCAIWithDLPack(RaisingCAI, Producer):
    pass


def test_cuda_interface_that_raises_is_named_or_falls_back_on_dlpack():
    with pytest.raises(TypeError, match=r"tensor 'g': reading the __cuda_array_interface__ of .*RaisingCAI "
                                        r"raised RuntimeError: Can't get"):
        intake.as_array(RaisingCAI(), "g")
    assert intake.on_device(RaisingCAI())
    a = np.arange(3, dtype=np.float32)
    p = RaisingCAIWithDLPack(a)
    assert intake.as_array(p, "g").ctypes.data == a.ctypes.data
    assert not intake.on_device(p)          # its DLPack device says host


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
