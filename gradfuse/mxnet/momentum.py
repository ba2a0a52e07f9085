"""DGC's momentum correction in the MXNet trainers: which optimizers it applies to, and how
``DistributedTrainer`` and ``DistributedOptimizer`` move their momentum into the
compressor state (``gradfuse.compressors.momentum``; docs/mxnet.md, "Momentum correction").

MXNet 1.9.1's SGD kernel (``sgd_mom_update``) does, per weight ``w`` with gradient ``g``::

    d   = clip(rescale_grad * g, clip_gradient) + wd * w
    mom = m * mom - lr * d;   w = w + mom

With the correction every rank keeps its own velocity ``u`` in gradient units instead,
error feedback accumulates it, and the optimizer runs without momentum::

    d = clip(rescale_grad * g, clip_gradient) + wd * w    (prepare, here, on this rank's g)
    u = (m * f) * u + d,  x = u                           (the pipeline; NAG: x = m * u + d)
    w = w - lr * mean_ranks(decompress(compress(x + e)))  (the optimizer: momentum, wd and
                                                           clip 0, rescale_grad 1)

with ``f = lr_prev / lr`` when the learning rate changed since the last step (1 while it
is constant). Without compression that is MXNet's update exactly in real arithmetic:
``mom = -lr * mean(u)`` holds at every step, learning-rate changes included (NAG's kernel
``nag_mom_update`` keeps the same lr-scaled buffer and steps by ``d + m * u``). wd and
``wd_mult`` enter ``d`` as MXNet's ``_get_wds`` gives them, ``lr_mult`` stays in the
optimizer. What differs: ``clip_gradient`` clips each rank's own rescaled gradient
(the velocity is local, so the average does not exist yet; on one rank it is the same),
and ``f`` uses the base learning rate (``lr_mult`` is taken as constant).
"""
import contextlib

import mxnet as mx

from ..compressors import randomk
from ..compressors.policy import LayerPolicy
from . import adam as _adam

SUPPORTED = {mx.optimizer.SGD: False, mx.optimizer.NAG: True}      # class -> Nesterov
_NEUTRAL = {"momentum": 0.0, "wd": 0.0, "clip_gradient": None, "rescale_grad": 1.0}
_OWN = ("momentum", "nesterov", "momentum_masking")


def setup(optimizer, compress, options, requested, who, adam_requested=None):
    """``(compress, options, Correction or AdamCorrection or None)`` for a trainer of ``optimizer``.

    ``requested`` (``momentum_correction``): None (on for SGD and NAG with momentum > 0 and a
    lossy compressor that takes a correction by default, ``corrects_by_default``: one that
    keeps error feedback), True (on; other optimizers or no momentum are an error) or False
    (off, the Adam correction too). Adam and AdamW get the Adam correction by the same
    default rule (``gradfuse.mxnet.adam``); ``adam_requested`` (``adam_correction``): True
    forces it, False turns it off.
    """
    if type(optimizer) in _adam.RULES:
        if requested is True:
            raise ValueError(f"{who}: momentum_correction=True needs an SGD or NAG optimizer (DGC's momentum "
                             f"correction moves their momentum into the compressor state); got "
                             f"{type(optimizer).__name__.lower()}, whose correction is the Adam correction: on "
                             f"by default with a lossy compressor that keeps error feedback, adam_correction=True "
                             f"forces it")
        return _adam.setup(optimizer, compress, options, False if requested is False else adam_requested, who)
    if adam_requested:
        raise ValueError(f"{who}: adam_correction=True needs an adam or adamw optimizer; got "
                         f"{type(optimizer).__name__.lower()}")
    own = sorted(set(options) & set(_OWN))
    if own:
        raise TypeError(f"{who}: option(s) {', '.join(own)} come from the optimizer "
                        f"({type(optimizer).__name__.lower()}, momentum="
                        f"{getattr(optimizer, 'momentum', None)}); use momentum_correction= to turn DGC's "
                        f"momentum correction on or off")
    if requested not in (None, True, False):
        raise TypeError(f"{who}: momentum_correction must be None, True or False, got {requested!r}")
    kind = type(optimizer)
    m = float(getattr(optimizer, "momentum", 0.0) or 0.0)
    _warn_delayed_update(compress, options, m, who)
    if requested is None:
        if kind not in SUPPORTED or m <= 0 or not _adam.corrected_by_default(compress, options):
            return compress, options, None
    elif requested is False:
        return compress, options, None
    elif kind not in SUPPORTED:
        raise ValueError(f"{who}: momentum_correction=True needs an SGD or NAG optimizer (DGC's momentum "
                         f"correction moves their momentum into the compressor state); got "
                         f"{kind.__name__.lower()}, which keeps its own state: leave the correction off "
                         f"(its gradients then go through error feedback as they are)")
    elif m <= 0:
        raise ValueError(f"{who}: momentum_correction=True needs an optimizer with momentum > 0; "
                         f"{kind.__name__.lower()} has momentum={m}")
    nesterov = SUPPORTED[kind]
    compress, options = _adam.with_options(compress, options, {"momentum": m, "nesterov": nesterov},
                                           "momentum correction")
    return compress, options, Correction(m, nesterov)


