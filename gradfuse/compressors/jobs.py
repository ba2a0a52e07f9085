"""Which exchange job runs a bucket: the registry of job classes by algorithm name.

Each algorithm lives in its own module (``exchange``: allgather and the 16-bit allreduce;
``twophase``: the two-phase compressed allreduce; ``sparse_allreduce``: random-k's values
summed at the shared positions); a new collective adds its class to ``JOBS``.
"""
from .exchange import AllgatherJob, AllreduceJob, BucketTask, ring_bytes  # noqa: F401  (the step's one import)
from .sparse_allreduce import SparseAllreduceJob
from .twophase import TwoPhaseJob, twophase_chunk  # noqa: F401

JOBS = {job.algorithm: job for job in (AllgatherJob, AllreduceJob, TwoPhaseJob, SparseAllreduceJob)}


def job_class(comp, n, p, link=None, counts=None):
    """The job class that exchanges a bucket of ``n`` elements on ``p`` ranks
    (``comp.algorithm_for``: the compressor's option, or the cost model's choice on
    ``link``; the same on every rank: it depends only on what the ranks agreed on)."""
    return JOBS[comp.algorithm_for(n, p, link=link, counts=counts)]
