"""The Adam correction in the DDP comm hook: ``CompressionState(compress, adam={...})``.

The hook keeps Adam's moments (``gradfuse.compressors.adam``, rule ``"adamw"``:
``torch.optim.AdamW``'s): each bucket's pipeline warms up with exact Adam on the averaged
gradients, freezes ``v``, then compresses the first moment with error feedback, and the
hook returns the preconditioned step ``m_hat / (sqrt(v_hat) + eps)`` in place of the
averaged gradient. The optimizer must then be ``torch.optim.SGD(lr=lr, momentum=0,
weight_decay=wd)``: ``w -= lr * (step + wd * w)`` is AdamW's ``w *= 1 - lr * wd; w -= lr *
step`` (decoupled decay) to float rounding, with the optimizer's learning rate and its
scheduler as the user set them.

``adam`` keys: ``betas`` (default (0.9, 0.999)), ``eps`` (1e-8), ``freeze_iter`` (the DDP
iteration from which ``v`` is frozen: the hook's ``iteration`` counter, the one
``start_iter`` counts; default None: each bucket layout's pipeline freezes by the adaptive
rule, or after ``warmup_steps`` of its own calls when that compressor option is given,
counted per layout, so a rebuild of DDP's buckets starts them again), ``clip`` (the
largest ``|g|`` of each rank's gradient, clipped before the moments, as MXNet's
``clip_gradient``: ``clip_grad_norm_`` between backward and the optimizer's step would clip
Adam's step instead, and the hook sees one bucket at a time, not the global norm).
A ``GradScaler`` cannot be used: it would unscale (and skip on) Adam's steps, not the
gradients (``check_optimizer`` refuses one).

DDP rebuilds its buckets after the first iteration: the new layouts' pipelines take over
the moments of their tensors from the old ones (``carry``; the tensors are known by their
parameter names, so give ``CompressionState`` the ``module``), so the exact warm-up is
``torch.optim.AdamW`` across the rebuild; a layout that changes after the freeze (or
whose tensors are not named) starts from zero, with its own warm-up.
"""
import warnings

import numpy as np

from ..compressors import adam as _cadam
from ..runtime import context as _runtime

KEYS = ("betas", "eps", "freeze_iter", "clip")


class AdamOptions:
    """The validated ``adam`` argument of a ``CompressionState``."""

    __slots__ = ("betas", "eps", "freeze_iter", "clip")

    def __init__(self, adam):
        if not isinstance(adam, dict):
            raise TypeError(f"adam must be a dict of {', '.join(KEYS)} (or None), got {type(adam).__name__}")
        unknown = sorted(set(adam) - set(KEYS))
        if unknown:
            raise TypeError(f"adam: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(KEYS)}")
        self.betas = tuple(adam.get("betas", (0.9, 0.999)))
        self.eps = adam.get("eps", 1e-8)
        fi = adam.get("freeze_iter")
        if fi is not None and (isinstance(fi, bool) or not isinstance(fi, int) or fi < 1):
            raise ValueError(f"adam: freeze_iter must be an int >= 1 (a DDP iteration) or None, got {fi!r}")
        self.freeze_iter = fi
        clip = adam.get("clip")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"adam: clip must be a number > 0 or None, got {clip!r}")
        self.clip = None if clip is None else float(clip)

    def pipeline_options(self):
        """The compressor options of the correction (validated by the compressor)."""
        return {"adam": "adamw", "betas": list(self.betas), "eps": self.eps}

    def __repr__(self):
        return (f"{{'betas': {self.betas}, 'eps': {self.eps}, 'freeze_iter': {self.freeze_iter}, "
                f"'clip': {self.clip}}}")


def configure(adam, momentum, start_iter, opts):
    """The ``AdamOptions`` of a ``CompressionState`` (None without ``adam``), its options
    added to the pipeline's ``opts``."""
    if adam is None:
        return None
    if momentum:
        raise ValueError(f"CompressionState: momentum={momentum} and adam exclude each other (Adam's first "
                         f"moment is its momentum)")
    if start_iter:
        raise ValueError(f"CompressionState: start_iter={start_iter} with adam: the exact warm-up of the Adam "
                         f"correction is its own (it keeps the moments across it); give adam's freeze_iter instead")
    options = AdamOptions(adam)
    opts.update(options.pipeline_options())
    return options


def clip(state, io):
    """Clip this rank's gradients of one bucket (``gradfuse.torch.buckets.BucketIO``) to
    ``[-clip, clip]``, where the step will read them: the bucket's buffer, or a bfloat16
    bucket's float32 staging buffer (on the bucket's stream on a GPU)."""
    c = state.adam.clip
    if c is None:
        return
    if io._f32 is None:
        io.buf.clamp_(-c, c)
        return
    with io._context():
        xp = np if isinstance(io._f32, np.ndarray) else _cupy()
        xp.clip(io._f32, -c, c, out=io._f32)


def _cupy():
    from ..gpu import cupy
    return cupy()


