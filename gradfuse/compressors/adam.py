"""The Adam correction: 1-bit Adam's frozen variance (Tang et al., 2021) for every lossy compressor.

Adam's second moment is not linear in the gradient, so error feedback on the gradients
does not carry over to Adam's update (docs/compressors.md, "The Adam correction"). As in
DeepSpeed's 1-bit Adam, the pipeline keeps Adam's moments itself, warms up with exact Adam,
then freezes the second moment ``v`` and compresses the first moment ``m`` with error
feedback. Per bucket, with ``d`` this rank's (prepared) gradient, float32, on step ``t``
(counted from 1) of the bucket:

* **warm-up** (and tensors that stay uncompressed: a layer policy's ``None`` patterns,
  ``min_elements``, ``compress=None``; they keep a live ``v`` for good): the gradients are
  averaged exactly, ``g = mean_ranks(d)``, then ``m = b1 m + c1 g``, ``v = b2 v + c2 g^2`` and
  the result is the step ``s = (a_t m) / (b_t sqrt(v) + eps)`` (``adam_plain``);
* **after the freeze** at step ``T``: with ``r = 1 / (b_T sqrt(v_T) + eps)`` (fixed from now on;
  ``m`` becomes ``m r``), ``x = b1 m + (c1 d) r`` (this rank's moment, in the update's units),
  error feedback on it, ``c = x + e``, ``send compress(c)``, ``e = c - decompress(sent)`` (one
  fused pass for 1-bit: ``adam_onebit_compress``); after the exchange every rank sets ``m`` to
  the mean of the ranks' decoded payloads (DeepSpeed's rule, below) and the result is the
  step ``a_t m``, with ``v_T`` and its bias correction ``1 - b2^T`` frozen (``adam_apply``);
  where ``v_T`` is 0 (``mask``) the step and ``m`` are 0, as DeepSpeed's ``exp_avg_mask`` makes
  them (1-bit cannot send an exact 0: without it a parameter that never had a gradient,
  such as the embedding row of a byte never seen, would move by the block's scale).

The two rules (``rule``), with ``B1(t) = 1 - b1^t`` and ``B2 = 1 - b2^t`` (``t`` frozen at ``T``):
``"adam"`` is MXNet's Adam (``mxnet/optimizer/optimizer.py``: ``c1 = 1.f - b1`` in float32,
epsilon added to the uncorrected ``sqrt(v)``, the bias correction in the step size):
``a_t = sqrt(B2) / B1(t)``, ``b_t = 1``; ``"adamw"`` is ``torch.optim.AdamW``'s (``c1 = 1 - b1``
rounded once, epsilon added to ``sqrt(v / B2)``): ``a_t = 1 / B1(t)``, ``b_t = 1 / sqrt(B2)``. The
optimizer then does ``w -= lr * s`` (with AdamW's decoupled decay ``w *= 1 - lr wd`` first;
with MXNet's Adam the decay ``wd w`` is in ``d``, inside the clip).

**Which m after the exchange.** Every rank takes the mean of the ranks' decoded moments
(DeepSpeed's ``exp_avg.set_(compressed_allreduce(exp_avg))``), not its own decoded payload
(the rule of 1-bit's sent velocity for SGD, ``gradfuse.compressors.onebit``). The mean the
ranks apply follows the same recursion under both rules,
``m_t = b1 m_(t-1) + c1 mean(d) + mean(e_(t-1)) - mean(e_t)``, so the sum of the applied
moments misses the exact one by the current residuals over ``c1`` either way. Taking the
mean keeps one ``m`` on every rank (any rank's checkpoint holds the ``m`` that was applied),
writes ``m`` once, after the step's verdict, in the pass that computes the step (the fused
compress pass reads ``m`` and writes none), so a refused step leaves it as it was without a
second buffer, and needs nothing of a compressor (the sent rule needs each compressor to
decode its own payload).

**Which units.** The compressed quantity is the moment divided by the frozen denominator,
``m r`` with ``r = 1 / (b sqrt(v_T) + eps)`` (``r`` 0 where ``v_T`` is 0), not ``m`` itself as
in DeepSpeed: with ``v`` frozen, ``r`` is a fixed diagonal map, so error feedback is exact in
either space, but a compressor's error is then relative to the update, not to the moment.
Compressing ``m`` gives a tensor element whose frozen ``v`` is small (a unit that stopped
firing) 1-bit's block scale, an ``m`` of its neighbours' size, divided by its own small
``sqrt(v)``: a step orders of magnitude too large, which diverged the digits CNN at the
freeze (docs/compressors.md, "The Adam correction"). After the freeze ``adam.m`` holds ``m r``.

**The freeze.** A bucket's ``v`` freezes after ``T`` exact steps: ``warmup_steps`` of its
compressor when set (DeepSpeed's ``freeze_step``), else the step at which the pipeline's
rule fired: the relative change of the bias-corrected ``v`` over one step,
``sum |v_t / B2(t) - v_(t-1) / B2(t-1)| / sum v_t / B2(t)`` over the pipeline's compressible
buckets (the largest over the ranks: one 8-byte max-allreduce per warm-up step), stayed
below ``FREEZE_TOL`` for ``FREEZE_WINDOW`` steps in a row. It needs no run length: ``v`` is
frozen once one more step changes its estimate by less than 1 %, i.e. once it averages
enough steps that the noise of one does not move it (about ``1 / FREEZE_TOL`` steps for
gradients whose noise is of their own size; slower when their scale still drifts).
docs/compressors.md reports where it froze on the runs measured there.

State (named per-bucket arrays of ``gradfuse.compressors.state``, checkpointed bit-exactly):
``adam.m``, ``adam.v`` (float32), ``adam.step`` (the bucket's Adam steps ``t``),
``adam.freeze`` (``T``, 0 while ``v`` is live), ``adam.mask`` (uint8) and ``adam.r`` (float32,
both after the freeze); the
pipeline's rule keeps ``{"calm": steps in a row below the tolerance, "frozen_at": its
freeze step or 0}`` in ``CompressionState.meta["adam"]``.
"""
import math

