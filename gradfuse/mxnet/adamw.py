"""``adamw``: AdamW for MXNet, with ``torch.optim.AdamW``'s update rule.

MXNet 1.9.1 registers no AdamW optimizer (only the operator ``mx.nd.contrib.adamw_update``,
whose rule differs: its decay is scaled by an extra ``eta``). Importing ``gradfuse.mxnet``
registers this class as ``"adamw"``, so ``gluon.Trainer(params, "adamw", ...)`` and
``DistributedTrainer(params, "adamw", ...)`` train with the rule PyTorch users know, per
weight ``w`` with gradient ``g`` at step ``t``::

    g = clip(rescale_grad * g, clip_gradient)
    w = w * (1 - lr * wd)                          # decoupled weight decay
    m = m + (1 - beta1) * (g - m)                  # torch: exp_avg.lerp_(g, 1 - beta1)
    v = beta2 * v + (1 - beta2) * g * g
    w = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + epsilon)

``wd`` (with ``wd_mult``) is the decoupled decay (torch's ``weight_decay``, default 0.01),
``lr`` comes from the learning rate and its scheduler times ``lr_mult``.
"""
import math

import mxnet as mx


@mx.optimizer.register
class AdamW(mx.optimizer.Optimizer):
    """AdamW with ``torch.optim.AdamW``'s update rule (module docstring).

    Args:
        learning_rate: the base learning rate (default 0.001, torch's).
        beta1, beta2: the moments' decay rates (torch's ``betas``, default 0.9, 0.999).
        epsilon: added to the bias-corrected ``sqrt(v)`` (default 1e-8).
        wd: the decoupled weight decay (torch's ``weight_decay``, default 0.01).
        **kwargs: MXNet's optimizer options (``rescale_grad``, ``clip_gradient``,
            ``lr_scheduler``, ...).

    Example:
        >>> trainer = gluon.Trainer(net.collect_params(), "adamw",
        ...                         {"learning_rate": 1e-3, "wd": 0.01})
    """

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, wd=wd, **kwargs)
        for name, value in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"adamw: {name} must be in [0, 1), got {value!r}")
        if not epsilon >= 0.0:
            raise ValueError(f"adamw: epsilon must be >= 0, got {epsilon!r}")
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)

    def create_state(self, index, weight):
        zeros = lambda: mx.nd.zeros(weight.shape, weight.context, dtype=weight.dtype)  # noqa: E731
        return zeros(), zeros()        # the first moment m, the second moment v

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        t = self._index_update_count[index]
        g = grad * self.rescale_grad
        if self.clip_gradient:
            g = mx.nd.clip(g, -self.clip_gradient, self.clip_gradient)
        m, v = state
        if wd:
            weight[:] = weight * (1.0 - lr * wd)
        m[:] = m + (1.0 - self.beta1) * (g - m)
        v[:] = v * self.beta2 + (1.0 - self.beta2) * (g * g)
        step = lr / (1.0 - self.beta1 ** t)
        denom = mx.nd.sqrt(v) / math.sqrt(1.0 - self.beta2 ** t) + self.epsilon
        weight[:] = weight - step * (m / denom)