def freeze_if_due(state, pipe, iteration):
    """Before a bucket's step of DDP iteration ``iteration`` (the hook's thread): from
    ``freeze_iter`` on, tell the bucket's pipeline to freeze (queued on its communication
    thread, after the steps in flight, so every rank freezes at the same step)."""
    options = state.adam
    if options.freeze_iter is None:
        return
    rule = pipe.state.meta.setdefault("adam", {"calm": 0, "frozen_at": 0})
    rule["manual"] = True                    # the iteration decides, not the adaptive rule
    if iteration >= options.freeze_iter and not rule.get("requested"):
        rule["requested"] = True
        _runtime.context(state.comm).engine.submit(lambda: _freeze(pipe), "adam-freeze")


def _freeze(pipe):
    rule = pipe.state.meta["adam"]
    if not rule["frozen_at"]:
        rule["frozen_at"] = max(pipe.state.step, 1)


def check_optimizer(state, optimizer, scaler):
    """``CompressionState.check_optimizer`` with the Adam correction: a GradScaler is refused
    (ValueError); an optimizer that would apply Adam (betas) or momentum again warns once.
    Without it: warns once when an Adam-family optimizer meets a compressor that takes the
    correction by default. Returns whether it warned."""
    if state.adam is not None and scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
        raise ValueError("gradfuse.torch: CompressionState(adam=...) returns Adam's steps, and a GradScaler would "
                         "unscale them (and skip steps on their values), not the gradients: train without "
                         "GradScaler (bf16 autocast needs none), or without adam")
    if state._warned:
        return False
    groups = optimizer.param_groups
    betas = next((g.get("betas") for g in groups if g.get("betas")), None)
    m = next((g.get("momentum") for g in groups if g.get("momentum")), 0)
    if state.adam is not None and (betas or m):
        state._warned = True
        warnings.warn(f"gradfuse.torch: CompressionState(adam=...) applies Adam, but {type(optimizer).__name__} "
                      f"has {'betas=' + str(betas) if betas else 'momentum=' + str(m)}: Adam would run twice; use "
                      f"torch.optim.SGD(lr=..., momentum=0, weight_decay=...) (its decay is then AdamW's)",
                      RuntimeWarning, stacklevel=3)
        return True
    if state.adam is None and not state.momentum and betas and _corrects(state):
        state._warned = True
        warnings.warn(f"gradfuse.torch: {type(optimizer).__name__} (betas={betas}) with a lossy compressor "
                      f"({state.compress!r}): error feedback on the gradients does not carry over to Adam's "
                      f"update; CompressionState(..., adam={{}}) with torch.optim.SGD(momentum=0) keeps Adam's "
                      f"moments in the hook (docs/torch.md)", RuntimeWarning, stacklevel=3)
        return True
    return False


def _corrects(state):
    from ..compressors.policy import LayerPolicy
    opts = {k: v for k, v in state._opts.items() if k not in ("min_elements", "nonfinite")}
    try:
        policy = LayerPolicy.create(state.compress, 0, **opts)
    except (TypeError, ValueError):
        return False
    return any(c.corrects_by_default for c in policy.compressors[1:])


def harvest(state, key, pipe):
    """Keep the per-tensor moments of the pipeline of ``key`` = (warm, index, layout) (one
    bucket: the DDP bucket's tensors in order; host arrays) while its ``v`` is live, for
    ``carry``."""
    sd = pipe.state.buckets
    if len(sd) != 1 or pipe.state.step == 0:      # nothing yet, or its first step still in flight
        return
    arrays = next(iter(sd.values())).arrays
    if _cadam.M not in arrays or int(arrays[_cadam.FREEZE][0]):
        return
    m, v = (a if isinstance(a, np.ndarray) else a.get() for a in (arrays[_cadam.M], arrays[_cadam.V]))
    step, pos = int(arrays[_cadam.STEP][0]), 0
    names, shapes = key[2][0], key[2][1]
    for name, shape in zip(names, shapes):
        n = int(np.prod(shape, dtype=np.int64))
        if pos + n > m.size or _tensor(name) is None:
            return
        state._carry[_tensor(name)] = (m[pos:pos + n].copy(), v[pos:pos + n].copy(), step)
        pos += n


def carry(state, pipe, layout):
    """A new bucket layout's pipeline starts from the moments its tensors had (``harvest`` of
    every pipeline so far), when every tensor has some, all of the same step."""
    for key, (p, _) in list(state._pipes.items()):
        if p is not pipe:
            harvest(state, key, p)
    got = [state._carry.get(_tensor(name)) for name in layout[0] if _tensor(name) is not None]
    if len(got) != len(layout[0]):
        return
    if not got or any(g is None for g in got) or len({g[2] for g in got}) != 1:
        return
    entry = {"n": 0, "residual": np.zeros(0, np.float32), "server_residual": np.zeros(0, np.float32),
             "algorithm": "allgather",
             "arrays": {_cadam.M: np.concatenate([g[0] for g in got]), _cadam.V: np.concatenate([g[1] for g in got]),
                        _cadam.STEP: np.array([got[0][2]], np.int64), _cadam.FREEZE: np.zeros(1, np.int64)}}
    pipe.state.seed(0, entry)


def _tensor(name):
    """A tensor's parameter name, without the hook's ``bucket<i>.`` prefix (stable across a
    rebuild), or None where the hook names it by its position (no ``module`` given)."""
    rest = name.split(".", 1)[1] if name.startswith("bucket") and "." in name else name
    return None if rest.isdigit() else rest
