"""DGC's momentum correction across ranks (issue 14, item 2), under mpiexec -n 2 and -n 3
(tests/test_mpi_launch.py): every rank keeps its own velocity, the results are the same
bits on every rank, the pipeline equals the DGC math written out, the MXNet trainers and
the KVStore equal single-process momentum SGD without compression, and checkpoints
restore velocity and residual bit-exactly."""
import os
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ref_momentum as ref  # noqa: E402

import gradfuse  # noqa: E402
from gradfuse.compressors.base import BucketContext  # noqa: E402

F32 = np.float32
LOSSY = [("1bit", {"block_size": 64, "algorithm": "allgather"}), ("1bit", {"block_size": 32, "algorithm": "twophase"}),
         ("2bit", {"threshold": 0.5}), ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.1, "seed": 3}),
         ("fp16", {"error_feedback": True})]


def grads(step, rank):
    rng = np.random.default_rng([step, rank, 11])
    return {f"t{i}": (rng.standard_normal(s) * (0.01 if i % 2 else 1.0)).astype(F32)
            for i, s in enumerate((33, 1, 200, 7, 129))}


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32).tobytes()


def same_everywhere(comm, arrays):
    mine = b"".join(bits(a) for a in arrays)
    assert all(x == mine for x in comm.allgather(mine))


@pytest.mark.parametrize("name,opts", LOSSY, ids=[f"{n}-{i}" for i, (n, _) in enumerate(LOSSY)])
def test_compressed_momentum_equals_dgc_written_out(world, name, opts):
    """This rank's velocity by hand, fed to the same compressor without momentum; masking
    where that pipeline's residual was cleared, 1-bit's velocity set to this rank's decoded
    payload. Same outputs, same residuals, all ranks."""
    r = world.rank
    pipe = gradfuse.Pipeline(compress=name, momentum=0.9, fusion_threshold=300, **opts)
    plain = gradfuse.Pipeline(compress=name, fusion_threshold=300, **opts)
    masking = pipe.compressor.momentum_masking
    u = {}
    for step in range(4):
        g = grads(step, r)
        for k, v in g.items():
            u[k], _ = ref.momentum_update(v, u.get(k, np.zeros_like(v)), 0.9)
        x = {k: v.copy() for k, v in u.items()}
        before = {key: b["residual"] for key, b in plain.state_dict()["buckets"].items()}
        want = plain.allreduce(x)
        got = pipe.allreduce(g)
        for k in g:
            assert bits(got[k]) == bits(want[k]), (name, step, k)
        same_everywhere(world, [got[k] for k in sorted(got)])
        if masking:
            (entry,) = plain._plans.values()
            res = plain.state_dict()["buckets"]
            for b in entry.plan.buckets:
                key = f"{entry.state_key}/{b.index}"
                names = [entry.names[int(i)] for i in entry.plan.order[b.lo:b.hi]]
                e_in = before.get(key, np.zeros_like(res[key]["residual"]))
                flat, _ = ref.momentum_mask(e_in, np.concatenate([x[k] for k in names]), res[key]["residual"],
                                            np.concatenate([u[k] for k in names]))
                pos = 0
                for k in names:
                    u[k] = flat[pos:pos + u[k].size]
                    pos += u[k].size
        if name == "1bit":          # velocity="sent": u = this rank's own payload, decoded
            (entry,) = plain._plans.values()
            comp = plain.compressor
            for b in entry.plan.buckets:
                key = f"{entry.state_key}/{b.index}"
                names = [entry.names[int(i)] for i in entry.plan.order[b.lo:b.hi]]
                flat_x = np.concatenate([x[k] for k in names])
                e_in = before.get(key)
                c = np.add(flat_x, e_in if e_in is not None else np.zeros_like(flat_x), dtype=F32)
                ctx = BucketContext(counts=tuple(x[k].size for k in names))
                payloads = [np.zeros(n, dt) for dt, n in comp.bucket_layout(ctx)]
                comp.compress(c, payloads, ctx)
                flat = comp.decompress(payloads, c.size, ctx)
                pos = 0
                for k in names:
                    u[k] = flat[pos:pos + u[k].size]
                    pos += u[k].size


def test_uncompressed_momentum_is_the_mean_of_the_velocities(world):
    pipe = gradfuse.Pipeline(compress=None, momentum=0.9, nesterov=True, fusion_threshold=300)
    us = [dict() for _ in range(world.size)]
    for step in range(3):
        xs = []
        for rr in range(world.size):
            x = {}
            for k, v in grads(step, rr).items():
                us[rr][k], x[k] = ref.momentum_update(v, us[rr].get(k, np.zeros_like(v)), 0.9, 0.9)
            xs.append(x)
        got = pipe.allreduce(grads(step, world.rank))
        for k in got:
            total = xs[0][k].copy()
            for x in xs[1:]:
                total = total + x[k]
            np.testing.assert_allclose(got[k], total / F32(world.size), rtol=2e-6, atol=1e-7)
        same_everywhere(world, [got[k] for k in sorted(got)])


