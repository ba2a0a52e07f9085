"""The Adam correction in gradfuse.mxnet across ranks, under mpiexec -n 2 and -n 3: the
trainers without compression equal Adam / AdamW on the global batch in one process, a
compressed trainer keeps every rank's parameters identical and its warm-up is exact, and
trainer checkpoints restore each rank's state bit-exactly."""
import os
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
mx = pytest.importorskip("mxnet")
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402

from mxnet_nets import B, IN, OUT, flat, mlp  # noqa: E402
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


def same_everywhere(comm, arr):
    mine = np.ascontiguousarray(arr).tobytes()
    assert all(x == mine for x in comm.allgather(mine))


def batch(step, r):
    rng = np.random.default_rng([step, r, 99])
    return mx.nd.array(rng.standard_normal((B, IN))), mx.nd.array(rng.integers(0, OUT, B))


def train(net, trainer, steps, ranks, step_size, start=0):
    for s in range(start, start + steps):
        xs, ys = zip(*(batch(s, r) for r in ranks))
        with autograd.record():
            loss = LOSS(net(mx.nd.concat(*xs, dim=0)), mx.nd.concat(*ys, dim=0))
        loss.backward()
        trainer.step(step_size)


def rel_change(w, w_ref, w0):
    return float(np.linalg.norm(w - w_ref) / np.linalg.norm(w_ref - w0))


OPTS = {"adam": {"learning_rate": 0.01, "wd": 1e-3}, "adamw": {"learning_rate": 0.01, "wd": 0.05}}


@pytest.mark.parametrize("kw", [{}, {"overlap": True, "fusion_threshold": 300}])
@pytest.mark.parametrize("opt", ["adam", "adamw"])
def test_trainer_without_compression_equals_adam_on_the_global_batch(world, opt, kw):
    """The ranks' mean gradient through exact Adam == one process's Adam on all ranks'
    samples (60 steps; 2e-6 of the change: the mean is summed otherwise than the batch)."""
    net, ref = mlp(), mlp()
    w0 = flat(net)
    tr = hvd.DistributedTrainer(net.collect_params(), opt, dict(OPTS[opt]), adam_correction=True, **kw)
    train(net, tr, 60, [world.rank], B)
    train(ref, gluon.Trainer(ref.collect_params(), opt, dict(OPTS[opt]), kvstore=None), 60,
          list(range(world.size)), world.size * B)
    same_everywhere(world, flat(net))
    assert rel_change(flat(net), flat(ref), w0) < 2e-6


def test_distributed_optimizer_without_compression_equals_adam(world):
    net, ref = mlp(), mlp()
    w0 = flat(net)
    opt = hvd.DistributedOptimizer(mx.optimizer.create("adamw", **OPTS["adamw"]), adam_correction=True)
    train(net, gluon.Trainer(net.collect_params(), opt, kvstore=None), 40, [world.rank], B)
    train(ref, gluon.Trainer(ref.collect_params(), "adamw", dict(OPTS["adamw"]), kvstore=None), 40,
          list(range(world.size)), world.size * B)
    same_everywhere(world, flat(net))
    assert rel_change(flat(net), flat(ref), w0) < 2e-6


@pytest.mark.parametrize("compress,opts", [("1bit", {}), ("topk", {"ratio": 0.2}), ("2bit", {})])
def test_compressed_trainer_is_the_same_on_every_rank_and_checkpoints(world, compress, opts):
    """A compressed Adam trainer (on by default): warm-up exact, then identical parameters
    on every rank; save_states / load_states mid-run continue bit-exactly."""
    tmp = tempfile.mkdtemp()
    pfile = os.path.join(tmp, "params")
    sfile = os.path.join(tmp, "states")
    net, ref = mlp(), mlp()
    w0 = flat(net)
    tr = hvd.DistributedTrainer(net.collect_params(), "adamw", dict(OPTS["adamw"]), compress=compress,
                                warmup_steps=5, **opts)
    assert tr._adam_correction is not None
    train(net, tr, 5, [world.rank], B)
    train(ref, gluon.Trainer(ref.collect_params(), "adamw", dict(OPTS["adamw"]), kvstore=None), 5,
          list(range(world.size)), world.size * B)
    assert rel_change(flat(net), flat(ref), w0) < 2e-6
    train(net, tr, 5, [world.rank], B, start=5)
    same_everywhere(world, flat(net))
    if world.rank == 0:
        net.save_parameters(pfile)
    tr.save_states(sfile)            # the optimizer's and this rank's compressor state (own directory)
    with np.load(sfile + f".gradfuse-rank{world.rank}", allow_pickle=False) as z:     # .npz, no pickle
        assert "p0/a0/adam.v" in z.files
    world.Barrier()
    pfile = world.bcast(pfile)
    train(net, tr, 5, [world.rank], B, start=10)
    want = flat(net)
    net2 = mlp()
    net2.load_parameters(pfile)
    tr2 = hvd.DistributedTrainer(net2.collect_params(), "adamw", dict(OPTS["adamw"]), compress=compress,
                                 warmup_steps=5, **opts)
    tr2.load_states(sfile)
    train(net2, tr2, 5, [world.rank], B, start=10)
    np.testing.assert_array_equal(flat(net2), want)
    same_everywhere(world, want)
