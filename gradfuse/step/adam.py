"""The Adam correction's stages of a step (the math: ``gradfuse.compressors.adam``).

* ``adam_of(step)``: the pipeline's ``AdamSpec``, or None (float64 tensors are refused);
* ``frozen(step, b, comp)``: whether compressible bucket ``b`` runs compressed this step
  (its ``v`` is frozen; it freezes here when its warm-up is over);
* ``moment(job, spec)``: before compression, the compressor is told to read the moment in
  the frozen preconditioner's units (``BucketJob.compress_into``: the fused kernel or the
  moment pass);
* ``apply(job)``: after the bucket's decode (after the step's verdict): ``m`` becomes the
  mean of the ranks' moments, the outputs the step;
* ``plain(step, comm, jobs, spec)``: the buckets that were summed exactly (warm-up,
  uncompressed tensors): their verdict, then plain Adam, and the freeze rule's measurement.

Every write to the moments, counters and masks happens after the step's verdicts, so a
refused step leaves them as they were (a bucket whose ``v`` froze at the start of a step that
is then refused freezes again, identically, at the next one).
"""
import numpy as np

from .. import _core
from .. import dtypes as _dt
from ..compressors import adam as _adam
from ..errors import NonFiniteError
from ..fusion.staging import F16, staging

COMPRESSIBLE = (_dt.CODE[np.dtype(np.float32)], F16)      # the float dtypes the moments serve


def adam_of(step):
    """The pipeline's ``AdamSpec`` when it runs the Adam correction, else None. Float64
    tensors cannot take it: every rank raises the same TypeError, naming the tensor,
    before any data moves."""
    spec = step.cfg.adam
    if spec is not None and not step.entry.wire.get("adam-checked"):
        plan = step.entry.plan
        for b in plan.buckets:
            if b.code in _dt.FLOAT_CODES and b.code not in COMPRESSIBLE:
                name = step.entry.names[int(plan.order[b.lo])]
                raise TypeError(f"tensor {name!r}: the Adam correction (adam={spec.rule!r}) keeps float32 moments "
                                f"for float32 and float16 gradients; this one is {_dt.name(b.code)}")
        step.entry.wire["adam-checked"] = True
    return spec


def bucket_state(step, b):
    """Bucket ``b``'s state with its Adam arrays (double-buffered residuals: a compressed
    bucket's residual becomes current at its decode, after every verdict of the step)."""
    entry, bk, state = step.entry, step.entry.bk, step.cfg.state
    key = (entry.state_key, b.index)
    st = state.buckets.get(key)
    if st is None:                    # made here, or claimed from a restored state with its residuals' sizes
        saved = state.pending.get(key)
        n, server = (0, 0) if saved is None else (int(saved["n"]), saved["server_residual"].size)
        st = state.bucket(key, n, server, None, bk)
    elif st.device != (bk.device, bk.device_id):      # moved to this device, its residuals as they are
        st = state.bucket(key, st.n, st.server_cur.size, None, bk, st.vel_cur.size, st.single)
    _adam.bucket_arrays(st, b.count)
    return st


def frozen(step, b, comp):
    """Whether compressible bucket ``b`` (compressor ``comp``) runs compressed: its ``v`` is
    frozen, or freezes now because it has taken its warm-up's exact steps."""
    st = bucket_state(step, b)
    state = step.cfg.state
    return _adam.maybe_freeze(st, _adam.freeze_target(comp, state.meta), state.step, step.cfg.adam, step.entry.bk.xp)


def moment(job, spec):
    """The compressor of ``job`` reads the moment ``b1 m + (c1 g) r`` instead of the gradients
    (``BucketJob.compress_into``: 1-bit's fused pass, or the moment pass)."""
    job.adam = spec


def apply(job):
    """After ``job``'s decode: ``m`` = the decoded mean (in the frozen preconditioner's
    units), the outputs = the step ``a m`` (0 where the mask is 0); the bucket's step counter
    advances."""
    spec, st = job.adam, job.state
    arrays = st.arrays
    step, freeze = arrays[_adam.STEP], arrays[_adam.FREEZE]
    a = spec.factors(int(step[0]) + 1, int(freeze[0]))[0]
    ptrs, off, cnt, lo, hi = job.dst
    job.bk.kernels.adam_apply(ptrs, off, cnt, lo, hi, arrays[_adam.M], arrays[_adam.MASK], a)
    step[0] += 1


