"""The Adam correction in the MXNet trainers: which optimizers it applies to, and how
``DistributedTrainer`` and ``DistributedOptimizer`` move Adam's moments into the compressor
state (``gradfuse.compressors.adam``; docs/mxnet.md, "The Adam correction").

MXNet 1.9.1's Adam (``adam_update``, ``mxnet/optimizer/optimizer.py``) does, per weight
``w`` with gradient ``g`` at its update ``t``::

    d = clip(rescale_grad * g + wd * w, clip_gradient)
    m = b1 m + (1 - b1) d;   v = b2 v + (1 - b2) d^2
    w = w - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

and gradfuse's ``adamw`` (``gradfuse.mxnet.adamw``, torch.optim.AdamW's rule)::

    d = clip(rescale_grad * g, clip_gradient);   w = w (1 - lr wd)
    m, v as above;   w = w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

With the correction, ``prepare`` makes ``d`` on each rank (``adam``: the decay inside the
clip, as MXNet's kernel; ``adamw``: without it), the pipeline keeps ``m`` and ``v`` (exact
during its warm-up, ``v`` frozen after) and writes the step ``s`` of the formula above into
the gradients, and the optimizer runs as ``neutral`` makes it: ``w = w - lr s`` (``adamw``:
``w = w (1 - lr wd)`` first, so the decay stays decoupled), ``lr`` from its scheduler and
``lr_mult``, ``wd`` with ``wd_mult``, as the user set them; it keeps no state of its own.
``clip_gradient`` clips each rank's own gradient (on one rank it is the same), and the bias
correction counts the pipeline's steps of each bucket (MXNet counts its updates per
parameter: the same while every parameter is updated at every step).
"""
import contextlib

import mxnet as mx

from ..compressors.policy import LayerPolicy
from .adamw import AdamW

RULES = {mx.optimizer.Adam: "adam", AdamW: "adamw"}      # optimizer class -> the correction's rule
OWN = ("adam", "betas", "eps")


def corrected_by_default(compress, options):
    """Whether ``compress`` (a name, instance, config or layer policy) has a lossy
    compressor that takes an optimizer correction by default (``corrects_by_default``)."""
    policy = LayerPolicy.create(compress, 0, **options)
    return any(c.corrects_by_default for c in policy.compressors[1:])


def with_options(compress, options, extra, what):
    """``compress`` and ``options`` with ``extra`` given to every lossy compressor (a layer
    policy's patterns each get it; ``None`` patterns take the pipeline's state)."""
    if isinstance(compress, dict) and not isinstance(compress.get("name"), str):
        policy = {}
        for pattern, spec in compress.items():
            if spec is None or spec == "none":
                policy[pattern] = spec
            elif isinstance(spec, dict):
                policy[pattern] = {**spec, **extra}
            elif isinstance(spec, str):
                policy[pattern] = {"name": spec, **extra}
            else:
                raise TypeError(f"{what}: layer policy pattern {pattern!r} is a compressor instance; give a name "
                                f"or a config dict so the optimizer's settings can be added")
        return policy, dict(options)
    if compress is None or isinstance(compress, (str, dict)):
        return (compress if compress is not None else "none"), {**options, **extra}
    raise TypeError(f"{what}: compress= is a compressor instance; give its name or get_config() dict so the "
                    f"trainer can add the optimizer's settings to it")


def setup(optimizer, compress, options, requested, who):
    """``(compress, options, AdamCorrection or None)`` for a trainer of an Adam-family
    ``optimizer`` (a key of ``RULES``). ``requested``: None (on with a lossy compressor that
    takes a correction by default), True (on, any compressor, ``compress=None`` too) or
    False (off: the optimizer runs Adam on the averaged gradients)."""
    own = sorted(set(options) & set(OWN))
    if own:
        raise TypeError(f"{who}: option(s) {', '.join(own)} come from the optimizer "
                        f"({type(optimizer).__name__.lower()}); use adam_correction= to turn the Adam "
                        f"correction on or off")
    if requested not in (None, True, False):
        raise TypeError(f"{who}: adam_correction must be None, True or False, got {requested!r}")
    if requested is False or requested is None and not corrected_by_default(compress, options):
        return compress, options, None
    rule = RULES[type(optimizer)]
    corr = AdamCorrection(rule, optimizer.beta1, optimizer.beta2, optimizer.epsilon)
    compress, options = with_options(compress, options, corr.options(), "the Adam correction")
    return compress, options, corr


class AdamCorrection:
    """One trainer's Adam correction: ``prepare`` the gradients, the optimizer run as
    ``w -= lr * step`` (``neutral``). ``lr_factor`` is 1 (the step is not lr-scaled)."""

    def __init__(self, rule, beta1, beta2, epsilon):
        self.rule = rule
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)

    def options(self):
        """The compressor options of this correction."""
        return {"adam": self.rule, "betas": [self.beta1, self.beta2], "eps": self.epsilon}

    def prepare(self, opt, indices, grads, weights):
        """``g = clip(rescale_grad * g + wd_i * w, clip_gradient)`` in place (``adam``; MXNet's
        ``d``), or ``clip(rescale_grad * g, clip_gradient)`` (``adamw``: its decay is
        decoupled, applied by ``neutral``)."""
        r, clip = opt.rescale_grad, opt.clip_gradient
        wds = opt._get_wds(list(indices)) if self.rule == "adam" else [0.0] * len(grads)
        for g, w, wd in zip(grads, weights, wds):
            if r != 1.0:
                g *= r
            if wd:
                g += wd * w
            if clip:
                mx.nd.clip(g, -clip, clip, out=g)

    def lr_factor(self, opt, indices, key=0):
        """1.0: Adam's moments are kept in gradient units whatever the learning rate."""
        return 1.0

    def neutral(self, opt):
        """The optimizer applying the pipeline's step as it is, restored afterwards."""
        return _stepping(opt, self.rule == "adamw")

    def state(self):
        return {"adam": self.rule, "beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon}

    def load(self, saved):
        pass


def _step(opt, decoupled, index, weight, grad, state):
    """``w -= lr * grad`` (``decoupled``: ``w *= 1 - lr * wd`` first), with the optimizer's
    own learning rate and weight decay of ``index`` (scheduler, ``lr_mult``, ``wd_mult``)."""
    if isinstance(index, (tuple, list)):
        for i, w, g in zip(index, weight, grad):
            _step(opt, decoupled, i, w, g, None)
        return
    opt._update_count(index)
    lr = opt._get_lr(index)
    wd = opt._get_wd(index) if decoupled else 0.0
    if wd:
        weight[:] = weight * (1.0 - lr * wd)
    weight[:] = weight - lr * grad


@contextlib.contextmanager
def _stepping(opt, decoupled):
    """Within: ``opt.update`` applies the step (``_step``) and ``create_state`` makes none
    (instance attributes over the class's methods, removed afterwards, so the optimizer
    saves and reports what the user set)."""
    had = {k: opt.__dict__[k] for k in ("update", "create_state") if k in opt.__dict__}
    opt.update = lambda index, weight, grad, state: _step(opt, decoupled, index, weight, grad, state)
    opt.create_state = lambda index, weight: None
    try:
        yield opt
    finally:
        for k in ("update", "create_state"):
            if k in had:
                setattr(opt, k, had[k])
            else:
                opt.__dict__.pop(k, None)
