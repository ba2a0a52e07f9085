"""The communication-thread half of a step, and the pipeline's counters.

``Pipeline.allreduce_async`` prepares a ``Step`` on the caller's thread (pointer tables
read, plan looked up, outputs ready) and submits it to the communicator's one
communication thread, which calls it. A step runs these stages, each a function of one
bucket (or of the step), so that later work can reorder and pipeline them:

1. ``negotiate(step)``: every rank agrees on the request (``gradfuse.runtime.control``).
2. Compressed buckets (float32, a lossy compressor, past warm-up), one job each
   (``gradfuse.compressors.jobs``): ``compress(job)`` (residual add, compress, new
   residual, one fused kernel) and ``exchange(job)`` (the job's collective); pipelined, the
   exchange of one bucket overlaps the next one's compression (``gradfuse.grouped``: the
   allgather and sparse-allreduce buckets in exchange groups posted from this thread, the
   others on ``gradfuse.runtime.overlap``'s exchange thread). Before the first in-place
   residual update the ranks agree on the inputs' bound (``input_bound``); a *settled*
   step (nothing can overflow, ``jobs.settled``) decodes its grouped buckets as their
   groups arrive (stage 5 early).
3. ``check_finite(step, jobs)``: every rank has the same non-finite verdict here; a bad
   step raises ``NonFiniteError`` on every rank before anything is written.
4. Plain buckets: ``pack(step, b)``, ``reduce(step, comm, b)`` (the MPI library's or
   NCCL's own allreduce, in place), ``unpack(step, b, ...)`` (dividing when averaging).
   Tensors of ``direct`` buckets are reduced where they lie (``reduce_direct``). Between
   the ranks of one host, all plain buckets' tensors are summed where they lie in one
   call instead (``reduce_rows``: no pack, no unpack; ``gradfuse.comm.cma``).
5. ``decode(job)``: decode-sum-divide into the outputs, and commit the new residuals.

On a GPU the stages run on the backend's stream, after an event on the caller's stream; it syncs at the end.
"""
import numpy as np

from . import dtypes as _dt
from . import grouped as _grouped
from .compressors import momentum as _momentum
from .compressors.base import BucketContext
from .compressors.jobs import (BucketTask, halves_cannot_fail, input_bound, job_class, pays, plan_step, ring_bytes,
                               settle_bounds)
from .errors import NonFiniteError
from .fusion.staging import F16, staging
from .fusion.deferred import view_at
from .fusion.tables import as_ndarray
from .plain import bucket_names, reduce, reduce_bucket, reduce_rows, rows_buckets, uncompressed, unpack
from .runtime import timeline as _tl
from .runtime.control import Request

_F32 = _dt.CODE[np.dtype(np.float32)]
COMPRESSIBLE = (_F32, F16)        # the dtypes compressors take (float16 through float32 staging)
NONFINITE = ("raise", "skip")


class Stats:
    """Counters of one pipeline (read them as attributes or with ``as_dict()``).

    ``bytes_reduced`` counts the gradient bytes a step reduced (uncompressed size), so a
    collective that was stopped by the control plane or the non-finite policy adds 0.
    ``bytes_sent`` estimates the bytes this rank put on the wire: a compressed bucket's
    payloads as its collective sends them, an uncompressed allreduce (``none``, warm-up
    steps, non-float32 buckets) as a bandwidth-optimal one's 2(p-1)/p x its size (the MPI
    library or NCCL picks the real algorithm).
    ``cast_overflow``/``cast_underflow`` count fp16/bf16 values that became inf / zero.
    """

    FIELDS = ("steps", "tensors", "buckets", "bytes_reduced", "bytes_sent", "plans_built", "failed_steps",
              "nonfinite_steps", "cast_overflow", "cast_underflow")

    def __init__(self):
        for f in self.FIELDS:
            setattr(self, f, 0)

    def as_dict(self):
        return {f: getattr(self, f) for f in self.FIELDS}

    def __repr__(self):
        return f"Stats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


