"""What each collective of the binding does once MXNet's engine has handed its arrays over.

Each function checks the call (a bad array raises here, on this rank, and the other
ranks learn it in the negotiation), makes the outputs, and hands the collective to the
engine through ``handoff`` (one engine operation per call); it returns at once. The jobs
run on the communication thread with numpy views of the arrays' memory and the
framework-free collectives of ``gradfuse.collectives`` (or ``gradfuse.Pipeline``).

allgather and alltoall need the other ranks' first dimensions to size their outputs:
they run a short blocking round for them at call time (allgather's agrees on the whole
call there, so its errors are raised at the call), then hand the data movement to the engine.
"""
import mxnet as mx
import numpy as np

from .. import collectives as _coll
from . import fence, handoff
from .errors import _wait


def refuse(label, error, comm):
    """Raise this rank's own ``error`` (the other ranks raise RemoteInputMXNetError)."""
    _wait(_coll.refuse_async(label, error, comm))


def _tables(label, tensors, names, reduce, comm, outs=(), checked=False):
    """The call's ``fence.Tables`` after the local checks (``checked``: the caller has
    already made sure every tensor is an NDArray)."""
    bad = None if checked else handoff.not_ndarrays(tensors, names)
    if bad is not None:
        refuse(label, bad, comm)
    tables = fence.Tables(list(tensors), list(outs))
    bad = handoff.check(tables, label, names, reduce)
    if bad is not None:
        refuse(label, bad, comm)
    return tables


def _need_dim(label, tables, names, comm):
    for i in range(tables.n):
        if not tables.shape(i):
            refuse(label, ValueError(f"{label}: tensor {names[i]!r} is a scalar; {label} needs at least one "
                                     f"dimension"), comm)


def _copy_into(dst, srcs):
    for d, s in zip(dst, srcs):
        if d.size:
            np.copyto(d, s.reshape(d.shape))


# --- allreduce ----------------------------------------------------------------------------
def _fused(tables, op, pre, post, size):
    """Whether the Pipeline gives Horovod's bits: Sum, or an Average whose division by the
    number of ranks is exact (a power of two) on floats; no scale factors."""
    if pre != 1.0 or post != 1.0:
        return False
    if op == "sum":
        return True
    floats = all(int(t) in (0, 1, 2) for t in tables.mxtypes[:tables.n])
    return op == "average" and floats and size & (size - 1) == 0


def _allreduce_work(comm, tables, outs, op, names, pre, post):
    """The communication thread's half of an unfused allreduce: copy into ``outs`` (out of
    place), then reduce there with the framework-free collective."""
    n = tables.n

    def work():
        dst = tables.views(0, n)
        if outs:
            src, dst = dst, tables.views(n, 2 * n)
            _copy_into(dst, src)
        return _coll.allreduce_async(dst, op=op, names=names, prescale_factor=pre, postscale_factor=post,
                                     comm=comm, inplace=True, runner_only=True)()
    return work


def allreduce(ctx, comm, tensors, outs, op, names, pre, post):
    """Reduce ``tensors`` (NDArrays: the caller checked) into ``outs`` (new NDArrays), or in
    place when ``outs`` is None."""
    tables = _tables("allreduce", tensors, names, True, comm, outs or (), checked=True)
    n = tables.n
    if _fused(tables, op, pre, post, comm.size):
        pipe = handoff.reduce_pipeline(comm, op == "average")
        return handoff.pipeline_call(pipe, tables, names, outs)
    call = handoff.Call(tables, n if outs else 0, "gradfuse.allreduce", names)
    return handoff.submit(call, ctx, "allreduce", _allreduce_work(comm, tables, outs, op, names, pre, post))


def matched_allreduce(ctx, comm, matcher, handle, tensors, outs, op, names, pre, post):
    """An async allreduce matched by name (``handle``'s): queued with ``matcher``, whose
    round runs it once the name is ready on every rank (NDArrays: the caller checked)."""
    tables = _tables("allreduce", tensors, names, True, comm, outs or (), checked=True)
    n = tables.n
    call = handoff.Call(tables, n if outs else 0, f"gradfuse.{handle.name}", names)
    work = _allreduce_work(comm, tables, outs, op, names, pre, post)

    def abandon():
        # a round that failed before this name ran: the engine operation still completes
        if not call.op.done:
            call.op.wait_ready()
            call.finish(handle._error or RuntimeError("async allreduce abandoned"))

    matcher.add(handle.name, lambda: call.run(ctx, "allreduce", work), handle, ready=lambda: call.op.ready)
    handle.add_done(abandon)
    call.push()          # after add: NaiveEngine runs the operation (and its round) here


