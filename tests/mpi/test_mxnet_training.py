"""Gluon training across ranks: DistributedTrainer / DistributedOptimizer / broadcast_parameters.

Step convention (stated in DistributedTrainer's docstring): every rank calls
``trainer.step(B)`` with its own batch size B and a summed loss; the result equals one
process stepping with ``step(size * B)`` on the concatenation of all ranks' batches.
"""
import os
import tempfile

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402

B, IN, HID, OUT = 6, 8, 16, 3


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


def mlp(seed):
    """An MLP without BatchNorm/Dropout, initialised from ``seed``."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(HID, activation="tanh", in_units=IN), gluon.nn.Dense(OUT, in_units=HID))
    mx.random.seed(seed)
    net.initialize(mx.init.Xavier())
    return net


def batch(step, r):
    rng = np.random.default_rng([step, r, 99])
    return (mx.nd.array(rng.standard_normal((B, IN))), mx.nd.array(rng.integers(0, OUT, B)))


def params_of(net):
    return [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]


def copy_params(src, dst):
    for (_, a), (_, b) in zip(sorted(src.collect_params().items()), sorted(dst.collect_params().items())):
        b.set_data(a.data().copy())


LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


def train(net, trainer, steps, ranks, step_size):
    """Each step: the data of ``ranks`` concatenated (one rank's own batch when ranks=[r])."""
    for s in range(steps):
        xs, ys = zip(*(batch(s, r) for r in ranks))
        x, y = mx.nd.concat(*xs, dim=0), mx.nd.concat(*ys, dim=0)
        with autograd.record():
            loss = LOSS(net(x), y)
        loss.backward()
        trainer.step(step_size)


def assert_same_on_all_ranks(net):
    mine = params_of(net)
    for other in hvd.allgather_object(mine):
        for a, b in zip(mine, other):
            np.testing.assert_array_equal(a, b)


def reference(world, init_net, steps, opt_params):
    """One process, the concatenated batch of every rank, plain gluon.Trainer."""
    ref = mlp(0)
    copy_params(init_net, ref)
    tr = gluon.Trainer(ref.collect_params(), "sgd", dict(opt_params), kvstore=None)
    train(ref, tr, steps, list(range(world.size)), world.size * B)
    return params_of(ref)


OPT = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4}


@pytest.mark.parametrize("kw", [{}, {"num_groups": 2}, {"gradient_predivide_factor": 4.0},
                                {"fusion_threshold": 0}, {"overlap": True},
                                {"overlap": True, "fusion_threshold": 300}])
def test_trainer_equals_single_process_on_concatenated_batch(world, kw):
    net = mlp(world.rank)                        # different on purpose
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    start = mlp(0)
    copy_params(net, start)
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT), **kw)
    train(net, tr, 4, [world.rank], B)
    assert_same_on_all_ranks(net)
    for got, ref in zip(params_of(net), reference(world, start, 4, OPT)):
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
    stats = tr.stats
    n = len(params_of(net))
    # pipeline calls per step: one fused call, num_groups calls, or (overlap with
    # 300-byte buckets over tensors of 64, 512, 12 and 192 bytes) three buckets
    per_step = 2 if kw.get("num_groups") else (3 if kw.get("fusion_threshold") == 300 else 1)
    assert stats.steps == 4 * per_step, (kw, stats)
    if kw.get("fusion_threshold") == 0:
        assert stats.buckets == 4 * n            # fusion off: one bucket per tensor
    assert stats.tensors == 4 * n and stats.bytes_reduced > 0


def test_distributed_optimizer_in_gluon_trainer(world):
    net = mlp(0)
    start = mlp(0)
    copy_params(net, start)
    opt = hvd.DistributedOptimizer(mx.optimizer.create("sgd", **OPT))
    tr = gluon.Trainer(net.collect_params(), opt, kvstore=None)
    train(net, tr, 3, [world.rank], B)
    assert_same_on_all_ranks(net)
    for got, ref in zip(params_of(net), reference(world, start, 3, OPT)):
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)


def test_broadcast_parameters_equalises_and_handles_deferred_init(world):
    net = mlp(100 + world.rank)
    before = hvd.allgather_object(params_of(net))
    if world.size > 1:
        assert any(not np.array_equal(a, b) for a, b in zip(before[0], before[1]))
    hvd.broadcast_parameters(net.collect_params(), root_rank=world.size - 1)
    for a, b in zip(params_of(net), before[world.size - 1]):
        np.testing.assert_array_equal(a, b)
    # deferred initialisation: shapes unknown until the first forward
    lazy = gluon.nn.Dense(5)
    mx.random.seed(200 + world.rank)
    lazy.initialize()
    hvd.broadcast_parameters(lazy.collect_params(), root_rank=0, prefix="lazy.")
    lazy(mx.nd.ones((2, 7)))                     # initialises, then broadcasts
    w = lazy.weight.data().asnumpy()
    assert w.shape == (5, 7)
    for other in hvd.allgather_object(w):
        np.testing.assert_array_equal(w, other)


