"""The ``dist_gradfuse`` KVStore: MPI allreduce for ``gluon.Trainer`` and ``mx.mod.Module``
through MXNet's KVStore interface, registered with MXNet when this module is imported."""
import sys

import mxnet as mx

from .. import collectives as _coll
from ..compressors import checkpoint as _ckpt
from ..compressors.adam import pipeline_adam
from ..compressors.momentum import pipeline_momentum
from ..compressors.policy import is_policy, rename
from ..pipeline import Pipeline
from . import handoff
from .arrays import _view
from .basics import _comm_of, _ranks_of, _span, global_process_set, init, is_initialized, rank, size
from .errors import _wait
from .mpi_ops import _broadcast


class KVStore(mx.kvstore.KVStoreBase):
    """An MPI-allreduce KVStore, registered as ``'dist_gradfuse'``.

    ``gluon.Trainer(params, 'sgd', kvstore='dist_gradfuse')`` and
    ``mx.mod.Module(sym).fit(it, kvstore='dist_gradfuse')`` synchronise through it, and so
    does an instance: ``kvstore=gradfuse.mxnet.KVStore(compress='1bit')``. The name
    contains ``dist`` because MXNet 1.9.1's Trainer ignores a kvstore string without it on
    a single device.

    What MXNet hands a KVStore is taken as MXNet's own stores take it: a key or a list of
    keys; per key an NDArray or a list of NDArrays, one per device of this worker
    (``ctx=[mx.cpu(0), mx.cpu(1)]``), which ``push``/``pushpull`` sum before the ranks do;
    ``out`` an NDArray or a list (every device gets the result).

    ``pushpull`` **sums** across devices and ranks, as MXNet's ``dist_sync`` does
    (``average=True`` averages over the ranks instead). With the default sum,
    ``trainer.step(batch_size)`` must be given the global batch size (``size() *`` the
    per-rank batch) for the mean gradient. ``init`` and ``broadcast`` keep rank 0's value
    (of the process set) as the store's value of the key.

    **Where the optimizer runs.** ``gluon.Trainer`` keeps it (``is_capable('optimizer')``
    answers False to the Trainer, so its fast ``update_on_kvstore=False`` path runs),
    unless the Trainer asks for ``update_on_kvstore=True``. ``mx.mod.Module`` gets True,
    so, as with ``dist_sync``, the optimizer runs in the store (``set_optimizer``; a
    ``pushpull`` then sums the gradients, updates the store's weight identically on every
    rank and writes it to ``out``) unless ``MXNET_UPDATE_ON_KVSTORE=0``, where Module
    updates after each ``pushpull``. ``KVStore(update_on_kvstore=True)`` or ``False``
    answers the same to everyone. Module's ``rescale_grad`` is ``1/batch`` of this worker
    (MXNet multiplies the batch by the workers only for a type containing ``_sync``), so
    with the default sum give Module ``optimizer_params={'rescale_grad': 1 / (batch *
    size())}`` (or ``KVStore(average=True)``) for the mean gradient of the global batch.

    Fusion: the gradients of one ``pushpull`` call with a list of keys are reduced in
    one fused call. ``gluon.Trainer`` and Module call ``pushpull`` once per parameter: the
    store learns that key sequence in the first step (reducing each key at once), and from
    then on defers the keys of a pass (``Trainer._allreduce_grads``, Module's
    ``_update_params``/``_update_params_on_kvstore``) and reduces them all in one fused
    call at its last key, before the caller reads any result. Calls from anywhere else
    are handed over before ``pushpull`` returns.

    Every reduction is one operation in MXNet's engine, as for the hvd ops and
    DistributedTrainer (``handoff.reduce_group``): ``pushpull``/``push`` return at once and
    whatever reads the results (``wait_to_read``, ``asnumpy``, the optimizer's update)
    waits for them in MXNet's engine; an error of the collective is raised there, on every
    rank. GPU arrays are reduced through DLPack before the call returns.

    ``set_gradient_compression({'type': NAME, **options})`` selects a gradfuse
    compressor (Gluon's ``compression_params``).

    DGC's momentum correction: the store does not see the Trainer's optimizer, so it
    takes the momentum as a compressor option, ``KVStore(compress='1bit', momentum=0.9)``
    or ``{'type': '1bit', 'momentum': 0.9}``: each rank keeps its velocity of the raw
    gradients in the compressor state and the sum carries the velocities. Give the
    Trainer's optimizer ``momentum=0``: a Trainer whose optimizer still has momentum is
    refused at its first step (momentum applied twice diverges). The optimizer's wd,
    clipping and rescaling then act on the velocity sum (docs/mxnet.md).

    The Adam correction likewise: ``KVStore(compress='1bit', adam='adamw')`` (options
    ``betas``, ``eps``, ``warmup_steps``, as a compressor's; ``average`` is then on: Adam's
    moments are of the mean gradient). The store keeps Adam's moments and its results are
    Adam's steps; give the Trainer ``'sgd'`` (momentum 0): its learning rate, scheduler,
    ``lr_mult`` and weight decay apply the steps (the decay decoupled, AdamW's). The
    optimizer's ``rescale_grad`` is applied to the gradients before the moments and taken
    out of the steps again. A Trainer whose optimizer would apply Adam a second time (one
    with betas), that has momentum or ``clip_gradient`` (it would clip the steps), or that
    has weight decay with ``adam='adam'`` (MXNet's Adam couples it into the gradient, and the
    store does not see the weights), is refused at its first step.
    """

    def __init__(self, compress=None, process_set=global_process_set, average=False,
                 fusion_threshold=None, update_on_kvstore=None, **compressor_options):
        if not is_initialized():
            init()
        if update_on_kvstore not in (None, True, False):
            raise ValueError(f"update_on_kvstore must be None, True or False, got {update_on_kvstore!r}")
        self._process_set = process_set
        self._compress = compress
        self._options = dict(compressor_options)
        self._fusion_threshold = fusion_threshold
        self._average = bool(average)
        self._update_on_kvstore = update_on_kvstore
        if self._options.get("adam") is not None:
            self._average = True         # Adam's moments are of the mean gradient
        self._pipeline = None
        self._seq = None            # the learned key sequence of one pass
        self._learning = []
        self._pending = []          # (key, arrays, outs) deferred in this pass
        self._trainer_checked = False
        self._velocity = False      # the pipeline runs DGC's momentum correction
        self._adam_opt = None       # with the Adam correction: the caller's optimizer (its rescale_grad)
        self._store = {}            # key -> the store's value (rank 0's at init/broadcast)
        self._updater = None        # with set_optimizer: the optimizer's updater

    # --- what Trainer and Module ask --------------------------------------------------
    @property
    def type(self):
        return "dist_gradfuse"

    @property
    def rank(self):
        return self._process_set.rank() if self._process_set.process_set_id else rank()

    @property
    def num_workers(self):
        return self._process_set.size() if self._process_set.process_set_id else size()

    def is_capable(self, capability):
        """'optimizer': whether the optimizer may run in this store (see the class doc)."""
        if capability != mx.kvstore.KVStoreBase.OPTIMIZER:
            return False
        if self._update_on_kvstore is not None:
            return self._update_on_kvstore
        caller = sys._getframe(1)
        if caller.f_code is mx.model._create_kvstore.__code__:
            return True           # Module (gluon.Trainer ignores this answer and asks itself)
        if caller.f_code is mx.gluon.Trainer._init_kvstore.__code__:
            trainer = caller.f_locals.get("self")
            return getattr(trainer, "_kvstore_params", {}).get("update_on_kvstore") is True
        return False

    def set_optimizer(self, optimizer):
        """Run ``optimizer`` in the store: every ``pushpull``/``push`` then updates the
        store's weights (the same on every rank: same gradients, same optimizer)."""
        if self._update_on_kvstore is False:
            raise NotImplementedError("this dist_gradfuse store was made with update_on_kvstore=False")
        self._updater = mx.optimizer.get_updater(optimizer)

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Save the store's optimizer states (the same on every rank; call it on one)."""
        if self._updater is None:
            raise NotImplementedError("dist_gradfuse runs no optimizer here: the Trainer saves its states")
        states = self._updater.get_states(dump_optimizer)
        _ckpt.atomic_write(fname, lambda f: f.write(states))      # the old file or the whole new one

    def load_optimizer_states(self, fname):
        """Load what ``save_optimizer_states`` wrote (on every rank)."""
        if self._updater is None:
            raise NotImplementedError("dist_gradfuse runs no optimizer here: the Trainer loads its states")
        with open(fname, "rb") as f:
            self._updater.set_states(f.read())

    def set_gradient_compression(self, compression_params):
        """Select a gradfuse compressor: ``{'type': '1bit', **options}``."""
        if self._pipeline is not None:
            raise RuntimeError("set_gradient_compression must come before the first pushpull")
        params = dict(compression_params or {})
        self._compress = params.pop("type", None)
        self._options = params
        if params.get("adam") is not None:
            self._average = True

    @property
    def pipeline(self):
        """The ``gradfuse.Pipeline`` of this store (``.stats``)."""
        if self._pipeline is None:
            self._pipeline = Pipeline(compress=self._compress, average=self._average,
                                      comm=_comm_of(self._process_set),
                                      fusion_threshold=self._fusion_threshold, **self._options)
        return self._pipeline

    # --- data -------------------------------------------------------------------------
    def init(self, key, value):
        """Set the store's value of each key to rank 0's ``value`` (its first device's)."""
        keys, values, _ = _normalize(key, value, None)
        self._keep(keys, values)

    def broadcast(self, key, value, out, priority=0):
        """Write rank 0's ``value`` (of the process set) into ``out`` on every rank (and keep
        it as the store's value)."""
        keys, values, outs = _normalize(key, value, out)
        for k, o in zip(keys, outs):
            if o is None:
                raise ValueError(f"dist_gradfuse.broadcast: key {k!r}: no out given")
        # the store keeps the value only where an optimizer will update it
        for root_value, o in zip(self._keep(keys, values, keep=self._updater is not None), outs):
            for dst in o:
                dst[:] = root_value

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Copy the store's value of each key into ``out`` (every device)."""
        keys, _, outs = _normalize(key, out, out)
        for k, o in zip(keys, outs):
            if k not in self._store:
                raise KeyError(f"dist_gradfuse.pull: key {k!r} was never initialised (init or broadcast)")
            for dst in o:
                dst[:] = self._store[k]

    def push(self, key, value, priority=0):
        """Sum ``value`` over devices and ranks into the store: with an optimizer
        (``set_optimizer``) the store's weight is updated with the sum, else replaced by it."""
        keys, values, _ = _normalize(key, value, None)
        self._flush()
        self._reduce([(k, v, None) for k, v in zip(keys, values)], store=True)

    def pushpull(self, key, value, out=None, priority=0):
        """Sum ``value`` over devices and ranks into ``out`` (default: ``value``); with an
        optimizer, update the store's weight with the sum and write the weight to ``out``."""
        keys, values, outs = _normalize(key, value, out)
        entries = [(k, v, o if o is not None else v) for k, v, o in zip(keys, values, outs)]
        kind, caller = _caller()
        if kind is not None and not self._trainer_checked:
            self._check_caller(kind, caller)
        if kind is None or len(entries) != 1:
            self._flush()
            self._reduce(entries)
            return
        k = keys[0]
        if self._seq is None and not self._learning and self._velocity:
            # a velocity (or residual) is keyed by the fused call's plan: learning the sequence
            # from a first pass of one-key calls would start the fused plan from zero, so
            # take the sequence from the Trainer's parameters (its _allreduce_grads order)
            self._seq = _dense_keys(caller)
        if self._seq is None:
            if k in self._learning:             # a new pass began: the sequence is known
                self._seq, self._learning = self._learning, []
            else:
                self._learning.append(k)
                self._reduce(entries)
                return
        pos = len(self._pending)
        if pos < len(self._seq) and self._seq[pos] == k:
            self._pending.append(entries[0])
            if len(self._pending) == len(self._seq):
                self._flush()
            return
        # the caller's sequence changed: reduce what waits, then learn again
        self._flush()
        self._seq, self._learning = None, [k]
        self._reduce(entries)

    def _check_caller(self, kind, caller):
        """Refuse an optimizer that still has momentum when this store applies it;
        a layer policy (against parameter names) is matched to the caller's keys here."""
        if self._pipeline is None and is_policy(self._compress):
            names = ({f"kv.{i}": p.name for i, p in enumerate(caller._params)} if kind == "trainer"
                     else {f"kv.{n}": n for n in caller.get("param_names") or ()})
            self._compress = rename(self._compress, names)
        vel = pipeline_momentum(self.pipeline.policy if hasattr(self.pipeline, "policy")
                                else self.pipeline.compressor)
        opt = getattr(caller, "_optimizer", None) if kind == "trainer" else \
            getattr(self._updater, "optimizer", None)
        m = getattr(opt, "momentum", 0.0) or 0.0
        if vel and m:
            raise ValueError(f"dist_gradfuse: the KVStore applies momentum={vel[0]} (DGC's momentum correction, "
                             f"compressor {self.pipeline.compressor.name!r}), and the {kind.capitalize()}'s optimizer "
                             f"{type(opt).__name__.lower()} has momentum={m} too: momentum applied twice "
                             f"diverges. Give the optimizer momentum=0 (the store keeps the velocity), or drop "
                             f"the store's momentum option")
        adam = pipeline_adam(self.pipeline.policy)
        if adam is not None:
            self._check_adam(adam, kind, opt)
        self._trainer_checked = True
        self._velocity = bool(vel) or adam is not None

    def _check_adam(self, adam, kind, opt):
        """Refuse an optimizer that would apply Adam again, clip or decay where the store's
        Adam cannot (class docstring); keep it for its ``rescale_grad``."""
        who = (f"dist_gradfuse: the KVStore applies Adam (adam={adam.rule!r}, compressor "
               f"{self.pipeline.compressor.name!r}), and the {kind.capitalize()}'s optimizer {type(opt).__name__.lower()}")
        if hasattr(opt, "beta1") or hasattr(opt, "beta2"):
            raise ValueError(f"{who} would apply Adam a second time: give it 'sgd' (momentum 0), whose learning rate, "
                             f"scheduler and weight decay then apply the store's steps, or drop the store's adam option")
        if getattr(opt, "momentum", 0.0):
            raise ValueError(f"{who} has momentum={opt.momentum}: give it momentum=0 (Adam's first moment is the "
                             f"store's)")
        if getattr(opt, "clip_gradient", None):
            raise ValueError(f"{who} has clip_gradient={opt.clip_gradient}, which would clip Adam's steps; clip in "
                             f"DistributedTrainer instead, which clips the gradients before the moments")
        if adam.rule == "adam" and getattr(opt, "wd", 0.0):
            raise ValueError(f"{who} has wd={opt.wd}: MXNet's Adam couples the decay into the gradient, and the store "
                             f"does not see the weights; use adam='adamw' (the optimizer's decay then stays "
                             f"decoupled, AdamW's) or DistributedTrainer")
        self._adam_opt = opt

    def _flush(self):
        pending, self._pending = self._pending, []
        if pending:
            self._reduce(pending)

    def _keep(self, keys, values, keep=True):
        """Rank 0's value of each key (one negotiated broadcast), kept as the store's."""
        tmp = [v[0].copy() for v in values]
        _broadcast(tmp, _ranks_of(self._process_set)[0], [f"kv.{k}" for k in keys], self._process_set)
        if keep:
            self._store.update(zip(keys, tmp))
        return tmp

    def _reduce(self, entries, store=False):
        """One fused, in-place allreduce of the (device-summed) arrays of ``entries``
        ``(key, [arrays], [outs] or None)``; then the optimizer's update, or the copies out.

        The allreduce is one operation in MXNet's engine (``handoff.reduce_group``, as
        the hvd ops and DistributedTrainer do), so this returns at once: the device sum,
        the update and the copies out are MXNet operations too, ordered after it by
        MXNet's dependency tracking, and a reader of ``out`` waits for them. A bad array
        raises here (on every rank); an error of the collective itself at the first wait
        on its outputs (``wait_to_read``, ``asnumpy``, ``waitall``), on every rank.
        GPU arrays take the DLPack path and are reduced before this returns.
        """
        srcs, names = [], []
        for k, vs, _ in entries:
            src = vs[0]
            for extra in vs[1:]:
                src += extra.as_in_context(src.context)
            srcs.append(src)
            names.append(f"kv.{k}")
        # the Adam correction: the caller's rescale_grad before the moments, out of the steps after
        r = float(getattr(self._adam_opt, "rescale_grad", 1.0) or 1.0)
        if r != 1.0:
            for src in srcs:
                src *= r
        with _span("pushpull", names[0]):
            if handoff.reduce_group(self.pipeline, srcs, names) is None:
                self._reduce_blocking(srcs, names)
        if r != 1.0:
            for src in srcs:
                src /= r
        for (k, vs, outs), src in zip(entries, srcs):
            if self._updater is not None:
                if k not in self._store:
                    raise KeyError(f"dist_gradfuse: key {k!r} was never initialised (init or broadcast) "
                                   f"before an update on the store")
                self._updater(k, src, self._store[k])
                result = self._store[k]
            elif store:
                self._store[k] = src.copy()
                result = src
            else:
                result = src
            for dst in outs or ():
                if dst is not result:
                    dst[:] = result

    def _reduce_blocking(self, srcs, names):
        """GPU arrays: through their DLPack views, reduced before this returns."""
        views = [_view(s, n, device_ok=True) for s, n in zip(srcs, names)]
        bad = [v for v in views if isinstance(v, _coll.InvalidInput)]
        if bad:
            _wait(_coll.refuse_async("allreduce", bad[0].error, _comm_of(self._process_set)))
        _wait(self.pipeline.allreduce_async(views, out=views, names=names))


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _normalize(key, value, out):
    """MXNet's KVStore arguments as (keys, [[values of a key's devices]], [[outs]] or [None]).

    A key or a list of keys; per key an NDArray or a list of them (one per device); ``out``
    likewise, or None."""
    if isinstance(key, (list, tuple)):
        keys = list(key)
        values = list(value) if value is not None else [None] * len(keys)
        outs = list(out) if out is not None else [None] * len(keys)
        if not len(values) == len(outs) == len(keys):
            raise ValueError(f"dist_gradfuse: {len(keys)} keys, {len(values)} values and {len(outs)} outs")
    else:
        keys, values, outs = [key], [value], [out]
    values = [None if v is None else _as_list(v) for v in values]
    outs = [None if o is None else _as_list(o) for o in outs]
    for k, v in zip(keys, values):
        if v is not None and not v:
            raise ValueError(f"dist_gradfuse: key {k!r}: an empty list of values")
    return keys, values, outs


