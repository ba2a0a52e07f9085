"""DLPack as C lays it out: the structs of a capsule, its flags and versions, declared with
ctypes for ``gradfuse.fusion.intake`` (which reads capsules without a framework).

``DLManagedTensorVersioned`` (DLPack >= 1.0, capsule ``"dltensor_versioned"``) and the
legacy ``DLManagedTensor`` (``"dltensor"``); a consumed capsule is renamed ``"used_..."``.
"""
import ctypes

_kDLCPU, _kDLCUDA, _kDLCUDAHost, _kDLCUDAManaged = 1, 2, 3, 13
GPU_DEVICE_TYPES = (_kDLCUDA, _kDLCUDAManaged)    # DLPack device types of GPU memory
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
