"""gradfuse in PyTorch: a DDP communication hook with every gradfuse compressor.

    import gradfuse.torch
    state = gradfuse.torch.CompressionState("1bit", momentum=0.9, module=model)
    ddp.register_comm_hook(state, gradfuse.torch.comm_hook)

It needs no MPI and no ``gradfuse.init()``: the exchange goes through ``torch.distributed``
on DDP's process group (``TorchCommunicator``), CPU buckets through gradfuse's CPU kernels,
CUDA buckets through its CUDA kernels (``gradfuse.torch.device``). Launchers: torchrun,
srun, mpiexec (``init_process_group``). Lightning: ``gradfuse.torch.lightning`` (the
``lightning`` package) and ``gradfuse.torch.pytorch_lightning``; accelerate: a recipe in
docs/torch.md.
"""
from .comm import TorchCommunicator
from .hook import CompressionState, comm_hook
from .launch import init_process_group

__all__ = ["CompressionState", "TorchCommunicator", "comm_hook", "init_process_group"]
