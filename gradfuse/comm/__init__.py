"""Communicators: MPI (mpi4py), single-process, NCCL and host-staged MPI for GPU buffers.

Each one implements ``gradfuse.comm.base.Communicator`` and says which memory its data
plane carries (``devices``: ``"cpu"``, ``"cuda"``).
"""
from .base import Communicator
from .single import SingleProcessCommunicator


def __getattr__(name):
    # mpi4py is imported only when the MPI communicator is asked for
    if name == "MPICommunicator":
        from .mpi import MPICommunicator
        return MPICommunicator
    # cupy is imported only when a GPU communicator is asked for
    if name in ("NCCLCommunicator", "make_gpu_communicator"):
        from . import nccl
        return getattr(nccl, name)
    if name == "HostStagedCommunicator":
        from .staged import HostStagedCommunicator
        return HostStagedCommunicator
    raise AttributeError(name)


__all__ = ["Communicator", "SingleProcessCommunicator", "MPICommunicator", "NCCLCommunicator",
           "HostStagedCommunicator", "make_gpu_communicator"]