def test_fp16_compression_trains_and_stays_in_sync(world):
    net = mlp(0)
    start = mlp(0)
    copy_params(net, start)
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT), compression=hvd.Compression.fp16)
    train(net, tr, 3, [world.rank], B)
    assert_same_on_all_ranks(net)
    for got, ref in zip(params_of(net), reference(world, start, 3, OPT)):
        np.testing.assert_allclose(got, ref, rtol=1e-2, atol=2e-3)
    assert all(p.grad().dtype == np.float32 for p in net.collect_params().values())


def test_save_and_load_states(world):
    net = mlp(0)
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT))
    train(net, tr, 2, [world.rank], B)
    path = os.path.join(tempfile.gettempdir(), f"gradfuse_states_{os.getpid()}")
    tr.save_states(path)
    try:
        plain = gluon.Trainer(net.collect_params(), "sgd", dict(OPT), kvstore=None)
        plain.load_states(path)              # a plain Trainer reads the optimizer part
        tr2 = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT))
        tr2.load_states(path)
        for t in (plain, tr2):
            for i, st in tr._updaters[0].states.items():
                np.testing.assert_array_equal(t._updaters[0].states[i].asnumpy(), st.asnumpy())
    finally:
        for f in (path, path + f".gradfuse-rank{world.rank}"):
            if os.path.exists(f):
                os.unlink(f)


def test_trainer_on_a_process_set(world):
    if world.size < 3:
        pytest.skip("needs 3 ranks (a proper subset of at least 2)")
    ps = hvd.add_process_set([0, 1])
    try:
        net = mlp(0)
        start = mlp(0)
        copy_params(net, start)
        tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT), process_set=ps)
        ref = mlp(0)        # on every rank: Gluon's parameter names count the nets made
        if world.rank in (0, 1):
            train(net, tr, 2, [world.rank], B)
            copy_params(start, ref)
            rtr = gluon.Trainer(ref.collect_params(), "sgd", dict(OPT), kvstore=None)
            train(ref, rtr, 2, [0, 1], 2 * B)
            for got, want in zip(params_of(net), params_of(ref)):
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        else:
            assert tr.pipeline is None
    finally:
        hvd.remove_process_set(ps)