import numpy as np

from . import momentum as _momentum
from .base import ADAM_RULES

F32 = np.float32
M, V, STEP, FREEZE, MASK, R = "adam.m", "adam.v", "adam.step", "adam.freeze", "adam.mask", "adam.r"
#: the adaptive freeze (module docstring): the largest relative change of the bias-corrected
#: v per step, and how many steps in a row it must stay below it
FREEZE_TOL = 0.01
FREEZE_WINDOW = 10


class AdamSpec:
    """The Adam correction of a pipeline: its rule, betas and epsilon, and the float32
    coefficients its kernels take."""

    __slots__ = ("rule", "b1", "b2", "eps", "c1", "c2")

    def __init__(self, rule, betas, eps):
        if rule not in ADAM_RULES:
            raise ValueError(f"adam: rule must be one of {', '.join(map(repr, ADAM_RULES))}, got {rule!r}")
        self.rule, (self.b1, self.b2), self.eps = rule, (float(betas[0]), float(betas[1])), float(eps)
        if rule == "adam":        # MXNet's kernel: (1.f - beta) in float32
            self.c1, self.c2 = float(F32(1) - F32(self.b1)), float(F32(1) - F32(self.b2))
        else:                     # torch: 1 - beta in double, rounded once
            self.c1, self.c2 = float(F32(1.0 - self.b1)), float(F32(1.0 - self.b2))

    def factors(self, t, t_v):
        """``(a, b)`` of the step ``(a m) / (b sqrt(v) + eps)`` at step ``t`` with ``v`` of step
        ``t_v`` (``t`` while it is live, the freeze step after)."""
        bc1 = 1.0 - self.b1 ** t
        bc2 = 1.0 - self.b2 ** t_v
        if self.rule == "adam":
            return math.sqrt(bc2) / bc1, 1.0
        return 1.0 / bc1, 1.0 / math.sqrt(bc2)

    def bias2(self, t):
        """``1 / (1 - b2^t)``, the bias correction of v at step ``t`` (0 for t = 0: no v yet)."""
        return 0.0 if t <= 0 else 1.0 / (1.0 - self.b2 ** t)

    def __eq__(self, other):
        return isinstance(other, AdamSpec) and (self.rule, self.b1, self.b2, self.eps) == (
            other.rule, other.b1, other.b2, other.eps)

    def __hash__(self):
        return hash((self.rule, self.b1, self.b2, self.eps))

    def __repr__(self):
        return f"AdamSpec({self.rule!r}, betas=({self.b1}, {self.b2}), eps={self.eps})"


def pipeline_adam(policy):
    """The ``AdamSpec`` of a pipeline's compressors (a ``LayerPolicy``), or None without the
    Adam correction. The moments belong to the pipeline (its uncompressed tensors take
    plain Adam with them), so its lossy compressors must agree on rule, betas and eps."""
    main = getattr(policy, "main", policy)
    comps = [main] if getattr(policy, "single", True) else list(policy.compressors[1:])
    seen = {}
    for c in comps:
        key = (getattr(c, "adam", None), getattr(c, "betas", None), getattr(c, "eps", None))
        seen.setdefault(key, c.name)
    if len(seen) > 1:
        parts = ", ".join(f"{name!r} has adam={a!r}, betas={b}, eps={e}" for (a, b, e), name in seen.items())
        raise ValueError(f"layer policy: the compressors disagree on the Adam correction ({parts}); the moments "
                         f"are the pipeline's, give every lossy compressor the same adam, betas and eps")
    if not seen:
        return None
    (rule, betas, eps), = seen
    return AdamSpec(rule, betas, eps) if rule else None


