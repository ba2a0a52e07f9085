"""Horovod's op set on gradfuse: allreduce (blocking, grouped, async with handles),
broadcast, allgather, alltoall, reducescatter, the object collectives,
``broadcast_parameters``, and Horovod's op codes (Average, Sum, ...).

Arrays go to ``gradfuse.collectives``; blocking collectives are matched by call order,
async allreduces by name (``gradfuse.runtime.matching``).
"""
import itertools
import types
import warnings

import mxnet as mx
import numpy as np

from .. import collectives as _coll
from ..runtime import context as _runtime
from ..runtime import matching as _matching
from .arrays import _to_nd, _view
from .basics import _comm_of, _ranks_of, _require_init, _span, global_process_set, size
from .errors import _as_mxnet_errors, _wait
from .fence import _fence

# Horovod's op codes (horovod.common.basics), so code that stores them keeps working.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "prod"}


def _resolve_op(op, average):
    """Horovod's rule: op wins; average= is deprecated; default Average."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    elif average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        op = Average if average else Sum
    else:
        op = Average
    if op == Adasum:
        raise NotImplementedError("gradfuse.mxnet: the Adasum op is not implemented; "
                                  "use Average or Sum")
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


def _group_names(name, n):
    if name is None:
        return None
    return [str(name)] if n == 1 else [f"{name}.{i}" for i in range(n)]


class AsyncHandle:
    """A collective in flight: ``wait()`` (or ``synchronize(handle)``) returns its result
    once every rank has taken part; ``done()`` (or ``poll(handle)``) never blocks.

    The arrays were read when the call was made (after MXNet finished writing them).
    The outputs are fenced in MXNet's engine: MXNet operations issued after the call
    that use them wait until the collective has finished, as with Horovod's engine ops.
    Only direct memory access (``asnumpy`` goes through the engine and is safe; a numpy
    view taken by hand is not) must wait for ``wait()``.
    """

    __slots__ = ("_handle", "_result")

    def __init__(self, handle, result):
        self._handle, self._result = handle, result

    def done(self):
        return self._handle.done()

    def wait(self):
        _wait(self._handle)
        return self._result


def _allreduce_async(tensors, inplace, average, name, prescale_factor, postscale_factor,
                     process_set, op, group):
    comm = _comm_of(process_set)
    try:
        op = _resolve_op(op, average)
    except (ValueError, NotImplementedError) as exc:
        # raised on every rank, not just here: the others would wait for this rank
        return _coll.refuse_async("allreduce", exc, comm), list(tensors)
    names = _group_names(name, len(tensors)) if group else (None if name is None else [str(name)])
    if inplace:
        outs = list(tensors)
    else:
        outs = [t.copy() if isinstance(t, mx.nd.NDArray) else t for t in tensors]
    views = [_view(t, names[i] if names else f"tensor{i}") for i, t in enumerate(outs)]
    h = _coll.allreduce_async(views, op=_OP_NAMES[op], names=names, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, comm=comm, inplace=True)
    return h, outs


def _allreduce(tensors, inplace, average, name, prescale_factor, postscale_factor,
               process_set, op, group):
    with _span("allreduce", name if name is not None else "allreduce"):
        h, outs = _allreduce_async(tensors, inplace, average, name, prescale_factor,
                                   postscale_factor, process_set, op, group)
        _wait(h)
    return outs


_async_names = {}


def _allreduce_matched(tensors, inplace, average, name, prescale_factor, postscale_factor,
                       process_set, op, group):
    """Start an allreduce matched by name across ranks; returns (handle, outputs)."""
    comm = _comm_of(process_set)
    ctx = _runtime.context(comm)
    try:
        op = _resolve_op(op, average)
    except (ValueError, NotImplementedError) as exc:
        return _coll.refuse_async("allreduce", exc, comm), list(tensors)
    if name is None:
        counter = _async_names.setdefault(id(ctx), itertools.count())
        name = f"allreduce_async.noname.{next(counter)}"
    name = str(name)
    names = _group_names(name, len(tensors)) if group else [name]
    outs = list(tensors) if inplace else [t.copy() if isinstance(t, mx.nd.NDArray) else t
                                          for t in tensors]
    views = [_view(t, names[i]) for i, t in enumerate(outs)]
    run = _coll.allreduce_async(views, op=_OP_NAMES[op], names=names, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, comm=comm, inplace=True,
                                runner_only=True)
    handle = _matching.MatchedHandle(name)
    _matching.matcher(ctx).add(name, run, handle)
    nds = [o for o in outs if isinstance(o, mx.nd.NDArray)]
    if nds:     # after add: NaiveEngine runs the fence at once and waits for the round
        _fence(ctx, nds, name, handle.add_done)
    return handle, outs


def allreduce_async(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, op=None):
    """Start ``allreduce`` and return an ``AsyncHandle`` whose ``wait()`` gives the result.

    gradfuse extension (Horovod's MXNet binding has no handles; its PyTorch one does).
    Async calls are matched by ``name`` across ranks, in any order (see
    ``gradfuse.runtime.matching.Matcher``); unnamed ones by their order.
    """
    h, outs = _allreduce_matched([tensor], False, average, name, prescale_factor,
                                 postscale_factor, process_set, op, False)
    return AsyncHandle(h, outs[0])


def allreduce_async_(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, op=None):
    """In-place ``allreduce_async``: ``wait()`` returns ``tensor`` holding the result."""
    h, outs = _allreduce_matched([tensor], True, average, name, prescale_factor,
                                 postscale_factor, process_set, op, False)
    return AsyncHandle(h, outs[0])


def grouped_allreduce_async_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set, op=None):
    """In-place ``grouped_allreduce`` started now; ``wait()`` returns ``tensors``."""
    h, _ = _allreduce_matched(list(tensors), True, average, name, prescale_factor,
                              postscale_factor, process_set, op, True)
    return AsyncHandle(h, tensors)


def synchronize(handle):
    """Wait for an ``AsyncHandle`` and return its result (Horovod PyTorch's name)."""
    return handle.wait()


def poll(handle):
    """True when the collective of ``handle`` has finished (never blocks)."""
    return handle.done()


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set, op=None):
    """Reduce ``tensor`` across the ranks of ``process_set`` into a new NDArray.

    Args:
        tensor: CPU NDArray (float16/32/64, int32, int64); not modified.
        average: deprecated, use ``op``.
        name: matches the tensor across ranks (labels errors and the timeline).
        priority: ignored (gradfuse runs collectives first in, first out).
        prescale_factor, postscale_factor: multiply before / after the reduction.
        process_set: the ranks that take part.
        op: Average (default), Sum, Min, Max or Product; Adasum raises NotImplementedError.

    Returns:
        A new NDArray of the same shape and dtype with the result.
    """
    return _allreduce([tensor], False, average, name, prescale_factor, postscale_factor,
                      process_set, op, False)[0]


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, op=None):
    """In-place ``allreduce``: the result is written into ``tensor``, which is returned."""
    return _allreduce([tensor], True, average, name, prescale_factor, postscale_factor,
                      process_set, op, False)[0]


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, op=None):
    """Reduce a list of tensors as one collective; returns a list of new NDArrays."""
    if not tensors:
        return tensors
    return _allreduce(list(tensors), False, average, name, prescale_factor, postscale_factor,
                      process_set, op, True)


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, op=None):
    """In-place ``grouped_allreduce``; returns ``tensors``."""
    if not tensors:
        return tensors
    _allreduce(list(tensors), True, average, name, prescale_factor, postscale_factor,
               process_set, op, True)
    return tensors


