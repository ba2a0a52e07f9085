"""DGC's momentum correction in gradfuse.mxnet, one process (size 1): DistributedTrainer and
DistributedOptimizer against a plain gluon.Trainer, the default rules, the errors, the
KVStore's explicit momentum and its refusal, checkpoints.

The equivalence check of issue 14: with ``compress=None`` and the correction forced on,
100 steps match a plain ``gluon.Trainer`` with SGD momentum to 1e-6 relative (max |a - b|
over max |a|, all parameters). For scale, the same gluon.Trainer with the loss divided by
the batch inside the graph instead of ``step(B)`` (the same math, other roundings) differs
from itself by 2e-7 to 1.8e-6 after 100 steps on these nets (float32 noise; measured while
writing this test): the MLP here runs at lr 0.05, where that noise is 3-6e-7.
"""
import os
import re
import tempfile

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
pytest.importorskip("mpi4py")
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402

from mxnet_nets import B, HID, IN, OUT, flat, mlp  # noqa: E402,F401
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def train(net, trainer, steps, start=0):
    for s in range(start, start + steps):
        rng = np.random.default_rng([s, 99])
        x, y = mx.nd.array(rng.standard_normal((B, IN))), mx.nd.array(rng.integers(0, OUT, B))
        with autograd.record():
            loss = LOSS(net(x), y)
        loss.backward()
        trainer.step(B)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(a).max())


def schedule(kind):
    if kind == "factor":
        return mx.lr_scheduler.FactorScheduler(step=20, factor=0.5, base_lr=0.05)
    if kind == "cosine":       # warm-up then cosine, changing the lr at every step
        return mx.lr_scheduler.CosineScheduler(max_update=150, base_lr=0.05, warmup_steps=10, final_lr=0.001)
    return None


CASES = [("sgd", {}), ("sgd", {"wd": 1e-3}), ("sgd", {"wd": 1e-3, "clip_gradient": 0.05}),
         ("sgd", {"wd": 1e-3, "lr_scheduler": "factor"}),
         ("sgd", {"wd": 1e-3, "lr_scheduler": "cosine"}), ("nag", {}), ("nag", {"lr_scheduler": "factor"})]


@pytest.mark.parametrize("opt,extra", CASES, ids=[f"{o}-{'-'.join(e)}" for o, e in CASES])
def test_correction_without_compression_equals_gluon_momentum(opt, extra):
    """100 steps, compress=None, correction forced on == gluon.Trainer with momentum, 1e-6."""
    def params():
        p = {"learning_rate": 0.05, "momentum": 0.9, **extra}
        if "lr_scheduler" in p:
            p["lr_scheduler"] = schedule(p["lr_scheduler"])
        return p
    ref, net = mlp(), mlp()
    train(ref, gluon.Trainer(ref.collect_params(), opt, params(), kvstore=None), 100)
    tr = hvd.DistributedTrainer(net.collect_params(), opt, params(), momentum_correction=True)
    train(net, tr, 100)
    assert tr._correction is not None and tr.optimizer.momentum == 0.9     # the user's settings stay
    assert rel(flat(ref), flat(net)) < 1e-6, rel(flat(ref), flat(net))
    assert rel(flat(ref), flat(mlp())) > 0.1            # it trained


def test_wd_mult_and_lr_mult_are_kept():
    ref, net = mlp(), mlp()
    for n in (ref, net):
        n[0].bias.wd_mult = 0.0
        n[1].weight.lr_mult = 0.5
    p = {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-2}
    train(ref, gluon.Trainer(ref.collect_params(), "sgd", dict(p), kvstore=None), 50)
    train(net, hvd.DistributedTrainer(net.collect_params(), "sgd", dict(p), momentum_correction=True), 50)
    assert rel(flat(ref), flat(net)) < 1e-6


