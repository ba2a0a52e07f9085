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
    kv.pushpull("c", mx.nd.ones((3,)), out=out)  # outside the Trainer: pushed at once, asnumpy waits
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


# --- what MXNet hands a KVStore: value lists, per-device lists (issue 15) ----------------
CTXS = [mx.cpu(0), mx.cpu(1)]


def test_broadcast_takes_a_value_list(world):
    kv = hvd.KVStore()
    nd = mx.nd.ones((3,)) * (world.rank + 5)
    o = mx.nd.zeros((3,))
    kv.broadcast("200", [nd], out=o)                 # raised TypeError before issue 15
    np.testing.assert_array_equal(o.asnumpy(), np.full(3, 5))
    outs = [mx.nd.zeros((2,), ctx=c) for c in CTXS]
    kv.broadcast(["201"], [[mx.nd.ones((2,), ctx=CTXS[0]) * world.rank]], out=[outs])
    for x in outs:
        np.testing.assert_array_equal(x.asnumpy(), np.zeros(2))
    np.testing.assert_array_equal(nd.asnumpy(), np.full(3, world.rank + 5))   # the value is untouched


def test_pushpull_sums_devices_then_ranks(world):
    kv = hvd.KVStore()
    total = sum(range(world.size))
    vals = [mx.nd.ones((4,), ctx=c) * (world.rank + d) for d, c in enumerate(CTXS)]
    kv.pushpull("a", vals)                           # out=None: every device gets the sum
    want = np.full(4, 2 * total + world.size)         # sum over ranks of (r + 0) + (r + 1)
    for v in vals:
        np.testing.assert_array_equal(v.asnumpy(), want)
    outs = [mx.nd.zeros((4,), ctx=c) for c in CTXS]
    a = [mx.nd.ones((4,), ctx=c) for c in CTXS]
    b = [mx.nd.ones((2, 2), ctx=c) * 3 for c in CTXS]
    outs_b = [mx.nd.zeros((2, 2), ctx=c) for c in CTXS]
    kv.pushpull(["x", "y"], [a, b], out=[outs, outs_b])     # several keys, several devices
    for o in outs:
        np.testing.assert_array_equal(o.asnumpy(), np.full(4, 2 * world.size))
    for o in outs_b:
        np.testing.assert_array_equal(o.asnumpy(), np.full((2, 2), 6 * world.size))


def test_init_push_pull(world):
    kv = hvd.KVStore()
    kv.init("w", mx.nd.ones((3,)) * (world.rank + 1))        # the store keeps rank 0's value
    out = [mx.nd.zeros((3,), ctx=c) for c in CTXS]
    kv.pull("w", out=out)
    for o in out:
        np.testing.assert_array_equal(o.asnumpy(), np.ones(3))
    kv.push("w", [mx.nd.ones((3,), ctx=c) for c in CTXS])    # no optimizer: the sum replaces it
    kv.pull("w", out=out[0])
    np.testing.assert_array_equal(out[0].asnumpy(), np.full(3, 2 * world.size))
    with pytest.raises(KeyError, match="never initialised"):
        kv.pull("nope", out=out[0])


def _scoped_mlp(seed, tag, ctxs=None):
    """mlp(seed) named under its own prefix: Gluon's global name counters stay untouched
    (other tests pair parameters by sorted names, which a shifted counter reorders)."""
    holder = gluon.nn.HybridSequential(prefix=f"kv{tag}_")
    with holder.name_scope():
        net = mlp(seed)
    if ctxs:
        for p in net.collect_params().values():
            p.reset_ctx(ctxs)
    return net


def _values(net):
    return [p.data().asnumpy() for p in net.collect_params().values()]


def _train_multi(net, trainer, steps, rank, step_size):
    """Each step: this rank's batch split over the two devices, one backward per device."""
    for s in range(steps):
        x, y = batch(s, rank)
        xs = gluon.utils.split_and_load(x, CTXS)
        ys = gluon.utils.split_and_load(y, CTXS)
        with autograd.record():
            losses = [LOSS(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(step_size)


def _params_per_device(net):
    return [[d.asnumpy() for d in p.list_data()] for p in net.collect_params().values()]


@pytest.mark.parametrize("how", ["dist_gradfuse", "update_on_kvstore", "DistributedTrainer"])
def test_gluon_training_with_two_contexts_per_rank(world, how):
    """ctx=[cpu(0), cpu(1)] on every rank: the same parameters as one process on one device
    stepping on every rank's batch, on both devices of every rank."""
    start = _scoped_mlp(500, f"{how}.start")
    net = _scoped_mlp(500, f"{how}.net", CTXS)
    opt = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4}
    if how == "DistributedTrainer":
        tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(opt))
        step_size = B                                   # averaged over the ranks: the rank's batch
    else:
        tr = gluon.Trainer(net.collect_params(), "sgd", dict(opt), kvstore="dist_gradfuse",
                           update_on_kvstore=True if how == "update_on_kvstore" else None)
        step_size = world.size * B                      # the store sums: the global batch
    _train_multi(net, tr, 4, world.rank, step_size)
    if how != "DistributedTrainer":
        assert tr._update_on_kvstore == (how == "update_on_kvstore")
    ref = _scoped_mlp(0, f"{how}.ref")
    for a, b in zip(start.collect_params().values(), ref.collect_params().values()):
        b.set_data(a.data().copy())
    rtr = gluon.Trainer(ref.collect_params(), "sgd", dict(opt), kvstore=None)
    _train(ref, rtr, 4, list(range(world.size)), world.size * B)
    mine = _params_per_device(net)
    for devs, want in zip(mine, _values(ref)):
        for got in devs:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(devs[0], devs[1])     # the devices agree exactly
    for other in hvd.allgather_object([d[0] for d in mine], name=f"kv.multi.{how}"):
        for a, b in zip(other, mine):
            np.testing.assert_array_equal(a, b[0])