def _root_in(process_set, root_rank):
    """Translate a global root rank to the process set's rank (Horovod's convention)."""
    ranks = _ranks_of(process_set)
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        return _coll.InvalidInput(TypeError(f"root_rank must be an int, got {root_rank!r}"))
    if int(root_rank) not in ranks:
        return _coll.InvalidInput(ValueError(
            f"root_rank {root_rank} is not a rank of the process set (ranks {ranks})"))
    return ranks.index(int(root_rank))


def _broadcast(tensors, root_rank, names, process_set):
    comm = _comm_of(process_set)
    root = _root_in(process_set, root_rank)
    views = [_view(t, names[i] if names else f"tensor{i}") for i, t in enumerate(tensors)]
    if isinstance(root, _coll.InvalidInput):
        views[0:1] = [root]       # reported on every rank through the negotiation
        root = 0
    with _span("broadcast", names[0] if names else "broadcast"):
        _wait(_coll.broadcast_async(views, root, names=names, comm=comm))
    return tensors


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """A new NDArray holding ``tensor`` of ``root_rank`` (a global rank) on every rank."""
    out = tensor.copy() if isinstance(tensor, mx.nd.NDArray) else tensor
    return _broadcast([out], root_rank, None if name is None else [str(name)], process_set)[0]


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Overwrite ``tensor`` with root's value, in place; returns ``tensor``."""
    return _broadcast([tensor], root_rank, None if name is None else [str(name)], process_set)[0]


def _append_broadcast_init(param, root_rank, name):
    init_impl = param._init_impl

    def wrapped_init_impl(self, *args, **kwargs):
        init_impl(*args, **kwargs)
        broadcast_(self.data(), root_rank=root_rank, name=name)
    return wrapped_init_impl