def test_distributed_optimizer_correction_equals_gluon_momentum():
    ref, net = mlp(), mlp()
    p = {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3}
    train(ref, gluon.Trainer(ref.collect_params(), "sgd", dict(p), kvstore=None), 100)
    opt = hvd.DistributedOptimizer(mx.optimizer.create("sgd", **p), momentum_correction=True)
    train(net, gluon.Trainer(net.collect_params(), opt, kvstore=None), 100)
    assert opt._correction is not None and opt.momentum == 0.9
    assert rel(flat(ref), flat(net)) < 1e-6


def test_default_rules_and_errors():
    p = {"learning_rate": 0.1, "momentum": 0.9}
    on = hvd.DistributedTrainer(mlp().collect_params(), "sgd", dict(p), compress="1bit")
    assert on._correction is not None and on.pipeline.compressor.momentum == 0.9
    nag = hvd.DistributedTrainer(mlp().collect_params(), "nag", dict(p), compress="topk", ratio=0.1)
    assert nag.pipeline.compressor.nesterov and nag.pipeline.compressor.momentum_masking
    for kw in ({"compress": "fp16"}, {}, {"compress": "1bit", "momentum_correction": False}):
        tr = hvd.DistributedTrainer(mlp().collect_params(), "sgd", dict(p), **kw)
        assert tr._correction is None and tr.pipeline.compressor.momentum == 0.0, kw
    assert hvd.DistributedTrainer(mlp().collect_params(), "sgd", {"learning_rate": 0.1},
                                  compress="1bit")._correction is None          # no momentum
    assert hvd.DistributedTrainer(mlp().collect_params(), "adam", {}, compress="1bit")._correction is None
    with pytest.raises(ValueError, match="momentum_correction=True needs an SGD or NAG optimizer.*got adam"):
        hvd.DistributedTrainer(mlp().collect_params(), "adam", {}, compress="1bit", momentum_correction=True)
    with pytest.raises(ValueError, match="needs an optimizer with momentum > 0; sgd has momentum=0.0"):
        hvd.DistributedTrainer(mlp().collect_params(), "sgd", {}, momentum_correction=True)
    with pytest.raises(TypeError, match="option\\(s\\) momentum come from the optimizer \\(sgd, momentum=0.9\\)"):
        hvd.DistributedTrainer(mlp().collect_params(), "sgd", dict(p), compress="1bit", momentum=0.5)
    with pytest.raises(ValueError, match="DistributedOptimizer: momentum_correction=True needs an SGD or NAG"):
        hvd.DistributedOptimizer(mx.optimizer.create("rmsprop"), momentum_correction=True)
    # a layer policy: the lossy patterns get the momentum, the None ones the pipeline's velocity
    pol = hvd.DistributedTrainer(mlp().collect_params(), "sgd", dict(p), compress={"1": None, "*": "1bit"})
    assert pol._correction is not None
    assert [c.momentum for c in pol.pipeline.policy.compressors[1:]] == [0.9]


def test_compressed_trainer_with_correction_checkpoint_restores_bit_exactly():
    p = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4,
         "lr_scheduler": mx.lr_scheduler.FactorScheduler(step=3, factor=0.5, base_lr=0.1)}
    tmp = tempfile.mkdtemp()
    pfile, sfile = os.path.join(tmp, "params"), os.path.join(tmp, "states")
    net = mlp()
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(p), compress="topk", ratio=0.2)
    train(net, tr, 4)
    net.save_parameters(pfile)
    tr.save_states(sfile)
    train(net, tr, 4, start=4)
    want = flat(net)
    net2 = mlp()
    net2.load_parameters(pfile)
    tr2 = hvd.DistributedTrainer(net2.collect_params(), "sgd", dict(p), compress="topk", ratio=0.2)
    tr2.load_states(sfile)
    train(net2, tr2, 4, start=4)
    np.testing.assert_array_equal(flat(net2), want)
    assert tr2.optimizer.momentum == 0.9 and tr2._updaters[0].states[0] is None   # no momentum buffers


