"""CUDA buffers on ``torch.distributed``: the data plane of the hook's CUDA buckets.

gradfuse's GPU step (``gradfuse.fusion.backend.CudaBackend``: the CUDA kernels of
``cuda/`` through ``gradfuse.gpu``, on cupy arrays) asks its communicator for a data
plane that carries device memory (``Communicator.device_communicator``). On
``torch.distributed`` there are two:

- ``TorchDeviceCommunicator`` (the group's backend is NCCL): every device buffer is
  viewed as a torch CUDA tensor through DLPack (no copy) and moved by torch's own
  collective on the bucket's device, enqueued after the step's stream (torch's current
  stream is set to it) and waited for before the call returns, as gradfuse's NCCL
  communicator does. The 16-bit sum of fp16/bf16 is exact by default (an allgather,
  then the ``gf_sum16`` kernel folds the rows in rank order: the CPU path's bits).
- ``TorchHostStaged`` (any other backend, e.g. gloo: several ranks on one GPU, which
  NCCL refuses): each payload is copied into pinned host memory, moved by the host
  ``TorchCommunicator`` and copied back (``gradfuse.comm.staged``'s scheme).

Both keep the control plane of the host ``TorchCommunicator`` (its gloo group): the
per-step agreement never runs on the GPU.

``BRIDGE`` is where device memory crosses between torch and cupy (DLPack both ways) and
where torch's and cupy's streams meet. The kernel emulator's tests (no GPU: CPU tensors
stand in for device tensors, tests/torch_bodies/cuda_emulated.py) replace it; nothing
else differs between the emulated and the real path.
"""
import numpy as np

from ..comm.device import DeviceCommunicator, as_bytes, as_device, cupy
from ..comm.staged import HostStagedCommunicator

_SUM16_DTYPE = {1: "float16", 2: "bfloat16"}


def all_gather_into(out, inp, group, async_op=False):
    """``dist.all_gather_single`` where torch has it (2.13 renamed
    ``all_gather_into_tensor`` and deprecated the old name), else the old name."""
    import torch.distributed as dist
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


class Bridge:
    """How tensors and cupy arrays share device memory, and how their streams meet.

    Each method is one line of torch or cupy: DLPack (``cupy.from_dlpack``,
    ``torch.from_dlpack``), ``ExternalStream`` on both sides, a CUDA-aware
    ``torch.futures.Future``.
    """

    def is_device(self, tensor):
        """Whether ``tensor`` (a bucket's buffer) lives on a GPU."""
        return tensor.device.type == "cuda"

    def device_index(self, tensor):
        """The CUDA device number of ``tensor``."""
        import torch
        return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()

    def to_cupy(self, tensor):
        """A cupy array over ``tensor``'s memory (DLPack, no copy)."""
        return cupy().from_dlpack(tensor.detach())

    def to_torch(self, arr):
        """A torch CUDA tensor over a cupy array's memory (DLPack, no copy)."""
        import torch
        return torch.from_dlpack(arr)

    def cupy_stream(self, tensor):
        """torch's current stream on ``tensor``'s device, as a cupy stream (the producer of
        the bucket: the step waits for it)."""
        import torch
        s = torch.cuda.current_stream(tensor.device)
        return cupy().cuda.ExternalStream(s.cuda_stream, tensor.device.index)

    def torch_stream(self, device):
        """A context that makes cupy's current stream torch's current stream on ``device``
        (torch's collectives are ordered after the current stream)."""
        import torch
        s = cupy().cuda.get_current_stream()
        return torch.cuda.stream(torch.cuda.ExternalStream(s.ptr, device=torch.device("cuda", device)))

    def future(self, tensor):
        """A future whose result is ``tensor``, CUDA-aware on its device."""
        import torch
        return torch.futures.Future(devices=[tensor.device])

    def direct(self, group):
        """Whether the group's backend moves CUDA tensors itself (NCCL), else host-staged."""
        import torch.distributed as dist
        return "nccl" in str(dist.get_backend(group)).lower()


BRIDGE = Bridge()


def make(host, device):
    """The data-plane communicator of ``host`` (a ``TorchCommunicator``) for GPU ``device``:
    ``TorchDeviceCommunicator`` on NCCL, else ``TorchHostStaged``."""
    if BRIDGE.direct(host.group):
        return TorchDeviceCommunicator(host, device)
    return TorchHostStaged(host, device)


class _TorchControl:
    """The control plane and ranks of the host ``TorchCommunicator`` (its gloo group)."""

    def _init_control(self, host):
        self.mpi = host          # the name the shared device pieces give their control plane
        self.host = host
        for k in ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"):
            setattr(self, k, getattr(host, k))

    def ctl_isend(self, data, dest):
        return self.host.ctl_isend(data, dest)

    def ctl_irecv(self, buf, source):
        return self.host.ctl_irecv(buf, source)

    def ctl_ibcast(self, buf, root):
        return self.host.ctl_ibcast(buf, root)

    def ctl_iallgather_bytes(self, data):
        return self.host.ctl_iallgather_bytes(data)

    def test(self, request):
        return self.host.test(request)

    def abort(self, code=1):
        self.host.abort(code)

    def split(self, ranks):
        raise NotImplementedError(f"{self.describe()}: split() is not supported; make a process group instead")


