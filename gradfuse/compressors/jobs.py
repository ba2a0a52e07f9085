"""Which exchange job runs a bucket: the registry of job classes by algorithm name.

Each algorithm lives in its own module (``exchange``: allgather and the 16-bit allreduce;
``twophase``: the two-phase compressed allreduce; ``sparse_allreduce``: random-k's values
summed at the shared positions); a new collective adds its class to ``JOBS``.
"""
import ctypes

import numpy as np

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
    updated in place). One float32 sum per tensor (a finite sum has finite terms; an
    overflowing one only costs this step its in-place update) and one allreduce of a flag."""
    bad = 0
    with np.errstate(over="ignore", invalid="ignore"):
        for job in jobs.values():
            ptrs, _, cnt, lo, hi = job.src
            for r in range(lo, hi):
                m = int(cnt[r])
                if m and not np.isfinite(np.add.reduce(np.ctypeslib.as_array((ctypes.c_float * m).from_address(
                        int(ptrs[r]))), dtype=np.float32)):
                    bad = 1
                    break
            if bad:
                break
    flags = np.array([bad], np.int64)
    comm.allreduce_inplace(flags)
    return not flags[0]
