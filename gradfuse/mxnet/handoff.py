"""The hand-off of a collective to MXNet's engine, as Horovod does it.

Every collective of ``gradfuse.mxnet`` (and every group of ``DistributedTrainer`` /
``DistributedOptimizer``) becomes one operation in MXNet's engine and the call returns at
once:

1. call time, on the caller's thread (``Call``): one C pass over the NDArrays
   (``fence.Tables``), local checks (a bad array raises here, and the other ranks learn it
   in the negotiation), then the job is queued on gradfuse's communication thread, which
   fixes the order of collectives on every rank, and only then the operation is pushed
   (``MXEnginePushAsyncND``): inputs as read dependencies, outputs as write
   dependencies, an in-place array only as a write dependency;
2. MXNet's engine starts the operation when those dependencies are free: its C callback
   reads the data pointers (MXNet allocates lazily; they exist only now), marks the
   operation ready and returns (it never blocks the engine's worker);
3. the communication thread, at the job's turn, waits for "ready", runs the collective
   (``Call.run``: negotiate, move the data) and completes the operation, with the
   error if there was one. MXNet operations on the outputs (``wait_to_read()``,
   ``asnumpy()``, an optimizer update) wait through MXNet's dependency tracking, and an
   error is rethrown by MXNet at the first of them (``engine_message``).

Under ``MXNET_ENGINE_TYPE=NaiveEngine`` the push runs the operation to completion, so
the call returns after the collective and raises its error itself (NaiveEngine drops the
error of a completion callback).
"""
import re

import mxnet as mx
import numpy as np

from .. import collectives as _coll
from ..fusion.deferred import Deferred
from ..pipeline import Pipeline
from ..runtime import context as _runtime
from ..runtime.control import Request
from . import _engine, fence, hugepages
from .errors import _wait

_registered = {}


class _Raiser:
    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error

    def wait(self):
        raise self.error


def binding_error(exc):
    """``exc`` as the binding raises it from a handle (``errors._wait``'s translation)."""
    try:
        _wait(_Raiser(exc))
    except BaseException as got:       # noqa: B902 - whatever _wait makes of it
        return got
    return exc


def engine_message(exc):
    """The message MXNet's engine carries to ``wait_to_read()``: MXNet builds the Python
    error from its first word (``mxnet.base.register_error``), so the class is registered
    under that word and the user gets the class the binding raises elsewhere."""
    exc = binding_error(exc)
    cls = type(exc)
    key = _registered.get(cls)
    if key is None:
        key = "gradfuse." + re.sub(r"[^0-9A-Za-z_.]", "_", f"{cls.__module__}.{cls.__qualname__}")
        prefix = key + ": "

        def make(msg, cls=cls, prefix=prefix):
            text = msg[len(prefix):] if msg.startswith(prefix) else msg
            try:
                return cls(text)
            except Exception:     # a class that does not take one message
                return mx.base.MXNetError(f"{cls.__name__}: {text}")
        mx.base.register_error(key, make)
        key = _registered[cls] = key
    text = str(exc) or type(exc).__name__
    return f"{key}: {text}"


