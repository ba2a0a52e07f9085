"""Negotiated collectives beyond the fused allreduce: numpy in, numpy out, no framework.

Every function here describes its call as a ``gradfuse.runtime.control.Request`` (names,
shapes, dtypes and every option that must match: op, root rank, scale factors, the
ranks of the communicator) and runs on the communicator's one communication thread
after all ranks agreed. A mismatch, an invalid root rank or an unsupported dtype thus
raises on every rank before any data moves: the rank whose input was bad raises its
own ``TypeError``/``ValueError``, the others ``RemoteInputError`` naming it, and a
cross-rank disagreement raises ``MismatchError`` everywhere.

Each ``*_async`` function returns a ``gradfuse.Handle``; the plain functions wait.
Arrays must be C-contiguous numpy arrays; in-place variants write into them.

Call-order rule: collectives on one communicator must be issued in the same order on
every rank (they are matched by position; a different order is reported as a mismatch
naming the tensors, it never pairs the wrong data).

Dimension rules (as Horovod defines them):

* allgather: tensors may differ in their first dimension only; the result is their
  concatenation along it, in rank order.
* alltoall: rows (first dimension) are sent in rank order, ``splits[r]`` rows to rank r
  (default: equal parts, the first dimension must then divide by the size).
* reducescatter: the reduced tensor is split along the first dimension; rank r gets
  ``n // size`` rows, plus one for the first ``n % size`` ranks.

Reductions take float16, float32, float64, int32 and int64; data-movement collectives
(broadcast, allgather, alltoall) take any fixed-size numpy dtype. ``average`` on
integers truncates toward zero after the sum (Horovod's scaling rule).
"""
import itertools
import pickle

import numpy as np

from . import dtypes as _dt
from .runtime import context as runtime
from .runtime.control import Request

REDUCE_OPS = ("sum", "average", "min", "max", "prod")


def _context(comm):
    return runtime.context(comm)


_COUNTERS = {}


def _next_name(ctx, op):
    """Auto-generated name for an unnamed collective: per communicator and op, in call
    order, so ranks that issue the same calls generate the same names."""
    c = _COUNTERS.setdefault((id(ctx), op), itertools.count())
    return f"{op}.noname.{next(c)}"


def _names(op, names, n, ctx):
    if names is None:
        base = _next_name(ctx, op)
        return [base] if n == 1 else [f"{base}.{i}" for i in range(n)]
    names = [str(x) for x in names]
    if len(names) != n:
        raise ValueError(f"{op}: got {len(names)} names for {n} tensors")
    return names


class InvalidInput:
    """A placeholder for an input that a binding could not take: its error is raised
    on this rank during validation (and reported to the others) instead of hanging them."""

    def __init__(self, error):
        self.error = error


def _check_arrays(op, arrays, names, reduce):
    for a, name in zip(arrays, names):
        if isinstance(a, InvalidInput):
            raise a.error
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{op}: tensor {name!r} is a {type(a).__name__}, not a numpy array")
        if reduce and a.dtype not in _dt.CODE:
            raise TypeError(f"{op}: tensor {name!r}: dtype {a.dtype} is not supported "
                            f"(supported: {_dt.SUPPORTED})")
        if a.dtype.hasobject or a.dtype.itemsize == 0:
            raise TypeError(f"{op}: tensor {name!r}: dtype {a.dtype} cannot be communicated")
        if not a.flags.c_contiguous:
            raise ValueError(f"{op}: tensor {name!r} is not C-contiguous")


def _runner(ctx, op, build, job_of):
    """Validate locally (``build`` returns (request, state)); return the function that
    negotiates and runs on the communication thread.

    A local validation error still takes part in the negotiation, so the other ranks
    raise too instead of waiting.
    """
    try:
        request, state = build()
    except (TypeError, ValueError) as exc:
        bad = Request(op, error=exc)

        def refuse():
            ctx.coordinator.negotiate(bad)
        return refuse
    job = job_of(state)

    def run():
        ctx.coordinator.negotiate(request)
        return job()
    return run


