"""What the GPU communicators share: cupy views of device buffers, and a control plane
that is an MPI communicator.

A device communicator's data plane takes device buffers (cupy arrays, anything with
``__cuda_array_interface__``, or ``gradfuse.fusion.intake.DeviceArray``), contiguous;
its control plane (the small host messages of ``gradfuse.runtime.control``) and its
ranks are those of an ``MPICommunicator``.
"""
import numpy as np

from .base import Communicator
from .mpi import MPICommunicator


def cupy():
    """cupy (imported on first use)."""
    from .. import gpu
    return gpu.cupy()


def as_device(obj):
    """A cupy array viewing ``obj`` (cupy array, ``__cuda_array_interface__``, DeviceArray),
    without copying."""
    cp = cupy()
    if isinstance(obj, cp.ndarray):
        arr = obj
    elif hasattr(obj, "__cuda_array_interface__"):
        arr = cp.asarray(obj)
    elif hasattr(obj, "ptr") and hasattr(obj, "dtype") and hasattr(obj, "shape"):   # intake.DeviceArray
        nbytes = int(np.prod(obj.shape, dtype=np.int64)) * np.dtype(obj.dtype).itemsize
        # device -1 (from __cuda_array_interface__, which names none): cupy looks up the
        # pointer's own device, as cupy.asarray does; a null pointer needs an explicit one
        dev = obj.device_id if obj.device_id >= 0 else (-1 if obj.ptr else cp.cuda.runtime.getDevice())
        mem = cp.cuda.UnownedMemory(int(obj.ptr), nbytes, obj.owner, dev)
        arr = cp.ndarray(obj.shape, obj.dtype, cp.cuda.MemoryPointer(mem, 0))
    else:
        raise TypeError(f"expected a device array, got {type(obj).__module__}.{type(obj).__qualname__}")
    if not arr.flags.c_contiguous:
        raise ValueError("device buffers must be C-contiguous")
    return arr


def is_host(arr):
    """Whether ``arr`` is a host (numpy) array: a device communicator sums those, the small
    host messages of a step (e.g. the Adam freeze rule's 8-byte max), on its control plane."""
    return isinstance(arr, np.ndarray) and not hasattr(arr, "__cuda_array_interface__")


def as_bytes(arr):
    return arr.reshape(-1).view(np.uint8)


class DeviceCommunicator(Communicator):
    """Shared part: ranks and the control plane come from an MPI communicator."""

    devices = ("cuda",)

    def _init_control(self, mpi_comm):
        self.mpi = mpi_comm if isinstance(mpi_comm, MPICommunicator) else MPICommunicator(mpi_comm)
        m = self.mpi
        self.rank, self.size = m.rank, m.size
        self.local_rank, self.local_size = m.local_rank, m.local_size
        self.cross_rank, self.cross_size = m.cross_rank, m.cross_size

    # --- control plane: MPI ----------------------------------------------------------
    def ctl_isend(self, data, dest):
        return self.mpi.ctl_isend(data, dest)

    def ctl_irecv(self, buf, source):
        return self.mpi.ctl_irecv(buf, source)

    def ctl_ibcast(self, buf, root):
        return self.mpi.ctl_ibcast(buf, root)

    def ctl_iallgather_bytes(self, data):
        return self.mpi.ctl_iallgather_bytes(data)

    @staticmethod
    def test(request):
        return MPICommunicator.test(request)

    def abort(self, code=1):
        self.mpi.abort(code)
