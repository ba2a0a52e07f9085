"""A communicator for one process: every collective is the identity."""
import numpy as np

from .base import Communicator


class _Done:
    def __init__(self, value=None):
        self.value = value

    def result(self):
        return self.value


class SingleProcessCommunicator(Communicator):
    """Size-1 communicator with no MPI at all; useful for tests and single-GPU runs."""

    kind = "single-process"

    def __init__(self):
        self.rank = self.local_rank = self.cross_rank = 0
        self.size = self.local_size = self.cross_size = 1

    def allreduce_inplace(self, arr):
        return arr

    def allreduce(self, src, dst):
        np.copyto(dst, src)

    def ctl_isend(self, data, dest):
        raise RuntimeError("single-process communicator has no peers")

    ctl_irecv = ctl_ibcast = ctl_isend

    def ctl_iallgather_bytes(self, data):
        return _Done([bytes(data)])

    @staticmethod
    def test(request):
        return True

    def allreduce16(self, buf, fmt):
        return buf

    def allreduce_op(self, src, dst, op):
        if src is not dst:
            np.copyto(dst, src)

    def bcast(self, arr, root):
        if root != 0:
            raise ValueError(f"root rank {root} does not exist in a communicator of size 1")

    def allgather(self, src, dst):
        np.copyto(dst.reshape(-1), np.asarray(src).reshape(-1))

    def allgatherv(self, src, dst, counts):
        np.copyto(dst.reshape(-1)[:counts[0]], np.asarray(src).reshape(-1))

    alltoall = allgather

    def alltoallv(self, src, send_counts, dst, recv_counts):
        np.copyto(dst.reshape(-1)[:recv_counts[0]], np.asarray(src).reshape(-1)[:send_counts[0]])

    def reduce_scatter(self, src, dst, counts, op="sum"):
        np.copyto(dst.reshape(-1), np.asarray(src).reshape(-1)[:counts[0]])

    def split(self, ranks):
        return self if list(ranks) == [0] else None
