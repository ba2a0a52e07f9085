"""A stand-in for the few cupy features gradfuse.gpu and its tests use, running the real
cuda/*.cu kernels on the CPU through the SIMT emulator in simt.h (g++, C++20, threads).

Purpose: exercise the GPU code path (kernels, launch geometry, wrappers, tests) on a
machine without a GPU, before the first device run. It proves nothing about the GPU's
own arithmetic or memory model; it does catch indexing, layout, divergence and
argument-passing bugs. Enabled by GRADFUSE_GPU_EMULATOR=1 (tests/conftest_gpu.py), never
on its own.

Arrays are numpy arrays of a subclass (``ndarray``) in host memory; "device pointers"
are host addresses.
"""
import ctypes
import hashlib
import os
import re
import subprocess
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
_BUILD = os.path.join(tempfile.gettempdir(), f"gradfuse_simt_{os.getuid()}")
# gradfuse.gpu keeps compiled modules in cupy's cache directory; the emulator's go beside
# its own builds, not into the user's ~/.cupy
os.environ.setdefault("CUPY_CACHE_DIR", os.path.join(_BUILD, "kernel_cache"))

__version__ = "0.0-simt-emulator"
float32, float64, float16 = np.float32, np.float64, np.float16
int8, int32, int64, uint8, uint16, uint32, uint64 = (np.int8, np.int32, np.int64, np.uint8, np.uint16,
                                                     np.uint32, np.uint64)


class _Ptr:
    def __init__(self, arr=None, ptr=None, owner=None):
        self.ptr = arr.ctypes.data if arr is not None else int(ptr)
        self.owner = owner

    def __add__(self, off):
        return _Ptr(ptr=self.ptr + int(off), owner=self.owner)


class _Dev:
    id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _span(shape, strides, itemsize):
    """Bytes from the first element to one past the last (non-negative strides)."""
    if any(int(d) == 0 for d in shape):
        return 0
    return sum((int(d) - 1) * int(st) for d, st in zip(shape, strides)) + itemsize


class ndarray(np.ndarray):
    """A host numpy array posing as a cupy array."""

    def __new__(cls, shape, dtype=float, memptr=None, strides=None, order="C"):
        """cupy.ndarray(shape, dtype, memptr, strides): a view of memory at memptr.ptr."""
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
        dtype = np.dtype(dtype)
        if memptr is None:
            return np.empty(shape, dtype).view(cls)
        if strides is None:
            strides, acc = [], dtype.itemsize
            for d in reversed(shape):
                strides.insert(0, acc)
                acc *= d
        span = _span(shape, strides, dtype.itemsize)
        raw = (ctypes.c_char * max(span, 1)).from_address(memptr.ptr)
        arr = np.ndarray.__new__(cls, shape, dtype, buffer=raw, offset=0, strides=tuple(strides))
        arr._owner = (raw, memptr.owner)
        return arr

    def __array_finalize__(self, obj):
        self._owner = getattr(obj, "_owner", None)

    @property
    def data(self):
        return _Ptr(self)

    def toDlpack(self):  # noqa: N802 (cupy's name)
        """A "dltensor_versioned" (DLPack 1.0) capsule of device type kDLCUDA (2) over this
        array's memory, as cupy 14's toDlpack() gives."""
        return _cuda_capsule(self, versioned=True)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """As cupy's: versioned with max_version >= (1, 0), else a legacy "dltensor" (not
        numpy's, which would say kDLCPU). Streams: the emulator has nothing to order."""
        return _cuda_capsule(self, versioned=max_version is not None and tuple(max_version) >= (1, 0))

    def __dlpack_device__(self):
        return (2, 0)       # kDLCUDA, device 0

    @property
    def __cuda_array_interface__(self):
        return {"version": 3, "shape": self.shape, "typestr": self.dtype.str,
                "data": (self.ctypes.data, False),
                "strides": None if self.flags.c_contiguous else self.strides}

    @property
    def device(self):
        return _Dev()

    # get(out=) and set() as strict as cupy's (cupy/_core/core.pyx): a host numpy array of
    # exactly this dtype and shape, no casting or broadcasting
    def _exact_host(self, arr, verb):
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray):
            raise TypeError(f"Only numpy.ndarray can be {verb} cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be {verb} {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch: this array has shape {self.shape}, the host array {arr.shape}")

    def get(self, stream=None, out=None):
        h = np.array(self, copy=True).view(np.ndarray)
        if out is not None:
            self._exact_host(out, "obtained from")
            out[...] = h
            return out
        return h

    def set(self, arr, stream=None):
        self._exact_host(arr, "set to")
        self[...] = arr


