"""gradfuse: fused (and compressed) gradient allreduce for data-parallel training.

    import gradfuse
    pipe = gradfuse.Pipeline()
    grads = pipe.allreduce(grads)       # list or dict of arrays, averaged across ranks

Run under ``mpiexec -n N python train.py``. See README.md and docs/. This module is the
package's face: it only re-exports (docs/design.md maps where each piece lives).
"""
from . import comm, compressors
from ._version import __version__
from .compressors import register_compressor
from .errors import GradfuseError, MismatchError, NonFiniteError, RemoteInputError, StallError
from .pipeline import Pipeline
from .runtime.context import (cross_rank, cross_size, init, is_initialized, local_rank, local_size,
                              rank, size)
from .runtime.control import StallWarning
from .runtime.engine import Handle

__all__ = ["Pipeline", "Handle", "init", "is_initialized", "rank", "size", "local_rank",
           "local_size", "cross_rank", "cross_size", "comm", "compressors", "register_compressor",
           "GradfuseError", "MismatchError", "NonFiniteError", "RemoteInputError", "StallError",
           "StallWarning"]
