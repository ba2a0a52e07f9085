"""One intake for arrays: what kind each of a call's arrays is, decided once; a zero-copy view.

``read(objs, names, writable, outs, deferred)`` takes a call's arrays: on a GPU when its
first array is (``on_device``), cupy views then (``device_views``); on the host every
object that is not a numpy array becomes one (``host_views``); then one table builder
(``gradfuse.fusion.host``, ``gradfuse.fusion.device``) reads their tables into ``Inputs``.

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

from . import device, host
from .call import Inputs
from .dlpack import (
    _kDLCPU, _kDLCUDA, _kDLCUDAHost, _kDLCUDAManaged, GPU_DEVICE_TYPES, _DL_INT, _DL_UINT, _DL_FLOAT,
    _DLManagedTensor, _DLPackVersion, _DLManagedTensorVersioned, DLPACK_FLAG_BITMASK_READ_ONLY,
    DLPACK_FLAG_BITMASK_IS_COPIED, DLPACK_MAJOR_VERSION, DLPACK_MAX_VERSION, _api, _LEGACY, _VERSIONED,
    _USED, _USED_VERSIONED)
from .. import dtypes as _dt


def is_gpu_device(dev):
    """Whether a DLPack ``(device type, id)`` (or None) is GPU memory."""
    return dev is not None and dev[0] in GPU_DEVICE_TYPES


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


# --- what kind of array: decided once per call (on_device), then each taken as it is -------
def _dlpack_device(obj):
    """``obj.__dlpack_device__()`` as (type, id) ints; None without one or if it fails."""
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None:
        return None
    try:
        d = dev()
        return int(d[0]), int(d[1])
    except Exception:
        return None


def _producer_device(obj):
    """The DLPack device of a producer (``__dlpack__`` and ``__dlpack_device__``), else None."""
    return _dlpack_device(obj) if hasattr(obj, "__dlpack__") else None


def on_device(obj):
    """True for GPU arrays (cupy, ``__cuda_array_interface__``, CUDA DLPack, DeviceArray)."""
    if type(obj) is np.ndarray:
        return False
    if isinstance(obj, DeviceArray):
        return True
    dev = _producer_device(obj)
    if dev is not None:              # a DLPack producer says where it is
        return is_gpu_device(dev)
    cai, cai_error = cuda_interface(obj)
    if cai is not None:
        return True
    if getattr(getattr(obj, "context", None), "device_type", None) == "gpu":
        return True         # an MXNet NDArray on a GPU (read through its DLPack capsule)
    if is_capsule(obj):
        return is_gpu_device(capsule_device(obj))
    # a CUDA array interface whose property raises (PyTorch: a tensor that requires grad)
    # still says the tensor is on a GPU; the GPU intake falls back on DLPack or names it
    return cai_error is not None


def read(objs, names, writable, outs=None, deferred=None):
    """The ``Inputs`` of one call: its arrays ``objs`` and, with ``out=``, the arrays ``outs``
    (read in the same pass), or a ``Deferred`` binding's description (``deferred``).

    What kind of arrays they are is decided here, once: the call is on a GPU when its first
    array is; on the host every object that is not a numpy array is taken as one first
    (``host_views``: the buffer protocol, DLPack, MXNet NDArrays); on a GPU every array
    becomes a zero-copy cupy view (``device_views``). Then one table builder reads them all
    (``host.host_tables``: one C loop; ``device.device_tables``). ``writable``: the results
    are written into ``objs`` (in place). Bad input raises ``TypeError``/``ValueError``
    naming the tensor.
    """
    gpu = deferred is None and bool(objs) and on_device(objs[0])
    xp, dev, out_dev = np, None, None
    if deferred is None and not gpu:
        objs = host_views(objs, names, "tensor")
        if outs is not None:
            outs = host_views(outs, names, "output")
    if gpu:
        xp = _cupy_for(names[0])
        objs, dev = device_views(objs, names, writable, xp)
        if outs is not None:
            bad = next((n for o, n in zip(outs, names) if not on_device(o)), None)
            if bad is not None:
                raise TypeError(f"output {bad!r} is in host memory but the gradients are on GPU {dev}")
            outs, out_dev = device_views(outs, names, True, xp)
            if out_dev != dev and any(a.size for a in outs):
                raise ValueError(f"outputs are on GPU {out_dev} but the gradients are on GPU {dev}")
    out_tables = None
    if deferred is not None:
        sig, ptrs, nbytes = deferred.sig, deferred.ptrs, deferred.nbytes
    elif gpu:
        sig, ptrs, nbytes = device.device_tables(objs)
        if outs is not None:
            out_tables = device.device_tables(outs)
    else:
        objs, sig, ptrs, nbytes, outs, out_tables = host.host_tables(objs, names, writable, outs)
    return Inputs(objs, names, sig, ptrs, nbytes, dev, xp, deferred, outs, out_tables)


def _cupy_for(name):
    """cupy, or a TypeError naming the tensor when the GPU path cannot run here."""
    from .. import gpu
    try:
        cp = gpu.cupy()
    except ImportError as e:
        raise TypeError(f"tensor {name!r} is a CUDA array, and the GPU path needs cupy, which "
                        f"cannot be imported ({e}); install gradfuse[cuda12] or gradfuse[cuda13]") from None
    if not _gpu_seen[0]:
        if not gpu.available():
            raise TypeError(f"tensor {name!r} is a CUDA array, but cupy sees no CUDA device here")
        _gpu_seen[0] = True
    return cp


_gpu_seen = [False]     # a CUDA device was seen once: no device query per step after that


#: the types the host table builder takes as they are (anything else is taken as an array first)
_NDARRAY = frozenset({np.ndarray})


def host_views(objs, names, role):
    """``objs`` with every object that is not a numpy array taken as one (``as_array``:
    the buffer protocol, DLPack, MXNet NDArrays, zero-copy); a GPU array among host ones is
    refused, naming it."""
    if set(map(type, objs)) <= _NDARRAY:
        return objs
    objs = list(objs)
    for i, obj in enumerate(objs):
        if type(obj) is np.ndarray:
            continue
        arr = as_array(obj, names[i])
        if isinstance(arr, DeviceArray):
            if role == "output":
                raise TypeError(f"output {names[i]!r} is on a GPU but the gradients are in host memory")
            raise TypeError(f"tensor {names[i]!r} is on a GPU but tensor {names[0]!r} is in host "
                            f"memory; all tensors of one call must be on the same device")
        objs[i] = arr
    return objs


def _device_view(obj, name, first, cp):
    """A cupy view of one GPU tensor (no copy) and whether it is read-only."""
    from ..comm.device import as_device
    if isinstance(obj, cp.ndarray):
        return obj, False       # cupy's own arrays: no protocol, ordered by the caller's stream
    readonly = False
    cai = cai_error = dl_dev = None
    use_dlpack = False
    if not isinstance(obj, DeviceArray):
        # DLPack first: __dlpack__(stream=...) makes the producer order its own work
        # (a side stream's too) before ours; __cuda_array_interface__ may carry no
        # stream (PyTorch's is version 2) or raise (PyTorch: requires_grad)
        dl_dev = _producer_device(obj)
        use_dlpack = is_gpu_device(dl_dev)
        if not use_dlpack:
            cai, cai_error = cuda_interface(obj)
            if cai_error is not None:
                if not hasattr(obj, "__dlpack__"):
                    raise cuda_interface_error(obj, name, cai_error)
                use_dlpack = True
    if cai is not None:
        return cp.asarray(obj), bool(cai["data"][1])
    got = obj
    if use_dlpack:
        # the producer makes the current stream of the tensor's device wait for its work
        # (DLPack: 1 is the legacy default stream); the ready event is recorded on that
        # same stream
        with cp.cuda.Device(dl_dev[1] if dl_dev is not None else cp.cuda.runtime.getDevice()):
            stream = cp.cuda.get_current_stream().ptr or 1
        capsule = dlpack_capsule(obj, stream=stream)
        got = from_dlpack_capsule(capsule, name, source=obj)
    elif not isinstance(obj, DeviceArray):
        got = as_array(obj, name)
    if not isinstance(got, DeviceArray):
        raise TypeError(f"tensor {name!r} is in host memory but tensor {first!r} is on "
                        f"a GPU; all tensors of one call must be on the same device")
    readonly = got.readonly
    return as_device(got), readonly


def device_views(objs, names, writable, cp):
    """cupy views of GPU tensors (no copies, except non-contiguous inputs) and their device.

    Raises TypeError/ValueError naming the tensor: host memory mixed in, tensors on
    different devices, unsupported dtypes, read-only or non-contiguous outputs.
    """
    arrays, device, first_device = [], None, None
    for obj, name in zip(objs, names):
        arr, readonly = _device_view(obj, name, names[0], cp)
        if writable and readonly:
            raise ValueError(f"tensor {name!r} is read-only; the results cannot be written into it")
        if arr.dtype not in _dt.CODE:
            raise TypeError(f"tensor {name!r}: dtype {arr.dtype} is not supported (supported: {_dt.SUPPORTED})")
        if first_device is None:
            first_device = arr.device.id
        if arr.size and device is None:
            device = arr.device.id
        elif arr.size and arr.device.id != device:
            raise ValueError(f"tensor {name!r} is on GPU {arr.device.id} but the tensors before it are on "
                             f"GPU {device}; all tensors of one call must be on the same device")
        if not arr.flags.c_contiguous:
            if writable:
                raise ValueError(f"tensor {name!r} is not C-contiguous; outputs and in-place inputs "
                                 f"must be (use allreduce() without out=, which copies inputs)")
            with arr.device:     # on the tensor's own device (and its current stream)
                arr = cp.ascontiguousarray(arr)
        arrays.append(arr)
    if device is None:      # only empty tensors: the device they were made on
        device = first_device if first_device is not None else cp.cuda.runtime.getDevice()
    return arrays, device
