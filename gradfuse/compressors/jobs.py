"""Which exchange job runs a bucket: the registry of job classes by algorithm name.

Each algorithm lives in its own module (``exchange``: allgather and the 16-bit allreduce;
``twophase``: the two-phase compressed allreduce); a new collective adds its class to
``JOBS``.
"""
from .exchange import AllgatherJob, AllreduceJob, BucketTask, ring_bytes  # noqa: F401  (the step's one import)
from .twophase import TwoPhaseJob, twophase_chunk  # noqa: F401

JOBS = {job.algorithm: job for job in (AllgatherJob, AllreduceJob, TwoPhaseJob)}


def job_class(comp, n, p):
    """The job class that exchanges a bucket of ``n`` elements on ``p`` ranks (the same on
    every rank: it depends only on what the ranks agreed on)."""
    algorithm = comp.algorithm_for(n, p) if hasattr(comp, "algorithm_for") else comp.collective
    return JOBS[algorithm]
