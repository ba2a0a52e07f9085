"""Horovod's op set on gradfuse: allreduce (blocking, grouped, async with handles),
broadcast, allgather, alltoall, reducescatter, the object collectives,
``broadcast_parameters``, and Horovod's op codes (Average, Sum, ...).

Every collective is handed to MXNet's engine and returns at once (``handoff``): the
outputs are NDArrays whose MXNet operations wait for the result, as with Horovod.
Sum (and Average where it is exact: a power-of-two number of ranks) goes through
``gradfuse.Pipeline`` (fused); other ops and scale factors through
``gradfuse.collectives``. Blocking-style collectives are matched by call order, async
allreduces by name (``gradfuse.runtime.matching``).
"""
import itertools
import types
import warnings

import mxnet as mx
import numpy as np

from .. import collectives as _coll
from ..runtime import context as _runtime
from ..runtime import matching as _matching
from . import handoff, jobs
from .basics import _comm_of, _ranks_of, _require_init, _span, global_process_set, size
from .errors import _as_mxnet_errors, _wait

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


_name_cache = {}


def _group_names(name, n):
    """The names of a named group's tensors (``name.0``, ``name.1``, ...), as a tuple kept for
    the next call of the same group: 2000 f-strings a call are a good part of a call's own
    cost, and ``fusion.tables.flatten`` checks a tuple it has seen before only once."""
    if name is None:
        return None
    if n == 1:
        return [str(name)]
    key = (name, n)
    got = _name_cache.get(key)
    if got is None:
        if len(_name_cache) >= 256:
            _name_cache.clear()
        got = _name_cache[key] = tuple(f"{name}.{i}" for i in range(n))
    return got


class AsyncHandle:
    """A collective in flight: ``wait()`` (or ``synchronize(handle)``) returns its result
    once every rank has taken part, or raises its error; ``done()`` (or ``poll(handle)``)
    never blocks.

    Its outputs are written through MXNet's engine: MXNet operations on them
    (``asnumpy()``, ``x * 2``, an optimizer update) wait for the result without ``wait()``,
    as with Horovod's engine operations.
    """

    __slots__ = ("_handle", "_result")

    def __init__(self, handle, result):
        self._handle, self._result = handle, result

    def done(self):
        """True once the collective has finished (never blocks), as ``poll(handle)``."""
        return self._handle.done()

    def wait(self):
        """Block until the collective has finished; return its result or raise its error
        (as ``synchronize(handle)``)."""
        try:
            _wait(self._handle)
        except BaseException:
            _consume(self._result)      # raised here: MXNet need not rethrow it again later
            raise
        return self._result


def _consume(result):
    """MXNet keeps a failed operation's error for the next wait on its outputs (or
    ``waitall``, or its shutdown): once ``wait()`` has raised it, take MXNet's copy."""
    for nd in (result if isinstance(result, (list, tuple)) else [result]):
        if isinstance(nd, mx.nd.NDArray):
            try:
                nd.wait_to_read()
            except mx.base.MXNetError:
                pass
            except (TypeError, ValueError):     # the binding's classes that are not MXNetErrors
                pass


def _names(ctx, op, name, n, group):
    """The tensors' names, fixed at call time (auto-named calls are numbered in call order)."""
    if name is not None:
        return _group_names(name, n) if group else [str(name)]
    return _coll._names(op, None, n, ctx)


def _allreduce(tensors, inplace, average, name, prescale_factor, postscale_factor,
               process_set, op, group):
    comm = _comm_of(process_set)
    ctx = _runtime.context(comm)
    try:
        op = _resolve_op(op, average)
    except (ValueError, NotImplementedError) as exc:
        jobs.refuse("allreduce", exc, comm)        # raised on every rank, not just here
    tensors = list(tensors)
    names = _names(ctx, "allreduce", name, len(tensors), group)
    bad = handoff.not_ndarrays(tensors, names)
    if bad is not None:
        jobs.refuse("allreduce", bad, comm)
    outs = None if inplace else [handoff.empty_like(t) for t in tensors]
    with _span("allreduce", names[0]):
        jobs.allreduce(ctx, comm, tensors, outs, _OP_NAMES[op], names, prescale_factor, postscale_factor)
    return tensors if inplace else outs


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
    tensors = list(tensors)
    names = _group_names(name, len(tensors)) if group else [name]
    bad = handoff.not_ndarrays(tensors, names)
    if bad is not None:
        return _coll.refuse_async("allreduce", bad, comm), tensors
    outs = None if inplace else [handoff.empty_like(t) for t in tensors]
    handle = _matching.MatchedHandle(name)
    jobs.matched_allreduce(ctx, comm, _matching.matcher(ctx), handle, tensors, outs, _OP_NAMES[op], names,
                           prescale_factor, postscale_factor)
    return handle, (tensors if inplace else outs)


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
    ctx = _runtime.context(comm)
    root = _root_in(process_set, root_rank)
    if isinstance(root, _coll.InvalidInput):
        jobs.refuse("broadcast", root.error, comm)      # raised on every rank
    names = names or _coll._names("broadcast", None, len(tensors), ctx)
    with _span("broadcast", names[0]):
        jobs.broadcast(ctx, comm, tensors, root, names)
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
    ctx = _runtime.context(comm)
    names = _names(ctx, "allgather", name, len(tensors), True)
    with _span("allgather", names[0]):
        return jobs.allgather(ctx, comm, list(tensors), names)


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
    (an int32 NDArray), as Horovod does. The other ranks' splits are needed to size the
    output: they are exchanged at call time (a short blocking round), the rows then
    move through MXNet's engine.
    """
    comm = _comm_of(process_set)
    ctx = _runtime.context(comm)
    name = _names(ctx, "alltoall", name, 1, False)[0]
    if splits is not None and isinstance(splits, mx.nd.NDArray):
        splits = splits.asnumpy()
    with _span("alltoall", name):
        result, recv = jobs.alltoall(ctx, comm, tensor, splits, name)
    if splits is None:
        return result
    return result, recv


def _reducescatter(tensors, op, name, process_set, prescale_factor, postscale_factor):
    comm = _comm_of(process_set)
    ctx = _runtime.context(comm)
    if op not in (Average, Sum):
        jobs.refuse("reducescatter", ValueError(f"reducescatter supports op=Average or Sum, got {op!r}"), comm)
    names = _names(ctx, "reducescatter", name, len(tensors), True)
    with _span("reducescatter", names[0]):
        return jobs.reducescatter(ctx, comm, list(tensors), _OP_NAMES[op], names, prescale_factor,
                                  postscale_factor)


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
    """Return ``obj`` of ``root_rank`` on every rank (cloudpickle; trusted peers only).

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
