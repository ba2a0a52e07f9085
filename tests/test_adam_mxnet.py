"""The Adam correction in gradfuse.mxnet, one process (size 1): DistributedTrainer and
DistributedOptimizer against a plain gluon.Trainer with MXNet's ``adam`` and gradfuse's
``adamw`` (weight decay, wd_mult, lr_mult, clip_gradient, rescale_grad, schedulers), the
default rules, the errors, checkpoints and the KVStore's explicit options and refusal.

The check of the issue: with ``compress=None`` and the correction on, every step up to the
freeze (here: all, nothing is compressed) matches plain Adam to 1e-6 relative, measured on
the parameters' total change (|w - w_ref| / |w_ref - w_0| in the 2-norm over every
parameter), after every step.
"""
import os
import tempfile

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
pytest.importorskip("mpi4py")
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402

from mxnet_nets import B, IN, OUT, flat, mlp  # noqa: E402
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def batch(s):
    rng = np.random.default_rng([s, 99])
    return mx.nd.array(rng.standard_normal((B, IN))), mx.nd.array(rng.integers(0, OUT, B))


def train(net, trainer, steps, start=0, each=None):
    for s in range(start, start + steps):
        x, y = batch(s)
        with autograd.record():
            loss = LOSS(net(x), y)
        loss.backward()
        trainer.step(B)
        if each is not None:
            each(s)


def rel_change(w, w_ref, w0):
    return float(np.linalg.norm(w - w_ref) / np.linalg.norm(w_ref - w0))


def params(extra):
    p = {"learning_rate": 0.01, **extra}
    if p.get("lr_scheduler") == "factor":
        p["lr_scheduler"] = mx.lr_scheduler.FactorScheduler(step=20, factor=0.5, base_lr=0.01)
    elif p.get("lr_scheduler") == "cosine":
        p["lr_scheduler"] = mx.lr_scheduler.CosineScheduler(max_update=150, base_lr=0.01, warmup_steps=10,
                                                           final_lr=0.001)
    return p


def lockstep(opt, extra, make, steps=100, mults=False):
    """Train a gluon.Trainer and ``make(net, params)``'s trainer side by side; the worst
    relative difference of the parameters' change over every step."""
    ref, net = mlp(), mlp()
    if mults:
        for n in (ref, net):
            n[0].bias.wd_mult = 0.0
            n[1].weight.lr_mult = 0.5
    w0 = flat(ref)
    rt = gluon.Trainer(ref.collect_params(), opt, params(extra), kvstore=None)
    tr = make(net, params(extra))
    worst = 0.0
    for s in range(steps):
        train(ref, rt, 1, start=s)
        train(net, tr, 1, start=s)
        worst = max(worst, rel_change(flat(net), flat(ref), w0))
    assert np.linalg.norm(flat(ref) - w0) > 0.1 * np.linalg.norm(w0)        # it trained
    return tr, worst


