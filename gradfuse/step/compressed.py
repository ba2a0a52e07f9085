"""The compressed buckets of a step: one exchange job each, and their three stages.

``compressed_jobs`` makes the jobs (``gradfuse.step.jobs`` picks each bucket's job class);
``compress``, ``exchange`` and ``decode`` run one stage of one job, each inside its
timeline span. With DGC's momentum correction (``velocity_of``) a job first updates its
velocity (``velocity``), and the compressor reads the velocity instead of the gradients;
with the Adam correction (``gradfuse.step.adam``) a bucket is compressed once its ``v`` is
frozen, its compressor reads the moment, and its decode writes the step.
"""
import numpy as np

from . import adam as _adam
from .jobs import BucketTask, job_class, pays
from .plain import bucket_names
from .. import dtypes as _dt
from ..compressors import momentum as _momentum
from ..compressors.base import BucketContext
from ..fusion.staging import F16, staging
from ..runtime import timeline as _tl

_F32 = _dt.CODE[np.dtype(np.float32)]
COMPRESSIBLE = (_F32, F16)        # the dtypes compressors take (float16 through float32 staging)


def _job_stage(stage, job):      # the timeline span of a compressed bucket's stage
    return _tl.stage(stage, "allreduce", getattr(job, "names", ()), bucket=job.bucket.index,
                     bytes=job.bucket.nbytes, algorithm=job.algorithm)


def compressed_jobs(step, comm, divisor):
    """One exchange job per compressed bucket, {bucket index: job}.

    A bucket is compressed when its group's compressor is lossy, its dtype float32 or
    float16, and that compressor's ``warmup_steps`` are over; the others go uncompressed. A float16 bucket is upcast into a float32 staging array
    first (``gradfuse.fusion.staging``: the job reads and writes the staging array, and
    ``Step.run`` rounds the result back once after decoding). Each job class says which
    residuals it keeps, and the bucket's residual state is sized from that.
    """
    cfg, entry = step.cfg, step.entry
    state, bk = cfg.state, entry.bk
    off, cnt = step.tables.elem_offsets, step.tables.counts
    with_velocity = velocity_of(step) is not None     # DGC's momentum correction: a velocity per bucket
    adam = _adam.adam_of(step)                        # the Adam correction: compressed once v is frozen
    jobs = {}
    for b in entry.plan.buckets:
        comp = cfg.compressor.compressors[b.group]
        if comp.lossless or b.code not in COMPRESSIBLE:
            continue
        if adam is None and state.step < comp.warmup_steps or adam is not None and not _adam.frozen(step, b, comp):
            continue
        comp = _momentum.stage_compressor(comp, state.step)      # top-k/random-k's sparsity warm-up
        src, dst = (step.src, off, cnt, b.lo, b.hi), (step.dst, off, cnt, b.lo, b.hi)
        if b.code == F16:
            st = step.staged[b.index] = staging(entry.wire, bk, b, entry.plan)
            st.load(step.src, step.tables)
            src = dst = st.table(step.tables)
        # the tensors' element counts: per-tensor formats (1-bit blocks, top-k/random-k's k
        # per tensor) depend on them, and every rank has the same
        counts = tuple(cnt[b.lo:b.hi].tolist())
        shapes = entry.wire.get(("shapes", b.index))
        if shapes is None:       # the tensors' shapes (a format may see a tensor as a matrix), once per plan
            shapes = entry.wire[("shapes", b.index)] = tuple(entry.shapes[i] for i in
                                                             entry.plan.order[b.lo:b.hi].tolist())
        job = job_class(comp, b.count, comm.size, link=cfg.link, counts=counts)
        if cfg.only_if_faster and b.code == _F32 and not pays(comp, job.algorithm, b.count, comm.size, cfg.link,
                                                               counts, shapes):
            step.unpaid.add(b.index)      # after check_finite, with its residual (uncompressed())
            continue
        n_res, n_server = job.residual_sizes(comp, b.count, comm, counts=counts)
        residual = state.bucket((entry.state_key, b.index), n_res, n_server, job.algorithm, bk,
                                velocity=b.count if with_velocity else 0,
                                single=bk.device == "cpu" and not with_velocity and adam is None)
        task = BucketTask(comm=comm, compressor=comp, bucket=b, src=src, dst=dst, residual=residual,
                          ctx=BucketContext(bucket=b.index, step=state.step, device=bk.device, counts=counts,
                                            shapes=shapes),
                          divisor=divisor, cache=entry.wire.setdefault(b.index, {}), stats=cfg.stats,
                          backend=bk, scratch=entry.wire.setdefault("scratch", {}))
        jobs[b.index] = job(task)
        jobs[b.index].names = lambda b=b: bucket_names(step, b)     # the timeline's (built when recording)
    return jobs


def velocity_of(step):
    """``(m, nesterov)`` when the pipeline runs DGC's momentum correction, else None
    (``gradfuse.compressors.momentum``). Float64 tensors cannot take a velocity: every
    rank raises the same TypeError, naming the tensor, before any data moves."""
    vel = _momentum.pipeline_momentum(step.cfg.compressor)
    if vel and not step.entry.wire.get("velocity-checked"):
        plan = step.entry.plan
        for b in plan.buckets:
            if b.code in _dt.FLOAT_CODES and b.code not in COMPRESSIBLE:
                name = step.entry.names[int(plan.order[b.lo])]
                raise TypeError(f"tensor {name!r}: momentum={vel[0]} keeps a float32 velocity for float32 and "
                                f"float16 gradients; this one is {_dt.name(b.code)}")
        step.entry.wire["velocity-checked"] = True
    return vel


def velocity(job, vel):
    """The velocity update of a compressed bucket: the compressor then reads the velocity."""
    job.apply_velocity(vel)


def compress(job):
    """Residual add, compression and the new residual of one bucket (fused kernel)."""
    with _job_stage("compress", job):
        job.compress()


def exchange(job):
    """The bucket's collective: its payloads to the other ranks, theirs to this one."""
    with _job_stage("exchange", job):
        job.exchange()


def decode(job):
    """Decode-sum-divide into the outputs; the new residuals become current. With the Adam
    correction the decoded mean moment then becomes ``m`` and the outputs the step."""
    with _job_stage("decompress", job):
        job.decode()
        if getattr(job, "adam", None) is not None:      # (a 16-bit Part16 has none: no Adam there)
            _adam.apply(job)
