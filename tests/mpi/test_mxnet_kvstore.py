"""The 'dist_gradfuse' KVStore under gluon.Trainer, as a string and as an instance."""
import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402
from test_mxnet_training import (B, LOSS, OPT, assert_same_on_all_ranks, batch, copy_params,  # noqa: E402
                                 mlp, params_of)


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


def _train(net, trainer, steps, ranks, step_size):
    for s in range(steps):
        xs, ys = zip(*(batch(s, r) for r in ranks))
        with autograd.record():
            loss = LOSS(net(mx.nd.concat(*xs, dim=0)), mx.nd.concat(*ys, dim=0))
        loss.backward()
        trainer.step(step_size)


@pytest.mark.parametrize("how", ["string", "instance", "instance-average"])
def test_trainer_with_kvstore_synchronises(world, how):
    net = mlp(300)
    start = mlp(300)
    kv = {"string": "dist_gradfuse", "instance": hvd.KVStore(),
          "instance-average": hvd.KVStore(average=True)}[how]
    tr = gluon.Trainer(net.collect_params(), "sgd", dict(OPT), kvstore=kv)
    # the kvstore sums: step() gets the global batch size; averaging: the per-rank one
    step_size = B if how == "instance-average" else world.size * B
    _train(net, tr, 4, [world.rank], step_size)
    assert tr._kvstore is not None and tr._kvstore.type == "dist_gradfuse"
    assert tr._distributed and not tr._update_on_kvstore
    assert_same_on_all_ranks(net)
    ref = mlp(0)
    copy_params(start, ref)
    rtr = gluon.Trainer(ref.collect_params(), "sgd", dict(OPT), kvstore=None)
    _train(ref, rtr, 4, list(range(world.size)), world.size * B)
    for got, want in zip(params_of(net), params_of(ref)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    # fused: the first step reduces key by key (learning), then one call per step
    stats = tr._kvstore.pipeline.stats
    n_keys = len(params_of(net))
    assert stats.steps == n_keys + 3, stats
    assert stats.tensors == 4 * n_keys


def test_trainer_kvstore_broadcasts_rank0_parameters(world):
    """Trainer broadcasts through the kvstore when it first initialises it (the first
    step: that step's gradients were computed with each rank's own weights)."""
    net = mlp(400 + world.rank)
    first = params_of(net)
    root = hvd.broadcast_object(first, root_rank=0, name="kv.root")
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.0}, kvstore="dist_gradfuse")
    _train(net, tr, 1, [world.rank], B)
    assert_same_on_all_ranks(net)
    for a, b in zip(params_of(net), root):
        np.testing.assert_array_equal(a, b)


def test_pushpull_and_broadcast_directly(world):
    kv = hvd.KVStore()
    assert kv.rank == world.rank and kv.num_workers == world.size and not kv.is_capable("optimizer")
    a = mx.nd.ones((3,)) * (world.rank + 1)
    b = mx.nd.ones((2, 2)) * 10 * (world.rank + 1)
    kv.pushpull(["a", "b"], [a, b])              # one fused call, in place
    total = sum(range(1, world.size + 1))
    np.testing.assert_array_equal(a.asnumpy(), np.full(3, total))
    np.testing.assert_array_equal(b.asnumpy(), np.full((2, 2), 10 * total))
    out = mx.nd.zeros((3,))
    kv.pushpull("c", mx.nd.ones((3,)), out=out)  # outside the Trainer: done on return
    np.testing.assert_array_equal(out.asnumpy(), np.full(3, world.size))
    v = mx.nd.ones((4,)) * world.rank
    outs = [mx.nd.zeros((4,)), mx.nd.zeros((4,))]
    kv.broadcast("w", v, outs)
    for o in outs:
        np.testing.assert_array_equal(o.asnumpy(), np.zeros(4))
    with pytest.raises(RuntimeError, match="before the first pushpull"):
        kv.set_gradient_compression({"type": "none"})
    fresh = hvd.KVStore()
    fresh.set_gradient_compression({"type": "none"})
    assert fresh.pipeline.compressor.name == "none"
    with pytest.raises(ValueError, match="unknown compressor"):
        hvd.KVStore(compress="no-such").pipeline
