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
from ..runtime import context as _runtime
from . import handoff
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
        self._inflight = []          # the handles of the last reduce_'s groups

    @property
    def pipeline(self):
        return self.pipelines[0]

    def _pipe(self, g):
        while len(self.pipelines) <= g:
            self.pipelines.append(Pipeline(**self._config))
        return self.pipelines[g]

    def stats(self):
        """The counters of all bucket pipelines, summed (after the groups in flight)."""
        from ..step.stats import Stats
        self.synchronize()
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
        """Average ``grads`` (NDArrays) across the process set, in place.

        Each group (one, ``num_groups``, or the overlap buckets) is one operation in
        MXNet's engine (``handoff.reduce_group``), so this returns at once: MXNet starts a
        group when backward has written its gradients, and the optimizer's update (any
        MXNet operation on them) waits for its result. A failed group's error is
        rethrown by MXNet there; the other groups keep their gradients locked in MXNet's
        engine until their own writes are done, so no later operation (the next backward)
        sees them half written.
        """
        if not grads:
            return
        if compression is not NoneCompressor:
            sent, ctxs = zip(*(compression.compress(g) for g in grads))
            sent = list(sent)
        else:
            sent, ctxs = grads, None
        _scale_nd(sent, 1.0 / predivide)
        handles = []
        try:
            with _span("allreduce", names[0]):
                groups = self._groups(sent, num_groups, overlap)
                for g, idx in enumerate(groups):
                    part, part_names = [sent[i] for i in idx], [names[i] for i in idx]
                    try:
                        h = handoff.reduce_group(self._pipe(g), part, part_names)
                        if h is None:        # GPU arrays: through their DLPack views, waited for here
                            h = self._device_group(self._pipe(g), part, part_names)
                    except Exception as exc:
                        self._refuse_rest(groups[g + 1:], names, exc)
                        raise
                    handles.append(h)
        finally:
            self._inflight = handles
            _scale_nd(sent, predivide)       # an MXNet operation: after the reductions
        if ctxs is not None:
            for g, s, c in zip(grads, sent, ctxs):
                g[:] = compression.decompress(s, c)

    def _refuse_rest(self, groups, names, exc):
        """A group failed on this rank (its own check, after its earlier groups were queued):
        refuse the groups after it too, so that the other ranks' requests for them are
        answered, by an error, instead of pairing with this rank's next collective."""
        refusals = [_coll.refuse_async("allreduce", ValueError(
            f"tensor {names[idx[0]]!r}: not reduced, an earlier group of the same call failed: {exc}"), self.comm)
            for idx in groups]
        for h in refusals:       # each raises this rank's own refusal: already reported by ``exc``
            try:
                h.wait()
            except Exception:
                pass

    def _device_group(self, pipe, part, part_names):
        views = [_view(t, n, device_ok=True) for t, n in zip(part, part_names)]
        bad = [v for v in views if isinstance(v, _coll.InvalidInput)]
        if bad:     # every rank raises: the others learn it in the negotiation
            _wait(_coll.refuse_async("allreduce", bad[0].error, self.comm))
        h = pipe.allreduce_async(views, out=views, names=part_names)
        _wait(h)
        return h

    def synchronize(self):
        """Wait until the groups in flight have finished (their errors went to MXNet)."""
        handles, self._inflight = self._inflight, []
        for h in handles:
            try:
                h.wait()
            except Exception:
                pass

    def scale_velocity(self, factor):
        """``CompressionState.scale_velocity`` of every pipeline, between two steps: queued
        on the communication thread, after the step in flight."""
        if factor == 1.0:
            return
        pipes = list(self.pipelines)
        _runtime.context(self.comm).engine.submit(
            lambda: [p.state.scale_velocity(factor) for p in pipes], "scale_velocity")

    def state_dicts(self):
        self.synchronize()
        return [p.state_dict() for p in self.pipelines]


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
        state["_saved"] = dict(self._saved, **{k: r.state_dicts() for k, r in self._reducers.items()})
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
        red.scale_velocity(self._correction.lr_factor(self._optimizer, idx, key))
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
        # several contexts per worker (ctx=[cpu(0), cpu(1)]): the first device's gradient
        # takes the sum of the others', is reduced, and is copied back (MXNet's engine
        # orders the copies after the reduction)
        multi = [p.list_grad() for p in self._params if p.grad_req != "null" and len(p.list_grad()) > 1]
        for gs in multi:
            for g in gs[1:]:
                gs[0] += g.as_in_context(gs[0].context)
        self._allreduce_first_device()
        for gs in multi:
            for g in gs[1:]:
                gs[0].copyto(g)

    def _allreduce_first_device(self):
        if self._correction is not None:        # the velocity lives here, on one rank too
            idx = [i for i, p in enumerate(self._params) if p.grad_req != "null"]
            grads, names = self._grads()
            self._correction.prepare(self._optimizer, idx, grads,
                                     [self._params[i].list_data()[0] for i in idx])
            self._reducer.scale_velocity(self._correction.lr_factor(self._optimizer, idx))
            self._reducer.reduce_(grads, names, self._num_groups, self._compression,
                                  self._gradient_predivide_factor, overlap=self._overlap)
            return
        if self._process_set.size() == 1 or not self._process_set.included():
            return
        grads, names = self._grads()
        self._reducer.reduce_(grads, names, self._num_groups, self._compression,
                              self._gradient_predivide_factor, overlap=self._overlap)

    def allreduce_grads(self, batch_size=None):
        """Gluon's ``allreduce_grads()``, for code that changes the reduced gradients before
        ``update(batch_size)`` (e.g. ``gluon.utils.clip_global_norm``).

        With the momentum correction on, the exchange itself folds ``1 / batch_size``
        (MXNet's ``rescale_grad``), ``wd`` and ``clip_gradient`` into each rank's velocity,
        so it needs the batch size before it runs: pass ``batch_size`` here, and the same
        to ``update``. Without the correction, ``batch_size`` is not needed (``update``
        rescales, as in Gluon)."""
        if self._correction is not None:
            if batch_size is None:
                raise ValueError(
                    "DistributedTrainer.allreduce_grads(): the momentum correction is on, and it folds "
                    "1/batch_size (rescale_grad), wd and clipping into the velocity during the exchange, so "
                    "the batch size is needed now: call allreduce_grads(batch_size) and then "
                    "update(batch_size) with the same value, or step(batch_size) (or build the trainer "
                    "with momentum_correction=False)")
            self._check_and_rescale_grad(self._scale / batch_size)
            self._reduced_scale = self._optimizer.rescale_grad
        super().allreduce_grads()

    def update(self, batch_size, ignore_stale_grad=False):
        """Gluon's ``update(batch_size)``; with the momentum correction on, ``batch_size``
        must be the one given to ``allreduce_grads`` (the velocity already holds it)."""
        reduced = getattr(self, "_reduced_scale", None)
        if self._correction is not None and reduced is not None and self._scale / batch_size != reduced:
            raise ValueError(
                f"DistributedTrainer.update({batch_size}): allreduce_grads() folded rescale_grad "
                f"{reduced!r} into the velocity, and batch_size {batch_size} asks for "
                f"{self._scale / batch_size!r}: pass both calls the same batch size (the reduced "
                f"step is still pending: update() with allreduce_grads()'s batch size applies it)")
        self._reduced_scale = None
        super().update(batch_size, ignore_stale_grad)

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
            side = {"format": "gradfuse.mxnet/1", "rank": rank(), "pipelines": self._reducer.state_dicts()}
            if self._correction is not None:
                side["momentum_correction"] = self._correction.state()      # the last lr (velocity scale)
            with open(_sidecar(fname), "wb") as f:
                pickle.dump(side, f, protocol=pickle.HIGHEST_PROTOCOL)

    def load_states(self, fname):
        """Load what ``save_states`` wrote (the compressor part only if it exists)."""
        super().load_states(fname)
        side = _sidecar(fname)
        if self._reducer is not None and os.path.exists(side):
            self._reducer.synchronize()
            with open(side, "rb") as f:
                saved = pickle.load(f)
            for g, state in enumerate(saved["pipelines"]):
                self._reducer._pipe(g).load_state_dict(state)
            if self._correction is not None:
                self._correction.load(saved.get("momentum_correction"))