class TorchHostStaged(_TorchControl, HostStagedCommunicator):
    """Device buffers through pinned host memory and the host ``TorchCommunicator``
    (gloo): the path where the group cannot move CUDA tensors, e.g. two ranks on one GPU.

    Args:
        host: the ``TorchCommunicator`` whose group and control plane it uses.
        device: this rank's CUDA device.
    """

    kind = "torch-host-staged"

    def __init__(self, host, device):
        super().__init__(host, device=device, reason=None, warn=False)

    def describe(self):
        return (f"torch.distributed ({self.host.backend}) communicator, host-staged device buffers, "
                f"rank {self.rank} of {self.size}, device {self.device}")


class TorchDeviceCommunicator(_TorchControl, DeviceCommunicator):
    """Device buffers moved by torch.distributed's collectives on the GPU (NCCL).

    Args:
        host: the ``TorchCommunicator`` whose group and control plane it uses.
        device: this rank's CUDA device.

    Every call is blocking: the collective is enqueued after the caller's current (cupy)
    stream and the stream is synchronized before the call returns.
    """

    kind = "torch-cuda"

    def __init__(self, host, device):
        self._init_control(host)
        self.device = int(device)
        self.group = host.group
        self._scratch = {}

    def describe(self):
        return (f"torch.distributed ({self.host.backend}) communicator, CUDA buffers, rank {self.rank} of "
                f"{self.size}, device {self.device}")

    def _call(self, fn):
        """Run ``fn()`` (DLPack views and torch collectives) with torch's current stream the
        caller's (cupy's current stream), then wait for it."""
        with BRIDGE.torch_stream(self.device):
            fn()
        cupy().cuda.get_current_stream().synchronize()

    def _t(self, arr, as_bytes_=False):
        a = as_device(arr)
        return BRIDGE.to_torch(as_bytes(a) if as_bytes_ else a.reshape(-1))

    @staticmethod
    def _host(arr):
        return isinstance(arr, np.ndarray) and not hasattr(arr, "__cuda_array_interface__")

    # --- data plane ------------------------------------------------------------------
    def allreduce_inplace(self, arr):
        if self._host(arr):
            return self.host.allreduce_inplace(arr)
        self._call(lambda: self._dist().all_reduce(self._t(arr), group=self.group))
        return arr

    def allreduce(self, src, dst):
        return self.allreduce_op(src, dst, "sum")

    def allreduce_op(self, src, dst, op):
        if self._host(dst):
            return self.host.allreduce_op(src, dst, op)
        dist = self._dist()
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
               "prod": dist.ReduceOp.PRODUCT}
        if op not in ops:
            raise ValueError(f"{self.describe()}: unknown reduction {op!r} (one of {', '.join(ops)})")
        a, b = as_device(src), as_device(dst)
        if a.size != b.size or a.dtype != b.dtype:
            raise ValueError(f"allreduce: src {a.dtype}[{a.size}] and dst {b.dtype}[{b.size}] differ")
        if a.data.ptr != b.data.ptr:
            b[...] = a
        self._call(lambda: dist.all_reduce(self._t(b), op=ops[op], group=self.group))
        return dst

    native_sum16 = True

    def allreduce16(self, buf, fmt, native=False):
        """The 16-bit sum of fp16 (fmt 1) / bf16 (fmt 2) words: exact by default (allgather,
        then the rank-order ``sum16`` fold: every rank gets the CPU path's bits); with
        ``native=True`` the backend's own half/bfloat16 sum (NCCL's order and rounding)."""
        from .. import gpu
        b = as_device(buf)
        if b.dtype != np.uint16:
            raise TypeError(f"allreduce16 needs uint16 words, got {b.dtype}")
        if self.size == 1 or b.size == 0:
            return buf
        if native:
            import torch
            self._call(lambda: self._dist().all_reduce(self._t(b).view(getattr(torch, _SUM16_DTYPE[fmt])),
                                                       group=self.group))
            return buf
        rows = self._scratch_buf(2 * b.size * self.size).view(np.uint16).reshape(self.size, b.size)
        self.allgather(b, rows)
        b[...] = rows[0]
        for r in range(1, self.size):
            gpu.sum16(fmt, rows[r], b)
        cupy().cuda.get_current_stream().synchronize()
        return buf

    def _scratch_buf(self, nbytes):
        buf = self._scratch.get(nbytes)
        if buf is None:
            self._scratch.clear()
            buf = self._scratch[nbytes] = cupy().empty(nbytes, np.uint8)
        return buf

    def bcast(self, arr, root):
        self._call(lambda: self._dist().broadcast(self._t(arr, True), src=self.host._global[root], group=self.group))
        return arr

    def allgather(self, src, dst):
        na, nb = as_bytes(as_device(src)).size, as_bytes(as_device(dst)).size
        if nb != na * self.size:
            raise ValueError(f"allgather: dst of {nb} bytes, expected {self.size} x {na}")
        self._call(lambda: all_gather_into(self._t(dst, True), self._t(src, True), self.group))
        return dst

    def alltoall(self, src, dst):
        na, nb = as_bytes(as_device(src)).size, as_bytes(as_device(dst)).size
        if na % self.size or na != nb:
            raise ValueError(f"alltoall: {na} bytes do not split into {self.size} equal blocks")
        self._call(lambda: self._dist().all_to_all_single(self._t(dst, True), self._t(src, True), group=self.group))
        return dst

    @staticmethod
    def _dist():
        import torch.distributed as dist
        return dist