# --- broadcast ----------------------------------------------------------------------------
def broadcast(ctx, comm, tensors, root, names):
    """Broadcast ``tensors`` from ``root`` (a rank of ``comm``), in place."""
    tables = _tables("broadcast", tensors, names, False, comm)
    call = handoff.Call(tables, 0, "gradfuse.broadcast", names)

    def work():
        return _coll.broadcast_async(tables.views(0, tables.n), root, names=names, comm=comm,
                                     runner_only=True)()
    return handoff.submit(call, ctx, "broadcast", work)


# --- allgather / alltoall: a blocking round for the outputs' shapes ----------------------------
def allgather(ctx, comm, tensors, names):
    """Concatenate each tensor across ranks along its first dimension; returns new NDArrays.

    The call's round agrees on the whole allgather (names, the dimensions after the first,
    dtypes) as it fetches the first dimensions, so a disagreement raises here, at the
    call, on every rank (Horovod blocks in its allgather for the same reason: the output's
    shape depends on the other ranks); the data then moves through MXNet's engine.
    """
    tables = _tables("allgather", tensors, names, False, comm)
    _need_dim("allgather", tables, names, comm)
    n = tables.n
    shapes = [np.broadcast_to(np.zeros((), tables.dtype(i)), tables.shape(i)) for i in range(n)]   # no memory
    rows = _wait(_coll.allgather_async(shapes, names=names, comm=comm, rows_only=True))
    outs = [handoff.empty_like(t, (int(rows[:, i].sum()),) + tables.shape(i)[1:]) for i, t in enumerate(tensors)]
    tables = fence.Tables(list(tensors), outs)
    call = handoff.Call(tables, n, "gradfuse.allgather")

    def work():
        got = _coll.allgather_async(tables.views(0, n), names=names, comm=comm, runner_only=True)()
        _copy_into(tables.views(n, 2 * n), got)
    handoff.submit(call, ctx, "allgather", work)
    return outs


def alltoall(ctx, comm, tensor, splits, name):
    """Send ``splits[r]`` rows to rank r; returns (the received rows, the received splits)."""
    tables = _tables("alltoall", [tensor], [name], False, comm)
    _need_dim("alltoall", tables, [name], comm)
    shape = tables.shape(0)
    # the splits round, at call time: gradfuse.collectives checks the splits (every rank
    # raises on a bad one) and returns the rows this rank receives
    _, recv = _wait(_coll.alltoall_async(np.empty((shape[0], 0), dtype=np.uint8), splits,
                                         name=f"{name}.splits", comm=comm))
    out = handoff.empty_like(tensor, (int(recv.sum()),) + shape[1:])
    tables = fence.Tables([tensor], [out])
    call = handoff.Call(tables, 1, "gradfuse.alltoall")

    def work():
        got, _ = _coll.alltoall_async(tables.views(0, 1)[0], splits, name=name, comm=comm, runner_only=True)()
        _copy_into(tables.views(1, 2), [got])
    handoff.submit(call, ctx, "alltoall", work)
    return out, mx.nd.array(recv, ctx=mx.cpu(), dtype=np.int32)


# --- reducescatter ------------------------------------------------------------------------
def reducescatter(ctx, comm, tensors, op, names, pre, post):
    """This rank's rows of each reduced tensor, as new NDArrays."""
    tables = _tables("reducescatter", tensors, names, True, comm)
    _need_dim("reducescatter", tables, names, comm)
    n = tables.n
    outs = [handoff.empty_like(t, (_coll.scatter_rows(tables.shape(i)[0], comm.size)[comm.rank],)
                               + tables.shape(i)[1:]) for i, t in enumerate(tensors)]
    tables = fence.Tables(list(tensors), outs)
    call = handoff.Call(tables, n, "gradfuse.reducescatter")

    def work():
        got = _coll.reducescatter_async(tables.views(0, n), op=op, names=names, prescale_factor=pre,
                                        postscale_factor=post, comm=comm, runner_only=True)()
        _copy_into(tables.views(n, 2 * n), got)
    handoff.submit(call, ctx, "reducescatter", work)
    return outs
