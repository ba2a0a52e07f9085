"""gradfuse: fused (and compressed) gradient allreduce for data-parallel training.

    import gradfuse
    pipe = gradfuse.Pipeline()
    grads = pipe.allreduce(grads)       # list or dict of arrays, averaged across ranks

Run under ``mpiexec -n N python train.py``. See README.md and docs/.
"""
from . import comm, compressors
from .compressors import register_compressor
from .engine import Handle
from .errors import GradfuseError, MismatchError, NonFiniteError, RemoteInputError, StallError
from .pipeline import Pipeline
from .runtime import init, is_initialized
from . import runtime as _runtime

__version__ = "0.1.0"


def _comm():
    return _runtime.default_context().comm


def rank():
    """This process's rank in the default communicator (after ``init()``)."""
    return _comm().rank


def size():
    """Number of ranks in the default communicator."""
    return _comm().size


def local_rank():
    """Rank among the processes on this host (split by shared memory)."""
    return _comm().local_rank


def local_size():
    """Number of processes on this host."""
    return _comm().local_size


def cross_rank():
    """Index of this host among hosts (ranks with the same local rank)."""
    return _comm().cross_rank


def cross_size():
    """Number of hosts (ranks with the same local rank)."""
    return _comm().cross_size


__all__ = ["Pipeline", "Handle", "init", "is_initialized", "rank", "size", "local_rank",
           "local_size", "cross_rank", "cross_size", "comm", "compressors", "register_compressor",
           "GradfuseError", "MismatchError", "NonFiniteError", "RemoteInputError", "StallError"]