def _submit(ctx, op, build, job_of, runner_only=False):
    run = _runner(ctx, op, build, job_of)
    return run if runner_only else ctx.engine.submit(run, op)


def refuse_async(op, error, comm=None):
    """Take part in the next collective only to report ``error`` (a local TypeError or
    ValueError): this rank raises it, the other ranks raise ``RemoteInputError``."""
    ctx = _context(comm)
    bad = Request(op, error=error)

    def refuse():
        ctx.coordinator.negotiate(bad)
    return ctx.engine.submit(refuse, op)


def _scale(a, factor):
    if factor != 1.0:
        if a.dtype.kind == "f":
            np.multiply(a, a.dtype.type(factor) if a.dtype != np.float16 else np.float32(factor),
                        out=a, casting="unsafe")
        else:
            np.copyto(a, np.trunc(a * float(factor)), casting="unsafe")


def _check_factor(op, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{op}: {name} must be a number, got {value!r}")
    return float(value)


# --- allreduce ---------------------------------------------------------------------
def _reduce_request(what, names, arrays, op, prescale_factor, postscale_factor, ctx):
    """The agreed request of a reducing collective, and its checked scale factors."""
    pre = _check_factor(what, "prescale_factor", prescale_factor)
    post = _check_factor(what, "postscale_factor", postscale_factor)
    req = Request(what, names, [a.shape for a in arrays], [str(a.dtype) for a in arrays],
                  {"op": op, "prescale_factor": pre, "postscale_factor": post, "size": ctx.comm.size})
    return req, (pre, post)


def _divide_by_size(a, size):
    """Average after the sum, in place: floats in their own arithmetic (float16 through
    float32), integers truncated toward zero as Horovod does."""
    if a.dtype.kind == "f":
        np.divide(a, np.float32(size) if a.dtype == np.float16 else a.dtype.type(size),
                  out=a, casting="unsafe")
    else:
        np.copyto(a, np.trunc(a / float(size)), casting="unsafe")


def allreduce_async(arrays, op="average", names=None, prescale_factor=1.0, postscale_factor=1.0,
                    comm=None, inplace=False, runner_only=False):
    """Reduce each array across ranks with ``op``; returns a Handle of the result list.

    With ``runner_only`` nothing is submitted: the function that negotiates and reduces
    is returned, for a caller already on the communication thread (name matching).

    Args:
        arrays: list of numpy arrays (same names, shapes, dtypes on every rank).
        op: "sum", "average", "min", "max" or "prod".
        prescale_factor, postscale_factor: multiply before / after the reduction
            (average divides after the sum, before ``postscale_factor``).
        inplace: write the results into ``arrays``; otherwise the inputs are untouched.
    """
    ctx = _context(comm)
    arrays = list(arrays)

    def build():
        nm = _names("allreduce", names, len(arrays), ctx)
        if op not in REDUCE_OPS:
            raise ValueError(f"allreduce: unknown op {op!r}; valid: {', '.join(REDUCE_OPS)}")
        _check_arrays("allreduce", arrays, nm, reduce=True)
        return _reduce_request("allreduce", nm, arrays, op, prescale_factor, postscale_factor, ctx)

    def job_of(state):
        pre, post = state

        def job():
            c = ctx.comm
            outs = arrays if inplace else [a.copy() for a in arrays]
            for a in outs:
                _scale(a, pre)
                if a.size:
                    c.allreduce_op(a, a, "sum" if op == "average" else op)
                if op == "average":
                    _divide_by_size(a, c.size)
                _scale(a, post)
            return outs
        return job

    return _submit(ctx, "allreduce", build, job_of, runner_only)


def allreduce(arrays, **kw):
    """Blocking ``allreduce_async``."""
    return allreduce_async(arrays, **kw).wait()


# --- broadcast ---------------------------------------------------------------------
def broadcast_async(arrays, root, names=None, comm=None):
    """Broadcast each array in place from ``root`` (a rank of ``comm``)."""
    ctx = _context(comm)
    arrays = list(arrays)

    def build():
        nm = _names("broadcast", names, len(arrays), ctx)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise TypeError(f"broadcast: root_rank must be an int, got {root!r}")
        if not 0 <= int(root) < ctx.comm.size:
            raise ValueError(f"broadcast: root_rank {root} is out of range: the communicator has "
                             f"{ctx.comm.size} ranks (0..{ctx.comm.size - 1})")
        _check_arrays("broadcast", arrays, nm, reduce=False)
        req = Request("broadcast", nm, [a.shape for a in arrays], [str(a.dtype) for a in arrays],
                      {"root": int(root), "size": ctx.comm.size})
        return req, int(root)

    def job_of(r):
        def job():
            for a in arrays:
                if a.size:
                    ctx.comm.bcast(a, r)
            return arrays
        return job

    return _submit(ctx, "broadcast", build, job_of)


def broadcast(arrays, root, **kw):
    return broadcast_async(arrays, root, **kw).wait()


# --- allgather ---------------------------------------------------------------------
def _need_dim(op, arrays, names):
    for a, name in zip(arrays, names):
        if a.ndim == 0:
            raise ValueError(f"{op}: tensor {name!r} is a scalar; {op} needs at least one dimension")


def allgather_async(arrays, names=None, comm=None):
    """Concatenate each array along its first dimension across ranks (rank order).

    The first dimension may differ between ranks; the other dimensions and the dtype
    must match. The handle's result is a list of new arrays.
    """
    ctx = _context(comm)
    arrays = list(arrays)

    def build():
        nm = _names("allgather", names, len(arrays), ctx)
        _check_arrays("allgather", arrays, nm, reduce=False)
        _need_dim("allgather", arrays, nm)
        req = Request("allgather", nm, [("*",) + a.shape[1:] for a in arrays],
                      [str(a.dtype) for a in arrays], {"size": ctx.comm.size})
        return req, None

    def job_of(_):
        def job():
            c = ctx.comm
            mine = np.array([a.shape[0] for a in arrays], dtype=np.int64)
            rows = np.empty((c.size, len(arrays)), dtype=np.int64)
            if len(arrays):
                c.allgather(mine, rows)
            outs = []
            for i, a in enumerate(arrays):
                per_row = int(np.prod(a.shape[1:], dtype=np.int64))
                total = int(rows[:, i].sum())
                out = np.empty((total,) + a.shape[1:], dtype=a.dtype)
                if out.size:
                    c.allgatherv(a.reshape(-1), out.reshape(-1), (rows[:, i] * per_row).tolist())
                outs.append(out)
            return outs
        return job

    return _submit(ctx, "allgather", build, job_of)


def allgather(arrays, **kw):
    return allgather_async(arrays, **kw).wait()


# --- alltoall ----------------------------------------------------------------------
def alltoall_async(array, splits=None, name=None, comm=None):
    """Send ``splits[r]`` rows of ``array`` to rank r; the result is (rows received, splits received).

    Without ``splits`` the first dimension is divided equally (it must divide by the size).
    """
    ctx = _context(comm)

    def build():
        nm = _names("alltoall", None if name is None else [name], 1, ctx)
        _check_arrays("alltoall", [array], nm, reduce=False)
        _need_dim("alltoall", [array], nm)
        size = ctx.comm.size
        n = array.shape[0]
        if splits is None:
            if n % size:
                raise ValueError(f"alltoall: tensor {nm[0]!r}: first dimension {n} does not divide "
                                 f"by the number of ranks {size}; pass splits=")
            sp = np.full(size, n // size, dtype=np.int64)
        else:
            sp = np.asarray(splits)
            if sp.dtype.kind not in "iu":
                raise TypeError(f"alltoall: splits must be integers, got dtype {sp.dtype}")
            sp = sp.astype(np.int64).reshape(-1)
            if sp.size != size:
                raise ValueError(f"alltoall: tensor {nm[0]!r}: splits has {sp.size} entries, "
                                 f"there are {size} ranks")
            if (sp < 0).any():
                raise ValueError(f"alltoall: tensor {nm[0]!r}: splits must be non-negative, got {sp.tolist()}")
            if int(sp.sum()) != n:
                raise ValueError(f"alltoall: tensor {nm[0]!r}: splits sum to {int(sp.sum())}, "
                                 f"first dimension is {n}")
        req = Request("alltoall", nm, [("*",) + array.shape[1:]], [str(array.dtype)],
                      {"size": size, "splits_given": splits is not None})
        return req, sp

    def job_of(sp):
        def job():
            c = ctx.comm
            recv = np.empty(c.size, dtype=np.int64)
            c.alltoall(sp, recv)
            per_row = int(np.prod(array.shape[1:], dtype=np.int64))
            out = np.empty((int(recv.sum()),) + array.shape[1:], dtype=array.dtype)
            c.alltoallv(array.reshape(-1), (sp * per_row).tolist(), out.reshape(-1),
                        (recv * per_row).tolist())
            return out, recv
        return job

    return _submit(ctx, "alltoall", build, job_of)


def alltoall(array, splits=None, **kw):
    return alltoall_async(array, splits, **kw).wait()


# --- reducescatter -----------------------------------------------------------------
def scatter_rows(n, size):
    """Rows of an n-row tensor that each rank gets from reducescatter (Horovod's rule)."""
    q, r = divmod(int(n), size)
    return [q + (1 if i < r else 0) for i in range(size)]


def reducescatter_async(arrays, op="average", names=None, prescale_factor=1.0,
                        postscale_factor=1.0, comm=None):
    """Reduce each array across ranks and keep this rank's block of rows of the result."""
    ctx = _context(comm)
    arrays = list(arrays)

    def build():
        nm = _names("reducescatter", names, len(arrays), ctx)
        if op not in ("sum", "average"):
            raise ValueError(f"reducescatter: op must be Sum or Average, got {op!r}")
        _check_arrays("reducescatter", arrays, nm, reduce=True)
        _need_dim("reducescatter", arrays, nm)
        return _reduce_request("reducescatter", nm, arrays, op, prescale_factor, postscale_factor, ctx)

    def job_of(state):
        pre, post = state

        def job():
            c = ctx.comm
            outs = []
            for a in arrays:
                rows = scatter_rows(a.shape[0], c.size)
                per_row = int(np.prod(a.shape[1:], dtype=np.int64))
                src = a.copy()
                _scale(src, pre)
                out = np.empty((rows[c.rank],) + a.shape[1:], dtype=a.dtype)
                if a.size:
                    c.reduce_scatter(src.reshape(-1), out.reshape(-1), [r * per_row for r in rows], "sum")
                if op == "average":
                    _divide_by_size(out, c.size)
                _scale(out, post)
                outs.append(out)
            return outs
        return job

    return _submit(ctx, "reducescatter", build, job_of)


def reducescatter(arrays, **kw):
    return reducescatter_async(arrays, **kw).wait()


# --- objects (pickle: trusted peers only) ------------------------------------------
def broadcast_object(obj, root=0, name=None, comm=None):
    """Pickle ``obj`` on ``root`` and return the unpickled copy on every rank.

    Unpickling runs code chosen by the sender: use it only between the trusted
    processes of one job.
    """
    ctx = _context(comm)
    name = name or "broadcast_object"     # not the type: it may differ off the root (None)
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if ctx.comm.rank == root else b""
    n = np.array([len(payload)], dtype=np.int64)
    broadcast([n], root, names=[name + ".sz"], comm=comm)
    buf = np.frombuffer(payload, dtype=np.uint8).copy() if ctx.comm.rank == root else \
        np.empty(int(n[0]), dtype=np.uint8)
    broadcast([buf], root, names=[name + ".t"], comm=comm)
    return obj if ctx.comm.rank == root else pickle.loads(buf.tobytes())


def allgather_object(obj, name=None, comm=None):
    """Pickle ``obj`` on every rank; return the list of every rank's object, in rank order.

    Unpickling runs code chosen by the senders: trusted peers of one job only.
    """
    name = name or "allgather_object"
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()
    sizes, data = allgather([np.array([payload.size], dtype=np.int64), payload],
                            names=[name + ".sz", name + ".t"], comm=comm)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(data[offs[i]:offs[i + 1]].tobytes()) for i in range(sizes.size)]
