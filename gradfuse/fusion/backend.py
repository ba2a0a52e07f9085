"""Where a step's buffers live and which kernels run on them: host (numpy + ``_core``) or
CUDA (cupy + ``gradfuse.gpu``).

The step, the exchange jobs of ``gradfuse.step.exchange`` and the built-in
compressors are written once against this small interface; ``HOST`` and ``CudaBackend`` supply the allocations,
the kernel module (``kernels``: ``gradfuse._core`` or ``gradfuse.gpu``, whose functions
take the same arguments) and the few steps that differ (averaging dtypes other than
float32, reading a small device array on the host).

Tables (pointers, offsets, counts) stay numpy arrays on both: the GPU wrappers validate
and upload them per call, so the same plan serves both paths.
"""
import numpy as np

from .. import _core
from .. import dtypes as _dt
from .plan import aligned_empty

_F32 = _dt.CODE[np.dtype(np.float32)]


def to_host(a):
    """A numpy array with ``a``'s values (``a`` itself when it already is one)."""
    if type(a) is np.ndarray:
        return a
    get = getattr(a, "get", None)
    return get() if get is not None else np.asarray(a)


class HostBackend:
    """Host memory: numpy buffers, the Cython kernels of ``gradfuse._core``."""

    device = "cpu"
    device_id = -1
    xp = np
    kernels = _core

    @staticmethod
    def empty_bytes(nbytes):
        return aligned_empty(nbytes)

    @staticmethod
    def empty(n, dtype):
        return np.empty(n, dtype)

    @staticmethod
    def zeros(n, dtype=np.float32):
        return np.zeros(n, dtype)

    @staticmethod
    def upload(dst, src):
        """Copy host array ``src`` into ``dst`` (an array of this backend)."""
        dst[...] = src

    host = staticmethod(to_host)

    @staticmethod
    def plan_tables(plan):
        """The plan's offset/count tables as the kernels take them (the plan itself)."""
        return plan

    @staticmethod
    def pointers(ptrs):
        """A step's pointer table as the kernels take it."""
        return ptrs

    @staticmethod
    def pack(buf, ptrs, offsets, nbytes, lo, hi):
        _core.pack(buf, ptrs, offsets, nbytes, lo, hi)

    @staticmethod
    def unpack(buf, ptrs, offsets, nbytes, lo, hi):
        _core.unpack(buf, ptrs, offsets, nbytes, lo, hi)

    @staticmethod
    def unpack_div(buf, ptrs, offsets, nbytes, lo, hi, code, divisor, outs):
        _core.unpack_div(buf, ptrs, offsets, nbytes, lo, hi, code, divisor)

    @staticmethod
    def div_inplace(arr, ptr, count, code, divisor):
        _core.div_inplace(int(ptr), int(count), code, divisor)

    @staticmethod
    def gather_f32(table, n):
        """The bucket's float32 values in bucket order, as a host array (reference paths)."""
        g = np.empty(n, np.float32)
        src, off, cnt, lo, hi = table
        _core.pack(g.view(np.uint8), src, off * 4, cnt * 4, lo, hi)
        return g

    @staticmethod
    def scatter_f32(values, table):
        """Write host float32 ``values`` (bucket order) into the tensors of ``table``."""
        dst, off, cnt, lo, hi = table
        _core.unpack(np.ascontiguousarray(values, np.float32).view(np.uint8), dst, off * 4, cnt * 4, lo, hi)

    @staticmethod
    def synchronize():
        pass


HOST = HostBackend()


class _PlanTables:
    """A plan's four tables as resident device tables."""

    def __init__(self, plan, resident):
        self.offsets, self.nbytes = resident(plan.offsets), resident(plan.nbytes)
        self.elem_offsets, self.counts = resident(plan.elem_offsets), resident(plan.counts)