class Call:
    """One collective handed to MXNet's engine (see the module docstring).

    Args:
        tables: the ``fence.Tables`` of the call's arrays.
        n_read: the first ``n_read`` arrays are read dependencies, the others written.
        name: labels the engine operation.
    """

    __slots__ = ("tables", "n_read", "op", "name", "push_error", "names")

    def __init__(self, tables, n_read, name, names=None):
        if not fence.DEFERRED:
            fence.wait_at_call(tables.nds)
        if n_read:
            fence.reorder_inputs(tables, n_read)
        self.tables, self.n_read, self.name, self.names = tables, n_read, name, names
        self.op = fence.new_op(tables, n_read)
        self.push_error = None

    def push(self):
        """Push the operation (after its job was queued). Raises if MXNet refuses."""
        try:
            fence.push(self.op, self.name)
        except Exception as exc:
            self.push_error = exc
            self.op.complete(None)       # the queued job stops waiting, and refuses
            raise

    def wait(self):
        """On the communication thread: wait until MXNet started the operation."""
        err = self.op.wait_ready()
        if self.push_error is not None:
            raise RuntimeError(f"{self.name}: MXNet did not take the operation: {self.push_error}")
        if err:
            raise ValueError(f"{self.name}: MXNet could not hand over an array's memory: {err}")
        hugepages.advise(self.tables.ptrs, self.tables.nbytes)      # once per array: numpy's advice
        if self.n_read == 0 and self.op.shared:
            partial_overlap(self.tables, self.name, self.names)

    def finish(self, error):
        """Complete the engine operation, carrying ``error`` (an exception) if any."""
        self.op.complete(None if error is None else engine_message(error))

    def run(self, ctx, label, work):
        """The communication thread's job: wait, ``work()``, complete; returns its result."""
        error = None
        try:
            try:
                self.wait()
            except Exception as exc:     # announced: the other ranks raise too
                ctx.coordinator.negotiate(Request(label, error=exc))
                raise
            return work()
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.finish(error)


def partial_overlap(tables, label, names=None):
    """In-place arrays that share storage (views of one array): the same array twice is
    reduced once into both (as Horovod's fusion buffer does), but arrays that partly
    overlap would write each other's elements; ValueError naming both."""
    n = tables.n
    p, nb = tables.ptrs[:n], tables.nbytes[:n]
    order = np.lexsort((nb, p))
    prev = None
    for i in order:
        i = int(i)
        if nb[i] == 0:
            continue
        if prev is not None and (p[i], nb[i]) != (p[prev], nb[prev]) and p[prev] + nb[prev] > p[i]:
            a, b = (names[prev], names[i]) if names else (f"tensor{prev}", f"tensor{i}")
            raise ValueError(f"{label}: tensor {a!r} and tensor {b!r} partly overlap (views of one array): "
                             f"in-place arrays may be the same array, not overlapping parts of one")
        if prev is None or p[i] + nb[i] >= p[prev] + nb[prev]:
            prev = i


def submit(call, ctx, label, work):
    """Queue ``call``'s job, push it, and return the job's handle; under NaiveEngine the
    collective has run when this returns and its error is raised here."""
    handle = ctx.engine.submit(lambda: call.run(ctx, label, work), label)
    call.push()
    if fence.naive():
        _wait(handle)
    return handle


def check(tables, label, names, reduce, lo=0, hi=None):
    """The local checks of arrays ``lo..hi-1``: a TypeError/ValueError naming the tensor, or None."""
    hi = tables.n if hi is None else hi
    mask = ~0 if reduce else ~fence.NOT_REDUCIBLE
    flags = tables.flags[lo:hi]
    if not flags.any():                 # the usual case: one pass, no array made
        return None
    for i in np.flatnonzero(flags & mask) + lo:
        i = int(i)
        f = int(tables.flags[i])
        name = names[i - lo] if names else f"tensor{i - lo}"
        nd = tables.nds[i] if i < tables.n else None
        if f & fence.BAD_STORAGE:
            return TypeError(f"tensor {name!r}: {nd.stype if nd is not None else 'sparse'} NDArrays are not "
                             f"supported; use dense arrays (tostype('default'))")
        if f & fence.BAD_DEVICE:
            return TypeError(f"tensor {name!r} is on {nd.context if nd is not None else 'a GPU'}; the "
                             f"Horovod-style collectives of this binding take CPU arrays only (GPU arrays: "
                             f"DistributedTrainer or the dist_gradfuse KVStore, see docs/gpu.md)")
        if f & fence.BAD_SHAPE:
            return ValueError(f"tensor {name!r} has no known shape")
        dt = tables.dtype(i)
        if dt is None or dt == np.bool_ or (f & fence.NOT_REDUCIBLE and reduce):
            what = "is not supported" if dt is not None else "is unknown to this binding"
            return TypeError(f"{label}: tensor {name!r}: dtype {dt if dt is not None else 'of MXNet code '}"
                             f"{'' if dt is not None else int(tables.mxtypes[i])} {what}"
                             + (" for reductions (float16, float32, float64, int32, int64)" if reduce else ""))
    return None


