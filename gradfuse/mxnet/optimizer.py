"""Distributed training: ``DistributedOptimizer`` (wraps an MXNet optimizer) and
``DistributedTrainer`` (a ``gluon.Trainer``), both averaging gradients through
``_Reducer`` (``gradfuse.mxnet.reducer``: fused, in place, optionally bucket by bucket
overlapping backward).
"""
import contextlib
import os
import warnings
from collections import OrderedDict

import mxnet as mx

from ..compressors import checkpoint as _ckpt
from ..compressors.policy import rename
from ..errors import GradfuseError
from .basics import global_process_set, rank
from . import momentum as _momentum
from .adam import AdamCorrection
from .compression import Compression
from .reducer import _Reducer, split_list  # noqa: F401  (split_list: Horovod's name, re-exported)


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
            (other optimizers: ValueError), False keeps the optimizer's momentum (and turns
            the Adam correction off).
        adam_correction: the Adam correction (``DistributedTrainer``): None turns it on for
            ``adam`` and ``adamw`` with a lossy compressor that keeps error feedback, True
            forces it, False keeps the optimizer's Adam.
        **compressor_options: passed to the compressor.

    Aggregated updates (``optimizer.aggregate_num > 1``) are reduced in one fused
    call; names are the parameter indices, as Horovod's. With the correction each group of
    indices MXNet updates together has its own pipeline (its velocity), and pickling the
    optimizer (``Trainer.save_states``) keeps this rank's velocities: save it per rank.
    """

    _OWN = ("_optimizer", "_gradient_predivide_factor", "_num_groups", "_process_set", "_reducer",
            "_compress", "_compressor_options", "_corr", "_reducers", "_saved")

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0,
                 process_set=global_process_set, compress=None, momentum_correction=None,
                 adam_correction=None, **compressor_options):
        self.__dict__["_optimizer"] = optimizer
        self._gradient_predivide_factor = float(gradient_predivide_factor)
        self._num_groups = num_groups
        self._process_set = process_set
        self._reducer = None
        # the optimizer's correction: DGC's momentum correction or the Adam correction (or None)
        self._compress, self._compressor_options, self._corr = _momentum.setup(
            optimizer, compress, dict(compressor_options), momentum_correction, "DistributedOptimizer",
            adam_correction)
        self._reducers = {}          # with the correction: indices -> _Reducer (its velocity)
        self._saved = {}             # pickled velocities, loaded when their reducer is made

    _correction = property(lambda self: None if isinstance(self._corr, AdamCorrection) else self._corr,
                           doc="DGC's momentum correction, or None.")
    _adam_correction = property(lambda self: self._corr if isinstance(self._corr, AdamCorrection) else None,
                                doc="The Adam correction, or None.")

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
        # (keys are tuples of parameter indices: not keyword arguments)
        state["_saved"] = {**self._saved, **{k: r.state_dicts() for k, r in self._reducers.items()}}
        state["_reducers"] = {}
        return state

    def __setstate__(self, state):
        state.setdefault("_corr", state.pop("_correction", None))
        state.setdefault("_reducers", {})
        state.setdefault("_saved", {})
        self.__dict__.update(state)

    def _neutral(self):
        if self._corr is None or not self._process_set.included():
            return contextlib.nullcontext()
        return self._corr.neutral(self._optimizer)

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
                red._pipe(g).load_state_dict(sd, where=f"DistributedOptimizer's state of parameters {list(key)} "
                                                       f"(from Gluon's optimizer-state pickle)")
        self._corr.prepare(self._optimizer, idx, gs, ws)
        red.scale_velocity(self._corr.lr_factor(self._optimizer, idx, key))
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
        if self._corr is not None and self._process_set.included():
            self._corrected(index, weight, grad)
            with self._neutral():
                return self._optimizer.update(index, weight, grad, state)
        if self._process_set.included():
            self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        if self._corr is not None and self._process_set.included():
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


SIDE_FORMAT = "gradfuse.mxnet/2"
_OLD_SIDE = ((b"gradfuse.mxnet/1", "is a gradfuse.mxnet/1 side file: a pickle, written by an earlier gradfuse, which "
              "this gradfuse does not unpickle. Resume from a checkpoint saved by this version, or start the "
              "compressor state fresh by loading the optimizer part alone: "
              "gluon.Trainer.load_states(trainer, fname)"),)


def _sidecar(fname):
    return f"{fname}.gradfuse-rank{rank()}"


def _write_side(path, states, correction, size):
    """This rank's compressor state (one state dict per pipeline) as .npz, atomically, no pickle."""
    meta, arrays = {"format": SIDE_FORMAT, "rank": rank(), "world_size": size, "pipelines": []}, {}
    for g, sd in enumerate(states):
        m, a = _ckpt.pack(sd, prefix=f"p{g}/")
        meta["pipelines"].append(m)
        arrays.update(a)
    if correction is not None:
        # DGC's momentum correction: its last lr per group (keys as JSON lists of pairs)
        meta["correction"] = dict(correction, last_lr=[[k, v] for k, v in correction.get("last_lr", {}).items()])
    _ckpt.write_npz(path, meta, arrays)


