"""MXNet's Module API on the 'dist_gradfuse' KVStore: Module.fit trains, every rank ends
with the same parameters, in both of Module's update modes (run under mpiexec)."""
import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

import gradfuse.mxnet as hvd  # noqa: E402

B, IN, HID, OUT, STEPS = 8, 6, 12, 3, 6


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


def _symbol():
    data = mx.sym.Variable("data")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=HID, name="fc1"), act_type="tanh")
    out = mx.sym.FullyConnected(h, num_hidden=OUT, name="fc2")
    return mx.sym.SoftmaxOutput(out, mx.sym.Variable("softmax_label"), name="softmax")


def _data(rank, steps=STEPS):
    """Rank ``rank``'s samples: a learnable 3-class problem (class = argmax of a fixed map)."""
    rng = np.random.default_rng([rank, 7])
    x = rng.standard_normal((steps * B, IN)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((IN, OUT))
    return x, np.argmax(x @ w, axis=1).astype(np.float32)


def _global_data(size, steps=STEPS):
    """The samples of every rank, arranged so that global batch s is every rank's batch s."""
    parts = [_data(r, steps) for r in range(size)]
    xs = [np.concatenate([p[0][s * B:(s + 1) * B] for p in parts]) for s in range(steps)]
    ys = [np.concatenate([p[1][s * B:(s + 1) * B] for p in parts]) for s in range(steps)]
    return np.concatenate(xs), np.concatenate(ys)


def _init_params(seed):
    rng = np.random.default_rng(seed)
    shapes = {"fc1_weight": (HID, IN), "fc1_bias": (HID,), "fc2_weight": (OUT, HID), "fc2_bias": (OUT,)}
    return {k: mx.nd.array(rng.standard_normal(s) * 0.3) for k, s in shapes.items()}


def _fit(x, y, batch, kvstore, params, epochs, context=None, rescale=None):
    it = mx.io.NDArrayIter(x, y, batch_size=batch, shuffle=False)
    mod = mx.mod.Module(_symbol(), context=context or mx.cpu())
    opt = {"learning_rate": 0.2, "momentum": 0.9, "wd": 1e-4}
    if rescale is not None:
        opt["rescale_grad"] = rescale
    mod.fit(it, kvstore=kvstore, optimizer="sgd", optimizer_params=opt, num_epoch=epochs,
            arg_params={k: v.copy() for k, v in params.items()}, aux_params={}, eval_metric="acc")
    return mod


def _params(mod):
    arg, _ = mod.get_params()
    return {k: v.asnumpy() for k, v in sorted(arg.items())}


def _same_everywhere(world, mine, tag):
    for other in hvd.allgather_object(mine, name=f"module.{tag}"):
        for k in mine:
            np.testing.assert_array_equal(other[k], mine[k])


@pytest.mark.parametrize("contexts", [1, 2])
@pytest.mark.parametrize("update_on_kvstore", ["1", "0"])
def test_module_fit_matches_one_process_on_the_global_batch(world, monkeypatch, update_on_kvstore, contexts):
    """Module.fit(kvstore='dist_gradfuse'): MXNET_UPDATE_ON_KVSTORE=1 (MXNet's default) runs
    the optimizer in the store (kv.init, set_optimizer, pushpull onto the weights);
    0 runs it in Module after each pushpull. Both give one process's result on the global
    batch (with rescale_grad = 1 / global batch, as dist_sync sets it), on every rank and device."""
    monkeypatch.setenv("MXNET_UPDATE_ON_KVSTORE", update_on_kvstore)
    x, y = _data(world.rank)
    params = _init_params(3)
    ctx = [mx.cpu(i) for i in range(contexts)]
    epochs = 2
    mod = _fit(x, y, B, "dist_gradfuse", params, epochs, context=ctx, rescale=1.0 / (B * world.size))
    kv = mod._kvstore
    assert kv is not None and kv.type == "dist_gradfuse"
    assert mod._update_on_kvstore == (update_on_kvstore == "1")
    mx.nd.waitall()      # pushpull hands its allreduce to MXNet's engine: the last may still run
    # fused: the first pass reduces its 4 keys one by one (learning), then one call per pass
    assert kv.pipeline.stats.steps == 4 + epochs * STEPS - 1, kv.pipeline.stats
    mine = _params(mod)
    _same_everywhere(world, mine, f"fit.{update_on_kvstore}.{contexts}")
    monkeypatch.setenv("MXNET_UPDATE_ON_KVSTORE", "1")
    gx, gy = _global_data(world.size)
    ref = _params(_fit(gx, gy, B * world.size, None, params, epochs))
    for k in mine:
        np.testing.assert_allclose(mine[k], ref[k], rtol=1e-4, atol=1e-5)
    moved = max(float(np.abs(mine[k] - params[k].asnumpy()).max()) for k in mine)
    assert moved > 1e-2                                         # it trained
    # every device holds the same weights
    for name, devs in zip(mod._exec_group.param_names, mod._exec_group.param_arrays):
        for d in devs[1:]:
            np.testing.assert_array_equal(d.asnumpy(), devs[0].asnumpy())


def test_module_update_on_kvstore_starts_every_rank_from_rank0(world, monkeypatch):
    """With the optimizer in the store, Module broadcasts rank 0's initial parameters
    (kv.broadcast onto every device): ranks that start differently end identical."""
    monkeypatch.setenv("MXNET_UPDATE_ON_KVSTORE", "1")
    x, y = _data(world.rank)
    mod = _fit(x, y, B, "dist_gradfuse", _init_params(10 + world.rank), 1, rescale=1.0 / (B * world.size))
    _same_everywhere(world, _params(mod), "rank0")


def test_module_trains_to_accuracy_and_saves_optimizer_states(world, monkeypatch, tmp_path):
    monkeypatch.setenv("MXNET_UPDATE_ON_KVSTORE", "1")
    x, y = _data(world.rank, steps=40)
    mod = _fit(x, y, B, "dist_gradfuse", _init_params(4), 4, rescale=1.0 / (B * world.size))
    acc = mod.score(mx.io.NDArrayIter(x, y, batch_size=B), "acc")[0][1]
    assert acc > 0.8, acc
    f = str(tmp_path / f"opt-{world.rank}.states")
    mod.save_optimizer_states(f)                  # the store's optimizer (same on every rank)
    mod.load_optimizer_states(f)


def test_module_fit_with_distributed_optimizer_as_in_horovod(world):
    """Horovod's own Module recipe: ``kvstore=None`` and ``optimizer=DistributedOptimizer(opt)``
    after broadcasting rank 0's parameters. Every update averages the gradients over the
    ranks, so with rescale_grad = 1 / (this rank's batch) it is one process on the global
    batch; every rank ends identical."""
    x, y = _data(world.rank)
    params = _init_params(20 + world.rank)                  # ranks start differently
    hvd.broadcast_parameters(params, root_rank=0)
    # Module's own optimizer knows the parameter names (no weight decay on biases): so does this one
    names = [n for n in _symbol().list_arguments() if n not in ("data", "softmax_label")]
    opt = mx.optimizer.create("sgd", learning_rate=0.2, momentum=0.9, wd=1e-4, rescale_grad=1.0 / B,
                              param_idx2name=dict(enumerate(names)))
    it = mx.io.NDArrayIter(x, y, batch_size=B, shuffle=False)
    mod = mx.mod.Module(_symbol(), context=mx.cpu())
    mod.fit(it, kvstore=None, optimizer=hvd.DistributedOptimizer(opt), num_epoch=2,
            arg_params={k: v.copy() for k, v in params.items()}, aux_params={}, eval_metric="acc")
    mine = _params(mod)
    _same_everywhere(world, mine, "distopt")
    gx, gy = _global_data(world.size)
    ref = _params(_fit(gx, gy, B * world.size, None, params, 2))
    for k in mine:
        np.testing.assert_allclose(mine[k], ref[k], rtol=1e-4, atol=1e-5)
    assert max(float(np.abs(mine[k] - params[k].asnumpy()).max()) for k in mine) > 1e-2
