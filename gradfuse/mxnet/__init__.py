"""``gradfuse.mxnet``: Horovod's MXNet API on gradfuse, plus every gradfuse compressor.

Replace ``import horovod.mxnet as hvd`` with ``import gradfuse.mxnet as hvd``: the names,
arguments, defaults and return values are Horovod 0.28.1's. This module is a thin
binding: arrays go to ``gradfuse.Pipeline`` (fused gradient allreduce) and
``gradfuse.collectives`` (everything else); it holds no compression logic.

Arrays: CPU ``mx.nd.NDArray`` of float16/32/64 and int32/int64 for reductions (any
numeric dtype for broadcast/allgather/alltoall). They are read and written in place,
without copies, through ``to_dlpack_for_write`` (``gradfuse.fusion.intake``). Taking that
view makes MXNet's engine finish every pending read and write of the array first, so a
gradient is never read before backward has written it; every call here returns only
after the result has been written, so no array is handed back while still being written.

Call-order rule: collectives are matched in the order they are issued; every rank of a
process set must issue that set's collectives in the same order (names only label
them). A different order is reported as an error on every rank, never silently paired.
``priority`` is accepted for compatibility and ignored (first in, first out).

Errors: a cross-rank mismatch (name, shape, dtype, op, root rank, scale factors) raises
``CollectiveMismatchError`` on every rank before any data is reduced; it is both a
``ValueError`` (gradfuse's ``MismatchError``) and an ``mxnet.base.MXNetError`` (what
Horovod's MXNet ops raise). A rank whose own input is wrong raises ``TypeError`` or
``ValueError`` and the other ranks raise ``RemoteInputMXNetError`` naming it.

Example:
    >>> import gradfuse.mxnet as hvd
    >>> hvd.init()
    >>> trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
    ...                                  {"learning_rate": 0.1}, compress="1bit")
"""
from . import adamw  # noqa: F401  (registers the "adamw" optimizer with MXNet)
from .basics import (ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                     ddl_built, global_process_set, gloo_built, gloo_enabled, init, is_initialized,
                     local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                     nccl_built, rank, remove_process_set, rocm_built, shutdown, size,
                     start_timeline, stop_timeline)
# Horovod's compressor classes stay reachable here, as before (not in __all__)
from .compression import Compression, Compressor, FP16Compressor, NoneCompressor  # noqa: F401
from .errors import CollectiveMismatchError, RemoteInputMXNetError
from .kvstore import KVStore
from .mpi_ops import (Adasum, AsyncHandle, Average, Max, Min, Product, Sum, allgather,
                      allgather_object, allreduce, allreduce_, allreduce_async, allreduce_async_,
                      alltoall, broadcast, broadcast_, broadcast_object, broadcast_parameters,
                      grouped_allgather, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async_, grouped_reducescatter, poll, reducescatter,
                      synchronize)
from .optimizer import DistributedOptimizer, DistributedTrainer, split_list

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
    "broadcast", "broadcast_", "broadcast_parameters", "allgather", "grouped_allgather",
    "alltoall", "reducescatter", "grouped_reducescatter", "broadcast_object",
    "allgather_object", "Compression", "DistributedOptimizer", "DistributedTrainer",
    "CollectiveMismatchError", "RemoteInputMXNetError", "split_list", "KVStore",
    "AsyncHandle", "allreduce_async", "allreduce_async_", "grouped_allreduce_async_",
    "synchronize", "poll",
]
