"""The step's verdicts: what every rank agrees on before results are written.

* ``input_bound``: before the first in-place residual update, the largest ``|x|`` of every
  rank's compressed inputs and the largest residual bound (one max-allreduce); with it
  ``plan_step`` decides whether residuals are updated in place and whether the step is
  *settled* (nothing can overflow: buckets may be decoded as soon as they arrive), and
  ``settle_bounds`` carries the residual bounds to the next step.
* ``halves_cannot_fail``: whether a step of fp16/bf16 buckets can decode each bucket at once.
* ``check_finite``: the non-finite verdict (it travels with the payloads, so it is the same
  on every rank); ``skip`` writes NaN for a step that ``nonfinite="skip"`` drops.
"""
import time

import numpy as np

from .exchange import AllreduceJob
from .plain import reduce_bucket
from .. import _core
from .. import dtypes as _dt
from ..compressors.base import FLT_MAX, ROUNDING
from ..errors import NonFiniteError

NONFINITE = ("raise", "skip")


#: a residual bound above this is measured again (one max ``|e|`` pass over that residual)
#: before a step relies on it: bounds grow by each step's largest ``|g|`` and a few roundings,
#: so in a run whose values stay finite this happens rarely, if ever
MEASURE_ABOVE = 2.0 ** 64


def _bounded(job):
    """Whether ``job``'s residual is bounded by its state's ``bound`` and its compressor's
    ``settle``: a worker residual only (no server residual, no velocity), updated in place."""
    st = job.state
    return (st.single and st.cur.size > 0 and not st.server_cur.size and not st.vel_cur.size
            and job.velocity is None and job.comp.settle(0.0, job.comm.size) is not None)


def _measured(st):
    """max ``|e|`` of a single-buffered host residual (one pass), kept as its bound."""
    e = st.cur
    st.bound = _core.table_absmax(np.array([e.ctypes.data], np.int64), np.array([e.size], np.int64), 0, 1)
    return st.bound


def _absmax(jobs, between=None):
    """max ``|x|`` over the jobs' inputs, one ``table_absmax`` call per bucket (``between()``
    after each); inf, and no further bucket read, once a value is not finite."""
    m = 0.0
    for job in jobs.values():
        ptrs, _, cnt, lo, hi = job.src
        m = max(m, _core.table_absmax(ptrs, cnt, lo, hi))
        if between is not None:
            between()
        if m == float("inf"):
            break
    return m


def input_bound(jobs, comm, between=None, spans=None):
    """``(M, E)``, the same on every rank: M the largest ``|x|`` of every rank's compressed
    inputs (inf once one is not finite; then the step may be refused and single-buffered
    residuals take spares), E the largest bound on their residuals (inf when a job's
    residual is not ``_bounded``). One max ``|x|`` per bucket (``table_absmax``, AVX2, one
    call per bucket; ``between()`` after each: a pipelined step's exchanges in flight
    progress meanwhile) and one max-allreduce of the pair.

    M finite means every input is finite (single-buffered residuals are then updated in
    place); with E it also bounds every value the kernels compress, |g + e| <= M + E,
    which ``settled`` turns into "no value of this step can overflow". ``spans(part, t0,
    t1)``, when given, hears of the two parts' times (``time.perf_counter``): ``"max |x|"``
    (the pass, with any residual bound measured again) and ``"agree"`` (the allreduce)."""
    t0 = time.perf_counter() if spans else 0.0
    m = _absmax(jobs, between)
    e = 0.0
    if m < float("inf") and all(_bounded(j) for j in jobs.values()):
        for job in jobs.values():
            st = job.state
            e = max(e, st.bound if st.bound <= MEASURE_ABOVE else _measured(st))
    else:
        e = float("inf")
    flags = np.array([m, e], np.float64)
    out = np.empty_like(flags)
    if spans:
        t1 = time.perf_counter()
        spans("max |x|", t0, t1)
    comm.allreduce_op(flags, out, "max")
    if spans:
        spans("agree", t1, time.perf_counter())
    return float(out[0]), float(out[1])


def _reach(m, e):
    """A bound on ``|fl(g + e)|`` for ``|g|`` <= m, ``|e|`` <= e (the add rounds once)."""
    return (m + e) * (1.0 + ROUNDING)


def settled(jobs, m, e, p):
    """Whether no value of the step can overflow (``input_bound``'s M and E, every job
    ``_bounded``): then its non-finite verdict is known to be clean before any exchange,
    and a bucket may be decoded into the outputs as soon as its exchange completes."""
    c = _reach(m, e)
    return bool(jobs) and c < float("inf") and all(
        _bounded(j) and j.comp.settle(c, p) is not None for j in jobs.values())


#: with residuals that ``settled`` cannot bound, inputs this large (or not finite) make
#: a step take spare residuals, as one that may overflow: a step refused then leaves
#: them as they were (float32's largest value / 2^32)
SPARE_ABOVE = FLT_MAX * 2.0 ** -32


def plan_step(jobs, m, e, p):
    """``(in_place, settled)`` for a step of single-buffered ``jobs`` with ``input_bound``'s
    M and E: settled (``settled``) steps update their residuals in place and decode each
    bucket as it arrives; the others update in place only when every input is finite and,
    where some residual has no bound, below ``SPARE_ABOVE`` (else the step takes spares,
    so that a refused step keeps the residuals as they were)."""
    sure = settled(jobs, m, e, p)
    if sure:
        return True, True
    if all(_bounded(j) for j in jobs.values()):
        return False, False            # the bound cannot rule out an overflow
    return m < SPARE_ABOVE, False


def settle_bounds(jobs, m):
    """After a committed step whose inputs had ``|g|`` <= ``m`` (None: not known): each job's
    residual bound for the next step (inf where it cannot be bounded)."""
    for job in jobs.values():
        st = job.state
        b = None
        if m is not None and _bounded(job):
            b = job.comp.settle(_reach(m, st.bound), job.comm.size)
        st.bound = float("inf") if b is None else b


# 16-bit formats: (unit roundoff, largest finite value)
_HALF = {1: (2.0 ** -11, 65504.0), 2: (2.0 ** -8, 3.3895313892515355e38)}


def halves_cannot_fail(jobs, comm):
    """Whether a step of 16-bit allreduce jobs (fp16/bf16, no residual, host) can run each
    bucket's cast, sum and decode at once, one bucket after the other, in one shared
    16-bit buffer: only if no rank's step could be refused, i.e. every input is finite
    and no cast or sum can overflow. Agreed with one max-allreduce of M = max ``|x|`` over
    every rank's inputs; a sum of p terms, each cast from at most M' (M / p when
    pre-divided) and each add rounded once, stays within p M' (1 + u)^(p + 1), so that must
    be below the format's largest value (u: its unit roundoff)."""
    if not jobs or not all(isinstance(j, AllreduceJob) and j.bk.device == "cpu" and not j.state.cur.size
                           for j in jobs.values()):
        return False
    flags = np.array([_absmax(jobs)], np.float64)
    out = np.empty_like(flags)
    comm.allreduce_op(flags, out, "max")
    p = comm.size
    j = next(iter(jobs.values()))
    u, top = _HALF[j.comp.fmt]
    scale = p if (j.comp.options.get("predivide") or j.native) and j.divisor != 1.0 else 1.0
    return bool(np.isfinite(out[0])) and p * (out[0] / scale) * (1 + u) ** (p + 1) < top * (1 - 1e-6)


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