def _read_side(path):
    """``(state dicts, correction state, where)`` of a side file; GradfuseError naming it when
    it is missing, empty, truncated, of another format or of an earlier one (refused by name)."""
    meta, z, where = _ckpt.read_npz(path, "gradfuse side file", _OLD_SIDE)
    with z:
        if meta.get("format") != SIDE_FORMAT:
            raise GradfuseError(f"gradfuse: {where} has format {meta.get('format')!r}; this gradfuse reads "
                                f"{SIDE_FORMAT!r}")
        try:
            states = [_ckpt.unpack(m, z, where, prefix=f"p{g}/") for g, m in enumerate(meta["pipelines"])]
        except GradfuseError:
            raise
        except _ckpt.READ_ERRORS as e:
            raise GradfuseError(f"gradfuse: {where} is truncated or corrupt ({type(e).__name__}: {e})") from None
    corr = meta.get("correction")
    if corr is not None:
        corr = dict(corr, last_lr={(tuple(k) if isinstance(k, list) else k): v for k, v in corr.get("last_lr", [])})
    return states, corr, where


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
            ValueError. False: the optimizer keeps its momentum (and the Adam correction is off).
        adam_correction: the Adam correction (docs/mxnet.md), for ``adam`` and ``adamw``.
            None (default): on with a lossy compressor that keeps error feedback: the
            pipeline keeps Adam's moments, warms up with exact Adam, then freezes ``v`` and
            compresses the first moment with error feedback; the optimizer applies the step
            (its lr, scheduler, lr_mult, wd and wd_mult as set). ``warmup_steps=`` (a
            compressor option) sets the freeze point; default: the adaptive rule. True: on
            for any compressor (also ``compress=None``: exact Adam); False: off.
        **compressor_options: passed to the compressor (e.g. ``ratio=0.01``).

    ``save_states(f)`` writes the optimizer state to ``f`` exactly as ``gluon.Trainer``
    does (a plain Trainer loads it), and, when the compressor keeps state (error
    feedback), each rank's compressor state to ``f + '.gradfuse-rank<r>'``.
    """

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0,
                 process_set=global_process_set, compress=None, fusion_threshold=None,
                 overlap=False, momentum_correction=None, adam_correction=None, **compressor_options):
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
        self._corr = None        # the optimizer's correction: DGC's momentum correction or the Adam correction
        if process_set.included() is not False:
            # a layer policy names parameters; the pipeline sees prefix + index
            compress = rename(compress, {self._prefix + str(i): p.name for i, p in enumerate(self._params)
                                         if p.grad_req != "null"})
            compress, compressor_options, self._corr = _momentum.setup(
                self._optimizer, compress, dict(compressor_options), momentum_correction, "DistributedTrainer",
                adam_correction)
            self._reducer = _Reducer(process_set, compress, compressor_options, fusion_threshold)

    _correction = property(lambda self: None if isinstance(self._corr, AdamCorrection) else self._corr,
                           doc="DGC's momentum correction, or None.")
    _adam_correction = property(lambda self: self._corr if isinstance(self._corr, AdamCorrection) else None,
                                doc="The Adam correction, or None.")

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
        if self._corr is not None:        # the velocity lives here, on one rank too
            idx = [i for i, p in enumerate(self._params) if p.grad_req != "null"]
            grads, names = self._grads()
            self._corr.prepare(self._optimizer, idx, grads,
                                     [self._params[i].list_data()[0] for i in idx])
            self._reducer.scale_velocity(self._corr.lr_factor(self._optimizer, idx))
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
        if self._corr is not None:
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
        if self._corr is not None and reduced is not None and self._scale / batch_size != reduced:
            raise ValueError(
                f"DistributedTrainer.update({batch_size}): allreduce_grads() folded rescale_grad "
                f"{reduced!r} into the velocity, and batch_size {batch_size} asks for "
                f"{self._scale / batch_size!r}: pass both calls the same batch size (the reduced "
                f"step is still pending: update() with allreduce_grads()'s batch size applies it)")
        self._reduced_scale = None
        super().update(batch_size, ignore_stale_grad)

    def _update(self, ignore_stale_grad=False):
        if self._corr is None:
            return super()._update(ignore_stale_grad)
        # momentum, wd, clipping and rescaling are in the velocity: the optimizer steps by lr * it
        with self._corr.neutral(self._optimizer):
            return super()._update(ignore_stale_grad)

    def _keeps_state(self):
        """Whether this trainer's pipelines keep state that a resume needs (a lossy
        compressor's residuals, or a correction's velocity or moments)."""
        return self._reducer is not None and (self._corr is not None or not self.pipeline.policy.lossless)

    def save_states(self, fname):
        """Save the optimizer state (gluon's format, to ``fname``) and this rank's compressor
        state (``fname + '.gradfuse-rank<r>'``: .npz, no pickle, written atomically after the
        steps in flight)."""
        super().save_states(fname)
        if self._reducer is not None:
            corr = self._corr.state() if self._corr is not None else None
            _write_side(_sidecar(fname), self._reducer.state_dicts(), corr, self._process_set.size())

    def load_states(self, fname, on_mismatch="raise"):
        """Load what ``save_states`` wrote: the optimizer state and this rank's compressor
        state. When the trainer keeps compressor state, its side file must be there (a
        GradfuseError names it otherwise); it is read and checked before anything is loaded.
        ``on_mismatch``: as ``Pipeline.load_state_dict`` (``"reset"``: start the compressor
        state fresh when it does not fit)."""
        side, saved = _sidecar(fname), None
        if self._reducer is not None:
            if os.path.exists(side):
                saved = _read_side(side)
            elif self._keeps_state():
                raise GradfuseError(
                    f"gradfuse: the compressor state of rank {rank()} is missing: {side!r} does not exist. "
                    f"DistributedTrainer.save_states({fname!r}) writes it beside the optimizer state (each "
                    f"rank its own), and this trainer's residuals and velocities are in it; copy it with "
                    f"{fname!r}, or, to resume with a fresh compressor state, load the optimizer part alone: "
                    f"gluon.Trainer.load_states(trainer, {fname!r})")
        if saved is not None:
            states, corr, where = saved
            self._reducer.synchronize()
            for g, state in enumerate(states):          # refused here, before anything is loaded
                self._reducer._pipe(g).load_state_dict(state, on_mismatch, where, check_only=True)
        super().load_states(fname)
        if saved is not None:
            for g, state in enumerate(states):
                self._reducer._pipe(g).load_state_dict(state, on_mismatch, where)
            if self._corr is not None:
                self._corr.load(corr)