class StepConfig:
    """What every step of one pipeline shares: its runtime context, compressors (a
    ``LayerPolicy``: a bucket's ``group`` indexes its ``compressors``), averaging rule,
    compression state (residuals, step counter), counters, what a compressed step
    with NaN/Inf does (``nonfinite``: "raise" or "skip") and the link the cost model
    assumes (``link``: None for its default); ``overlap``: the exchange thread of pipelined
    buckets (``gradfuse.runtime.overlap.Overlap``), or None to run them serially."""

    __slots__ = ("ctx", "compressor", "average", "state", "stats", "nonfinite", "link", "only_if_faster",
                 "overlap")

    def __init__(self, ctx, compressor, average, state, stats, nonfinite="raise", link=None,
                 only_if_faster=False, overlap=None):
        self.ctx, self.compressor, self.average = ctx, compressor, average
        self.state, self.stats, self.nonfinite = state, stats, nonfinite
        self.link = link          # the cost model's link (gradfuse.compressors.cost.Link), or None
        self.only_if_faster, self.overlap = only_if_faster, overlap      # uncompressed_if_faster=True

    def step_tag(self):
        """What of the compressor state the ranks must agree on: its step counter (it drives
        warm-up and random-k's positions). 0 for lossless pipelines."""
        return 0 if self.compressor.lossless else self.state.step


