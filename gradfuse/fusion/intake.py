"""One intake for arrays: turn any supported array into a zero-copy buffer view.

``as_array(obj, name)`` accepts, without copying:

* numpy arrays and anything with the buffer protocol;
* DLPack: objects with ``__dlpack__`` and raw capsules, legacy ``"dltensor"`` ones and
  DLPack 1.x ``"dltensor_versioned"`` ones (cupy 14's ``toDlpack()``, numpy 2's
  ``__dlpack__(max_version=(1, 0))``). The capsule is parsed here rather than by
  ``np.from_dlpack``, because numpy makes read-only views of capsules, and gradfuse
  must write results back (MXNet 1.9.1's ``to_dlpack_for_write()`` is such a capsule).
  A versioned capsule's read-only flag is kept, and a copy the producer made (the
  is-copied flag) is treated as read-only too (neither can be an output);
  producers are asked for a versioned capsule first (``max_version=(1, 0)``) and, when
  they do not take that argument, for a legacy one;
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
GPU_DEVICE_TYPES = (_kDLCUDA, _kDLCUDAManaged)    # DLPack device types of GPU memory
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT = 0, 1, 2, 4


def is_gpu_device(dev):
    """Whether a DLPack ``(device type, id)`` (or None) is GPU memory."""
    return dev is not None and dev[0] in GPU_DEVICE_TYPES


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


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    """DLPack >= 1.0 (capsule name ``"dltensor_versioned"``). Only ``version``, the first
    field, is ABI-stable across major versions: read it before anything else."""


_DELETER_VERSIONED = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensorVersioned))
_DLManagedTensorVersioned._fields_ = [
    ("version", _DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER_VERSIONED),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", _DLTensor),
]

DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
DLPACK_FLAG_BITMASK_IS_COPIED = 1 << 1
DLPACK_MAJOR_VERSION = 1           # the versioned layout gradfuse reads (DLPack 1.x)
DLPACK_MAX_VERSION = (1, 0)        # what gradfuse asks producers for (``max_version=``)

_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

_LEGACY, _VERSIONED = b"dltensor", b"dltensor_versioned"
# the names a consumed capsule gets; they must outlive the capsule: keep module refs
_USED = ctypes.c_char_p(b"used_dltensor")
_USED_VERSIONED = ctypes.c_char_p(b"used_dltensor_versioned")


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
    """Owns a consumed DLPack tensor; exposes it to numpy and frees it when the view dies
    (through the deleter of its struct: ``DLManagedTensor`` or ``DLManagedTensorVersioned``)."""

    def __init__(self, managed_ptr, interface, source, versioned=False):
        self._managed = managed_ptr
        self._struct = _DLManagedTensorVersioned if versioned else _DLManagedTensor
        self._source = source            # keep the producer alive too
        self.__array_interface__ = interface

    def __del__(self):
        m = self._managed
        self._managed = None
        if m:
            mt = ctypes.cast(m, ctypes.POINTER(self._struct))
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


def _capsule_kind(capsule):
    """``_VERSIONED`` or ``_LEGACY`` for an unused DLPack capsule, else None."""
    if not is_capsule(capsule):
        return None
    for kind in (_VERSIONED, _LEGACY):
        if _api.PyCapsule_IsValid(capsule, kind):
            return kind
    return None


def _versioned_struct(ptr):
    """The ``DLManagedTensorVersioned`` at ``ptr``, or None if its major version is not
    the one gradfuse reads (then nothing past the version may be read)."""
    if ctypes.cast(ptr, ctypes.POINTER(_DLPackVersion)).contents.major != DLPACK_MAJOR_VERSION:
        return None
    return ctypes.cast(ptr, ctypes.POINTER(_DLManagedTensorVersioned)).contents


def capsule_device(capsule):
    """``(device type, device id)`` of an unused ``"dltensor"`` or ``"dltensor_versioned"``
    capsule, without consuming it; None for anything else (also for a DLPack major
    version gradfuse does not read: ``from_dlpack_capsule`` names that error)."""
    kind = _capsule_kind(capsule)
    if kind is None:
        return None
    ptr = _api.PyCapsule_GetPointer(capsule, kind)
    if kind == _VERSIONED:
        mt = _versioned_struct(ptr)
        if mt is None:
            return None
    else:
        mt = ctypes.cast(ptr, ctypes.POINTER(_DLManagedTensor)).contents
    d = mt.dl_tensor.device
    return int(d.device_type), int(d.device_id)


def from_dlpack_capsule(capsule, name="tensor", source=None):
    """A zero-copy view of a legacy ``"dltensor"`` or a DLPack 1.x ``"dltensor_versioned"``
    capsule; writable unless a versioned capsule has the read-only flag.

    The capsule is consumed (renamed ``"used_dltensor"`` / ``"used_dltensor_versioned"``,
    as the DLPack protocol asks) and its deleter runs when the returned view is
    garbage-collected. CPU tensors give a numpy array; CUDA tensors give a
    ``DeviceArray``. A capsule that is refused (unsupported version, dtype, device or
    layout) is left unconsumed, so its producer still frees it.
    """
    kind = _capsule_kind(capsule)
    if kind is None:
        raise TypeError(f"tensor {name!r}: not an unused 'dltensor' or 'dltensor_versioned' DLPack capsule")
    ptr = _api.PyCapsule_GetPointer(capsule, kind)
    versioned = kind == _VERSIONED
    readonly = False
    if versioned:
        mt = _versioned_struct(ptr)
        if mt is None:
            v = ctypes.cast(ptr, ctypes.POINTER(_DLPackVersion)).contents
            raise TypeError(f"tensor {name!r}: DLPack {v.major}.{v.minor} capsule; gradfuse reads DLPack "
                            f"{DLPACK_MAJOR_VERSION}.x (versioned) and legacy capsules")
        # a copy the producer made (IS_COPIED) counts as read-only: results written into it
        # would never reach the producer's tensor
        readonly = bool(mt.flags & (DLPACK_FLAG_BITMASK_READ_ONLY | DLPACK_FLAG_BITMASK_IS_COPIED))
    else:
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
    if dev in GPU_DEVICE_TYPES and strides is not None and not _contiguous(shape, strides, dtype):
        raise ValueError(f"tensor {name!r}: non-contiguous CUDA DLPack tensors are not supported; "
                         f"make it contiguous first")
    _api.PyCapsule_SetName(capsule, _USED_VERSIONED if versioned else _USED)
    if dev in GPU_DEVICE_TYPES:
        owner = _DLPackOwner(ptr, None, (capsule, source), versioned)
        return DeviceArray(data, shape, dtype, int(t.device.device_id), readonly, owner)
    interface = {"version": 3, "shape": shape, "typestr": dtype.str,
                 "data": (data, readonly), "strides": strides}
    return np.asarray(_DLPackOwner(ptr, interface, (capsule, source), versioned))


def dlpack_capsule(obj, stream=None):
    """``obj.__dlpack__(...)``, asking for a DLPack 1.x versioned capsule
    (``max_version=(1, 0)``) and, for producers that do not take that argument (numpy
    1.x, older frameworks), for a legacy one. ``stream`` (GPU tensors only) is passed
    when given; a producer that takes no ``stream=`` is called without it."""
    kw = {} if stream is None else {"stream": stream}
    try:
        return obj.__dlpack__(max_version=DLPACK_MAX_VERSION, **kw)
    except TypeError:
        pass
    if kw:
        try:
            return obj.__dlpack__(**kw)
        except TypeError:
            pass
    return obj.__dlpack__()


def cuda_interface(obj):
    """``(interface, error)``: ``obj.__cuda_array_interface__`` (None when it has none),
    or the exception its property raised other than AttributeError (PyTorch raises
    RuntimeError for a tensor that requires grad), which ``hasattr`` would let escape."""
    try:
        return getattr(obj, "__cuda_array_interface__", None), None
    except Exception as e:       # noqa: BLE001 (reported by the caller, naming the tensor)
        return None, e


def cuda_interface_error(obj, name, err):
    """The TypeError for a tensor whose ``__cuda_array_interface__`` raised ``err`` and
    that offers no DLPack to fall back on."""
    return TypeError(f"tensor {name!r}: reading the __cuda_array_interface__ of "
                     f"{type(obj).__module__}.{type(obj).__qualname__} raised {type(err).__name__}: {err} "
                     f"(and it has no __dlpack__ to fall back on; a PyTorch tensor that requires grad "
                     f"must be detached first)")


def _from_cuda_interface(obj, name, cai):
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
    cai, cai_error = cuda_interface(obj)
    if cai is not None:
        return _from_cuda_interface(obj, name, cai)
    if cai_error is not None and not hasattr(obj, "__dlpack__"):
        raise cuda_interface_error(obj, name, cai_error)
    if is_capsule(obj):
        return from_dlpack_capsule(obj, name)
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        pass
    if hasattr(obj, "__dlpack__"):
        return from_dlpack_capsule(dlpack_capsule(obj), name, source=obj)
    if hasattr(obj, "to_dlpack_for_write"):
        # MXNet 1.9.1 NDArray: the write capsule makes the engine finish pending
        # writes to this array before we see its memory.
        return from_dlpack_capsule(obj.to_dlpack_for_write(), name, source=obj)
    raise TypeError(f"tensor {name!r}: {type(obj).__module__}.{type(obj).__qualname__} is not an array "
                    f"gradfuse can read (it needs the buffer protocol, DLPack, "
                    f"__cuda_array_interface__ or to_dlpack_for_write)")
