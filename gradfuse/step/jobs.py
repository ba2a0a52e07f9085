"""Which exchange job runs a bucket: the registry of job classes by algorithm name.

Each algorithm lives in its own module (``exchange``: allgather and the 16-bit allreduce;
``twophase``: the two-phase compressed allreduce; ``sparse_allreduce``: random-k's values
summed at the shared positions; ``powersgd``: PowerSGD's three allreduces). A compressor names its collective (``collective``, or
``algorithm_for``); ``register_job`` adds a job class for a new one. A job may run several
dependent collectives in its ``exchange()`` (two-phase runs an alltoall, sums, then an
allgather): the step runs every job through the same three stages whatever it holds.
"""
from .exchange import AllgatherJob, AllreduceJob, BucketJob, BucketTask  # noqa: F401
from .powersgd import PowerSGDJob
from .sparse_allreduce import SparseAllreduceJob
from .twophase import TwoPhaseJob
from ..compressors import cost

JOBS = {job.algorithm: job for job in (AllgatherJob, AllreduceJob, TwoPhaseJob, SparseAllreduceJob, PowerSGDJob)}


def register_job(cls):
    """Add exchange job class ``cls`` (a ``BucketJob`` subclass) under its ``algorithm``
    name; a compressor whose ``algorithm_for`` returns that name is exchanged by it.
    Returns ``cls``, so it serves as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, BucketJob)):
        raise TypeError(f"register_job: expected a BucketJob subclass, got {cls!r}")
    name = cls.algorithm
    if not isinstance(name, str) or name in ("", "abstract"):
        raise ValueError(f"register_job: {cls.__name__} needs an 'algorithm' name of its own, got {name!r}")
    if name in JOBS and JOBS[name] is not cls:
        raise ValueError(f"register_job: algorithm {name!r} is taken by {JOBS[name].__name__}")
    JOBS[name] = cls
    return cls


def job_class(comp, n, p, link=None, counts=None):
    """The job class that exchanges a bucket of ``n`` elements on ``p`` ranks
    (``comp.algorithm_for``: the compressor's option, or the cost model's choice on
    ``link``; the same on every rank: it depends only on what the ranks agreed on)."""
    return JOBS[comp.algorithm_for(n, p, link=link, counts=counts)]


def pays(comp, algorithm, n, p, link, counts, shapes=None):
    """Whether the cost model predicts the compressed exchange faster than the fp32 ring."""
    return (cost.predict(comp, algorithm, n, p, link, counts=counts, shapes=shapes)
            < cost.predict("none", "ring", n, p, link))