class Step:
    """One allreduce of one call, ready to run on the communication thread (call it).

    Args:
        cfg: the pipeline's ``StepConfig``.
        entry: the cached plan (plan, request, backend, names, residual key, wire buffers).
        inputs, outputs: ``gradfuse.fusion.tables.Inputs`` / ``Outputs`` of the call.
    """

    __slots__ = ("cfg", "entry", "src", "dst", "tables", "objs", "result", "ready",
                 "inplace", "staged", "deferred", "io", "unpaid")

    def __init__(self, cfg, entry, inputs, outputs):
        self.cfg, self.entry = cfg, entry
        self.staged = {}          # bucket index -> float32 Staging of a compressed float16 bucket
        self.unpaid = set()       # buckets Pipeline(uncompressed_if_faster=True) runs uncompressed
        self.deferred = inputs.deferred
        self.result, self.ready = outputs.result, outputs.ready
        if self.deferred is None:
            self.io = None
            self.bind(inputs, outputs)
        else:                     # the pointers arrive on the communication thread
            self.io = (inputs, outputs)
            self.deferred.taken = True

    def bind(self, inputs, outputs):
        """The step's pointer tables (the views of the tensors reduced where they lie are
        made when a stage first asks: ``in_objs``/``out_objs``)."""
        entry = self.entry
        plan, bk = entry.plan, entry.bk
        src, dst = inputs.ptrs[plan.order], outputs.ptrs[plan.order]
        self.inplace = bool(np.array_equal(src, dst))
        self.src, self.dst, self.tables = bk.pointers(src), bk.pointers(dst), bk.plan_tables(plan)
        self.objs = (inputs, outputs)

    def _views(self):
        """The call's objects, with numpy views of the tensors reduced where they lie (direct
        buckets; a deferred call's views at the pointers its binding handed over, shaped
        from the plan's own parse of the signature)."""
        inputs, outputs = self.objs
        entry = self.entry
        plan, bk, d = entry.plan, entry.bk, self.deferred
        in_objs, out_objs = list(inputs.objs), list(outputs.objs)
        if bk.device == "cpu":
            for b in plan.buckets:
                if b.direct:
                    i = int(plan.order[b.lo])
                    if d is not None:
                        dtype = _dt.DTYPE[entry.codes[i]]
                        in_objs[i] = view_at(int(d.ptrs[i]), entry.shapes[i], dtype)
                        out_objs[i] = in_objs[i] if d.out_ptrs is None else \
                            view_at(int(d.out_ptrs[i]), entry.shapes[i], dtype)
                    else:
                        in_objs[i], out_objs[i] = as_ndarray(in_objs[i]), as_ndarray(out_objs[i])
        self.objs = (in_objs, out_objs)

    @property
    def in_objs(self):
        """The inputs, direct tensors as numpy views (made on the first use)."""
        if not isinstance(self.objs[0], list):
            self._views()
        return self.objs[0]

    @property
    def out_objs(self):
        """The outputs, direct tensors as numpy views (made on the first use)."""
        if not isinstance(self.objs[0], list):
            self._views()
        return self.objs[1]

    def __call__(self):
        d = self.deferred
        if d is None:
            return self.execute()
        error = None
        try:
            try:
                d.bind()          # waits until the binding has the data pointers
            except Exception as exc:
                # announced, so the other ranks raise too instead of waiting in the exchange
                self.cfg.stats.failed_steps += 1
                self.cfg.ctx.coordinator.negotiate(Request("allreduce", error=exc), self.cfg.step_tag())
                raise
            self.bind(*self.io)
            self.io = None
            return self.execute()
        except BaseException as exc:
            error = exc
            raise
        finally:
            d.finish(error)

    def execute(self):
        """Negotiate, then run (the pointer tables are bound)."""
        cfg, bk = self.cfg, self.entry.bk
        try:
            negotiate(self)
        except BaseException:
            cfg.stats.failed_steps += 1
            raise
        if bk.device == "cpu":
            return self.run(cfg.ctx.comm)
        with bk.xp.cuda.Device(bk.device_id), bk.stream:
            comm = cfg.ctx.data_comm(bk.device_id)
            bk.stream.wait_event(self.ready)       # the producer of the gradients is done
            try:
                return self.run(comm)
            finally:
                bk.synchronize()      # nothing of this step still runs when wait() returns

    def run(self, comm):
        """Stages 2-5 on ``comm`` (the ranks have agreed); returns the call's result."""
        cfg, plan = self.cfg, self.entry.plan
        average = cfg.average
        divide = average and comm.size > 1
        size = float(comm.size)
        jobs = {}
        vel = velocity_of(self)
        if not cfg.compressor.lossless:
            jobs = compressed_jobs(self, comm, size if average else 1.0)
            for job in jobs.values():
                if vel:
                    velocity(job, vel)
            bound = []

            def verdict(between=None):
                """Before the first in-place residual update: every rank agrees on the
                inputs' bound; a step that may be refused takes spare residuals. Returns
                whether the step is settled (cannot be refused)."""
                if not any(j.state.in_place for j in jobs.values()):
                    return False
                rec = _tl.recorder()
                spans = None if rec is None else (
                    lambda part, t0, t1: rec("verdict", "allreduce", (), t0, t1, part=part))
                m, e = input_bound(jobs, comm, between, spans)
                bound.append(m)
                in_place, sure = plan_step(jobs, m, e, comm.size)
                if not in_place:
                    for job in jobs.values():
                        job.state.spare()     # a step that may be refused keeps its residuals: spares
                return sure
            stream = lambda: halves_cannot_fail(jobs, comm)     # noqa: E731 (fp16/bf16: bucket by bucket)
            # pipelined: exchange groups on this thread (gradfuse.grouped: the early groups
            # compressed before the verdict, a settled step's buckets decoded as their groups
            # arrive), the rest on the exchange thread (gradfuse.runtime.overlap)
            _grouped.run_jobs(cfg.overlap, comm, self.entry.bk.device, list(jobs.values()), stream,
                              compress, exchange, decode, verdict)
            if jobs:
                cfg.state.claim_done(self.entry.state_key)
            if not check_finite(self, jobs):
                return skip(self, comm)
            settle_bounds(jobs, bound[0] if bound and bound[0] < float("inf") else None)
        # one rank, in place: the sum (and the mean) of one tensor is the tensor itself
        plain = () if comm.size == 1 and self.inplace and not vel else plan.buckets
        rows = rows_buckets(self, comm, plain, jobs, vel)
        if rows:
            reduce_rows(self, comm, rows, divide, size)
        for b in plain:
            if b.index in jobs:
                continue
            if b.index in rows:
                pass                      # summed where they lie, above
            elif vel and b.code in COMPRESSIBLE:
                plain_velocity(self, comm, b, vel, divide, size)
            elif b.index in self.unpaid:
                uncompressed(self, comm, b, divide, size)
            else:
                reduce_bucket(self, comm, b, divide, size)
            cfg.stats.bytes_reduced += b.nbytes
            cfg.stats.bytes_sent += ring_bytes(b.nbytes, comm.size)
        for job in jobs.values():
            if not job.stream:
                decode(job)
            if job.bucket.index in self.staged:
                self.staged[job.bucket.index].store(self.dst, self.tables)
            cfg.stats.bytes_reduced += job.bucket.nbytes
        if not cfg.compressor.lossless:
            cfg.state.step += 1
        cfg.stats.steps += 1
        cfg.stats.tensors += len(self.entry.names)
        cfg.stats.buckets += len(plan.buckets)
        return self.result


