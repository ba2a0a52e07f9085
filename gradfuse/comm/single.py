"""A communicator for one process: every collective is the identity.

It works on host arrays and on device arrays (cupy) alike: the copies are array
assignments in the arrays' own memory.
"""
import numpy as np


def _flat(a, dst=False):
    """A flat view of an array (numpy or cupy) or of a buffer exporter. A destination
    must be contiguous: the flat view of anything else would be a copy, and the
    results would be lost."""
    if not hasattr(a, "reshape") or not hasattr(a, "dtype"):
        a = np.asarray(memoryview(a))
    if dst and a.size > 1 and not a.flags.c_contiguous:
        raise ValueError("single-process communicator: destination arrays must be C-contiguous")
    return a.reshape(-1)


def _copy(dst, src):
    d, s = _flat(dst, True), _flat(src)
    d[...] = s

from .base import Communicator


class _Done:
    def __init__(self, value=None):
        self.value = value

    def result(self):
        return self.value


class SingleProcessCommunicator(Communicator):
    """Size-1 communicator with no MPI at all; useful for tests and single-GPU runs."""

    kind = "single-process"
    devices = ("cpu", "cuda")

    def __init__(self):
        self.rank = self.local_rank = self.cross_rank = 0
        self.size = self.local_size = self.cross_size = 1

    def allreduce_inplace(self, arr):
        return arr

    def allreduce(self, src, dst):
        _copy(dst, src)

    def ctl_isend(self, data, dest):
        raise RuntimeError("single-process communicator has no peers")

    ctl_irecv = ctl_ibcast = ctl_isend

    def ctl_iallgather_bytes(self, data):
        return _Done([bytes(data)])

    @staticmethod
    def test(request):
        return True

    def allreduce16(self, buf, fmt, native=False):
        return buf

    def allreduce_op(self, src, dst, op):
        if src is not dst:
            _copy(dst, src)

    def bcast(self, arr, root):
        if root != 0:
            raise ValueError(f"root rank {root} does not exist in a communicator of size 1")

    def allgather(self, src, dst):
        _copy(dst, src)

    def allgatherv(self, src, dst, counts):
        _flat(dst, True)[:counts[0]] = _flat(src)

    alltoall = allgather

    def alltoallv(self, src, send_counts, dst, recv_counts):
        _flat(dst, True)[:recv_counts[0]] = _flat(src)[:send_counts[0]]

    def reduce_scatter(self, src, dst, counts, op="sum"):
        _copy(dst, _flat(src)[:counts[0]])

    def split(self, ranks):
        return self if list(ranks) == [0] else None
