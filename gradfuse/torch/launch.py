"""Start ``torch.distributed`` from whichever launcher started the process.

``torchrun`` sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; ``mpiexec`` sets
its own rank variables instead (MPICH/Hydra: ``PMI_RANK``/``PMI_SIZE``; Open MPI:
``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``), and the rendezvous address comes from
``MASTER_ADDR``/``MASTER_PORT`` (set them yourself; defaults 127.0.0.1:29500). No MPI is
initialised: mpiexec only starts the processes.
"""
import os

import torch.distributed as dist

_RANK_VARS = (("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
              ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
              ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE"))


def launcher_env(environ=None):
    """``(rank, world_size, local_rank, local_size, launcher)`` from the environment, or None."""
    env = os.environ if environ is None else environ
    for rank, size, lrank, lsize in _RANK_VARS:
        if rank in env and size in env:
            try:
                r, s = int(env[rank]), int(env[size])
                lr, ls = int(env.get(lrank, r)), int(env.get(lsize, s))
            except ValueError:
                raise ValueError(f"gradfuse.torch: {rank}={env[rank]!r} / {size}={env[size]!r} are not integers")
            if not 0 <= r < s:
                raise ValueError(f"gradfuse.torch: {rank}={r} is not a rank of {size}={s}")
            return r, s, lr, ls, rank
    return None


def init_process_group(backend="gloo", **kwargs):
    """``torch.distributed.init_process_group`` with the rank and world size of torchrun
    or mpiexec (MPICH's PMI_*, Open MPI's OMPI_COMM_WORLD_*); a no-op if already done.

    Args:
        backend: "gloo" (CPU; default) or "nccl".
        **kwargs: passed on (``timeout=...``).

    Returns:
        ``(rank, world_size)``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    found = launcher_env()
    if found is None:
        raise RuntimeError("gradfuse.torch: no launcher environment (RANK/WORLD_SIZE of torchrun, PMI_RANK/"
                           "PMI_SIZE of MPICH's mpiexec, OMPI_COMM_WORLD_* of Open MPI's)")
    rank, size, lrank, lsize, _ = found
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    # TorchCommunicator reads the node layout from torchrun's names
    os.environ.setdefault("LOCAL_RANK", str(lrank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(lsize))
    dist.init_process_group(backend, rank=rank, world_size=size, **kwargs)
    return rank, size