def _warn_delayed_update(compress, options, momentum, who):
    """Random-k at a small ratio with error feedback meeting the optimizer's momentum
    (``gradfuse.compressors.randomk.warn_delayed_update``; once per process)."""
    if momentum < randomk.DELAY_MOMENTUM:
        return
    try:
        policy = LayerPolicy.create(compress, 0, **options)
    except (TypeError, ValueError):
        return                         # the trainer's own checks name what is wrong
    randomk.warn_delayed_update(policy.compressors[1:], momentum, who)


def upcoming_lr(opt, indices):
    """The base learning rate the optimizer will use for its next update of ``indices``
    (MXNet counts the update before it asks its scheduler)."""
    n = opt.num_update
    for i in indices:
        n = max(n, opt._index_update_count.get(i, opt.begin_num_update) + 1)
    return opt.lr_scheduler(n) if opt.lr_scheduler is not None else opt.lr


class Correction:
    """One trainer's momentum correction: ``prepare`` the gradients, the learning-rate
    factor for the velocity, and the optimizer run without momentum (``neutral``)."""

    def __init__(self, momentum, nesterov):
        self.momentum, self.nesterov = momentum, nesterov
        self.last_lr = {}        # key (a group of parameters) -> base lr of its last update

    def prepare(self, opt, indices, grads, weights):
        """``g = clip(rescale_grad * g, clip_gradient) + wd_i * w`` in place (MXNet's ``d``)."""
        r, clip = opt.rescale_grad, opt.clip_gradient
        for g, w, wd in zip(grads, weights, opt._get_wds(list(indices))):
            if r != 1.0:
                g *= r
            if clip:
                mx.nd.clip(g, -clip, clip, out=g)
            if wd:
                g += wd * w

    def lr_factor(self, opt, indices, key=0):
        """``lr_prev / lr`` for the velocity of group ``key`` (1.0 when unchanged, at the
        first step, or when either is 0)."""
        lr = float(upcoming_lr(opt, indices))
        prev = self.last_lr.get(key)
        self.last_lr[key] = lr
        if prev is None or prev == lr or not lr or not prev:
            return 1.0
        return prev / lr

    @staticmethod
    @contextlib.contextmanager
    def neutral(opt):
        """The optimizer without momentum, weight decay, clipping and rescaling (they are in
        the velocity), restored afterwards, so that it saves and reports what the user set."""
        saved = {k: getattr(opt, k) for k in _NEUTRAL}
        for k, v in _NEUTRAL.items():
            setattr(opt, k, v)
        try:
            yield opt
        finally:
            for k, v in saved.items():
                setattr(opt, k, v)

    def state(self):
        return {"momentum": self.momentum, "nesterov": self.nesterov, "last_lr": dict(self.last_lr)}

    def load(self, saved):
        if saved:
            self.last_lr = dict(saved.get("last_lr", {}))