def test_hybridized_conv_net_with_onednn_layouts(world):
    """Conv weights and gradients of a hybridized net live in oneDNN layouts: they must be
    brought back to row-major before the zero-copy view, and MXNet must see the writes."""
    def cnn(seed):
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(4, 3, padding=1, activation="relu"), gluon.nn.Flatten(),
                gluon.nn.Dense(OUT))
        mx.random.seed(seed)
        net.initialize(mx.init.Xavier())
        net.hybridize()
        net(mx.nd.zeros((1, 1, 6, 6)))
        return net

    def data(s, r):
        rng = np.random.default_rng([s, r, 7])
        return mx.nd.array(rng.standard_normal((B, 1, 6, 6))), mx.nd.array(rng.integers(0, OUT, B))

    net = cnn(world.rank)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    ref = cnn(0)
    ref_start = params_of(ref)
    for a, b in zip(params_of(net), ref_start):
        np.testing.assert_array_equal(a, b)
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT))
    rtr = gluon.Trainer(ref.collect_params(), "sgd", dict(OPT), kvstore=None)
    for s in range(3):
        x, y = data(s, world.rank)
        with autograd.record():
            loss = LOSS(net(x), y)
        loss.backward()
        tr.step(B)
        xs, ys = zip(*(data(s, r) for r in range(world.size)))
        with autograd.record():
            loss = LOSS(ref(mx.nd.concat(*xs, dim=0)), mx.nd.concat(*ys, dim=0))
        loss.backward()
        rtr.step(world.size * B)
    assert_same_on_all_ranks(net)
    for got, want in zip(params_of(net), params_of(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # the forward pass (oneDNN) sees the same weights on every rank
    out = net(data(9, 0)[0]).asnumpy()
    for other in hvd.allgather_object(out):
        np.testing.assert_array_equal(out, other)


@pytest.mark.parametrize("compress,opts", [("1bit", {}), ("topk", {"ratio": 0.25})])
def test_compressed_trainer_checkpoint_restores_bit_exactly(world, compress, opts):
    """save_states keeps each rank's error-feedback residuals: a run restored from a
    checkpoint continues bit-identically; without the residuals it would not."""
    assert compress in hvd_compressors(), f"compressor {compress!r} is not in this build"
    tmp = tempfile.gettempdir()
    pfile = os.path.join(tmp, f"gf_params_{os.getpid()}")
    sfile = os.path.join(tmp, f"gf_states_{os.getpid()}")
    net = mlp(0)
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT), compress=compress, **opts)
    assert tr._correction is not None            # SGD with momentum: DGC's momentum correction, a velocity
    train(net, tr, 2, [world.rank], B)
    assert_same_on_all_ranks(net)
    net.save_parameters(pfile)
    tr.save_states(sfile)
    try:
        side = sfile + f".gradfuse-rank{world.rank}"
        with np.load(side, allow_pickle=False) as z:          # .npz, no pickle
            assert "meta" in z.files and any(name.startswith("p0/v") for name in z.files)
        for s in (2, 3):                      # continue: steps 2 and 3
            train_step(net, tr, s, world.rank)
        want = params_of(net)
        assert_same_on_all_ranks(net)

        def resumed(load_residuals):
            net2 = mlp(0)
            net2.load_parameters(pfile)
            tr2 = hvd.DistributedTrainer(net2.collect_params(), "sgd", dict(OPT), compress=compress, **opts)
            if load_residuals:
                tr2.load_states(sfile)
            else:
                gluon.Trainer.load_states(tr2, sfile)     # the optimizer part only
            for s in (2, 3):
                train_step(net2, tr2, s, world.rank)
            return params_of(net2)

        for a, b in zip(resumed(True), want):
            np.testing.assert_array_equal(a, b)
        assert any(not np.array_equal(a, b) for a, b in zip(resumed(False), want))
        plain = gluon.Trainer(net.collect_params(), "sgd", dict(OPT), kvstore=None)
        plain.load_states(sfile)              # still a gluon optimizer-state file
    finally:
        for f in (pfile, sfile, sfile + f".gradfuse-rank{world.rank}"):
            if os.path.exists(f):
                os.unlink(f)


def hvd_compressors():
    import gradfuse
    return gradfuse.compressors.available()


def train_step(net, trainer, s, r):
    x, y = batch(s, r)
    with autograd.record():
        loss = LOSS(net(x), y)
    loss.backward()
    trainer.step(B)


def test_resume_without_or_with_a_bad_side_file_is_refused_by_name(world):
    """The compressor state lives in save_states' side file: resuming without it (only the Gluon
    file copied), from a truncated one, or from an earlier pickled one raises GradfuseError
    naming the file, and nothing is loaded."""
    import pickle
    from gradfuse.errors import GradfuseError
    tmp = tempfile.mkdtemp()
    sfile = os.path.join(tmp, f"states_{world.rank}")
    side = sfile + f".gradfuse-rank{world.rank}"
    net = mlp(0)
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT), compress="1bit")
    train(net, tr, 2, [world.rank], B)
    tr.save_states(sfile)
    raw = open(side, "rb").read()
    assert raw.startswith(b"PK")
    fresh = hvd.DistributedTrainer(mlp(0).collect_params(), "sgd", dict(OPT), compress="1bit")
    os.rename(side, side + ".away")
    with pytest.raises(GradfuseError, match=rf"compressor state of rank {world.rank} is missing: '{side}' does not "
                                            rf"exist"):
        fresh.load_states(sfile)
    with open(side, "wb") as f:
        f.write(raw[:len(raw) // 2])
    with pytest.raises(GradfuseError, match=rf"gradfuse side file '{side}' is truncated or corrupt"):
        fresh.load_states(sfile)
    with open(side, "wb") as f:
        pickle.dump({"format": "gradfuse.mxnet/1", "rank": world.rank, "pipelines": []}, f)
    with pytest.raises(GradfuseError, match=rf"'{side}' is a gradfuse.mxnet/1 side file: a pickle.*does not unpickle"):
        fresh.load_states(sfile)
    assert fresh._updaters[0].states == {}                # the Gluon part was not loaded either
    os.replace(side + ".away", side)
    fresh.load_states(sfile)
    assert fresh.pipeline.state.step == 2
    plain = hvd.DistributedTrainer(mlp(0).collect_params(), "sgd", dict(OPT))      # no compressor state
    os.unlink(side)
    plain.load_states(sfile)