def test_kvstore_takes_momentum_and_refuses_a_trainer_with_momentum():
    net = mlp()
    kv = hvd.KVStore(compress=None, momentum=0.9, average=True)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv)
    with pytest.raises(ValueError, match="dist_gradfuse: the KVStore applies momentum=0.9 .*compressor 'none'.*"
                                         "optimizer sgd has momentum=0.9 too: momentum applied twice diverges"):
        train(net, tr, 1)
    # the store's velocity with an optimizer without momentum is SGD momentum (no wd here)
    ref, net = mlp(), mlp()
    train(ref, gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                             kvstore=None), 50)
    kv = hvd.KVStore(momentum=0.9)
    train(net, gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05}, kvstore=kv), 50)
    assert rel(flat(ref), flat(net)) < 1e-6
    kv = hvd.KVStore()
    kv.set_gradient_compression({"type": "1bit", "momentum": 0.9})
    assert kv.pipeline.compressor.momentum == 0.9


def test_allreduce_grads_then_update_with_correction_needs_the_batch_size():
    """Gluon's split step (allreduce_grads, then update) with the correction on: without a
    batch size the exchange would fold a stale rescale_grad into the velocity (the first
    step batch_size times too large), so it raises; with it, the split step equals step()."""
    p = {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3}
    a, b = mlp(), mlp()
    ta = hvd.DistributedTrainer(a.collect_params(), "sgd", dict(p), momentum_correction=True)
    tb = hvd.DistributedTrainer(b.collect_params(), "sgd", dict(p), momentum_correction=True)
    train(a, ta, 20)
    for s in range(20):
        rng = np.random.default_rng([s, 99])
        x, y = mx.nd.array(rng.standard_normal((B, IN))), mx.nd.array(rng.integers(0, OUT, B))
        with autograd.record():
            loss = LOSS(b(x), y)
        loss.backward()
        if s == 0:
            with pytest.raises(ValueError, match="batch size is needed"):
                tb.allreduce_grads()
        tb.allreduce_grads(B)
        if s == 0:
            with pytest.raises(ValueError, match="same batch size"):
                tb.update(2 * B)        # refused before anything is applied; the step is pending
        tb.update(B)
    assert rel(flat(a), flat(b)) < 1e-6, rel(flat(a), flat(b))
    plain = hvd.DistributedTrainer(mlp().collect_params(), "sgd", dict(p), momentum_correction=False)
    assert plain._correction is None      # without the correction Gluon's split step is unchanged


def test_distributed_optimizer_states_in_gluons_pickle_resume_and_are_validated():
    """DistributedOptimizer's velocities ride inside Gluon's optimizer-state pickle (before,
    pickling it with the correction on failed: its keys are tuples): a resume continues bit
    for bit, and the restored states pass the same validation as a Pipeline's: NaN is
    refused, naming the parameters."""
    from gradfuse.errors import GradfuseError
    p = {"learning_rate": 0.05, "momentum": 0.9}
    tmp = tempfile.mkdtemp()
    pfile, sfile = os.path.join(tmp, "params"), os.path.join(tmp, "states")

    def fresh():
        net = mlp()
        opt = hvd.DistributedOptimizer(mx.optimizer.create("sgd", **p), compress="1bit")
        return net, opt, gluon.Trainer(net.collect_params(), opt, kvstore=None)
    net, opt, tr = fresh()
    assert opt._correction is not None
    train(net, tr, 3)
    net.save_parameters(pfile)
    tr.save_states(sfile)
    train(net, tr, 3, start=3)
    net1, _, tr1 = fresh()
    net1.load_parameters(pfile)
    tr1.load_states(sfile)
    train(net1, tr1, 3, start=3)
    np.testing.assert_array_equal(flat(net1), flat(net))
    net2, _, tr2 = fresh()
    net2.load_parameters(pfile)
    tr2.load_states(sfile)
    saved = tr2._updaters[0].optimizer._saved
    key = next(iter(saved))
    entry = next(iter(saved[key][0]["buckets"].values()))
    entry["velocity"][2] = np.nan
    with pytest.raises(GradfuseError, match=rf"DistributedOptimizer's state of parameters {re.escape(str(list(key)))}"
                                            rf".*velocity holds nan at element 2"):
        train(net2, tr2, 1, start=3)