CASES = [("adam", {}), ("adam", {"wd": 1e-3}), ("adam", {"wd": 1e-3, "clip_gradient": 0.05}),
         ("adam", {"lr_scheduler": "factor", "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6}),
         ("adam", {"wd": 1e-3, "lr_scheduler": "cosine"}),
         ("adamw", {}), ("adamw", {"wd": 0.1, "clip_gradient": 0.05}), ("adamw", {"lr_scheduler": "cosine"})]


@pytest.mark.parametrize("opt,extra", CASES, ids=[f"{o}-{'-'.join(e)}" for o, e in CASES])
def test_correction_without_compression_equals_gluon_adam(opt, extra):
    """100 steps, compress=None, the correction forced on == gluon.Trainer with the same
    optimizer, 1e-6 relative after every step."""
    tr, worst = lockstep(opt, extra, lambda net, p: hvd.DistributedTrainer(net.collect_params(), opt, p,
                                                                          adam_correction=True))
    assert tr._adam_correction is not None and tr._correction is None
    assert tr._updaters[0].states[0] is None        # the optimizer keeps no Adam state of its own
    assert worst < 1e-6, worst


@pytest.mark.parametrize("opt", ["adam", "adamw"])
def test_wd_mult_and_lr_mult_are_kept(opt):
    _, worst = lockstep(opt, {"wd": 1e-2}, lambda net, p: hvd.DistributedTrainer(
        net.collect_params(), opt, p, adam_correction=True), steps=50, mults=True)
    assert worst < 1e-6, worst


@pytest.mark.parametrize("opt", ["adam", "adamw"])
def test_distributed_optimizer_equals_gluon_adam(opt):
    holder = {}

    def make(net, p):
        holder["opt"] = hvd.DistributedOptimizer(mx.optimizer.create(opt, **p), adam_correction=True)
        return gluon.Trainer(net.collect_params(), holder["opt"], kvstore=None)
    _, worst = lockstep(opt, {"wd": 1e-3}, make)
    assert holder["opt"]._adam_correction is not None
    assert worst < 1e-6, worst


def test_compressed_warmup_is_gluon_adam_then_trains():
    """1bit with warmup_steps=20: the first 20 steps are gluon's Adam (1e-6), then the
    compressed steps move away from it but keep training."""
    steps = []

    def make(net, p):
        return hvd.DistributedTrainer(net.collect_params(), "adamw", p, compress="1bit", warmup_steps=20)
    ref, net = mlp(), mlp()
    w0 = flat(ref)
    rt = gluon.Trainer(ref.collect_params(), "adamw", params({}), kvstore=None)
    tr = make(net, params({}))
    assert tr._adam_correction is not None and tr.pipeline.compressor.adam == "adamw"
    for s in range(40):
        train(ref, rt, 1, start=s)
        train(net, tr, 1, start=s)
        steps.append(rel_change(flat(net), flat(ref), w0))
    assert max(steps[:20]) < 1e-6, steps[:20]
    assert steps[-1] > 1e-4


def test_default_rules_and_errors():
    def trainer(opt, p=None, **kw):
        return hvd.DistributedTrainer(mlp().collect_params(), opt, p or {}, **kw)
    for opt in ("adam", "adamw"):
        on = trainer(opt, compress="1bit")
        assert on._adam_correction is not None and on.pipeline.compressor.adam == opt
        assert on.pipeline.compressor.betas == (0.9, 0.999)
        for kw in ({"compress": "fp16"}, {}, {"compress": "1bit", "momentum_correction": False},
                   {"compress": "1bit", "adam_correction": False}, {"compress": "1bit", "error_feedback": False}):
            off = trainer(opt, **kw)
            assert off._adam_correction is None and off.pipeline.compressor.adam is None, kw
    assert trainer("adam", {"beta1": 0.8, "epsilon": 1e-6}, compress="2bit").pipeline.compressor.betas[0] == 0.8
    pol = trainer("adamw", compress={"1": None, "*": "topk"})
    assert [c.adam for c in pol.pipeline.policy.compressors[1:]] == ["adamw"]
    with pytest.raises(ValueError, match="adam_correction=True needs an adam or adamw optimizer; got sgd"):
        trainer("sgd", {"momentum": 0.9}, adam_correction=True)
    with pytest.raises(TypeError, match="option\\(s\\) betas come from the optimizer \\(adam\\)"):
        trainer("adam", compress="1bit", betas=(0.9, 0.99))
    with pytest.raises(TypeError, match="adam_correction must be None, True or False"):
        trainer("adam", compress="1bit", adam_correction="yes")
    with pytest.raises(ValueError, match="momentum_correction=True needs an SGD or NAG optimizer.*adam_correction"):
        hvd.DistributedOptimizer(mx.optimizer.create("adamw"), momentum_correction=True)


def test_the_default_rule_is_the_compressors_attribute():
    """A compressor class with optimizer_correction=False (its own algorithm rules the
    corrections out) gets neither DGC's nor the Adam correction by default."""
    import gradfuse
    from gradfuse.compressors import OneBit

    class NoCorrection(OneBit):
        name = "1bit-nocorr"
        optimizer_correction = False
    from gradfuse.compressors import registry
    gradfuse.register_compressor("1bit-nocorr", NoCorrection)
    try:
        assert not NoCorrection().corrects_by_default and NoCorrection().error_feedback
        for opt, p in (("adam", {}), ("sgd", {"momentum": 0.9})):
            tr = hvd.DistributedTrainer(mlp().collect_params(), opt, p, compress="1bit-nocorr")
            assert tr._adam_correction is None and tr._correction is None, opt
        assert hvd.DistributedTrainer(mlp().collect_params(), "adam", {}, compress="1bit-nocorr",
                                      adam_correction=True)._adam_correction is not None
    finally:
        registry._REGISTRY.pop("1bit-nocorr", None)     # the registry is the process's


@pytest.mark.parametrize("at", [3, 8])
def test_checkpoint_restores_bit_exactly(at):
    """save_states / load_states before (3) and after (8) the freeze: m, v, the step
    counters, the freeze step and the mask come back, and training continues bit-exactly."""
    p = {"learning_rate": 0.01, "wd": 1e-3, "lr_scheduler": mx.lr_scheduler.FactorScheduler(step=3, factor=0.5,
                                                                                             base_lr=0.01)}
    tmp = tempfile.mkdtemp()
    pfile, sfile = os.path.join(tmp, "params"), os.path.join(tmp, "states")
    net = mlp()
    tr = hvd.DistributedTrainer(net.collect_params(), "adam", dict(p), compress="1bit", warmup_steps=5)
    train(net, tr, at)
    net.save_parameters(pfile)
    tr.save_states(sfile)
    train(net, tr, 6, start=at)
    want = flat(net)
    net2 = mlp()
    net2.load_parameters(pfile)
    tr2 = hvd.DistributedTrainer(net2.collect_params(), "adam", dict(p), compress="1bit", warmup_steps=5)
    tr2.load_states(sfile)
    train(net2, tr2, 6, start=at)
    np.testing.assert_array_equal(flat(net2), want)
    arrays = next(iter(tr2.pipeline.state_dict()["buckets"].values()))["arrays"]
    assert int(arrays["adam.freeze"][0]) == 5 and int(arrays["adam.step"][0]) == at + 6


def test_kvstore_takes_adam_and_refuses_a_trainer_with_adam():
    net = mlp()
    kv = hvd.KVStore(compress=None, adam="adamw", average=True)
    tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01}, kvstore=kv)
    with pytest.raises(ValueError, match="dist_gradfuse: the KVStore applies Adam \\(adam='adamw'.*optimizer adam "
                                         "would apply Adam a second time"):
        train(net, tr, 1)
    # the store's Adam with a plain SGD optimizer is AdamW (its wd decoupled, as SGD's on the
    # step); 1e-5: the step also takes the store's / rescale_grad and the optimizer's * rescale_grad,
    # and SGD's w - lr (s + wd w) rounds otherwise than AdamW's w (1 - lr wd) - lr s
    _, worst = lockstep("adamw", {"wd": 1e-2}, lambda net, p: gluon.Trainer(
        net.collect_params(), "sgd", p, kvstore=hvd.KVStore(adam="adamw")), steps=50)
    assert worst < 1e-5, worst
    for rule, bad, match in (("adamw", {"momentum": 0.9}, "has momentum=0.9"),
                             ("adamw", {"clip_gradient": 0.1}, "would clip Adam's steps"),
                             ("adam", {"wd": 1e-3}, "couples the decay into the gradient")):
        net = mlp()
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, **bad}, kvstore=hvd.KVStore(adam=rule))
        with pytest.raises(ValueError, match=match):
            train(net, tr, 1)
    kv = hvd.KVStore()
    kv.set_gradient_compression({"type": "1bit", "adam": "adamw", "warmup_steps": 10})
    assert kv.pipeline.compressor.adam == "adamw"
