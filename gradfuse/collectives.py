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
(broadcast, allgather, alltoall) take any fixed-size numpy dtype.

Scaling is Horovod 0.28.1's on the CPU, bit for bit (``_scale``): the prescale factor
multiplies each rank's input, the reduction runs (float16 summed pairwise in float32,
rounded once per add), then one postscale multiply by ``postscale_factor / size`` for
``average`` (Horovod averages through the postscale factor) or by ``postscale_factor``.
float16 is scaled in float32 and rounded once; integers are multiplied in double and
truncated toward zero (so ``average`` on integers truncates after the sum).
"""
import itertools
import pickle

import numpy as np

from . import dtypes as _dt
from .runtime import context as runtime
from .runtime import timeline as _tl
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


def _runner(ctx, op, build, job_of, suffix=""):
    """Validate locally (``build`` returns (request, state)); return the function that
    negotiates and runs on the communication thread (timeline: the names + ``suffix``).

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
    names = [n + suffix for n in request.names] if suffix else request.names

    def run():
        with _tl.stage("op", op, names):       # the timeline: negotiation, then the job
            with _tl.stage("negotiate", op, names):
                ctx.coordinator.negotiate(request)
            return job()
    return run


def _submit(ctx, op, build, job_of, runner_only=False, suffix=""):
    run = _runner(ctx, op, build, job_of, suffix)
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
    """Multiply ``a`` in place by ``factor`` as Horovod 0.28.1 does on the CPU
    (``ScaleBufferCPUImpl``): float16 and float32 by the factor rounded to float32, in
    float32 arithmetic, rounded once to the dtype; float64 in double; integers by the
    double factor, truncated toward zero. ``horovod_scale`` in tests/ref_horovod.py states
    the same rule in numpy."""
    if factor == 1.0:
        return
    if a.dtype == np.float16:
        # dtype=float32: the loop runs in float32 (numpy 1.x would otherwise round the
        # factor to float16 and multiply in float16, i.e. round twice)
        np.multiply(a, np.float32(factor), out=a, dtype=np.float32, casting="unsafe")
    elif a.dtype.kind == "f":
        np.multiply(a, a.dtype.type(factor), out=a)
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
    return req, (pre, post, names)


def _post_factor(op, post, size):
    """The one factor applied after the reduction: Horovod averages through the postscale
    factor (``postscale_factor / size``, in double), so the average and the postscale
    round once together."""
    return post / size if op == "average" else post


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
        pre, post, nm = state

        def job():
            c = ctx.comm
            outs = arrays if inplace else [a.copy() for a in arrays]
            after = _post_factor(op, post, c.size)
            rec = _tl.recorder()
            for a, name in zip(outs, nm):
                _scale(a, pre)
                if a.size:
                    t0 = _tl.clock() if rec else 0.0
                    c.allreduce_op(a, a, "sum" if op == "average" else op)
                    if rec:
                        rec("reduce", "allreduce", (name,), t0, _tl.clock(), bytes=a.nbytes)
                _scale(a, after)
            return outs
        return job

    return _submit(ctx, "allreduce", build, job_of, runner_only)


def allreduce(arrays, **kw):
    """Blocking ``allreduce_async``."""
    return allreduce_async(arrays, **kw).wait()


# --- broadcast ---------------------------------------------------------------------
def broadcast_async(arrays, root, names=None, comm=None, runner_only=False):
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
        return req, (int(root), nm)

    def job_of(state):
        r, nm = state

        def job():
            rec = _tl.recorder()
            for a, name in zip(arrays, nm):
                if a.size:
                    t0 = _tl.clock() if rec else 0.0
                    ctx.comm.bcast(a, r)
                    if rec:
                        rec("reduce", "broadcast", (name,), t0, _tl.clock(), bytes=a.nbytes)
            return arrays
        return job

    return _submit(ctx, "broadcast", build, job_of, runner_only)