def not_ndarrays(tensors, names):
    """A TypeError for the first argument that is not an NDArray, or None."""
    if type(tensors) is list and _engine.all_of_type(tensors, mx.nd.NDArray):    # one C pass, usually
        return None
    for i, t in enumerate(tensors):
        if not isinstance(t, mx.nd.NDArray):
            name = names[i] if names else f"tensor{i}"
            return TypeError(f"tensor {name!r}: expected an mxnet NDArray, got {type(t).__name__}")
    return None


def empty_like(t, shape=None, dtype=None):
    """A new NDArray beside ``t`` (its memory is allocated when the engine first writes it)."""
    return mx.nd.empty(t.shape if shape is None else shape, ctx=t.context, dtype=t.dtype if dtype is None else dtype)


# --- the fused path: gradfuse.Pipeline --------------------------------------------------
def pipeline_call(pipe, tables, names, outs=None, label="allreduce"):
    """Reduce the (checked) arrays of ``tables`` with ``pipe``, fused, through one engine
    operation: into ``outs`` (the binding's new NDArrays, scanned into ``tables`` after the
    inputs) or, without them, in place. Returns the job's handle."""
    n = tables.n
    call = Call(tables, n if outs else 0, f"gradfuse.{label}", names)
    d = Deferred(names if names is not None else list(range(n)), tables.sig, tables.nbytes[:n],
                 tables.ptrs[:n], tables.ptrs[n:] if outs else None, call.wait, call.finish,
                 outs if outs else tables.nds)
    handle = pipe.allreduce_async(d, out=None if outs else d)
    if not d.taken:               # refused while preparing: every rank raises now
        _wait(handle)
    call.push()
    if fence.naive():
        _wait(handle)
    return handle


def reduce_group(pipe, nds, names):
    """``DistributedTrainer``'s fused in-place reduction of one group of gradients.
    Returns the job's handle, or None when the group has GPU arrays (for the caller's
    synchronous GPU path); raises this rank's own error (every rank raises)."""
    bad = not_ndarrays(nds, names)
    tables = fence.Tables(list(nds)) if bad is None else None
    if tables is not None and (tables.flags & fence.BAD_DEVICE).any():
        return None
    if bad is None:
        bad = check(tables, "allreduce", names, reduce=True)
    if bad is not None:
        _wait(_coll.refuse_async("allreduce", bad, pipe._ctx.comm))
    return pipeline_call(pipe, tables, names)


class _OpPipeline(Pipeline):
    """The Pipeline of Horovod-style Sum (and exact Average) allreduces. Its requests carry
    ``gradfuse.collectives.allreduce``'s options (op, scale factors, size), the pipeline's
    own last, so that a rank that took the other path (another op, a scale factor) is told
    which option differs."""

    def __init__(self, op, comm):
        self._op = op             # before the Pipeline's own set-up, which asks _request_options
        super().__init__(average=op == "average", comm=comm)

    def _request_options(self, device):
        return {"op": self._op, "prescale_factor": 1.0, "postscale_factor": 1.0, "size": self.comm.size,
                "~pipeline": dict(self._options(), device=device)}


_pipes = {}


def reduce_pipeline(comm, average):
    """The binding's own Pipeline for Horovod-style Sum (and exact Average) allreduces."""
    ctx = _runtime.context(comm)
    key = (id(ctx), bool(average))
    pipe = _pipes.get(key)
    if pipe is None or pipe._ctx is not ctx:
        pipe = _pipes[key] = _OpPipeline("average" if average else "sum", comm)
    return pipe
