"""The ``dist_gradfuse`` KVStore: MPI allreduce for ``gluon.Trainer`` through MXNet's
KVStore interface, registered with MXNet when this module is imported."""
import mxnet as mx

from .. import collectives as _coll
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
        caller = _caller_is_trainer()
        if not caller or len(entries) != 1:
            self._flush()
            self._reduce(entries)
            return
        k = keys[0]
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


def _caller_is_trainer():
    """True when pushpull is called from gluon.Trainer._allreduce_grads (whose loop reads
    no gradient until it has pushed them all, so keys may be deferred to its last)."""
    import sys
    f = sys._getframe(2)
    return f.f_code is mx.gluon.Trainer._allreduce_grads.__code__


_registered = type("dist_gradfuse", (KVStore,), {"__doc__": KVStore.__doc__,
                                                 "__module__": __name__})
mx.kvstore.KVStoreBase.register(_registered)