def test_pipeline_checkpoint_restores_each_ranks_velocity(world):
    path = os.path.join(tempfile.gettempdir(), f"gf_mom_{os.getppid()}_{world.rank}.npz")
    cfg = dict(compress="topk", ratio=0.1, momentum=0.9, sparsity_warmup=4, fusion_threshold=300)
    a = gradfuse.Pipeline(**cfg)
    for step in range(3):
        a.allreduce(grads(step, world.rank))
    a.save_state(path)
    try:
        want = [a.allreduce(grads(s, world.rank)) for s in (3, 4, 5)]
        b = gradfuse.Pipeline(**cfg)
        assert b.load_state(path)
        for i, s in enumerate((3, 4, 5)):
            got = b.allreduce(grads(s, world.rank))
            assert all(bits(got[k]) == bits(want[i][k]) for k in got)
    finally:
        os.unlink(path)


# ------------------------------------------------------------------ MXNet

mx = pytest.importorskip("mxnet")
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402

from mxnet_nets import B, HID, IN, OUT, flat, mlp  # noqa: E402,F401
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


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


def reference(world, opt, params, steps):
    ref_net = mlp()
    train(ref_net, gluon.Trainer(ref_net.collect_params(), opt, dict(params), kvstore=None), steps,
          list(range(world.size)), world.size * B)
    return flat(ref_net)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(a).max())


OPT = {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3}


@pytest.mark.parametrize("kw", [{}, {"overlap": True, "fusion_threshold": 300}, {"num_groups": 2}])
def test_trainer_correction_without_compression_equals_momentum_sgd(world, kw):
    """Each rank's own velocity, averaged, is momentum SGD on the global batch (100 steps)."""
    net = mlp()
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT), momentum_correction=True, **kw)
    train(net, tr, 100, [world.rank], B)
    same_everywhere(world, [flat(net)])
    assert rel(reference(world, "sgd", OPT, 100), flat(net)) < 2e-6


def test_distributed_optimizer_correction_equals_momentum_sgd(world):
    net = mlp()
    opt = hvd.DistributedOptimizer(mx.optimizer.create("nag", learning_rate=0.05, momentum=0.9),
                                   momentum_correction=True)
    train(net, gluon.Trainer(net.collect_params(), opt, kvstore=None), 50, [world.rank], B)
    same_everywhere(world, [flat(net)])
    assert rel(reference(world, "nag", {"learning_rate": 0.05, "momentum": 0.9}, 50), flat(net)) < 2e-6


def test_kvstore_momentum_option_and_refusal(world):
    kv = hvd.KVStore(compress="1bit", momentum=0.9)
    tr = gluon.Trainer(mlp().collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.5}, kvstore=kv)
    with pytest.raises(ValueError, match="KVStore applies momentum=0.9.*compressor '1bit'.*optimizer sgd has "
                                         "momentum=0.5 too"):
        train(mlp(), tr, 1, [world.rank], B)
    # the store's velocity of the summed raw gradients == momentum SGD (global batch, no wd)
    net = mlp()
    p = {"learning_rate": 0.05, "momentum": 0.9}
    train(net, gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05},
                             kvstore=hvd.KVStore(momentum=0.9)), 50, [world.rank], world.size * B)
    same_everywhere(world, [flat(net)])
    assert rel(reference(world, "sgd", p, 50), flat(net)) < 2e-6


@pytest.mark.parametrize("compress,opts", [("1bit", {}), ("2bit", {}), ("topk", {"ratio": 0.25}),
                                           ("randomk", {"ratio": 0.25})])
def test_compressed_trainer_with_correction_resumes_bit_exactly(world, compress, opts):
    """Default-on correction (SGD momentum 0.9 + a lossy compressor), an lr schedule: a run
    restored from save_states continues bit-identically (velocity, residual, lr memory)."""
    def params():
        return {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4,
                "lr_scheduler": mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.1)}
    tmp = tempfile.gettempdir()
    pfile = os.path.join(tmp, f"gf_mp_{os.getppid()}_{world.rank}")
    sfile = os.path.join(tmp, f"gf_ms_{os.getppid()}_{world.rank}")
    net = mlp()
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", params(), compress=compress, **opts)
    assert tr._correction is not None
    train(net, tr, 3, [world.rank], B)
    net.save_parameters(pfile)
    tr.save_states(sfile)
    try:
        train(net, tr, 3, [world.rank], B, start=3)
        want = flat(net)
        same_everywhere(world, [want])
        net2 = mlp()
        net2.load_parameters(pfile)
        tr2 = hvd.DistributedTrainer(net2.collect_params(), "sgd", params(), compress=compress, **opts)
        tr2.load_states(sfile)
        train(net2, tr2, 3, [world.rank], B, start=3)
        np.testing.assert_array_equal(flat(net2), want)
    finally:
        for f in (pfile, sfile, sfile + f".gradfuse-rank{hvd.rank()}"):
            if os.path.exists(f):
                os.unlink(f)