def broadcast(arrays, root, **kw):
    return broadcast_async(arrays, root, **kw).wait()


# --- allgather ---------------------------------------------------------------------
def _need_dim(op, arrays, names):
    for a, name in zip(arrays, names):
        if len(a.shape) == 0:
            raise ValueError(f"{op}: tensor {name!r} is a scalar; {op} needs at least one dimension")


def allgather_async(arrays, names=None, comm=None, runner_only=False, rows_only=False):
    """Concatenate each array along its first dimension across ranks (rank order).

    The first dimension may differ between ranks; the other dimensions and the dtype
    must match. The handle's result is a list of new arrays. ``rows_only``: the first
    round of an allgather whose outputs must be sized before its data moves (a
    binding's): ``arrays`` need only ``shape`` and ``dtype``, the ranks agree as on the
    data (a disagreement raises here, with the same message), and the result is every
    rank's first dimensions (int64, ``[size, len(arrays)]``); its timeline track is
    ``<name>.rows``.
    """
    ctx = _context(comm)
    arrays = list(arrays)

    def build():
        nm = _names("allgather", names, len(arrays), ctx)
        if not rows_only:
            _check_arrays("allgather", arrays, nm, reduce=False)
        _need_dim("allgather", arrays, nm)
        req = Request("allgather", nm, [("*",) + tuple(a.shape[1:]) for a in arrays],
                      [str(a.dtype) for a in arrays], {"size": ctx.comm.size})
        return req, nm

    def job_of(nm):
        def job():
            c = ctx.comm
            rec = _tl.recorder()
            mine = np.array([a.shape[0] for a in arrays], dtype=np.int64)
            rows = np.empty((c.size, len(arrays)), dtype=np.int64)
            if len(arrays):
                c.allgather(mine, rows)
            if rows_only:
                return rows
            outs = []
            for i, a in enumerate(arrays):
                per_row = int(np.prod(a.shape[1:], dtype=np.int64))
                total = int(rows[:, i].sum())
                out = np.empty((total,) + a.shape[1:], dtype=a.dtype)
                if out.size:
                    t0 = _tl.clock() if rec else 0.0
                    c.allgatherv(a.reshape(-1), out.reshape(-1), (rows[:, i] * per_row).tolist())
                    if rec:
                        rec("reduce", "allgather", (nm[i],), t0, _tl.clock(), bytes=out.nbytes)
                outs.append(out)
            return outs
        return job

    return _submit(ctx, "allgather", build, job_of, runner_only, suffix=".rows" if rows_only else "")


def allgather(arrays, **kw):
    return allgather_async(arrays, **kw).wait()


# --- alltoall ----------------------------------------------------------------------
def alltoall_async(array, splits=None, name=None, comm=None, runner_only=False):
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
        return req, (sp, nm)

    def job_of(state):
        sp, nm = state

        def job():
            c = ctx.comm
            with _tl.stage("reduce", "alltoall", nm):
                recv = np.empty(c.size, dtype=np.int64)
                c.alltoall(sp, recv)
                per_row = int(np.prod(array.shape[1:], dtype=np.int64))
                out = np.empty((int(recv.sum()),) + array.shape[1:], dtype=array.dtype)
                c.alltoallv(array.reshape(-1), (sp * per_row).tolist(), out.reshape(-1),
                            (recv * per_row).tolist())
            return out, recv
        return job

    return _submit(ctx, "alltoall", build, job_of, runner_only)


def alltoall(array, splits=None, **kw):
    return alltoall_async(array, splits, **kw).wait()


# --- reducescatter -----------------------------------------------------------------
def scatter_rows(n, size):
    """Rows of an n-row tensor that each rank gets from reducescatter (Horovod's rule)."""
    q, r = divmod(int(n), size)
    return [q + (1 if i < r else 0) for i in range(size)]