def broadcast_parameters(params, root_rank=0, prefix=None):
    """Broadcast parameters from ``root_rank`` to every rank, in one negotiated collective.

    Args:
        params: dict of name -> NDArray or Parameter, or a Gluon ``ParameterDict``
            (``net.collect_params()``). Parameters not initialised yet (deferred
            initialisation) are broadcast when they are initialised.
        root_rank: the rank whose values win.
        prefix: prepended to the names (use distinct prefixes for distinct calls).
    """
    _require_init()
    if size() == 1:
        return
    assert prefix is None or isinstance(prefix, str)
    prefix = prefix or ""
    try:
        from mxnet.gluon.parameter import ParameterDict
        valid = (dict, ParameterDict)
    except ImportError:
        valid = (dict,)
    if not isinstance(params, valid):
        raise ValueError(f"invalid params of type: {type(params)}")
    tensors, names = [], []
    for name, p in sorted(params.items()):
        try:
            tensors.append(p.data() if isinstance(p, mx.gluon.parameter.Parameter) else p)
            names.append(prefix + str(name))
        except mx.gluon.parameter.DeferredInitializationError:
            p._init_impl = types.MethodType(_append_broadcast_init(p, root_rank, prefix + str(name)), p)
    if tensors:
        _broadcast(tensors, root_rank, names, global_process_set)


def _allgather(tensors, name, process_set):
    comm = _comm_of(process_set)
    names = _group_names(name, len(tensors))
    views = [_view(t, names[i] if names else f"tensor{i}") for i, t in enumerate(tensors)]
    with _span("allgather", names[0] if names else "allgather"):
        outs = _wait(_coll.allgather_async(views, names=names, comm=comm))
    return [_to_nd(o, t) for o, t in zip(outs, tensors)]


def allgather(tensor, name=None, priority=0, process_set=global_process_set):
    """Concatenate ``tensor`` of every rank along the first dimension (which may differ)."""
    return _allgather([tensor], name, process_set)[0]


def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set):
    """``allgather`` of each tensor of a list, as one collective; returns a list."""
    if not tensors:
        return []
    return _allgather(list(tensors), name, process_set)


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Send ``splits[r]`` rows of ``tensor`` to rank r of the process set.

    Returns the received rows, and with ``splits`` given also the received splits
    (an int32 NDArray), as Horovod does.
    """
    comm = _comm_of(process_set)
    view = _view(tensor, name or "tensor")
    if splits is not None and isinstance(splits, mx.nd.NDArray):
        splits = splits.asnumpy()
    with _span("alltoall", name or "alltoall"):
        out, recv = _wait(_coll.alltoall_async(view, splits, name=name, comm=comm))
    result = _to_nd(out, tensor)
    if splits is None:
        return result
    return result, mx.nd.array(recv, ctx=mx.cpu(), dtype=np.int32)


def _reducescatter(tensors, op, name, process_set, prescale_factor, postscale_factor):
    comm = _comm_of(process_set)
    if op not in (Average, Sum):
        _wait(_coll.refuse_async("reducescatter", ValueError(
            f"reducescatter supports op=Average or Sum, got {op!r}"), comm))
    names = _group_names(name, len(tensors))
    views = [_view(t, names[i] if names else f"tensor{i}") for i, t in enumerate(tensors)]
    with _span("reducescatter", names[0] if names else "reducescatter"):
        outs = _wait(_coll.reducescatter_async(views, op=_OP_NAMES[op], names=names,
                                               prescale_factor=prescale_factor,
                                               postscale_factor=postscale_factor, comm=comm))
    return [_to_nd(o, t) for o, t in zip(outs, tensors)]


def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across ranks and return this rank's rows of the result
    (``n // size`` rows, one more on the first ``n % size`` ranks)."""
    return _reducescatter([tensor], op, name, process_set, prescale_factor, postscale_factor)[0]


def grouped_reducescatter(tensors, op=Average, name=None, priority=0,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """``reducescatter`` of each tensor of a list, as one collective."""
    if not tensors:
        return []
    return _reducescatter(list(tensors), op, name, process_set, prescale_factor, postscale_factor)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return ``obj`` of ``root_rank`` on every rank (pickle).

    Unpickling runs code chosen by the sender: use it only between the trusted
    processes of one job.
    """
    comm = _comm_of(process_set)
    root = _root_in(process_set, root_rank)
    if isinstance(root, _coll.InvalidInput):      # every rank raises, none waits
        _wait(_coll.refuse_async("broadcast", root.error, comm))
    return _as_mxnet_errors(_coll.broadcast_object, obj, root, name=name, comm=comm)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Return the list of every rank's ``obj`` in rank order (pickle: trusted peers only)."""
    comm = _comm_of(process_set)
    return _as_mxnet_errors(_coll.allgather_object, obj, name=name, comm=comm)