def _wrap(a):
    return np.asarray(a).view(ndarray)


def asarray(a, dtype=None):
    if isinstance(a, ndarray) and (dtype is None or a.dtype == dtype):
        return a
    if not isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__"):
        cai = a.__cuda_array_interface__       # zero copy, as cupy does
        dt = np.dtype(cai["typestr"])
        arr = ndarray(cai["shape"], dt, _Ptr(ptr=cai["data"][0], owner=a), cai.get("strides"))
        return arr if dtype is None or dt == dtype else arr.astype(dtype)
    return np.array(a, dtype=dtype, copy=True).view(ndarray)


def ascontiguousarray(a, dtype=None):
    return _wrap(np.ascontiguousarray(np.asarray(a), dtype=dtype))


def broadcast_to(a, shape):
    return np.broadcast_to(np.asarray(a), shape).view(ndarray)


def count_nonzero(a):
    return _wrap(np.asarray(np.count_nonzero(np.asarray(a))))


def arange(*args, dtype=None):
    return _wrap(np.arange(*args, dtype=dtype))


def zeros(shape, dtype=np.float64):
    return _wrap(np.zeros(shape, dtype))


def empty(shape, dtype=np.float64):
    return _wrap(np.empty(shape, dtype))


def ones(shape, dtype=np.float64):
    return _wrap(np.ones(shape, dtype))


def full(shape, value, dtype=None):
    return _wrap(np.full(shape, value, dtype))


def empty_like(a):
    return _wrap(np.empty_like(a))


def stack(arrs):
    return _wrap(np.stack([np.asarray(a) for a in arrs]))


def tile(a, reps):
    return _wrap(np.tile(np.asarray(a), reps))


def copyto(dst, src):
    np.copyto(dst, src)


def concatenate(arrs):
    return _wrap(np.concatenate([np.asarray(a) for a in arrs]))


def repeat(a, r):
    return _wrap(np.repeat(np.asarray(a), r))


def where(c, a, b):
    return _wrap(np.where(np.asarray(c), np.asarray(a), np.asarray(b)))


def abs(a):  # noqa: A001
    return _wrap(np.abs(np.asarray(a)))


def packbits(a, bitorder="big"):
    return _wrap(np.packbits(np.asarray(a), bitorder=bitorder))


class _Gen:
    def __init__(self, seed):
        self.g = np.random.default_rng(seed)

    def standard_normal(self, n, dtype=np.float64):
        return _wrap(self.g.standard_normal(n, dtype=dtype))


class random:  # noqa: N801
    default_rng = _Gen


def array_equal(a, b):
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


# ------------------------------------------------------------------ cuda namespace

class _Runtime:
    @staticmethod
    def getDevice():
        return 0

    @staticmethod
    def getDeviceProperties(i):
        return {"name": b"SIMT emulator (CPU)"}

    @staticmethod
    def runtimeGetVersion():
        return 0

    @staticmethod
    def getDeviceCount():
        return 1


