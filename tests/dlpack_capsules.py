"""A test-only DLPack producer: capsules over any memory, built with ctypes from the
struct definitions of ``gradfuse.fusion.dlpack`` (the one place they are written).

``make_capsule`` gives a legacy ``"dltensor"`` or a DLPack 1.x ``"dltensor_versioned"``
capsule, with any flags and version (to test what numpy < 2 cannot produce: versioned,
read-only, unsupported versions), on the host (kDLCPU) or a GPU (kDLCUDA, over a device
pointer). Like a real producer, the capsule's destructor calls the deleter when the
capsule dies unconsumed (its name unchanged), and the consumer calls it otherwise; the
returned ``Record`` counts the calls, so a test sees a missing, wrong or double release.
tests/cuda_emu/fakecupy.py builds its ``toDlpack()``/``__dlpack__`` capsules here too.
"""
import ctypes

import numpy as np

from gradfuse.fusion import dlpack

kDLCPU, kDLCUDA = 1, 2
READ_ONLY = dlpack.DLPACK_FLAG_BITMASK_READ_ONLY
IS_COPIED = dlpack.DLPACK_FLAG_BITMASK_IS_COPIED

# private prototypes: setting argtypes on ctypes.pythonapi's shared function objects would
# change them for gradfuse.fusion.dlpack too
_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
# the capsule destructor runs while the capsule is being freed: no Python object for it
_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(("PyCapsule_GetName", ctypes.pythonapi))
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_RECORDS = {}      # struct address -> Record, for the deleters (kept for the whole run)
_KIND = {"f": 2, "i": 0, "u": 1}


class Record:
    """What became of one capsule's tensor: ``deleted`` counts deleter calls (1 when
    released correctly); ``keep`` holds the struct, shape, strides and the memory owner."""

    def __init__(self, versioned, keep):
        self.versioned = versioned
        self.keep = keep
        self.deleted = 0


def _deleter(mt_ptr):
    addr = ctypes.cast(mt_ptr, ctypes.c_void_p).value
    _RECORDS[addr].deleted += 1


_DELETER = dlpack._DELETER(_deleter)
_DELETER_VERSIONED = dlpack._DELETER_VERSIONED(_deleter)


def _capsule_destructor(capsule):
    name = _get_name(capsule)
    if name in (b"dltensor", b"dltensor_versioned"):        # never consumed: free it here
        ptr = _get_pointer(capsule, name)
        s = dlpack._DLManagedTensorVersioned if name == b"dltensor_versioned" else dlpack._DLManagedTensor
        mt = ctypes.cast(ptr, ctypes.POINTER(s))
        if mt.contents.deleter:
            mt.contents.deleter(mt)


_DESTRUCTOR_FN = _DESTRUCTOR(_capsule_destructor)


def make_capsule(ptr, shape, dtype, strides=None, device=(kDLCPU, 0), versioned=True, flags=0,
                 version=(1, 0), owner=None):
    """A DLPack capsule over ``ptr`` (shape, numpy dtype, byte strides or None for C order),
    and its ``Record``. ``owner`` is kept alive until the end of the run."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    ndim = len(shape)
    if versioned:
        mt = dlpack._DLManagedTensorVersioned()
        mt.version.major, mt.version.minor = version
        mt.flags = flags
        mt.deleter = _DELETER_VERSIONED
    else:
        mt = dlpack._DLManagedTensor()
        mt.deleter = _DELETER
    c_shape = (ctypes.c_int64 * max(1, ndim))(*shape)
    c_strides = None
    t = mt.dl_tensor
    t.data = ptr
    t.device.device_type, t.device.device_id = device
    t.ndim = ndim
    t.dtype.code, t.dtype.bits, t.dtype.lanes = _KIND[dtype.kind], 8 * dtype.itemsize, 1
    t.shape = ctypes.cast(c_shape, ctypes.POINTER(ctypes.c_int64))
    if strides is not None:
        c_strides = (ctypes.c_int64 * max(1, ndim))(*[int(st) // dtype.itemsize for st in strides])
        t.strides = ctypes.cast(c_strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    rec = Record(versioned, (mt, c_shape, c_strides, owner))
    _RECORDS[ctypes.addressof(mt)] = rec
    name = b"dltensor_versioned" if versioned else b"dltensor"
    return _new(ctypes.addressof(mt), name, ctypes.cast(_DESTRUCTOR_FN, ctypes.c_void_p)), rec


def host_capsule(arr, **kw):
    """``make_capsule`` over a numpy array's memory (kDLCPU)."""
    return make_capsule(arr.ctypes.data, arr.shape, arr.dtype, arr.strides, owner=arr, **kw)


def capsule_name(capsule):
    """The capsule's current name (``"dltensor"``, ``"used_dltensor_versioned"``, ...)."""
    get = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
    return get(capsule).decode()
