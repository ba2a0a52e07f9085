"""Which exchange job runs a bucket: the registry of job classes by algorithm name.

Each algorithm lives in its own module (``exchange``: allgather and the 16-bit allreduce;
``twophase``: the two-phase compressed allreduce; ``sparse_allreduce``: random-k's values
summed at the shared positions); a new collective adds its class to ``JOBS``.
"""
import numpy as np

from .. import _core
from . import cost
from .exchange import AllgatherJob, AllreduceJob, BucketTask, ring_bytes  # noqa: F401  (the step's one import)
from .sparse_allreduce import SparseAllreduceJob
from .twophase import TwoPhaseJob, twophase_chunk  # noqa: F401

JOBS = {job.algorithm: job for job in (AllgatherJob, AllreduceJob, TwoPhaseJob, SparseAllreduceJob)}


def job_class(comp, n, p, link=None, counts=None):
    """The job class that exchanges a bucket of ``n`` elements on ``p`` ranks
    (``comp.algorithm_for``: the compressor's option, or the cost model's choice on
    ``link``; the same on every rank: it depends only on what the ranks agreed on)."""
    return JOBS[comp.algorithm_for(n, p, link=link, counts=counts)]


def pays(comp, algorithm, n, p, link, counts):
    """Whether the cost model predicts the compressed exchange faster than the fp32 ring."""
    return cost.predict(comp, algorithm, n, p, link, counts=counts) < cost.predict("none", "ring", n, p, link)


def inputs_finite(jobs, comm):
    """Whether every rank's compressed inputs are finite (single-buffered residuals are then
    updated in place). One float32 sum per tensor (numpy 1.x's pairwise
    ``np.add.reduce(x, dtype=np.float32)``, bit for bit, on any numpy, by the
    ``table_first_bad_sum`` kernel: one call per bucket; a finite sum has finite terms
    whatever the order of the adds; an overflowing one only costs this step its in-place
    update) and one allreduce of a flag."""
    bad = 0
    for job in jobs.values():
        ptrs, _, cnt, lo, hi = job.src
        if _core.table_first_bad_sum(ptrs, cnt, lo, hi) >= 0:
            bad = 1
            break
    flags = np.array([bad], np.int64)
    comm.allreduce_inplace(flags)
    return not flags[0]


# 16-bit formats: (unit roundoff, largest finite value)
_HALF = {1: (2.0 ** -11, 65504.0), 2: (2.0 ** -8, 3.3895313892515355e38)}


def halves_cannot_fail(jobs, comm):
    """Whether a step of 16-bit allreduce jobs (fp16/bf16, no residual, host) can run each
    bucket's cast, sum and decode at once, one bucket after the other, in one shared
    16-bit buffer: only if no rank's step could be refused, i.e. every input is finite
    and no cast or sum can overflow. Agreed with one max-allreduce of M = max |x| over
    every rank's inputs; a sum of p terms, each cast from at most M' (M / p when
    pre-divided) and each add rounded once, stays within p M' (1 + u)^(p + 1), so that must
    be below the format's largest value (u: its unit roundoff)."""
    if not jobs or not all(isinstance(j, AllreduceJob) and j.bk.device == "cpu" and not j.state.cur.size
                           for j in jobs.values()):
        return False
    m = 0.0
    for job in jobs.values():          # max |x|, inf once any value is not finite (one call per bucket)
        ptrs, _, cnt, lo, hi = job.src
        m = max(m, _core.table_absmax(ptrs, cnt, lo, hi))
        if m == float("inf"):
            break
    flags = np.array([m], np.float64)
    out = np.empty_like(flags)
    comm.allreduce_op(flags, out, "max")
    p = comm.size
    j = next(iter(jobs.values()))
    u, top = _HALF[j.comp.fmt]
    scale = p if (j.comp.options.get("predivide") or j.native) and j.divisor != 1.0 else 1.0
    return bool(np.isfinite(out[0])) and p * (out[0] / scale) * (1 + u) ** (p + 1) < top * (1 - 1e-6)
