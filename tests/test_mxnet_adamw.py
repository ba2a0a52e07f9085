"""``adamw`` (gradfuse.mxnet.adamw): torch.optim.AdamW's update rule in MXNet, against a
numpy transcription of torch's ``_single_tensor_adamw`` (decoupled decay, lerp for the
first moment, bias corrections, epsilon added after the corrected square root)."""
import math

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
import gradfuse.mxnet  # noqa: E402,F401  (registers "adamw")


def torch_adamw(w, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, lrs=None, rescale=1.0,
                clip=None):
    """torch.optim.AdamW (amsgrad=False, maximize=False) in float32 numpy."""
    f = np.float32
    w = w.astype(f).copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    b1, b2 = betas
    for t, g in enumerate(grads, 1):
        lr_t = lrs[t - 1] if lrs is not None else lr
        g = (g * f(rescale)).astype(f)
        if clip is not None:
            g = np.clip(g, -clip, clip).astype(f)
        w = (w * f(1 - lr_t * weight_decay)).astype(f)
        m = (m + f(1 - b1) * (g - m)).astype(f)
        v = (v * f(b2) + f(1 - b2) * (g * g)).astype(f)
        denom = (np.sqrt(v) / f(math.sqrt(1 - b2 ** t)) + f(eps)).astype(f)
        w = (w - f(lr_t / (1 - b1 ** t)) * (m / denom)).astype(f)
    return w


def run_mxnet(w0, grads, **opts):
    opt = mx.optimizer.create("adamw", **opts)
    w = mx.nd.array(w0, dtype="float32")
    state = opt.create_state(0, w)
    for g in grads:
        opt.update(0, w, mx.nd.array(g, dtype="float32"), state)
    return w.asnumpy()


@pytest.mark.parametrize("opts", [{}, {"wd": 0.0}, {"wd": 0.1, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6},
                                  {"rescale_grad": 0.5, "clip_gradient": 0.3}])
def test_adamw_follows_torch_adamw(opts):
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(257).astype(np.float32)
    grads = [rng.standard_normal(257).astype(np.float32) for _ in range(12)]
    lr = 1e-2
    got = run_mxnet(w0, grads, learning_rate=lr, **opts)
    want = torch_adamw(w0, grads, lr, betas=(opts.get("beta1", 0.9), opts.get("beta2", 0.999)),
                       eps=opts.get("epsilon", 1e-8), weight_decay=opts.get("wd", 0.01),
                       rescale=opts.get("rescale_grad", 1.0), clip=opts.get("clip_gradient"))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7)
    assert not np.array_equal(got, w0)


def test_adamw_scheduler_and_wd_mult_in_a_gluon_trainer():
    """A Gluon Trainer with "adamw": the learning rate comes from the scheduler, and a
    parameter with wd_mult=0 is not decayed (the decay is per parameter, decoupled)."""
    rng = np.random.default_rng(4)
    sched = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.05)
    p = mx.gluon.Parameter("w", shape=(9,), init=mx.init.Constant(0.5))
    q = mx.gluon.Parameter("b", shape=(9,), init=mx.init.Constant(0.5), wd_mult=0.0)
    params = mx.gluon.ParameterDict()
    params._params.update({"w": p, "b": q})
    params.initialize(ctx=mx.cpu())
    trainer = mx.gluon.Trainer(params, "adamw", {"learning_rate": 0.05, "wd": 0.1, "lr_scheduler": sched},
                               kvstore=None)
    grads = [rng.standard_normal(9).astype(np.float32) for _ in range(5)]
    lrs = []
    for g in grads:
        x = mx.nd.array(g)
        with mx.autograd.record():
            loss = (p.data() * x).sum() + (q.data() * x).sum()       # d/dw = d/db = g
        loss.backward()
        trainer.step(1)
        lrs.append(trainer.learning_rate)
    w0 = np.full(9, 0.5, np.float32)
    np.testing.assert_allclose(p.data().asnumpy(), torch_adamw(w0, grads, None, weight_decay=0.1, lrs=lrs),
                               rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(q.data().asnumpy(), torch_adamw(w0, grads, None, weight_decay=0.0, lrs=lrs),
                               rtol=2e-6, atol=2e-7)
    assert lrs[0] != lrs[-1]


def test_adamw_refuses_bad_betas():
    with pytest.raises(ValueError, match="beta2 must be in"):
        mx.optimizer.create("adamw", beta2=1.0)