def reducescatter_async(arrays, op="average", names=None, prescale_factor=1.0,
                        postscale_factor=1.0, comm=None, runner_only=False):
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
        pre, post, nm = state

        def job():
            c = ctx.comm
            outs = []
            rec = _tl.recorder()
            for a, name in zip(arrays, nm):
                rows = scatter_rows(a.shape[0], c.size)
                per_row = int(np.prod(a.shape[1:], dtype=np.int64))
                src = a.copy()
                _scale(src, pre)
                out = np.empty((rows[c.rank],) + a.shape[1:], dtype=a.dtype)
                if a.size:
                    t0 = _tl.clock() if rec else 0.0
                    c.reduce_scatter(src.reshape(-1), out.reshape(-1), [r * per_row for r in rows], "sum")
                    if rec:
                        rec("reduce", "reducescatter", (name,), t0, _tl.clock(), bytes=a.nbytes)
                _scale(out, _post_factor(op, post, c.size))
                outs.append(out)
            return outs
        return job

    return _submit(ctx, "reducescatter", build, job_of, runner_only)


def reducescatter(arrays, **kw):
    return reducescatter_async(arrays, **kw).wait()


# --- objects (cloudpickle: trusted peers only) -------------------------------------
def _serializer():
    """cloudpickle, as Horovod's object collectives use (the mxnet extra installs it: it
    also sends lambdas and classes defined in ``__main__``); the standard pickle where it
    is not installed. Either way the bytes are read back with ``pickle.loads``."""
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:
        return pickle


def _serialize(op, obj, name):
    """(bytes as uint8, None), or (None, InvalidInput) when ``obj`` cannot be serialized:
    the error is then reported through the collective, so no other rank waits for it."""
    ser = _serializer()
    try:
        data = ser.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:       # PicklingError, TypeError ("cannot pickle '_thread.lock'"), ...
        hint = "" if ser is not pickle else (" (cloudpickle, which also sends lambdas and local classes, is not "
                                             "installed: pip install cloudpickle, or gradfuse[mxnet])")
        err = TypeError(f"{op} {name!r}: cannot serialize the {type(obj).__name__} object: {exc}{hint}")
        err.__cause__ = exc
        return None, InvalidInput(err)
    return np.frombuffer(data, dtype=np.uint8).copy(), None


def broadcast_object(obj, root=0, name=None, comm=None):
    """Serialize ``obj`` on ``root`` (cloudpickle) and return the copy on every rank.

    Unpickling runs code chosen by the sender: use it only between the trusted
    processes of one job. An object that cannot be serialized raises ``TypeError`` on
    the root and ``RemoteInputError`` on the others.
    """
    ctx = _context(comm)
    name = name or "broadcast_object"     # not the type: it may differ off the root (None)
    payload, bad = (None, None)
    if ctx.comm.rank == root:
        payload, bad = _serialize("broadcast_object", obj, name)
    n = np.array([0 if payload is None else payload.size], dtype=np.int64)
    broadcast([bad or n], root, names=[name + ".sz"], comm=comm)
    buf = payload if ctx.comm.rank == root else np.empty(int(n[0]), dtype=np.uint8)
    broadcast([buf], root, names=[name + ".t"], comm=comm)
    return obj if ctx.comm.rank == root else pickle.loads(buf.tobytes())


def allgather_object(obj, name=None, comm=None):
    """Serialize ``obj`` on every rank (cloudpickle); return every rank's object, in rank order.

    Unpickling runs code chosen by the senders: trusted peers of one job only. An
    object that cannot be serialized raises ``TypeError`` there and ``RemoteInputError``
    on the others.
    """
    name = name or "allgather_object"
    payload, bad = _serialize("allgather_object", obj, name)
    if bad is not None:
        allgather([bad, bad], names=[name + ".sz", name + ".t"], comm=comm)
    sizes, data = allgather([np.array([payload.size], dtype=np.int64), payload],
                            names=[name + ".sz", name + ".t"], comm=comm)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(data[offs[i]:offs[i + 1]].tobytes()) for i in range(sizes.size)]