class CudaBackend:
    """One CUDA device: cupy buffers, the kernels of ``gradfuse.gpu`` (cuda/*.cu).

    Every kernel runs on the current stream of the thread that calls it; the pipeline's
    communication thread makes ``self.stream`` current and has it wait for an event
    recorded on the caller's stream first.
    """

    device = "cuda"

    def __init__(self, device_id):
        from .. import gpu
        self.device_id = int(device_id)
        self.kernels = gpu
        self.xp = cp = gpu.cupy()
        with cp.cuda.Device(self.device_id):
            # the communication thread's own stream: it waits for the caller's stream
            # (an event) and is not serialised with the caller's other work
            self.stream = cp.cuda.Stream(non_blocking=True)
            gpu.compile_all()       # NVRTC once per device (and cupy's disk cache)

    # allocations are made on this backend's device, whichever device is current
    def empty_bytes(self, nbytes):
        with self.xp.cuda.Device(self.device_id):
            return self.xp.empty(int(nbytes), np.uint8)     # cupy allocations are 256-byte aligned

    def empty(self, n, dtype):
        with self.xp.cuda.Device(self.device_id):
            return self.xp.empty(n, dtype)

    def zeros(self, n, dtype=np.float32):
        with self.xp.cuda.Device(self.device_id):
            return self.xp.zeros(n, dtype)

    @staticmethod
    def upload(dst, src):
        src = np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape)
        dst.set(src)

    host = staticmethod(to_host)

    def plan_tables(self, plan):
        """The plan's tables as ``gpu.Resident`` (uploaded once per plan and device)."""
        t = getattr(plan, "device_tables", None)
        if t is None:
            t = plan.device_tables = _PlanTables(plan, self.kernels.resident)
        return t

    def pointers(self, ptrs):
        """A step's pointer table, uploaded once for all of the step's kernels."""
        return self.kernels.resident(ptrs)

    def pack(self, buf, ptrs, offsets, nbytes, lo, hi):
        self.kernels.pack(buf, ptrs, offsets, nbytes, lo, hi)

    def unpack(self, buf, ptrs, offsets, nbytes, lo, hi):
        self.kernels.unpack(buf, ptrs, offsets, nbytes, lo, hi)

    def unpack_div(self, buf, ptrs, offsets, nbytes, lo, hi, code, divisor, outs):
        """Unpack and average. float32 has a fused kernel (the CPU's bits); float16 and
        float64 are unpacked, then divided per tensor like ``_core`` (float16 in float32,
        rounded once; NaN payloads follow cupy's conversion)."""
        if code == _F32:
            self.kernels.unpack_div_f32(buf, ptrs, offsets, nbytes, lo, hi, divisor)
            return
        self.kernels.unpack(buf, ptrs, offsets, nbytes, lo, hi)
        for arr in outs:
            self._div(arr, code, divisor)

    def div_inplace(self, arr, ptr, count, code, divisor):
        self._div(arr, code, divisor)

    def _div(self, arr, code, divisor):
        flat = arr.reshape(-1)
        if flat.size == 0:
            return
        if code == _F32:
            self.kernels.div_f32(flat, divisor)
        elif code == _dt.CODE[np.dtype(np.float16)]:
            q = flat.astype(np.float32) / np.float32(divisor)
            flat[...] = q.astype(np.float16)
        elif code == _dt.CODE[np.dtype(np.float64)]:
            flat /= np.float64(divisor)
        else:
            raise TypeError(f"cannot average dtype {_dt.name(code)}")

    def gather_f32(self, table, n):
        g = self.xp.empty(n, np.float32)
        src, off, cnt, lo, hi = table
        if n:
            self.kernels.pack(g.view(np.uint8), src, off * 4, cnt * 4, lo, hi)
        return g.get()

    def scatter_f32(self, values, table):
        dst, off, cnt, lo, hi = table
        d = self.xp.asarray(np.ascontiguousarray(values, np.float32))
        if d.size:
            self.kernels.unpack(d.view(np.uint8), dst, off * 4, cnt * 4, lo, hi)

    def synchronize(self):
        self.stream.synchronize()

