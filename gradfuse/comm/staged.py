"""Device buffers over MPI through pinned host copies: the fallback where NCCL cannot run
(no NCCL library, or ranks that share a GPU)."""
import warnings

import numpy as np

from .device import DeviceCommunicator, as_device, cupy, is_host


class HostStagedCommunicator(DeviceCommunicator):
    """Device buffers over MPI through pinned host copies: the fallback without NCCL.

    Each call copies the device data to a pinned host buffer (cached by size), runs the
    MPI communicator's collective on it, and copies the result back. The arithmetic is
    the MPI communicator's, so results are the CPU path's bits (fp16/bf16 sums included).
    """

    kind = "host-staged"

    def __init__(self, comm=None, device=None, reason=None, warn=True):
        self._init_control(comm)
        cp = cupy()
        if device is None:
            device = self.local_rank % max(1, cp.cuda.runtime.getDeviceCount())
        self.device = int(device)
        cp.cuda.Device(self.device).use()
        self._pinned = {}
        self.reason = reason
        if warn:
            warnings.warn("gradfuse: NCCL is not usable" + (f" ({reason})" if reason else "")
                          + "; device buffers go through pinned host memory and MPI (slower)",
                          RuntimeWarning, stacklevel=2)

    def describe(self):
        return f"host-staged MPI communicator, rank {self.rank} of {self.size}, device {self.device}"

    def _host(self, key, shape, dtype):
        """A page-locked host view of ``shape``: one buffer per key ("a", "b"), grown when a
        larger payload comes (not one per size: pinned memory is scarce and never paged)."""
        import cupyx
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        raw = self._pinned.get(key)
        if raw is None or raw.size < nbytes:
            self._pinned.pop(key, None)
            raw = cupyx.empty_pinned(max(nbytes, 1), np.uint8)   # page-locked: fast copies
            self._pinned[key] = raw
        return raw[:nbytes].view(dtype).reshape(shape)

    def _down(self, arr, key="a"):
        d = as_device(arr)
        h = self._host(key, d.shape, d.dtype)
        d.get(out=h)            # synchronous on the current stream: the producer is done
        return d, h

    @staticmethod
    def _up(d, h):
        d.set(h)
        cupy().cuda.get_current_stream().synchronize()

    def _inplace(self, arr, collective, *args):
        """``collective(host copy, *args)`` on one buffer, copied down and back up (a host
        array: in place, no copies)."""
        if is_host(arr):
            collective(arr, *args)
            return arr
        d, h = self._down(arr)
        collective(h, *args)
        self._up(d, h)
        return arr

    def allreduce_inplace(self, arr):
        return self._inplace(arr, self.mpi.allreduce_inplace)

    def _pair(self, src, dst, collective, *args):
        """``collective(host src, host dst, *args)``: ``src`` copied down, ``dst`` back up
        (host arrays: as they are)."""
        if is_host(src) and is_host(dst):
            collective(src, dst, *args)
            return dst
        _, ha = self._down(src, "a")
        b = as_device(dst)
        hb = self._host("b", b.shape, b.dtype)
        collective(ha, hb, *args)
        self._up(b, hb)
        return dst

    def allreduce(self, src, dst):
        return self._pair(src, dst, self.mpi.allreduce)

    def allreduce_op(self, src, dst, op):
        return self._pair(src, dst, self.mpi.allreduce_op, op)

    def allreduce16(self, buf, fmt, native=False):
        return self._inplace(buf, self.mpi.allreduce16, fmt)

    def bcast(self, arr, root):
        return self._inplace(arr, self.mpi.bcast, root)

    def allgather(self, src, dst):
        return self._pair(src, dst, self.mpi.allgather)

    def allgatherv(self, src, dst, counts):
        return self._pair(src, dst, self.mpi.allgatherv, counts)

    def alltoall(self, src, dst):
        return self._pair(src, dst, self.mpi.alltoall)

    def alltoallv(self, src, send_counts, dst, recv_counts):
        return self._pair(src, dst, lambda ha, hb: self.mpi.alltoallv(ha, send_counts, hb, recv_counts))

    def reduce_scatter(self, src, dst, counts, op="sum"):
        return self._pair(src, dst, self.mpi.reduce_scatter, counts, op)

    def split(self, ranks):
        sub = self.mpi.split(ranks)
        if sub is None:
            return None
        return HostStagedCommunicator(sub, device=self.device, reason=self.reason, warn=False)
