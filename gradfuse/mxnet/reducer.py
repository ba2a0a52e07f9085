"""``_Reducer``: fused, in-place gradient averaging of NDArrays for one process set, the part
``DistributedTrainer`` and ``DistributedOptimizer`` share (optionally bucket by bucket,
overlapping backward); ``split_list``, Horovod's helper."""
import numpy as np

from .. import collectives as _coll
from ..pipeline import Pipeline
from ..runtime import context as _runtime
from . import handoff
from .arrays import _view
from .basics import _comm_of, _span
from .compression import NoneCompressor
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