def bucket_arrays(st, n):
    """The Adam arrays of bucket state ``st`` for a bucket of ``n`` elements: ``(m, v, step,
    freeze)``, made (zeros) when missing; arrays of another size start again from zero."""
    m, v = st.arrays.get(M), st.arrays.get(V)
    if m is None or m.size != n or v is None or v.size != n:
        for name in (M, V, STEP, FREEZE, MASK, R):
            st.arrays.pop(name, None)
    return st.array(M, n), st.array(V, n), st.array(STEP, 1, np.int64), st.array(FREEZE, 1, np.int64)


def freeze_target(comp, meta):
    """The step after which a bucket of compressor ``comp`` freezes its ``v``: its
    ``warmup_steps`` when set, else the pipeline's adaptive freeze step (0: not yet)."""
    if comp.warmup_steps:
        return comp.warmup_steps
    return int(meta.get("adam", {}).get("frozen_at", 0))


def maybe_freeze(st, target, steps, spec, xp):
    """Freeze bucket ``st``'s ``v`` if it and its pipeline (``steps`` steps so far) have taken
    ``target`` exact steps (``target`` > 0): its freeze step becomes its step count, its mask
    ``v != 0``, its preconditioner ``r = 1 / (b sqrt(v) + eps)`` (0 where masked) and ``m``
    goes into r's units (``xp``: the array module of the bucket's memory). Returns whether
    ``v`` is frozen. (The two counts differ where a bucket came later than its pipeline, or
    a binding carried a bucket's moments over from another pipeline.)"""
    step, freeze = st.arrays[STEP], st.arrays[FREEZE]
    if freeze[0]:
        return True
    if not target or step[0] < target or steps < target:
        return False
    v, m = st.arrays[V], st.arrays[M]
    b = spec.factors(1, int(step[0]))[1]
    mask = st.array(MASK, v.size, np.uint8)
    r = st.array(R, v.size, F32)
    keep = v != 0
    mask[...] = keep
    d = xp.add(xp.multiply(F32(b), xp.sqrt(v), dtype=F32), F32(spec.eps), dtype=F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        r[...] = xp.where(keep, xp.divide(F32(1), d, dtype=F32), F32(0))
    xp.multiply(m, r, out=m, dtype=F32)
    freeze[0] = step[0]
    return True


def measuring(comp, meta):
    """Whether the adaptive freeze rule measures this exact step of a bucket of compressor
    ``comp``: a lossy one without ``warmup_steps``, the pipeline not frozen yet, and no
    binding deciding the freeze itself (``meta["adam"]["manual"]``: the torch hook's
    ``freeze_iter``)."""
    rule = meta.get("adam", {})
    return not comp.lossless and not comp.warmup_steps and not rule.get("frozen_at") and not rule.get("manual")


def observe(meta, change, step):
    """The adaptive freeze rule after exact step ``step`` (counted from 1), whose relative
    change of the bias-corrected ``v`` was ``change`` (the largest over the ranks): returns
    whether the pipeline froze now."""
    rule = meta.setdefault("adam", {"calm": 0, "frozen_at": 0})
    if rule["frozen_at"]:
        return False
    rule["calm"] = rule["calm"] + 1 if change < FREEZE_TOL else 0
    if rule["calm"] >= FREEZE_WINDOW:
        rule["frozen_at"] = int(step)
        return True
    return False


def moment_table(bk, st, src, spec, x):
    """The moment pass of a compressed bucket whose compressor has no fused moment kernel:
    ``x = b1 m + (c1 g) r`` for the bucket ``src`` (a 5-tuple table) into ``x`` (the bucket's
    count of float32), and a table over ``x`` with the bucket's tensor boundaries, which the
    compressor reads instead of the gradients."""
    ptrs, off, cnt, lo, hi = src
    bk.kernels.adam_moment(ptrs, off, cnt, lo, hi, st.arrays[M], st.arrays[R], spec.b1, spec.c1, x)
    xt = _momentum.table(st, bk, _momentum.address(x), np.asarray(off, np.int64) * 4, len(ptrs), lo, hi)
    return (xt, off, cnt, lo, hi)
