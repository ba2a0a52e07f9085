"""The plan cache: one ``CachedPlan`` per signature a pipeline's calls cycle through.

A plan (bucket layout, pointer tables, fusion and wire buffers, the ranks' request, the
residual key) is built once per input signature (dtypes, shapes, names, device) and reused
while that stays the same. The cache holds what the model's calls cycle through, not a
fixed number: a plan is dropped only when it has not been used for twice as many calls as
the cache holds plans (it is no longer part of the cycle), and only once more than
``KEEP`` are held. A ``DistributedOptimizer`` that makes one call per aggregated group of
parameters thus keeps one plan per group, however many groups the model has. ``MOST``
bounds callers whose shapes change at every call.
"""
from collections import OrderedDict
from collections.abc import Mapping

from .backend import HOST, CudaBackend
from .plan import FusionPlan, parse_signature
from .pool import OutputPool
from .. import dtypes as _dt
from ..runtime.control import Request


class PlanRules:
    """What a pipeline fixes at construction and every plan it builds follows.

    Args:
        policy: the ``LayerPolicy`` (its ``groups`` puts each tensor in a compressor group).
        fusion_threshold, direct_threshold: the bucket rules of ``FusionPlan``.
        average: whether results are averaged (then every tensor must be a float).
        compressible: the dtype codes compressors take.
        request_options: the options every rank's request agrees on, by where the step runs
            (``"cpu"``, ``"cuda"``).
        state_options: the options that key a plan's residuals.
        stats: the pipeline's counters (``plans_built``).
    """

    __slots__ = ("policy", "fusion_threshold", "direct_threshold", "average", "compressible",
                 "request_options", "state_options", "stats", "backends")

    def __init__(self, policy, fusion_threshold, direct_threshold, average, compressible, request_options,
                 state_options, stats):
        self.policy, self.fusion_threshold, self.direct_threshold = policy, fusion_threshold, direct_threshold
        self.average, self.compressible = average, compressible
        self.request_options, self.state_options = request_options, state_options
        self.stats = stats
        self.backends = {}       # GPU id -> CudaBackend (made once; it compiles the kernels)


class CachedPlan:
    """A cached plan and everything derived from the same signature, built from a call's
    ``Inputs`` under a pipeline's ``PlanRules``: where the step runs (the host, or the
    ``CudaBackend`` of the inputs' GPU), the buckets, the request
    the ranks agree on and the key of the buckets' residuals.

    Raises TypeError naming the tensor when ``average`` meets an integer dtype.
    """

    __slots__ = ("plan", "request", "names", "shapes", "codes", "verified", "bk", "state_key", "wire",
                 "outputs", "used")

    def __init__(self, inputs, rules):
        names, dev = inputs.names, inputs.device
        if dev is None:
            bk = HOST
        else:
            bk = rules.backends.get(dev)
            if bk is None:
                bk = rules.backends[dev] = CudaBackend(dev)
        parsed = parse_signature(inputs.sig)
        codes = [c for c, _ in parsed]
        shapes = [s for _, s in parsed]
        if rules.average:
            for name, c in zip(names, codes):
                if c not in _dt.FLOAT_CODES:
                    raise TypeError(f"tensor {name!r}: average=True needs a float dtype, got "
                                    f"{_dt.name(c)} (use average=False to sum integers)")
        sizes = inputs.nbytes.tolist()
        counts = [nb // _dt.DTYPE[c].itemsize for nb, c in zip(sizes, codes)]
        groups = rules.policy.groups(names, counts, codes, rules.compressible)
        self.plan = FusionPlan(codes, sizes, rules.fusion_threshold, rules.direct_threshold,
                               alloc=bk.empty_bytes, groups=groups)
        dtypes = [_dt.name(c) for c in codes]
        self.request = Request("allreduce", names, shapes, dtypes, rules.request_options[bk.device])
        # residuals are keyed without the device, so they follow a bucket between host and GPU
        self.state_key = Request("allreduce", names, shapes, dtypes, rules.state_options).digest.hex()
        self.names, self.shapes, self.codes = names, shapes, codes
        self.verified = None     # (input, output) pointer tables last checked for overlaps
        self.bk = bk             # where the step runs: HOST or a CudaBackend
        self.wire = {}           # bucket index -> the exchange job's buffers
        self.outputs = OutputPool()  # out-of-place results, reused when the caller let go of them
        self.used = 0            # the cache's call count when this plan was last used
        rules.stats.plans_built += 1


class PlanCache(Mapping):
    """One pipeline's cached plans, by key (signature, names, device); a read-only mapping
    of the plans held, oldest first."""

    KEEP = 8
    MOST = 4096

    def __init__(self, rules):
        self.rules = rules
        self._plans = OrderedDict()
        self.calls = 0           # lookups so far: the clock of the cache

    def entry(self, inputs):
        """The plan of ``inputs`` (their signature, names and device): the cached one, now
        the most recently used, or a new one (plans that left the cycle are dropped)."""
        key = (inputs.sig, tuple(inputs.names), inputs.device)
        self.calls += 1
        entry = self._plans.get(key)
        if entry is not None:
            entry.used = self.calls
            self._plans.move_to_end(key)
            return entry
        entry = self._plans[key] = CachedPlan(inputs, self.rules)
        entry.used = self.calls
        while len(self._plans) > self.KEEP:
            oldest = next(iter(self._plans.values()))
            if len(self._plans) <= self.MOST and self.calls - oldest.used <= 2 * len(self._plans):
                break                            # still in the cycle: keep it
            self._plans.popitem(last=False)      # its fusion and wire buffers go with it
        return entry

    def __getitem__(self, key):
        return self._plans[key]

    def __iter__(self):
        return iter(self._plans)

    def __len__(self):
        return len(self._plans)