def _dense_keys(caller):
    """The keys of one pass of the caller, in its order (dense gradients)."""
    if isinstance(caller, dict):            # Module: the frame's locals
        names, grads = caller.get("param_names") or [], caller.get("grad_arrays") or []
        return [n for n, g in zip(names, grads) if g[0] is not None and g[0].stype == "default"]
    return [i for i, p in enumerate(caller._params)
            if p.grad_req != "null" and p.list_grad()[0].stype == "default"]


_MODULE_PASSES = (mx.model._update_params.__code__, mx.model._update_params_on_kvstore.__code__)


def _caller():
    """("trainer", the gluon.Trainer) when Trainer._allreduce_grads calls pushpull,
    ("module", its frame's locals) when Module's update loop does, else (None, None).
    Those loops read no result until they have pushed every key, so keys may be deferred
    to their last."""
    f = sys._getframe(2)
    if f.f_code is mx.gluon.Trainer._allreduce_grads.__code__:
        return "trainer", f.f_locals.get("self")
    if f.f_code in _MODULE_PASSES:
        return "module", f.f_locals
    return None, None


_registered = type("dist_gradfuse", (KVStore,), {"__doc__": KVStore.__doc__,
                                                 "__module__": __name__})
mx.kvstore.KVStoreBase.register(_registered)