class _Device:
    def __init__(self, i=0):
        if int(i) != 0:
            raise RuntimeError(f"simt emulator: no device {i}")
        self.id = int(i)
        # small grids: the emulator is slow (GRADFUSE_EMU_SMS=132 runs an H200's grid sizes)
        self.attributes = {"MultiProcessorCount": int(os.environ.get("GRADFUSE_EMU_SMS", "2"))}
        self.compute_capability = "90"

    def use(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    """Kernels run synchronously on the emulator, so every event has completed."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded = False

    def record(self, stream=None):
        import time
        self.t = time.perf_counter()
        self.recorded = True

    def synchronize(self):
        pass

    @property
    def done(self):
        return True


class _Stream:
    ptr = 0

    def __init__(self, null=False, non_blocking=False, ptds=False):
        pass

    def synchronize(self):
        pass

    def record(self, event=None):
        ev = event or _Event()
        ev.record(self)
        return ev

    def wait_event(self, event):
        if not isinstance(event, _Event):
            raise TypeError(f"wait_event needs an Event, got {type(event).__name__}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Memory:
    def __init__(self, ptr, size, owner, device_id=-1):
        # cupy: device -1 means "the pointer's own device", which a null pointer has not
        if int(device_id) < 0 and not int(ptr):
            raise ValueError("UnownedMemory requires explicit device ID for a null pointer.")
        self.ptr, self.size, self.owner = int(ptr), int(size), owner


def _memory_pointer(mem, offset):
    return _Ptr(ptr=mem.ptr + int(offset), owner=mem)


class _NVRTC:
    """cupy.cuda.nvrtc (cupy_backends.cuda.libs.nvrtc): the program API gradfuse.gpu calls.
    The "binary" is a marker plus the source, which RawModule(path=...) builds with g++;
    compileProgram builds it already, so a compile error surfaces where NVRTC's would.
    Flush-to-zero cannot be emulated, so options that ask for it are refused."""

    class NVRTCError(RuntimeError):
        pass

    MAGIC = b"//simt-emulator module\n"
    _progs = {}

    @staticmethod
    def getVersion():
        return (13, 0)

    @staticmethod
    def getSupportedArchs():
        return (75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121)

    def createProgram(self, src, name, headers, include_names):
        prog = max(self._progs, default=0) + 1
        self._progs[prog] = {"src": src, "name": name, "log": "", "ok": False}
        return prog

    def compileProgram(self, prog, options):
        p = self._progs[prog]
        opts = list(options)
        ftz = [o for o in opts if o.replace("--", "-").startswith("-ftz=")]
        if not ftz or ftz[-1].endswith("true"):
            p["log"] = f"simt emulator: flush-to-zero is not emulated; options {opts} must end with ftz=false"
            raise self.NVRTCError("NVRTC_ERROR_INVALID_OPTION (5)")
        if not any(o.startswith("-arch=") for o in opts):
            p["log"] = "simt emulator: no -arch option"
            raise self.NVRTCError("NVRTC_ERROR_INVALID_OPTION (5)")
        try:
            _build(p["src"])
        except RuntimeError as e:
            p["log"] = str(e)
            raise self.NVRTCError("NVRTC_ERROR_COMPILATION (6)") from None
        p["ok"] = True

    def _binary(self, prog):
        p = self._progs[prog]
        if not p["ok"]:
            raise self.NVRTCError("NVRTC_ERROR_INVALID_PROGRAM (3)")
        return self.MAGIC + p["src"].encode()

    getCUBIN = getPTX = _binary

    def getProgramLog(self, prog):
        return self._progs[prog]["log"]

    def destroyProgram(self, prog):
        self._progs.pop(prog, None)


class _NcclModule:
    """cupy.cuda.nccl for ONE rank (what a single GPU can run; NCCL refuses two ranks on one
    device): the calls and argument orders of cupy_backends/cuda/libs/nccl.pyx, with the
    data movement a one-rank collective does (a copy, or nothing). Pointers are host
    addresses here."""

    available = True
    _SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}
    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = range(6)
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = range(4)

    def __init__(self):
        self._group = 0

    @staticmethod
    def get_unique_id():
        # cupy 14: bytes (a tuple of 128 ints before 14.0)
        return bytes(range(128))

    def groupStart(self):  # noqa: N802 (cupy's names)
        self._group += 1

    def groupEnd(self):  # noqa: N802
        if self._group <= 0:
            raise RuntimeError("simt emulator nccl: groupEnd without groupStart")
        self._group -= 1

    class NcclCommunicator:
        def __init__(self, ndev, commId, rank):  # noqa: N803
            if int(ndev) != 1 or int(rank) != 0:
                raise RuntimeError(f"simt emulator nccl: one rank only (ndev={ndev}, rank={rank})")
            # cupy 14's constructor is typed (int ndev, bytes commId, int rank)
            if not isinstance(commId, bytes):
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                                f"{type(commId).__name__})")
            if len(commId) != 128:
                raise TypeError("commId must be the 128 bytes of get_unique_id()")
            self._alive, self._sends = True, []

        def _check(self, datatype, stream):
            if not self._alive:
                raise RuntimeError("simt emulator nccl: communicator used after destroy()")
            if not isinstance(stream, int):
                raise TypeError(f"stream must be an int pointer, got {type(stream).__name__}")
            return _NcclModule._SIZES[int(datatype)]

        def _copy(self, dst, src, nbytes):
            if int(dst) != int(src) and nbytes:
                ctypes.memmove(int(dst), int(src), int(nbytes))

        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
            self._copy(recvbuf, sendbuf, count * self._check(datatype, stream))

        def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
            self._copy(recvbuf, sendbuf, recvcount * self._check(datatype, stream))

        def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
            self._copy(recvbuf, sendbuf, count * self._check(datatype, stream))

        def bcast(self, buff, count, datatype, root, stream):
            self._check(datatype, stream)
            if int(root) != 0:
                raise ValueError(f"simt emulator nccl: root {root} of a one-rank communicator")

        def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
            self.bcast(recvbuf, count, datatype, root, stream)
            self._copy(recvbuf, sendbuf, count * self._check(datatype, stream))

        def send(self, sendbuf, count, datatype, peer, stream):
            self._sends.append((int(sendbuf), count * self._check(datatype, stream)))

        def recv(self, recvbuf, count, datatype, peer, stream):
            n = count * self._check(datatype, stream)
            src, m = self._sends.pop(0)
            if m != n:
                raise RuntimeError(f"simt emulator nccl: recv of {n} bytes matched a send of {m}")
            self._copy(recvbuf, src, n)

        def destroy(self):
            self._alive = False


class _Cuda:
    runtime = _Runtime()
    nvrtc = _NVRTC()
    nccl = _NcclModule()
    Device = _Device
    Event = _Event
    Stream = _Stream
    UnownedMemory = _Memory
    MemoryPointer = staticmethod(_memory_pointer)

    @staticmethod
    def get_elapsed_time(a, b):
        return (b.t - a.t) * 1e3

    @staticmethod
    def get_current_stream():
        return _Stream()


cuda = _Cuda()

# ------------------------------------------------------------------ kernels

_ARG = {np.dtype(np.int64): ctypes.c_int64, np.dtype(np.int32): ctypes.c_int32,
        np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float,
        np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.float64): ctypes.c_double}


def _build(code):
    """Compile one .cu source with the emulator header into a shared library (cached)."""
    names = re.findall(r'extern "C" __global__ void (\w+)\s*\(', code)
    reg = ("static const EmuKernel emu_kernels[] = {\n"
           + "".join(f'    {{"{n}", [](void** a) {{ emu_call({n}, a); }}, emu_sig({n})}},\n' for n in names)
           + "    {0, 0, 0}\n};\n")
    with open(os.path.join(HERE, "simt.h")) as f:
        head = f.read()
    with open(os.path.join(HERE, "simt_launch.h")) as f:
        tail = f.read()
    tu = head + "\n#line 1 \"kernel.cu\"\n" + code + "\n" + reg + tail
    flags = ["-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-Wno-unknown-pragmas"]
    key = hashlib.sha256((tu + " ".join(flags)).encode()).hexdigest()[:16]
    os.makedirs(_BUILD, exist_ok=True)
    so = os.path.join(_BUILD, f"k_{key}.so")
    if not os.path.exists(so):
        # per process: ranks that build the same kernel at once must not share the files
        # they write (the finished library is renamed into place, whoever is first)
        src = os.path.join(_BUILD, f"k_{key}.{os.getpid()}.cpp")
        with open(src, "w") as f:
            f.write(tu)
        tmp = f"{so}.{os.getpid()}.tmp"
        cmd = ["g++"] + flags + ["-o", tmp, src]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"simt emulator: g++ failed:\n{p.stderr[-4000:]}")
        os.replace(tmp, so)
        os.unlink(src)
    lib = ctypes.CDLL(so)
    lib.emu_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                               ctypes.POINTER(ctypes.c_void_p)]
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_signature.argtypes = [ctypes.c_char_p]
    lib.emu_signature.restype = ctypes.c_char_p
    return lib, set(names)


class RawKernel:
    def __init__(self, lib, name):
        self.lib, self.name = lib, name
        sig = lib.emu_signature(name.encode()).decode()
        self.params = [sig[i:i + 2] for i in range(0, len(sig), 2)]    # e.g. ["p8", "i4", "f4"]

    def __call__(self, grid, block, args):
        # real cupy: grid and block are tuples of ints; each argument is passed with the
        # width of its own type (a cupy array as a pointer, a numpy scalar as itself, and
        # a Python int as 8 bytes), which must be the kernel parameter's width and kind
        for what, dims in (("grid", grid), ("block", block)):
            if not isinstance(dims, tuple) or not 1 <= len(dims) <= 3 \
                    or not all(isinstance(d, (int, np.integer)) for d in dims):
                raise TypeError(f"{self.name}: {what} must be a tuple of 1-3 ints, got {dims!r}")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        keep = []
        for i, (a, want) in enumerate(zip(args, self.params)):
            if isinstance(a, np.ndarray):
                if not isinstance(a, ndarray):
                    raise TypeError(f"{self.name}: a host numpy array passed to a kernel")
                got = "p8"
                keep.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.generic):
                # a nullable pointer travels as np.uint64 (8 bytes, as cupy passes it)
                got = "p8" if want == "p8" and a.dtype == np.uint64 else a.dtype.kind + str(a.dtype.itemsize)
                keep.append(_ARG[a.dtype](a.item()))
            else:
                raise TypeError(f"{self.name}: untyped kernel argument {a!r} ({type(a).__name__})")
            if got != want:
                raise TypeError(f"{self.name}: argument {i} is {got} ({type(a).__name__}), the kernel "
                                f"parameter is {want} (kind and bytes)")
        argv = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.cast(ctypes.pointer(k), ctypes.c_void_p)
                                                      for k in keep])
        if grid[2] != 1 or block[1] != 1 or block[2] != 1:
            raise ValueError("simt emulator: only (x, y) grids and x blocks")
        rc = self.lib.emu_launch(self.name.encode(), grid[0], grid[1], block[0], argv)
        if rc:
            raise RuntimeError(f"simt emulator: cannot launch {self.name} with block {block}")


class RawModule:
    """Only ``RawModule(path=...)`` with a module from cuda.nvrtc: gradfuse never lets cupy
    compile (cupy would add -ftz=true), so ``code=`` is refused here."""

    def __init__(self, code=None, *, path=None, options=()):
        if code is not None or path is None:
            raise TypeError("simt emulator: RawModule takes path= (gradfuse.gpu compiles with NVRTC itself)")
        with open(path, "rb") as f:
            data = f.read()
        if not data.startswith(_NVRTC.MAGIC):
            raise RuntimeError(f"simt emulator: {path} is not a module from the emulator's nvrtc")
        self.options = tuple(options)
        self.file_path = path
        self.lib, self.names = _build(data[len(_NVRTC.MAGIC):].decode())

    def get_function(self, name):
        if name not in self.names:
            raise RuntimeError(f"no kernel {name} in the module")
        return RawKernel(self.lib, name)


class cupyx:  # noqa: N801
    """The one cupyx feature used (HostStagedCommunicator): pinned host buffers."""

    @staticmethod
    def empty_pinned(shape, dtype=np.float64):
        return np.empty(shape, dtype)


_CAPSULES = None


def _cuda_capsule(arr, versioned=True):
    """A kDLCUDA capsule over ``arr`` ("dltensor_versioned" or legacy "dltensor"), built by
    tests/dlpack_capsules.py on gradfuse.fusion.intake's structs (which keeps ``arr`` alive)."""
    global _CAPSULES
    if _CAPSULES is None:
        import importlib.util
        path = os.path.join(os.path.dirname(HERE), "dlpack_capsules.py")
        spec = importlib.util.spec_from_file_location("_fakecupy_dlpack_capsules", path)
        _CAPSULES = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_CAPSULES)
    return _CAPSULES.make_capsule(arr.ctypes.data, arr.shape, arr.dtype, arr.strides, device=(2, 0),
                                  versioned=versioned, owner=arr)[0]


def __getattr__(name):
    """Any other numpy function, with array results as emulator arrays (examples use
    ``xp.exp``, ``xp.mean``, ...)."""
    fn = getattr(np, name, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"fakecupy has no attribute {name!r}")

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        return _wrap(out) if isinstance(out, np.ndarray) else out
    return wrapped


def install():
    """Stand in for cupy and cupyx in sys.modules (``import cupy``, ``import cupyx``,
    ``from cupy.cuda import nccl``), and in gradfuse.gpu.loader; returns this module."""
    import sys
    this = sys.modules[__name__]
    sys.modules["cupy"] = this
    sys.modules["cupyx"] = cupyx
    sys.modules["cupy.cuda"] = cuda
    sys.modules["cupy.cuda.nccl"] = cuda.nccl
    from gradfuse.gpu import loader
    loader._cp = this
    return this