def _refuse(step, jobs, names):
    """A step whose exactly summed gradients hold NaN/Inf: the moments stay as they were.
    ``nonfinite="skip"``: returns False (the caller writes NaN); else raises on every rank
    (the sums are the same everywhere, so is this verdict)."""
    cfg = step.cfg
    cfg.stats.nonfinite_steps += 1
    for job in jobs.values():
        job.state.release()
    if cfg.nonfinite == "skip":
        return False
    cfg.stats.failed_steps += 1
    shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    raise NonFiniteError(f"adam: NaN/Inf in the averaged gradients of tensor(s) {shown}; the step was refused on "
                         f"every rank and the moments are unchanged (the exactly summed results were written)")


def plain(step, comm, jobs, spec):
    """Plain Adam on every float bucket of the step that is not compressed (``jobs`` are),
    whose outputs hold the averaged gradients: first the verdict (no moment changes when
    any of them is not finite), then ``adam_plain``; and the adaptive freeze rule's
    measurement over the compressible buckets still in warm-up. Returns False when the step
    is to be skipped (``nonfinite="skip"``)."""
    cfg, entry, t, bk = step.cfg, step.entry, step.tables, step.entry.bk
    buckets = [b for b in entry.plan.buckets if b.index not in jobs and b.code in COMPRESSIBLE and b.count]
    if not buckets:
        return True
    tables = {}
    for b in buckets:                 # float16: through the float32 staging array
        if b.code == F16:
            sg = staging(entry.wire, bk, b, entry.plan)
            sg.load(step.dst, t)
            tables[b.index] = (sg, sg.table(t))
        else:
            tables[b.index] = (None, (step.dst, t.elem_offsets, t.counts, b.lo, b.hi))
    bad = [b for b in buckets if _absmax(bk, tables[b.index][1], b.count) == float("inf")]
    if bad:
        return _refuse(step, jobs, [entry.names[int(i)] for b in bad for i in entry.plan.order[b.lo:b.hi]])
    meta = cfg.state.meta
    policy = cfg.compressor
    measure = [0.0, 0.0]
    measured = False
    for b in buckets:
        st = bucket_state(step, b)
        m, v, count = st.arrays[_adam.M], st.arrays[_adam.V], st.arrays[_adam.STEP]
        n = int(count[0]) + 1
        a, bb = spec.factors(n, n)
        rule = _adam.measuring(policy.compressors[b.group], meta)       # the adaptive freeze is measuring
        ptrs, off, counts, lo, hi = tables[b.index][1]
        sums = bk.kernels.adam_plain(ptrs, off, counts, lo, hi, m, v, spec.b1, spec.c1, spec.b2, spec.c2, a, bb,
                                     spec.eps, spec.bias2(n), spec.bias2(n - 1), rule)
        if rule:
            measure[0] += sums[0]
            measure[1] += sums[1]
            measured = True
        count[0] += 1
        sg = tables[b.index][0]
        if sg is not None:
            sg.store(step.dst, t)
    cfg.state.claim_done(entry.state_key)
    if measured:
        _observe(cfg, comm, measure)
    return True


def _absmax(bk, table, n):
    """max |x| of a float32 table of ``n`` elements (inf when a value is not finite)."""
    ptrs, off, counts, lo, hi = table
    if bk.device == "cpu":
        return _core.table_absmax(ptrs, counts, lo, hi)
    if not n:
        return 0.0
    xp = bk.xp                        # on the device: gathered there, reduced there
    x = xp.empty(n, np.float32)
    bk.kernels.pack(x.view(np.uint8), ptrs, off * 4, counts * 4, lo, hi)
    return float(xp.abs(x).max()) if bool(xp.isfinite(x).all()) else float("inf")


def _observe(cfg, comm, measure):
    """The adaptive freeze rule after this exact step: the relative change of the
    bias-corrected ``v``, the largest over the ranks (one 8-byte max-allreduce)."""
    change = measure[0] / measure[1] if measure[1] > 0 else float("inf")
    if comm.size > 1:
        flags = np.array([change], np.float64)
        out = np.empty_like(flags)
        comm.allreduce_op(flags, out, "max")
        change = float(out[0])
    _adam.observe(cfg.state.meta, change, cfg.state.step + 1)
