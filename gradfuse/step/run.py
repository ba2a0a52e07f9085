"""``Step``: one call's allreduce on the communication thread, stage by stage.

``Pipeline.allreduce_async`` prepares a ``Step`` on the caller's thread and submits it;
the communication thread calls it. ``Step.run`` is the order of the stages of
``gradfuse.step`` (the package docstring lists them); each stage lives in its own module.
"""
import numpy as np

from . import adam as _adam
from . import grouped as _grouped
from .compressed import COMPRESSIBLE, compress, compressed_jobs, decode, exchange, velocity, velocity_of
from .exchange import ring_bytes
from .plain import plain_velocity, reduce_bucket, reduce_rows, rows_buckets, uncompressed
from .verdict import NONFINITE, check_finite, halves_cannot_fail, input_bound, plan_step, settle_bounds, skip  # noqa: F401
from .. import dtypes as _dt
from ..fusion.deferred import view_at
from ..fusion.host import as_ndarray
from ..runtime import timeline as _tl
from ..runtime.control import Request


class StepConfig:
    """What every step of one pipeline shares: its runtime context, compressors (a
    ``LayerPolicy``: a bucket's ``group`` indexes its ``compressors``), averaging rule,
    compression state (residuals, step counter), counters, what a compressed step
    with NaN/Inf does (``nonfinite``: "raise" or "skip") and the link the cost model
    assumes (``link``: None for its default); ``overlap``: the exchange thread of pipelined
    buckets (``gradfuse.step.overlap.Overlap``), or None to run them serially."""

    __slots__ = ("ctx", "compressor", "average", "state", "stats", "nonfinite", "link", "only_if_faster",
                 "overlap", "adam")

    def __init__(self, ctx, compressor, average, state, stats, nonfinite="raise", link=None,
                 only_if_faster=False, overlap=None, adam=None):
        self.ctx, self.compressor, self.average = ctx, compressor, average
        self.state, self.stats, self.nonfinite = state, stats, nonfinite
        self.link = link          # the cost model's link (gradfuse.compressors.cost.Link), or None
        self.only_if_faster, self.overlap = only_if_faster, overlap      # uncompressed_if_faster=True
        self.adam = adam          # the Adam correction's AdamSpec (gradfuse.compressors.adam), or None

    def step_tag(self):
        """What of the compressor state the ranks must agree on: its step counter (it drives
        warm-up, random-k's positions and Adam's bias correction). 0 for lossless pipelines
        without the Adam correction."""
        return 0 if self.compressor.lossless and self.adam is None else self.state.step


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
        adam = _adam.adam_of(self)
        if not cfg.compressor.lossless:
            jobs = compressed_jobs(self, comm, size if average else 1.0)
            for job in jobs.values():
                if vel:
                    velocity(job, vel)
                if adam:
                    _adam.moment(job, adam)
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
            # fp16/bf16: bucket by bucket (not with the Adam correction: its decode writes the moments,
            # which must wait for the verdicts of the whole step)
            stream = (lambda: halves_cannot_fail(jobs, comm)) if adam is None else False     # noqa: E731
            # pipelined: exchange groups on this thread (gradfuse.step.grouped: the early groups
            # compressed before the verdict, a settled step's buckets decoded as their groups
            # arrive), the rest on the exchange thread (gradfuse.step.overlap)
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
        if adam and not _adam.plain(self, comm, jobs, adam):
            return skip(self, comm)
        for job in jobs.values():
            if not job.stream:
                decode(job)
            if job.bucket.index in self.staged:
                self.staged[job.bucket.index].store(self.dst, self.tables)
            cfg.stats.bytes_reduced += job.bucket.nbytes
        if not cfg.compressor.lossless or adam:
            cfg.state.step += 1
        cfg.stats.steps += 1
        cfg.stats.tensors += len(self.entry.names)
        cfg.stats.buckets += len(plan.buckets)
        return self.result


# --- the stages -----------------------------------------------------------------------
def negotiate(step):
    """Every rank agrees on the request and the step tag, or every rank raises."""
    cfg = step.cfg
    with _tl.stage("negotiate", "allreduce", step.entry.names):      # the timeline's span
        cfg.ctx.coordinator.negotiate(step.entry.request, cfg.step_tag())
