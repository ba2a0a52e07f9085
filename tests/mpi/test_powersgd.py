"""PowerSGD across ranks: the numpy reference step, every rank the same bits, serial and
pipelined alike, a non-finite gradient on one rank refused on every rank, momentum."""
import functools
import os
import sys

import numpy as np
import pytest

import gradfuse
from gradfuse.compressors.base import BucketContext
from gradfuse.compressors.powersgd import PowerSGD
from gradfuse.errors import NonFiniteError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ref_powersgd as ref  # noqa: E402


def grads(step, r):
    rng = np.random.default_rng([step, r, 7])
    return {"conv": rng.standard_normal((16, 4, 3, 3)).astype(np.float32),
            "bias": rng.standard_normal(16).astype(np.float32),
            "fc": rng.standard_normal((10, 64)).astype(np.float32),
            "fc2": rng.standard_normal((64, 40)).astype(np.float32),
            "tiny": rng.standard_normal((2, 2)).astype(np.float32)}


def same_everywhere(comm, arrays):
    mine = np.concatenate([a.ravel() for a in arrays]).view(np.uint32)
    every = comm.allgather(mine)
    return all(np.array_equal(every[0], x) for x in every)


@pytest.mark.parametrize("opts", [{}, {"rank": 2}, {"rank": 4, "warm_start": False}, {"error_feedback": False}])
def test_matches_the_reference_on_every_rank(world, opts):
    p, me = world.Get_size(), world.Get_rank()
    pipe = gradfuse.Pipeline(compress="powersgd", comm=world, fusion_threshold=1 << 30, **opts)
    comp = PowerSGD(**opts)
    names = list(grads(0, 0))
    shapes = tuple(grads(0, 0)[k].shape for k in names)
    counts = tuple(int(np.prod(s)) for s in shapes)
    lay = comp.layout(BucketContext(counts=counts, shapes=shapes), sum(counts))
    states = [{} for _ in range(p)]
    for step in range(5):
        want = ref.reference_step(comp, lay, [[grads(step, r)[k] for k in names] for r in range(p)], states, 0,
                                  step, float(p))
        got = pipe.allreduce(grads(step, me))
        assert same_everywhere(world, [got[k] for k in names])
        for k, w in zip(names, want):
            # MPI's sum of 3 or more ranks need not be in rank order: to rounding
            assert np.allclose(got[k], w, rtol=1e-4, atol=1e-5), (k, step)
            if p == 2:
                assert got[k].tobytes() == w.tobytes(), (k, step)
    assert pipe.stats.steps == 5


def test_pipelined_and_serial_give_the_same_bits(world):
    me = world.Get_rank()
    a = gradfuse.Pipeline(compress="powersgd", comm=world, rank=2, fusion_threshold=4096, pipeline_buckets=True)
    b = gradfuse.Pipeline(compress="powersgd", comm=world, rank=2, fusion_threshold=4096, pipeline_buckets=False)
    for step in range(3):
        x, y = a.allreduce(grads(step, me)), b.allreduce(grads(step, me))
        assert all(x[k].tobytes() == y[k].tobytes() for k in x)


def test_non_finite_on_one_rank_is_refused_on_every_rank(world):
    me = world.Get_rank()
    a = gradfuse.Pipeline(compress="powersgd", comm=world, rank=2)
    a.allreduce(grads(0, me))
    g = grads(1, me)
    if me == world.Get_size() - 1:
        g["bias"][3] = np.nan           # an uncompressed tensor
    with pytest.raises(NonFiniteError):
        a.allreduce_(g)
    g = grads(1, me)
    if me == 0:
        g["fc2"][3, 3] = np.inf         # a compressed one
    with pytest.raises(NonFiniteError):
        a.allreduce_(g)
    out = a.allreduce(grads(2, me))     # goes on, matched
    assert same_everywhere(world, list(out.values()))


def test_momentum_correction_runs_through_the_job(world):
    me = world.Get_rank()
    pipe = gradfuse.Pipeline(compress="powersgd", comm=world, rank=2, momentum=0.9)
    for step in range(3):
        out = pipe.allreduce(grads(step, me))
        assert same_everywhere(world, list(out.values()))
    st = next(iter(pipe.state.buckets.values()))
    assert st.vel_cur.size and set(st.arrays) == {"q", "residual"}


@pytest.mark.parametrize("where", ["trainer", "kvstore"])
def test_mxnet_trainer_and_kvstore_train_identically_on_every_rank(world, where):
    mx = pytest.importorskip("mxnet")
    from mxnet import autograd, gluon
    import gradfuse.mxnet as hvd
    hvd.init()
    me = world.Get_rank()
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(32, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    rng = np.random.default_rng(me)
    x = mx.nd.array(rng.standard_normal((16, 40)).astype(np.float32))
    y = mx.nd.array(np.arange(16) % 10)
    net(x)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    if where == "trainer":
        tr = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                                    compress="powersgd", rank=2, momentum_correction=False)
    else:
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                           kvstore=hvd.KVStore(compress="powersgd", rank=2, average=True))
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(4):
        with autograd.record():
            val = loss(net(x), y).mean()
        val.backward()
        tr.step(1 if where == "trainer" else world.Get_size())
    ws = [p.data().asnumpy() for p in net.collect_params().values()]
    assert all(np.isfinite(w).all() for w in ws)
    assert same_everywhere(world, ws)
