"""gradfuse.mxnet in one process (size 1): API shape, intake, errors, local helpers.

The multi-rank behaviour is tested under mpiexec in tests/mpi/test_mxnet_*.py.
"""
import ctypes
import inspect

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
pytest.importorskip("mpi4py")
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402
from gradfuse.fusion import intake  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def ptr(nd):
    p = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(nd.handle, ctypes.byref(p)))
    return p.value


def _params(fn):
    out = []
    for p in inspect.signature(fn).parameters.values():
        d = p.default
        if hasattr(d, "process_set_id"):
            d = "process_set"
        elif isinstance(d, type):
            d = d.__name__
        out.append((p.name, p.kind, d))
    return out


def test_signatures_match_horovod_0_28_1():
    """Every public callable of horovod.mxnet has the same parameters and defaults here."""
    H = pytest.importorskip("horovod.mxnet")
    checked = 0
    for name in H.__all__ if hasattr(H, "__all__") else dir(H):
        if name.startswith("_") or name in ("init", "check_extension"):
            continue
        h = getattr(H, name)
        if inspect.ismodule(h) or name in ("OrderedDict", "defaultdict", "mx", "types", "warnings"):
            continue
        assert hasattr(hvd, name), name
        g = getattr(hvd, name)
        if isinstance(h, int):
            assert g == h, name
            continue
        if not callable(h):
            continue
        hp, gp = _params(h), _params(g)
        assert gp[:len(hp)] == hp, (name, hp, gp)
        extra = gp[len(hp):]
        assert all(d is not inspect.Parameter.empty or k == inspect.Parameter.VAR_KEYWORD
                   for _, k, d in extra), (name, extra)   # additions are optional keywords
        checked += 1
    assert checked >= 40


def test_size_one_world():
    assert hvd.is_initialized() and hvd.size() == 1 and hvd.rank() == 0
    x = mx.nd.array([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(hvd.allreduce(x).asnumpy(), [1, 2, 3])
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Max, postscale_factor=2.0).asnumpy(), [2, 4, 6])
    np.testing.assert_array_equal(hvd.broadcast(x, 0).asnumpy(), [1, 2, 3])
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(x, 1)
    np.testing.assert_array_equal(hvd.allgather(x).asnumpy(), [1, 2, 3])
    out, splits = hvd.alltoall(x, splits=[3])
    np.testing.assert_array_equal(out.asnumpy(), [1, 2, 3])
    np.testing.assert_array_equal(splits.asnumpy(), [3])
    np.testing.assert_array_equal(hvd.reducescatter(x, op=hvd.Sum).asnumpy(), [1, 2, 3])
    assert hvd.broadcast_object({"a": 1}) == {"a": 1}
    assert hvd.allgather_object(5) == [5]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_intake_is_zero_copy_and_writes_back(dtype):
    x = mx.nd.arange(6, dtype=dtype).reshape((2, 3))
    y = x + 1                                      # pending in MXNet's engine
    view = intake.as_array(y, "y")                 # waits for the write, then views it
    assert view.dtype == np.dtype(dtype) and view.ctypes.data == ptr(y)
    np.testing.assert_array_equal(view, np.arange(1, 7).reshape(2, 3))
    assert hvd.allreduce_(y, op=hvd.Sum) is y
    view[0, 0] = 42
    assert y.asnumpy()[0, 0] == 42


def test_bad_inputs():
    with pytest.raises(TypeError, match="NDArray"):
        hvd.allreduce_(np.ones(3), name="np")
    with pytest.raises(TypeError, match="uint8"):
        hvd.allreduce(mx.nd.ones((2,), dtype="uint8"), name="u8")
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce(mx.nd.ones((2,), dtype="bool"), name="b")
    with pytest.raises(TypeError, match="row_sparse"):
        hvd.allreduce(mx.nd.ones((2, 2)).tostype("row_sparse"), name="sp")
    with pytest.raises(NotImplementedError):
        hvd.allreduce(mx.nd.ones((2,)), op=hvd.Adasum)
    with pytest.raises(ValueError, match="op"):
        hvd.allreduce(mx.nd.ones((2,)), op=17)
    with pytest.raises(ValueError, match="scalar"):
        hvd.reducescatter(mx.nd.array(np.ones(()), dtype="float32"))       # a 0-d array
    with pytest.raises(ValueError):
        hvd.ProcessSet(["a"])


def test_compression_matches_horovod_contract():
    x = mx.nd.array([1.5, 2.25], dtype="float32")
    c, ctx = hvd.Compression.fp16.compress(x)
    assert c.dtype == np.float16 and ctx == np.float32
    back = hvd.Compression.fp16.decompress(c, ctx)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back.asnumpy(), x.asnumpy())
    i = mx.nd.array([1, 2], dtype="int32")
    assert hvd.Compression.fp16.compress(i)[0] is i
    assert hvd.Compression.none.compress(x) == (x, None)


def test_split_list_matches_horovod():
    util = pytest.importorskip("horovod.common.util")
    for n in range(1, 6):
        for k in range(1, 13):
            assert hvd.split_list(list(range(k)), n) == util.split_list(list(range(k)), n), (n, k)


def test_trainer_on_one_rank_is_a_plain_trainer():
    def make():
        net = gluon.nn.Dense(2, in_units=3)
        net.initialize(mx.init.Constant(0.5))
        return net
    a, b = make(), make()
    ta = hvd.DistributedTrainer(a.collect_params(), "sgd", {"learning_rate": 0.1})
    tb = gluon.Trainer(b.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=None)
    x = mx.nd.array([[1.0, 2.0, 3.0]])
    for net, tr in ((a, ta), (b, tb)):
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        tr.step(1)
    np.testing.assert_array_equal(a.weight.data().asnumpy(), b.weight.data().asnumpy())
    with pytest.raises(ValueError, match="not both"):
        hvd.DistributedTrainer(a.collect_params(), "sgd", compression=hvd.Compression.fp16, compress="topk")
    with pytest.raises(ValueError, match="unknown compressor"):
        hvd.DistributedTrainer(make().collect_params(), "sgd", compress="no-such-compressor")


def test_distributed_optimizer_pickles_and_delegates():
    import pickle
    opt = hvd.DistributedOptimizer(mx.optimizer.create("sgd", learning_rate=0.3, momentum=0.9))
    assert opt.learning_rate == 0.3 and opt.momentum == 0.9
    opt.rescale_grad = 0.25
    assert opt._optimizer.rescale_grad == 0.25
    again = pickle.loads(pickle.dumps(opt))
    assert again.learning_rate == 0.3 and again._optimizer.rescale_grad == 0.25


def test_kvstore_string_in_one_process():
    """MXNet creates the registered store from its name; on one rank pushpull is the identity."""
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize(mx.init.Constant(0.5))
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="dist_gradfuse")
    x = mx.nd.array([[1.0, 2.0, 3.0]])
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    tr.step(1)
    assert isinstance(tr._kvstore, hvd.KVStore) and tr._kvstore.type == "dist_gradfuse"
    np.testing.assert_allclose(net.weight.data().asnumpy(), 0.5 - 0.1 * np.array([[1, 2, 3]] * 2))
    assert isinstance(mx.kv.create("dist_gradfuse"), hvd.KVStore)