# --- the stages -----------------------------------------------------------------------
def negotiate(step):
    """Every rank agrees on the request and the step tag, or every rank raises."""
    cfg = step.cfg
    with _tl.stage("negotiate", "allreduce", step.entry.names):      # the timeline (issue 15)
        cfg.ctx.coordinator.negotiate(step.entry.request, cfg.step_tag())


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
    jobs = {}
    for b in entry.plan.buckets:
        comp = cfg.compressor.compressors[b.group]
        if comp.lossless or b.code not in COMPRESSIBLE or state.step < comp.warmup_steps:
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
        job = job_class(comp, b.count, comm.size, link=cfg.link, counts=counts)
        if cfg.only_if_faster and b.code == _F32 and not pays(comp, job.algorithm, b.count, comm.size, cfg.link,
                                                               counts):
            step.unpaid.add(b.index)      # after check_finite, with its residual (uncompressed())
            continue
        n_res, n_server = job.residual_sizes(comp, b.count, comm, counts=counts)
        residual = state.bucket((entry.state_key, b.index), n_res, n_server, job.algorithm, bk,
                                velocity=b.count if with_velocity else 0,
                                single=bk.device == "cpu" and not with_velocity)
        task = BucketTask(comm=comm, compressor=comp, bucket=b, src=src, dst=dst, residual=residual,
                          ctx=BucketContext(bucket=b.index, step=state.step, device=bk.device, counts=counts),
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


def plain_velocity(step, comm, b, vel, divide, size):
    """An uncompressed bucket of a momentum pipeline: its velocity ``u = m * u + g`` is
    written where the reduction reads (the fusion buffer, or a direct tensor itself), so the
    bucket's sum is the sum of the velocities (float16: through the float32 staging array,
    rounded once to float16 before the sum)."""
    cfg, entry, t, bk = step.cfg, step.entry, step.tables, step.entry.bk
    st = cfg.state.bucket((entry.state_key, b.index), 0, 0, None, bk, velocity=b.count)
    src, rows = step.src, len(entry.plan.order)
    if b.code == F16:
        sg = staging(entry.wire, bk, b, entry.plan)
        sg.load(step.src, t)
        src = out = sg.ptrs                   # u written over the staged gradients
    elif b.direct:
        out = step.dst
    else:
        out = _momentum.table(st, bk, _momentum.address(b.buffer), t.offsets, rows, b.lo, b.hi)
    _momentum.update(bk, st, (src, t.elem_offsets, t.counts, b.lo, b.hi), out, vel)
    if b.code == F16 and b.direct:
        sg.store(step.dst, t)
    elif b.code == F16:
        bk.kernels.cast_to16(1, sg.f32, b.buffer.view(np.uint16))
    if b.direct:
        i = int(entry.plan.order[b.lo])
        comm.allreduce_inplace(step.out_objs[i])
        if divide:
            bk.div_inplace(step.out_objs[i], step.dst[b.lo], entry.plan.counts[b.lo], b.code, size)
    else:
        reduce(step, comm, b)
        unpack(step, b, divide, size)
    st.commit_velocity()
    cfg.state.claim_done(entry.state_key)


def compress(job):
    """Residual add, compression and the new residual of one bucket (fused kernel)."""
    with _job_stage("compress", job):
        job.compress()


def exchange(job):
    """The bucket's collective: its payloads to the other ranks, theirs to this one."""
    with _job_stage("exchange", job):
        job.exchange()


def decode(job):
    """Decode-sum-divide into the outputs; the new residuals become current."""
    with _job_stage("decompress", job):
        job.decode()


def check_finite(step, jobs):
    """True when no rank saw NaN/Inf in a compressed bucket (the verdict is the same on
    every rank: it travels with the payloads). Otherwise, with ``nonfinite="raise"``,
    raise ``NonFiniteError`` on every rank alike; with "skip", return False."""
    bad = [j for j in jobs.values() if j.nonfinite_ranks]
    if not bad:
        return True
    cfg, entry = step.cfg, step.entry
    cfg.stats.nonfinite_steps += 1
    lost = [j for j in jobs.values() if j.state.in_place]
    for j in jobs.values():
        if j in lost:           # finite inputs that overflowed in place (g + e, a server's sum)
            j.state.zero()
        j.state.release()
    if cfg.nonfinite == "skip":
        return False
    cfg.stats.failed_steps += 1
    parts = []
    for j in bad:
        names = [entry.names[int(i)] for i in entry.plan.order[j.bucket.lo:j.bucket.hi][:4]]
        who = (f"on rank(s) {', '.join(str(r) for r in j.nonfinite_ranks)}"
               if "?" not in j.nonfinite_ranks else "")
        parts.append(f"bucket {j.bucket.index} (tensors {', '.join(repr(x) for x in names)}"
                     f"{', ...' if j.bucket.hi - j.bucket.lo > 4 else ''}): non-finite values {who}"
                     f"{'; ' + j.nonfinite_detail if j.nonfinite_detail else ''}")
    kept = ("the residuals are unchanged" if not lost else
            f"the residuals of {len(lost)} bucket(s) were reset to zero (finite inputs overflowed float32 "
            f"in their in-place update)")
    written = sorted(j.bucket.index for j in jobs.values() if j.stream)
    wrote = ("no result was written" if not written else
             f"but bucket(s) {', '.join(map(str, written))} had already been written (the step's bound said "
             f"no value could overflow: please report this)")
    raise NonFiniteError(f"{cfg.compressor.name}: NaN/Inf in the step's gradients; the step was refused on "
                         f"every rank, {wrote} and {kept}: "
                         + "; ".join(parts))


def skip(step, comm):
    """A compressed step that saw NaN/Inf, with ``nonfinite="skip"``: every float output
    of the call becomes NaN on every rank (a dynamic loss scaler sees the overflow and
    skips the optimizer step), integer tensors are still summed, no residual changes and
    the compressor's step counter stays (the step did not happen)."""
    cfg, plan, bk, t = step.cfg, step.entry.plan, step.entry.bk, step.tables
    for b in plan.buckets:
        dtype = _dt.DTYPE[b.code]
        if b.code not in _dt.FLOAT_CODES:
            reduce_bucket(step, comm, b, False, 1.0)
            continue
        if b.direct:
            step.out_objs[int(plan.order[b.lo])][...] = dtype.type(np.nan)
        else:
            bk.xp.asarray(b.buffer).view(dtype)[...] = dtype.type(np.nan)
            bk.unpack(b.buffer, step.dst, t.offsets, t.nbytes, b.lo, b.hi)
    cfg.stats.steps += 1
    cfg.stats.tensors += len(step.entry.names)
    cfg.stats.buckets += len(plan.buckets)
    return step.result
