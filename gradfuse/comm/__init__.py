"""Communicators: MPI (mpi4py), single-process, and (GPU issue) NCCL.

Each one implements ``gradfuse.comm.base.Communicator``.
"""
from .base import Communicator
from .single import SingleProcessCommunicator


def __getattr__(name):
    # mpi4py is imported only when the MPI communicator is asked for
    if name == "MPICommunicator":
        from .mpi import MPICommunicator
        return MPICommunicator
    # cupy is imported only when a GPU communicator is asked for
    if name in ("NCCLCommunicator", "HostStagedCommunicator", "make_gpu_communicator"):
        from . import nccl
        return getattr(nccl, name)
    raise AttributeError(name)


__all__ = ["Communicator", "SingleProcessCommunicator", "MPICommunicator", "NCCLCommunicator",
           "HostStagedCommunicator", "make_gpu_communicator"]
