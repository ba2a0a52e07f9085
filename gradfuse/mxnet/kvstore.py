"""The ``dist_gradfuse`` KVStore: MPI allreduce for ``gluon.Trainer`` through MXNet's
KVStore interface, registered with MXNet when this module is imported."""
import mxnet as mx

from .. import collectives as _coll
from ..compressors.momentum import pipeline_momentum
from ..compressors.policy import is_policy, rename
from ..pipeline import Pipeline
from .arrays import _view
from .basics import _comm_of, _ranks_of, _span, global_process_set, init, is_initialized, rank, size
from .errors import _wait
from .mpi_ops import _broadcast


class KVStore(mx.kvstore.KVStoreBase):
    """An MPI-allreduce KVStore for ``gluon.Trainer``, registered as ``'dist_gradfuse'``.

    ``gluon.Trainer(params, 'sgd', kvstore='dist_gradfuse')`` synchronises through it,
    and so does an instance: ``kvstore=gradfuse.mxnet.KVStore(compress='1bit')``. The
    name contains ``dist`` because MXNet 1.9.1's Trainer ignores a kvstore string
    without it on a single device.

    ``pushpull`` **sums** across ranks, as MXNet's ``dist_sync`` does (``average=True``
    to average instead). With the default sum, ``trainer.step(batch_size)`` must be
    given the global batch size (``size() *`` the per-rank batch) for the mean gradient.

    Fusion: the gradients of one ``pushpull`` call with a list of keys are reduced in
    one fused call. ``gluon.Trainer`` calls ``pushpull`` once per parameter: the store
    learns that key sequence in the first step (reducing each key at once), and from
    then on defers the keys of a ``Trainer._allreduce_grads`` pass and reduces them all
    in one fused call at its last key, before the Trainer reads any gradient. Calls
    from anywhere else are reduced before ``pushpull`` returns.

    ``set_gradient_compression({'type': NAME, **options})`` selects a gradfuse
    compressor (Gluon's ``compression_params``). The optimizer stays in the Trainer
    (``is_capable('optimizer')`` is False; ``update_on_kvstore`` is off).

    DGC's momentum correction: the store does not see the optimizer, so it takes the
    momentum as a compressor option, ``KVStore(compress='1bit', momentum=0.9)`` or
    ``{'type': '1bit', 'momentum': 0.9}``: each rank keeps its velocity of the raw gradients
    in the compressor state and the sum carries the velocities. Give the Trainer's
    optimizer ``momentum=0``: a Trainer whose optimizer still has momentum is refused at
    its first step (momentum applied twice diverges). The optimizer's wd, clipping and
    rescaling then act on the velocity sum (docs/mxnet.md).
    """

    def __init__(self, compress=None, process_set=global_process_set, average=False,
                 fusion_threshold=None, **compressor_options):
        if not is_initialized():
            init()
        self._process_set = process_set
        self._compress = compress
        self._options = dict(compressor_options)
        self._fusion_threshold = fusion_threshold
        self._average = bool(average)
        self._pipeline = None
        self._seq = None            # the learned key sequence of one Trainer pass
        self._learning = []
        self._pending = []          # (key, arrays) deferred in this pass
        self._trainer_checked = False
        self._velocity = False      # the pipeline runs DGC's momentum correction

    # --- what Trainer asks ------------------------------------------------------------
    @property
    def type(self):
        return "dist_gradfuse"

    @property
    def rank(self):
        return self._process_set.rank() if self._process_set.process_set_id else rank()

    @property
    def num_workers(self):
        return self._process_set.size() if self._process_set.process_set_id else size()

    @staticmethod
    def is_capable(capability):
        return False        # no optimizer on the store: the Trainer updates

    def set_optimizer(self, optimizer):
        raise NotImplementedError("dist_gradfuse keeps no optimizer: use update_on_kvstore=False")

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError("dist_gradfuse keeps no optimizer: the Trainer saves its states")

    load_optimizer_states = save_optimizer_states

    def set_gradient_compression(self, compression_params):
        """Select a gradfuse compressor: ``{'type': '1bit', **options}``."""
        if self._pipeline is not None:
            raise RuntimeError("set_gradient_compression must come before the first pushpull")
        params = dict(compression_params or {})
        self._compress = params.pop("type", None)
        self._options = params

    @property
    def pipeline(self):
        """The ``gradfuse.Pipeline`` of this store (``.stats``)."""
        if self._pipeline is None:
            self._pipeline = Pipeline(compress=self._compress, average=self._average,
                                      comm=_comm_of(self._process_set),
                                      fusion_threshold=self._fusion_threshold, **self._options)
        return self._pipeline

    # --- data -------------------------------------------------------------------------
    def broadcast(self, key, value, out, priority=0):
        """Write rank 0's ``value`` (of the process set) into ``out`` on every rank."""
        keys, values, outs = self._normalize(key, value, out)
        tmp = [v.copy() for v in values]
        _broadcast(tmp, _ranks_of(self._process_set)[0], [f"kv.{k}" for k in keys],
                   self._process_set)
        for t, o in zip(tmp, outs):
            for dst in (o if isinstance(o, (list, tuple)) else [o]):
                dst[:] = t

    def pushpull(self, key, value, out=None, priority=0):
        """Sum ``value`` over devices and ranks into ``out`` (default: ``value``)."""
        keys, values, outs = self._normalize(key, value, out)
        entries = list(zip(keys, values, outs))
        trainer = _calling_trainer()
        caller = trainer is not None
        if caller and not self._trainer_checked:
            self._check_trainer(trainer)
        if not caller or len(entries) != 1:
            self._flush()
            self._reduce(entries)
            return
        k = keys[0]
        if self._seq is None and not self._learning and self._velocity:
            # a velocity (or residual) is keyed by the fused call's plan: learning the sequence
            # from a first pass of one-key calls would start the fused plan from zero, so
            # take the sequence from the Trainer's parameters (its _allreduce_grads order)
            self._seq = _dense_keys(trainer)
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
        # the Trainer's sequence changed: reduce what waits, then learn again
        self._flush()
        self._seq, self._learning = None, [k]
        self._reduce(entries)

    def _check_trainer(self, trainer):
        """Refuse a Trainer whose optimizer still has momentum when this store applies it;
        a layer policy (against parameter names) is matched to the Trainer's keys here."""
        if self._pipeline is None and is_policy(self._compress):
            self._compress = rename(self._compress, {f"kv.{i}": p.name for i, p in enumerate(trainer._params)})
        vel = pipeline_momentum(self.pipeline.policy if hasattr(self.pipeline, "policy")
                                else self.pipeline.compressor)
        opt = getattr(trainer, "_optimizer", None)
        m = getattr(opt, "momentum", 0.0) or 0.0
        if vel and m:
            raise ValueError(f"dist_gradfuse: the KVStore applies momentum={vel[0]} (DGC's momentum correction, "
                             f"compressor {self.pipeline.compressor.name!r}), and the Trainer's optimizer "
                             f"{type(opt).__name__.lower()} has momentum={m} too: momentum applied twice "
                             f"diverges. Give the optimizer momentum=0 (the store keeps the velocity), or drop "
                             f"the store's momentum option")
        self._trainer_checked = True
        self._velocity = bool(vel)

    def _flush(self):
        pending, self._pending = self._pending, []
        if pending:
            self._reduce(pending)

    @staticmethod
    def _normalize(key, value, out):
        if isinstance(key, (list, tuple)):
            outs = out if out is not None else value
            return list(key), list(value), list(outs)
        return [key], [value], [out if out is not None else value]

    def _reduce(self, entries):
        """One fused, in-place allreduce of the (device-summed) arrays of ``entries``."""
        srcs, names = [], []
        for k, v, _ in entries:
            vs = v if isinstance(v, (list, tuple)) else [v]
            src = vs[0]
            for extra in vs[1:]:
                src += extra.as_in_context(src.context)
            srcs.append(src)
            names.append(f"kv.{k}")
        views = [_view(s, n, device_ok=True) for s, n in zip(srcs, names)]
        bad = [v for v in views if isinstance(v, _coll.InvalidInput)]
        with _span("pushpull", names[0]):
            if bad:
                _wait(_coll.refuse_async("allreduce", bad[0].error, _comm_of(self._process_set)))
            _wait(self.pipeline.allreduce_async(views, out=views, names=names))
        for (k, v, o), src in zip(entries, srcs):
            for dst in (o if isinstance(o, (list, tuple)) else [o]):
                if dst is not src:
                    dst[:] = src


def _dense_keys(trainer):
    """The keys gluon.Trainer._allreduce_grads pushpulls, in its order (dense gradients)."""
    return [i for i, p in enumerate(trainer._params)
            if p.grad_req != "null" and p.list_grad()[0].stype == "default"]


def _calling_trainer():
    """The gluon.Trainer whose _allreduce_grads calls pushpull, or None (that loop reads no
    gradient until it has pushed them all, so keys may be deferred to its last)."""
    import sys
    f = sys._getframe(2)
    if f.f_code is mx.gluon.Trainer._allreduce_grads.__code__:
        return f.f_locals.get("self")
    return None


_registered = type("dist_gradfuse", (KVStore,), {"__doc__": KVStore.__doc__,
                                                 "__module__": __name__})
mx.kvstore.KVStoreBase.register(_registered)
