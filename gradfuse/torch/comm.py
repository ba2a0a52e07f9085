"""A gradfuse ``Communicator`` over ``torch.distributed``.

The data plane runs on the given process group (DDP's, by default the world group):
every numpy buffer gradfuse hands it is wrapped without a copy (``torch.from_numpy``) and
moved by torch's own collectives (gloo on CPU). The control plane (the per-step
agreement of ``gradfuse.runtime.control``) runs on a gloo group of the same ranks made
for it here, so gradfuse's small messages never match a user's own sends, and a NCCL
data group still gets a CPU control channel.

Made collectively: every rank of the group must construct it (``dist.new_group``).
"""
import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

from ..comm.base import Communicator
from .device import all_gather_into
from .launch import launcher_env

_FMT16 = {1: torch.float16, 2: torch.bfloat16}


def _tensor(arr):
    """A zero-copy flat torch view of a contiguous numpy array (the caller's memory)."""
    if not arr.flags.c_contiguous:
        raise ValueError("torch communicator: buffers must be C-contiguous")
    return torch.from_numpy(arr.reshape(-1))


def _bytes(arr):
    """The same, as bytes (the payload collectives move raw bytes)."""
    return _tensor(arr.reshape(-1).view(np.uint8))


class _Gather:
    """Variable-length bytes from every rank: sizes first, then the padded data (two async steps)."""

    def __init__(self, comm, data):
        self.comm = comm
        self.data = bytes(data)
        self.sizes = torch.zeros(comm.size, dtype=torch.int64)
        mine = torch.tensor([len(self.data)], dtype=torch.int64)
        self.work = all_gather_into(self.sizes, mine, comm.ctl, async_op=True)
        self.stage = 0
        self.out = None

    def test(self):
        if not _done(self.work):
            return False
        if self.stage == 0:
            self.stage = 1
            width = max(1, int(self.sizes.max()))
            send = torch.zeros(width, dtype=torch.uint8)
            if self.data:
                send[:len(self.data)] = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            self.out = torch.empty(width * self.comm.size, dtype=torch.uint8)
            self.width = width
            self.work = all_gather_into(self.out, send, self.comm.ctl, async_op=True)
            return self.test()
        return True

    def result(self):
        raw = self.out.numpy().tobytes()
        return [raw[r * self.width:r * self.width + int(s)] for r, s in enumerate(self.sizes.tolist())]


def _done(work):
    if isinstance(work, Future):
        if work.done():
            work.result()       # raises the wait's error, if it had one
            return True
        return False
    if work.is_completed():
        work.wait()             # raises the collective's error, if it had one
        return True
    return False


class TorchCommunicator(Communicator):
    """gradfuse's communicator contract on a ``torch.distributed`` process group.

    Args:
        process_group: the group to reduce on (None: the default world group, which
            ``dist.init_process_group`` must have made).

    Example:
        >>> dist.init_process_group("gloo")
        >>> pipe = gradfuse.Pipeline(compress="1bit", comm=TorchCommunicator())
    """

    kind = "torch"
    # host buffers here; CUDA buffers through the communicator device_communicator makes
    devices = ("cpu",)

    def __init__(self, process_group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("gradfuse.torch: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group (torchrun sets its environment)")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))
        ranks = dist.get_process_group_ranks(self.group)
        self.ctl = dist.new_group(ranks=ranks, backend="gloo")
        self._global = ranks          # group rank -> global rank (point-to-point takes global ranks)
        # gloo's send/recv works say they are complete only once wait() returned, so they are
        # waited for on these threads and polled through a Future (one thread per peer)
        self._waiters = ThreadPoolExecutor(max(1, self.size - 1), thread_name_prefix="gradfuse-torch-ctl")
        # the launcher's environment names the node layout (torchrun, mpiexec, srun) for the
        # world group; without one, or for a subgroup, one host is assumed
        self.local_rank, self.local_size = self.rank, self.size
        try:
            found = launcher_env() if self.size == dist.get_world_size() else None
        except ValueError:          # a launcher's variables that do not parse: the group's own layout
            found = None
        if found is not None and found[0] == dist.get_rank() and found[1] == self.size:
            self.local_rank, self.local_size = found[2], found[3]
        self.cross_rank = self.rank // max(1, self.local_size)
        self.cross_size = max(1, self.size // max(1, self.local_size))

    def device_communicator(self, device):
        """The data plane for CUDA buffers on ``device`` (``gradfuse.torch.device``): NCCL
        through torch when the group's backend is NCCL, else host-staged over this one."""
        from . import device as _device
        return _device.make(self, device)

    # --- data plane (the communication thread) ------------------------------------
    def allreduce_inplace(self, arr):
        dist.all_reduce(_tensor(arr), group=self.group)
        return arr

    def allreduce(self, src, dst):
        np.copyto(dst, src)
        return self.allreduce_inplace(dst)

    def allreduce_op(self, src, dst, op):
        """Reduce with ``op`` ("sum", "min", "max", "prod") by the backend, ``src`` into ``dst``
        (the pipeline's agreements: the finiteness flags, fp16's largest magnitude)."""
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
               "prod": dist.ReduceOp.PRODUCT}
        if op not in ops:
            raise ValueError(f"torch communicator: unknown reduction {op!r} (one of {', '.join(ops)})")
        if src is not dst:
            np.copyto(dst, src)
        dist.all_reduce(_tensor(dst), op=ops[op], group=self.group)
        return dst

    def allreduce16(self, buf, fmt, native=False):
        """fp16 (fmt 1) / bf16 (fmt 2) words summed by the backend (gloo: each pairwise add in
        float32, rounded once); the backend's sum is the only one here, so ``native`` changes
        nothing."""
        dist.all_reduce(torch.from_numpy(buf.reshape(-1)).view(_FMT16[fmt]), group=self.group)
        return buf

    def bcast(self, arr, root):
        dist.broadcast(_bytes(arr), src=self._global[root], group=self.group)
        return arr

    def allgather(self, src, dst):
        all_gather_into(_bytes(dst), _bytes(src), self.group)
        return dst

    def alltoall(self, src, dst):
        dist.all_to_all_single(_bytes(dst), _bytes(src), group=self.group)
        return dst

    # --- control plane ---------------------------------------------------------------
    def ctl_isend(self, data, dest):
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        work = dist.isend(buf, self._global[dest], group=self.ctl, tag=7)
        return self._waiters.submit(lambda: (work.wait(), buf))

    def ctl_irecv(self, buf, source):
        t = torch.frombuffer(buf, dtype=torch.uint8)
        work = dist.irecv(t, self._global[source], group=self.ctl, tag=7)
        return self._waiters.submit(lambda: (work.wait(), t))

    def ctl_ibcast(self, buf, root):
        return dist.broadcast(torch.frombuffer(buf, dtype=torch.uint8), src=self._global[root], group=self.ctl,
                              async_op=True)

    def ctl_iallgather_bytes(self, data):
        return _Gather(self, data)

    @staticmethod
    def test(request):
        if isinstance(request, _Gather):
            return request.test()
        return _done(request)

    def abort(self, code=1):
        os._exit(code)          # torch.distributed has no job-wide abort; the launcher ends the others

    def describe(self):
        """A one-line description for error messages: the backend, this rank and the size."""
        return f"torch.distributed ({dist.get_backend(self.group)}) communicator, rank {self.rank} of {self.size}"
