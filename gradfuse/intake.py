"""One intake for arrays: turn any supported array into a zero-copy buffer view.

``as_array(obj, name)`` accepts, without copying:

* numpy arrays and anything with the buffer protocol;
* DLPack: objects with ``__dlpack__`` and raw ``"dltensor"`` capsules. The capsule is
  parsed here rather than by ``np.from_dlpack``, because numpy makes read-only views
  of capsules, and gradfuse must write results back (MXNet 1.9.1's
  ``to_dlpack_for_write()`` is such a capsule);
* objects with ``to_dlpack_for_write`` (MXNet 1.9.1 NDArrays, which expose no other
  protocol): the writable capsule is taken, which also makes MXNet wait for pending
  writes to the array first;
* ``__cuda_array_interface__`` and CUDA DLPack tensors become a ``DeviceArray``
  record (pointer, shape, dtype, device), for the GPU path.

Host results are numpy arrays that view the original memory and keep its owner
alive. The core never imports a framework.
"""
import ctypes
from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

_kDLCPU, _kDLCUDA, _kDLCUDAHost, _kDLCUDAManaged = 1, 2, 3, 13
kDLCUDA, kDLCUDAManaged = _kDLCUDA, _kDLCUDAManaged        # DLPack device types of GPU memory
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT = 0, 1, 2, 4


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

_USED = ctypes.c_char_p(b"used_dltensor")   # must outlive the capsule: keep a module ref


@dataclass(frozen=True)
class DeviceArray:
    """A CUDA array seen through ``__cuda_array_interface__`` or DLPack (no copy)."""
    ptr: int
    shape: Tuple[int, ...]
    dtype: np.dtype
    device_id: int
    readonly: bool
    owner: Any

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _dl_dtype(dt, name):
    if dt.lanes != 1:
        raise TypeError(f"tensor {name!r}: DLPack vector dtype (lanes={dt.lanes}) is not supported")
    kind = {_DL_INT: "i", _DL_UINT: "u", _DL_FLOAT: "f"}.get(dt.code)
    if kind is None or dt.bits % 8:
        raise TypeError(f"tensor {name!r}: DLPack dtype code {dt.code} with {dt.bits} bits is not supported")
    return np.dtype(f"{kind}{dt.bits // 8}")


class _DLPackOwner:
    """Owns a consumed DLPack tensor; exposes it to numpy and frees it when the view dies."""

    def __init__(self, managed_ptr, interface, source):
        self._managed = managed_ptr
        self._source = source            # keep the producer alive too
        self.__array_interface__ = interface

    def __del__(self):
        m = self._managed
        self._managed = None
        if m:
            mt = ctypes.cast(m, ctypes.POINTER(_DLManagedTensor))
            if mt.contents.deleter:
                mt.contents.deleter(mt)


def _contiguous(shape, strides, dtype):
    """C-contiguous byte strides (dimensions of length 1 may have any stride)."""
    expected = dtype.itemsize
    for dim, st in zip(reversed(shape), reversed(strides)):
        if dim != 1 and st != expected:
            return False
        expected *= dim
    return True


def capsule_device(capsule):
    """``(device type, device id)`` of an unused ``"dltensor"`` capsule, without
    consuming it; None for anything else."""
    if not is_capsule(capsule) or not _api.PyCapsule_IsValid(capsule, b"dltensor"):
        return None
    ptr = _api.PyCapsule_GetPointer(capsule, b"dltensor")
    d = ctypes.cast(ptr, ctypes.POINTER(_DLManagedTensor)).contents.dl_tensor.device
    return int(d.device_type), int(d.device_id)


def from_dlpack_capsule(capsule, name="tensor", source=None):
    """A writable zero-copy view of a legacy ``"dltensor"`` capsule.

    The capsule is consumed (renamed ``"used_dltensor"``, as the DLPack protocol asks)
    and its deleter runs when the returned view is garbage-collected. CPU tensors give
    a numpy array; CUDA tensors give a ``DeviceArray``.
    """
    if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
        raise TypeError(f"tensor {name!r}: not an unused 'dltensor' DLPack capsule")
    ptr = _api.PyCapsule_GetPointer(capsule, b"dltensor")
    mt = ctypes.cast(ptr, ctypes.POINTER(_DLManagedTensor)).contents
    t = mt.dl_tensor
    dtype = _dl_dtype(t.dtype, name)
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    if t.strides:
        strides = tuple(int(t.strides[i]) * dtype.itemsize for i in range(t.ndim))
    else:
        strides = None
    data = (t.data or 0) + int(t.byte_offset)
    dev = t.device.device_type
    if dev not in (_kDLCPU, _kDLCUDAHost, _kDLCUDA, _kDLCUDAManaged):
        raise TypeError(f"tensor {name!r}: DLPack device type {dev} is not supported")
    if dev in (_kDLCUDA, _kDLCUDAManaged) and strides is not None and not _contiguous(shape, strides, dtype):
        raise ValueError(f"tensor {name!r}: non-contiguous CUDA DLPack tensors are not supported; "
                         f"make it contiguous first")
    _api.PyCapsule_SetName(capsule, _USED)
    if dev in (_kDLCUDA, _kDLCUDAManaged):
        owner = _DLPackOwner(ptr, None, (capsule, source))
        return DeviceArray(data, shape, dtype, int(t.device.device_id), False, owner)
    interface = {"version": 3, "shape": shape, "typestr": dtype.str,
                 "data": (data, False), "strides": strides}
    return np.asarray(_DLPackOwner(ptr, interface, (capsule, source)))


def _from_cuda_interface(obj, name):
    cai = obj.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(int(s) for s in cai["shape"])
    strides = cai.get("strides")
    if strides is not None:
        if not _contiguous(shape, strides, dtype):
            raise ValueError(f"tensor {name!r}: non-contiguous CUDA arrays are not supported; "
                             f"make it contiguous first")
    ptr, readonly = cai["data"]
    return DeviceArray(int(ptr or 0), shape, dtype, -1, bool(readonly), obj)


def is_capsule(obj):
    return type(obj).__name__ == "PyCapsule"


def as_array(obj, name="tensor"):
    """Turn ``obj`` into a numpy view (host) or a ``DeviceArray`` (CUDA), without copying.

    Raises ``TypeError`` naming the tensor when ``obj`` speaks none of the protocols.
    """
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_interface(obj, name)
    if is_capsule(obj):
        return from_dlpack_capsule(obj, name)
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        pass
    if hasattr(obj, "__dlpack__"):
        return from_dlpack_capsule(obj.__dlpack__(), name, source=obj)
    if hasattr(obj, "to_dlpack_for_write"):
        # MXNet 1.9.1 NDArray: the write capsule makes the engine finish pending
        # writes to this array before we see its memory.
        return from_dlpack_capsule(obj.to_dlpack_for_write(), name, source=obj)
    raise TypeError(f"tensor {name!r}: {type(obj).__module__}.{type(obj).__qualname__} is not an array "
                    f"gradfuse can read (it needs the buffer protocol, DLPack, "
                    f"__cuda_array_interface__ or to_dlpack_for_write)")
