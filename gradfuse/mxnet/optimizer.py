"""Distributed training: ``DistributedOptimizer`` (wraps an MXNet optimizer) and
``DistributedTrainer`` (a ``gluon.Trainer``), both averaging gradients through
``_Reducer`` (fused, in place, optionally bucket by bucket overlapping backward).
"""
import contextlib
import os
import pickle
import warnings
from collections import OrderedDict

import mxnet as mx
import numpy as np

from .. import collectives as _coll
from ..compressors.policy import rename
from ..pipeline import Pipeline
from .arrays import _view
from .basics import _comm_of, _span, global_process_set, rank
from . import momentum as _momentum
from .compression import Compression, NoneCompressor
from .errors import _wait


def split_list(l, n):
    """Split ``l`` into ``n`` nearly equal consecutive parts (Horovod's helper)."""
    d, r = divmod(len(l), n)
    return [l[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def _scale_nd(tensors, factor):
    if factor != 1.0:
        for t in tensors:
            t *= factor


class _Reducer:
    """Fused, in-place gradient averaging of NDArrays for one process set.

    Without overlap the gradients go in one fused call (or ``num_groups`` calls). With
    overlap they are cut into buckets of at most ``fusion_threshold`` bytes in reverse
    parameter order (backward writes the last layers' gradients first); each bucket is
    submitted as soon as MXNet has written its gradients, so the communication thread
    reduces it while MXNet's engine still computes the earlier layers' gradients.
    Each bucket position has its own ``Pipeline`` (plan cache, compressor state).
    """

    def __init__(self, process_set, compress, compressor_options, fusion_threshold=None):
        self.process_set = process_set
        self.comm = _comm_of(process_set)
        self._config = dict(compress=compress, average=True, comm=self.comm,
                            fusion_threshold=fusion_threshold, **compressor_options)
        self.pipelines = [Pipeline(**self._config)]

    @property
    def pipeline(self):
        return self.pipelines[0]

    def _pipe(self, g):
        while len(self.pipelines) <= g:
            self.pipelines.append(Pipeline(**self._config))
        return self.pipelines[g]

    def stats(self):
        """The counters of all bucket pipelines, summed."""
        from ..step import Stats
        total = Stats()
        for p in self.pipelines:
            for f in Stats.FIELDS:
                setattr(total, f, getattr(total, f) + getattr(p.stats, f))
        return total

    def _groups(self, sent, num_groups, overlap):
        idx = list(range(len(sent)))
        if overlap:
            limit = self.pipeline.fusion_threshold
            buckets, cur, nbytes = [], [], 0
            for i in reversed(idx):
                b = int(np.prod(sent[i].shape)) * np.dtype(sent[i].dtype).itemsize
                if cur and nbytes + b > limit:
                    buckets.append(cur)
                    cur, nbytes = [], 0
                cur.append(i)
                nbytes += b
            return buckets + ([cur] if cur else [])
        if num_groups > 0:
            return [g for g in split_list(idx, num_groups) if g]
        return [idx]

    def reduce_(self, grads, names, num_groups=0, compression=NoneCompressor,
                predivide=1.0, overlap=False):
        """Average ``grads`` (NDArrays) across the process set, in place."""
        if not grads:
            return
        if compression is not NoneCompressor:
            sent, ctxs = zip(*(compression.compress(g) for g in grads))
            sent = list(sent)
        else:
            sent, ctxs = grads, None
        _scale_nd(sent, 1.0 / predivide)
        handles = []
        with _span("allreduce", names[0]):
            for g, idx in enumerate(self._groups(sent, num_groups, overlap)):
                # zero-copy views of the NDArrays (each waits until MXNet has written
                # that gradient): the pipeline reads them and writes the results
                # straight into their memory (out=part)
                part = [_view(sent[i], names[i], device_ok=True) for i in idx]
                bad = [p for p in part if isinstance(p, _coll.InvalidInput)]
                if bad:     # every rank raises: the others learn it in the negotiation
                    handles.append(_coll.refuse_async("allreduce", bad[0].error, self.comm))
                    continue
                handles.append(self._pipe(g).allreduce_async(part, out=part,
                                                             names=[names[i] for i in idx]))
            for h in handles:
                _wait(h)
        _scale_nd(sent, predivide)
        if ctxs is not None:
            for g, s, c in zip(grads, sent, ctxs):
                g[:] = compression.decompress(s, c)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wrap an MXNet optimizer so that every update first averages the gradients.

    Args:
        optimizer: the ``mx.optimizer.Optimizer`` to wrap (its attributes stay
            reachable through the wrapper).
        gradient_predivide_factor: gradients are multiplied by
            ``1 / gradient_predivide_factor`` before the sum and by
            ``gradient_predivide_factor / size`` after it (the average overall).
        num_groups: split each aggregated update into this many allreduce calls
            (0: one fused call).
        process_set: the ranks that average together.
        compress: a gradfuse compressor (as ``DistributedTrainer``'s; default none).
        momentum_correction: DGC's momentum correction (``DistributedTrainer``): None turns
            it on for SGD and NAG with momentum and a lossy compressor, True forces it
            (other optimizers: ValueError), False keeps the optimizer's momentum.
        **compressor_options: passed to the compressor.

    Aggregated updates (``optimizer.aggregate_num > 1``) are reduced in one fused
    call; names are the parameter indices, as Horovod's. With the correction each group of
    indices MXNet updates together has its own pipeline (its velocity), and pickling the
    optimizer (``Trainer.save_states``) keeps this rank's velocities: save it per rank.
    """

    _OWN = ("_optimizer", "_gradient_predivide_factor", "_num_groups", "_process_set", "_reducer",
            "_compress", "_compressor_options", "_correction", "_reducers", "_saved")

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0,
                 process_set=global_process_set, compress=None, momentum_correction=None,
                 **compressor_options):
        self.__dict__["_optimizer"] = optimizer
        self._gradient_predivide_factor = float(gradient_predivide_factor)
        self._num_groups = num_groups
        self._process_set = process_set
        self._reducer = None
        self._compress, self._compressor_options, self._correction = _momentum.setup(
            optimizer, compress, dict(compressor_options), momentum_correction, "DistributedOptimizer")
        self._reducers = {}          # with the correction: indices -> _Reducer (its velocity)
        self._saved = {}             # pickled velocities, loaded when their reducer is made

    def __getattr__(self, item):
        if item.startswith("__") or item == "_optimizer":
            raise AttributeError(item)
        return getattr(self.__dict__["_optimizer"], item)

    def __setattr__(self, name, value):
        # Gluon's Trainer sets rescale_grad (every step) and param_dict on the optimizer
        # it holds: they belong to the wrapped optimizer, which does the update.
        if name in self._OWN:
            self.__dict__[name] = value
        else:
            setattr(self._optimizer, name, value)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_reducer"] = None          # a communicator does not pickle
        # this rank's velocities (numpy state dicts) travel; the reducers are made again
        state["_saved"] = dict(self._saved, **{k: [p.state_dict() for p in r.pipelines]
                                               for k, r in self._reducers.items()})
        state["_reducers"] = {}
        return state

    def __setstate__(self, state):
        state.setdefault("_correction", None)
        state.setdefault("_reducers", {})
        state.setdefault("_saved", {})
        self.__dict__.update(state)

    def _neutral(self):
        if self._correction is None or not self._process_set.included():
            return contextlib.nullcontext()
        return self._correction.neutral(self._optimizer)

    def create_state(self, index, weight):
        with self._neutral():
            return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        with self._neutral():
            return self._optimizer.create_state_multi_precision(index, weight)

    def _corrected(self, index, weight, grad):
        """The momentum correction's half of an update: d, the velocity, the exchange."""
        idx = list(index) if isinstance(index, (tuple, list)) else [index]
        ws = list(weight) if isinstance(index, (tuple, list)) else [weight]
        gs = list(grad) if isinstance(index, (tuple, list)) else [grad]
        key = tuple(idx)
        red = self._reducers.get(key)
        if red is None:
            red = self._reducers[key] = _Reducer(self._process_set, self._compress, self._compressor_options)
            for g, sd in enumerate(self._saved.pop(key, [])):
                red._pipe(g).load_state_dict(sd)
        self._correction.prepare(self._optimizer, idx, gs, ws)
        f = self._correction.lr_factor(self._optimizer, idx, key)
        for p in red.pipelines:
            p.state.scale_velocity(f)
        red.reduce_(gs, [str(i) for i in idx], self._num_groups, predivide=self._gradient_predivide_factor)

    def _do_allreduce(self, index, grad):
        if self._process_set.size() == 1:
            return
        if self._reducer is None:
            self._reducer = _Reducer(self._process_set, self._compress, self._compressor_options)
        if isinstance(index, (tuple, list)):
            self._reducer.reduce_(list(grad), [str(i) for i in index], self._num_groups,
                                  predivide=self._gradient_predivide_factor)
        else:
            self._reducer.reduce_([grad], [str(index)], predivide=self._gradient_predivide_factor)

    def update(self, index, weight, grad, state):
        if self._correction is not None and self._process_set.included():
            self._corrected(index, weight, grad)
            with self._neutral():
                return self._optimizer.update(index, weight, grad, state)
        if self._process_set.included():
            self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        if self._correction is not None and self._process_set.included():
            self._corrected(index, weight, grad)
            with self._neutral():
                return self._optimizer.update_multi_precision(index, weight, grad, state)
        if self._process_set.included():
            self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)


def _sidecar(fname):
    return f"{fname}.gradfuse-rank{rank()}"


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` that averages gradients across ranks with gradfuse.

    ``step(batch_size)``: pass each rank's own batch size. The gradients are averaged
    over the ranks (one fused, in-place allreduce per step, or ``num_groups`` of them),
    then scaled by ``1 / batch_size``: with a summed loss this is the gradient of the
    mean loss over the global batch, the same update as one process stepping on all
    ranks' samples with ``step(size() * batch_size)``.

    Args:
        params, optimizer, optimizer_params: as ``gluon.Trainer`` (no kvstore).
        compression: Horovod's ``Compression.none`` or ``Compression.fp16``.
        gradient_predivide_factor: scale by ``1/f`` before the sum, ``f/size`` after.
        prefix: prepended to the tensor names (distinct trainers need distinct prefixes).
        num_groups: split the gradients into this many allreduce calls (0: one).
        process_set: the ranks that average together.
        compress: a gradfuse compressor name or instance (``'1bit'``, ``'topk'``, ...,
            whatever ``gradfuse.compressors.available()`` lists), with its error feedback;
            or a layer policy against the parameter names, first match wins, ``None``
            uncompressed: ``{"*_bias": None, "*batchnorm*": None, "*": "1bit"}``.
        min_elements: parameters with fewer elements go uncompressed (default 0: off).
        fusion_threshold: gradfuse's bucket size in bytes (default: the pipeline's).
        overlap: reduce bucket by bucket in reverse parameter order, each bucket as
            soon as backward has written its gradients, while the rest are computed.
        momentum_correction: DGC's momentum correction (docs/mxnet.md). None (default):
            on for SGD and NAG with momentum > 0 and a lossy compressor with error feedback
            (1bit, 2bit, topk, randomk): each rank keeps its velocity in the compressor
            state, error feedback accumulates it, and the optimizer runs without momentum.
            True: on for any compressor (also ``compress=None``); other optimizers raise
            ValueError. False: the optimizer keeps its momentum.
        **compressor_options: passed to the compressor (e.g. ``ratio=0.01``).

    ``save_states(f)`` writes the optimizer state to ``f`` exactly as ``gluon.Trainer``
    does (a plain Trainer loads it), and, when the compressor keeps state (error
    feedback), each rank's compressor state to ``f + '.gradfuse-rank<r>'``.
    """

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0,
                 process_set=global_process_set, compress=None, fusion_threshold=None,
                 overlap=False, momentum_correction=None, **compressor_options):
        self._overlap = bool(overlap)
        self._compression = compression
        self._process_set = process_set
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take DistributedOptimizer "
                          "as its optimizer. We have unwrapped it for you.")
        if compress not in (None, "none") and compression is not Compression.none:
            raise ValueError("pass either compression= (Horovod's) or compress= (gradfuse's), not both")
        if isinstance(params, dict):
            params = OrderedDict(params)
        elif isinstance(params, (list, tuple)):
            params = sorted(params, key=lambda p: p.name)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        assert prefix is None or isinstance(prefix, str)
        self._prefix = prefix or ""
        self._num_groups = num_groups
        self._gradient_predivide_factor = float(gradient_predivide_factor)
        self._reducer = None
        self._correction = None
        if process_set.included() is not False:
            # a layer policy names parameters; the pipeline sees prefix + index
            compress = rename(compress, {self._prefix + str(i): p.name for i, p in enumerate(self._params)
                                         if p.grad_req != "null"})
            compress, compressor_options, self._correction = _momentum.setup(
                self._optimizer, compress, dict(compressor_options), momentum_correction, "DistributedTrainer")
            self._reducer = _Reducer(process_set, compress, compressor_options, fusion_threshold)

    @property
    def pipeline(self):
        """The (first) ``gradfuse.Pipeline`` that reduces this trainer's gradients."""
        return self._reducer.pipeline if self._reducer is not None else None

    @property
    def stats(self):
        """Counters of every pipeline of this trainer, summed (a ``gradfuse`` Stats)."""
        return self._reducer.stats() if self._reducer is not None else None

    def _grads(self):
        grads, names = [], []
        for i, param in enumerate(self._params):
            if param.grad_req != "null":
                grads.append(param.list_grad()[0])
                names.append(self._prefix + str(i))
        return grads, names

    def _allreduce_grads(self):
        if self._correction is not None:        # the velocity lives here, on one rank too
            idx = [i for i, p in enumerate(self._params) if p.grad_req != "null"]
            grads, names = self._grads()
            self._correction.prepare(self._optimizer, idx, grads,
                                     [self._params[i].list_data()[0] for i in idx])
            f = self._correction.lr_factor(self._optimizer, idx)
            for p in self._reducer.pipelines:
                p.state.scale_velocity(f)
            self._reducer.reduce_(grads, names, self._num_groups, self._compression,
                                  self._gradient_predivide_factor, overlap=self._overlap)
            return
        if self._process_set.size() == 1 or not self._process_set.included():
            return
        grads, names = self._grads()
        self._reducer.reduce_(grads, names, self._num_groups, self._compression,
                              self._gradient_predivide_factor, overlap=self._overlap)

    def _update(self, ignore_stale_grad=False):
        if self._correction is None:
            return super()._update(ignore_stale_grad)
        # momentum, wd, clipping and rescaling are in the velocity: the optimizer steps by lr * it
        with self._correction.neutral(self._optimizer):
            return super()._update(ignore_stale_grad)

    def save_states(self, fname):
        """Save the optimizer state (gluon's format) and this rank's compressor state."""
        super().save_states(fname)
        pipes = self._reducer.pipelines if self._reducer is not None else []
        if pipes and all(hasattr(p, "state_dict") for p in pipes):
            side = {"format": "gradfuse.mxnet/1", "rank": rank(), "pipelines": [p.state_dict() for p in pipes]}
            if self._correction is not None:
                side["momentum_correction"] = self._correction.state()      # the last lr (velocity scale)
            with open(_sidecar(fname), "wb") as f:
                pickle.dump(side, f, protocol=pickle.HIGHEST_PROTOCOL)

    def load_states(self, fname):
        """Load what ``save_states`` wrote (the compressor part only if it exists)."""
        super().load_states(fname)
        side = _sidecar(fname)
        if self._reducer is not None and os.path.exists(side):
            with open(side, "rb") as f:
                saved = pickle.load(f)
            for g, state in enumerate(saved["pipelines"]):
                self._reducer._pipe(g).load_state_dict(state)
            if self._correction is not None:
                self._correction.load(saved.get("momentum_correction"))

