"""A layer policy against Gluon parameter names, through DistributedTrainer and the KVStore."""
import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402

POLICY = {"*_bias": None, "*": {"name": "1bit", "block_size": 32}}


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


def _net():
    net = gluon.nn.HybridSequential(prefix="pol_")
    with net.name_scope():
        net.add(gluon.nn.Dense(16, activation="relu", in_units=12), gluon.nn.Dense(3, in_units=16))
    mx.random.seed(7)                       # the same weights on every rank
    net.initialize(mx.init.Uniform(0.5))
    return net


def _grads_after_allreduce(world, make_trainer):
    net = _net()
    trainer = make_trainer(net)
    x = mx.nd.array(np.random.default_rng(world.rank).standard_normal((4, 12)).astype(np.float32))
    with autograd.record():
        loss = (net(x) ** 2).sum()
    loss.backward()
    local = {p.name: p.grad().asnumpy().copy() for p in net.collect_params().values()}
    trainer.allreduce_grads()
    return local, {p.name: p.grad().asnumpy() for p in net.collect_params().values()}


def _check(world, local, reduced, average):
    everyone = world.allgather(local)
    for name, g in reduced.items():
        exact = sum(e[name] for e in everyone)
        if average:
            exact = exact / np.float32(world.size)
        if name.endswith("_bias"):       # uncompressed: the exact sum
            np.testing.assert_allclose(g, exact, rtol=1e-6, atol=1e-7, err_msg=name)
        else:                            # 1-bit: one magnitude per block and sign
            assert not np.allclose(g, exact, rtol=1e-3), name
    same = world.allgather({k: v.tobytes() for k, v in reduced.items()})
    assert all(s == same[0] for s in same)


def test_distributed_trainer_policy_by_parameter_name(world):
    local, reduced = _grads_after_allreduce(
        world, lambda net: hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                                  compress=POLICY))
    _check(world, local, reduced, average=True)


def test_kvstore_policy_by_parameter_name(world):
    local, reduced = _grads_after_allreduce(
        world, lambda net: gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                         kvstore=hvd.KVStore(compress=POLICY)))
    _check(world, local, reduced, average=False)


def test_min_elements_through_the_trainer(world):
    local, reduced = _grads_after_allreduce(
        world, lambda net: hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                                  compress="1bit", block_size=32, min_elements=17))
    _check(world, local, reduced, average=True)      # the biases (16 and 3 elements) go uncompressed
