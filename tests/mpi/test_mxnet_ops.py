"""gradfuse.mxnet collectives across ranks, against numpy references (run under mpiexec)."""
import ctypes
import json
import os
import tempfile

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
from mxnet.base import MXNetError  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402
from gradfuse.mxnet import basics as hvd_basics  # noqa: E402
from gradfuse.errors import MismatchError, RemoteInputError  # noqa: E402

FLOATS = ["float16", "float32", "float64"]
ALL = FLOATS + ["int32", "int64"]


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


def data(seed, r, shape=(3, 5), dtype="float32"):
    """Rank r's values: small integers, so sums/products are exact in every dtype."""
    rng = np.random.default_rng([seed, r])
    return rng.integers(-4, 5, size=shape).astype(dtype)


def ptr(nd):
    p = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(nd.handle, ctypes.byref(p)))
    return p.value


def test_basics(world):
    assert hvd.is_initialized()
    assert hvd.rank() == world.rank and hvd.size() == world.size
    assert hvd.local_size() == world.size and hvd.local_rank() == world.rank   # one host
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    assert hvd.mpi_enabled() and hvd.mpi_built()
    assert not hvd.gloo_enabled() and not hvd.gloo_built()
    assert hvd.nccl_built() == 0 and not hvd.cuda_built() and not hvd.rocm_built()
    assert not hvd.ddl_built() and not hvd.ccl_built()
    assert isinstance(hvd.mpi_threads_supported(), bool)
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("op", ["Sum", "Average", "Min", "Max", "Product"])
def test_allreduce_ops(world, dtype, op):
    n = world.size
    x = mx.nd.array(data(1, world.rank, dtype=dtype), dtype=dtype)
    before = x.asnumpy().copy()
    all_ = np.stack([data(1, r, dtype=dtype) for r in range(n)]).astype(np.float64)
    ref = {"Sum": all_.sum(0), "Average": all_.sum(0) / n, "Min": all_.min(0),
           "Max": all_.max(0), "Product": all_.prod(0)}[op]
    if dtype.startswith("int") and op == "Average":
        ref = np.trunc(ref)
    out = hvd.allreduce(x, op=getattr(hvd, op), name=f"ar.{op}.{dtype}")
    assert out.dtype == np.dtype(dtype) and out.shape == x.shape
    np.testing.assert_allclose(out.asnumpy().astype(np.float64), ref, rtol=1e-3 if dtype == "float16" else 1e-7)
    np.testing.assert_array_equal(x.asnumpy(), before)            # input untouched


def test_allreduce_in_place_is_zero_copy(world):
    x = mx.nd.array(data(2, world.rank))
    p = ptr(x)
    y = x * 1          # pending engine work on x's inputs: intake must wait for it
    z = hvd.allreduce_(y, op=hvd.Sum, name="inplace")
    assert z is y and ptr(y) == ptr(z)
    ref = sum(data(2, r) for r in range(world.size))
    np.testing.assert_array_equal(y.asnumpy(), ref)
    assert ptr(x) == p


def test_allreduce_waits_for_pending_writes(world):
    """A gradient computed by a lazily scheduled op is reduced after it is written."""
    a = mx.nd.ones((300, 300)) * (world.rank + 1)
    g = mx.nd.dot(a, a)                      # asynchronous in MXNet's engine
    hvd.allreduce_(g, op=hvd.Sum, name="pending")
    ref = sum(np.full((300, 300), 300.0 * (r + 1) ** 2) for r in range(world.size))
    np.testing.assert_allclose(g.asnumpy(), ref, rtol=1e-6)


def test_average_default_and_deprecated_average(world):
    x = mx.nd.array(data(3, world.rank))
    ref = sum(data(3, r) for r in range(world.size)) / world.size
    np.testing.assert_allclose(hvd.allreduce(x, name="avg.default").asnumpy(), ref, rtol=1e-6)
    with pytest.warns(DeprecationWarning):
        s = hvd.allreduce(x, average=False, name="avg.false")
    np.testing.assert_allclose(s.asnumpy(), ref * world.size, rtol=1e-6)
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(x, op=hvd.Adasum)


def test_prescale_postscale(world):
    x = mx.nd.array(data(4, world.rank, dtype="float64"), dtype="float64")
    ref = sum(data(4, r, dtype="float64") * 0.5 for r in range(world.size)) / world.size * 3.0
    out = hvd.allreduce(x, prescale_factor=0.5, postscale_factor=3.0, name="scaled")
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=1e-12)


def test_grouped_allreduce(world):
    xs = [mx.nd.array(data(5 + i, world.rank, shape=(i + 1, 4), dtype=dt), dtype=dt)
          for i, dt in enumerate(ALL)]
    refs = [sum(data(5 + i, r, shape=(i + 1, 4), dtype=dt).astype(np.float64) for r in range(world.size))
            for i, dt in enumerate(ALL)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="grp")
    assert len(outs) == len(xs) and all(o is not x for o, x in zip(outs, xs))
    for o, ref in zip(outs, refs):
        np.testing.assert_array_equal(o.asnumpy().astype(np.float64), ref)
    same = hvd.grouped_allreduce_(xs, op=hvd.Sum, name="grp_")
    assert same is xs
    for x, ref in zip(xs, refs):
        np.testing.assert_array_equal(x.asnumpy().astype(np.float64), ref)
    assert hvd.grouped_allreduce([]) == []


def _raises_everywhere(fn, world, local_type=None, bad_rank=None):
    """Run fn on every rank; return the exception. All ranks must raise."""
    with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
        fn()
        mx.nd.waitall()     # a collective's error reaches the next wait (MXNet's engine), as in Horovod
    exc = info.value
    if bad_rank is not None:
        if world.rank == bad_rank:
            assert isinstance(exc, local_type), exc
        else:
            assert isinstance(exc, RemoteInputError) and isinstance(exc, MXNetError), exc
            assert f"rank {bad_rank}" in str(exc)
    return exc


def test_shape_mismatch_raises_on_every_rank_before_reducing(world):
    shape = (3, 4) if world.rank == 0 else (4, 3)
    x = mx.nd.array(np.full(shape, world.rank + 1.0))
    exc = _raises_everywhere(lambda: hvd.allreduce_(x, name="bad.shape"), world)
    assert isinstance(exc, MismatchError) and isinstance(exc, MXNetError)
    assert "bad.shape" in str(exc) and "shape" in str(exc) and "rank 0 sent (3, 4)" in str(exc)
    np.testing.assert_array_equal(x.asnumpy(), np.full(shape, world.rank + 1.0))   # untouched
    # the control plane is still in step: the next collective works
    np.testing.assert_array_equal(hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum, name="after").asnumpy(),
                                  np.full(2, world.size))


def test_dtype_op_name_and_scale_mismatches(world):
    dt = "float32" if world.rank == 0 else "float64"
    exc = _raises_everywhere(lambda: hvd.allreduce(mx.nd.ones((2,), dtype=dt), name="bad.dtype"), world)
    assert isinstance(exc, MismatchError) and "dtype" in str(exc)
    op = hvd.Sum if world.rank == 0 else hvd.Max
    exc = _raises_everywhere(lambda: hvd.allreduce(mx.nd.ones((2,)), op=op, name="bad.op"), world)
    assert isinstance(exc, MismatchError) and "'op'" in str(exc)
    bad_op = hvd.Adasum if world.rank == 0 else hvd.Sum
    _raises_everywhere(lambda: hvd.allreduce(mx.nd.ones((2,)), op=bad_op, name="bad.adasum"), world,
                       local_type=NotImplementedError, bad_rank=0)
    exc = _raises_everywhere(lambda: hvd.allreduce(mx.nd.ones((2,)), name=f"n{world.rank}"), world)
    assert isinstance(exc, MismatchError) and "'n0'" in str(exc)
    exc = _raises_everywhere(lambda: hvd.allreduce(mx.nd.ones((2,)), name="bad.pre",
                                                   prescale_factor=1.0 + world.rank), world)
    assert "prescale_factor" in str(exc)


def test_wrong_dtype_raises_type_error_and_peers_stop(world):
    dt = "uint8" if world.rank == world.size - 1 else "float32"
    _raises_everywhere(lambda: hvd.allreduce(mx.nd.ones((2,), dtype=dt), name="bad.uint8"), world,
                       local_type=TypeError, bad_rank=world.size - 1)
    # every rank with uint8: TypeError on every rank
    with pytest.raises(TypeError, match="uint8"):
        hvd.allreduce(mx.nd.ones((2,), dtype="uint8"), name="all.uint8")


@pytest.mark.parametrize("dtype", ALL + ["uint8", "int8"])
def test_broadcast(world, dtype):
    for root in range(world.size):
        x = mx.nd.array(data(6, world.rank, dtype=dtype), dtype=dtype)
        before = x.asnumpy().copy()
        out = hvd.broadcast(x, root, name=f"bc.{dtype}.{root}")
        np.testing.assert_array_equal(out.asnumpy(), data(6, root, dtype=dtype))
        np.testing.assert_array_equal(x.asnumpy(), before)
        p = ptr(x)
        assert hvd.broadcast_(x, root_rank=root, name=f"bc_.{dtype}.{root}") is x and ptr(x) == p
        np.testing.assert_array_equal(x.asnumpy(), data(6, root, dtype=dtype))


def test_broadcast_bad_root_rank(world):
    x = mx.nd.ones((2,)) * world.rank
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast_(x, root_rank=world.size, name="bad.root")
    np.testing.assert_array_equal(x.asnumpy(), np.full(2, world.rank))
    exc = _raises_everywhere(lambda: hvd.broadcast_(x, root_rank=world.rank, name="diff.root"), world)
    assert isinstance(exc, MismatchError) and "'root'" in str(exc)


def test_allgather_different_first_dims(world):
    xs = {r: data(7, r, shape=(r + 1, 3), dtype="float32") for r in range(world.size)}
    out = hvd.allgather(mx.nd.array(xs[world.rank]), name="ag")
    np.testing.assert_array_equal(out.asnumpy(), np.concatenate([xs[r] for r in range(world.size)]))
    ys = [mx.nd.array(data(8, world.rank, shape=(2, 2), dtype="int64"), dtype="int64"),
          mx.nd.array(data(9, world.rank, shape=(world.rank + 2,), dtype="float16"), dtype="float16")]
    outs = hvd.grouped_allgather(ys, name="gag")
    np.testing.assert_array_equal(outs[0].asnumpy(),
                                  np.concatenate([data(8, r, shape=(2, 2), dtype="int64") for r in range(world.size)]))
    assert outs[0].dtype == np.int64 and outs[1].dtype == np.float16
    np.testing.assert_array_equal(outs[1].asnumpy(), np.concatenate(
        [data(9, r, shape=(r + 2,), dtype="float16") for r in range(world.size)]))
    bad = mx.nd.ones((2, 3 + world.rank))
    exc = _raises_everywhere(lambda: hvd.allgather(bad, name="ag.bad"), world)
    assert isinstance(exc, MismatchError) and "shape" in str(exc)


@pytest.mark.parametrize("what", ["shape", "dtype", "grouped"])
def test_allgather_errors_are_raised_at_the_call_on_every_rank(world, what):
    """A disagreement (a dimension after the first, a dtype) raises at ``hvd.allgather``
    itself, on every rank, as an MXNetError (Horovod's own test_horovod_allgather_error and
    _type_error catch MXNetError or RuntimeError right at the call), naming the tensor and
    both values; nothing surfaces later, and the next allgather works."""
    r = world.rank
    if what == "shape":
        call = lambda: hvd.allgather(mx.nd.ones((17, 10 * (r + 1), 17)), name="agx.shape")   # noqa: E731
        want = f"tensor 'agx.shape': shape: rank 0 sent ('*', 10, 17), rank 1 sent ('*', 20, 17)"
    elif what == "dtype":
        call = lambda: hvd.allgather(mx.nd.ones((17, 17), dtype="int32" if r % 2 == 0 else "float32"),  # noqa: E731
                                     name="agx.dtype")
        want = ("tensor 'agx.dtype': dtype: rank 0 sent 'int32', rank 1 sent 'float32'" if world.size == 2 else
                "tensor 'agx.dtype': dtype: ranks 0, 2 sent 'int32', rank 1 sent 'float32'")
    else:
        call = lambda: hvd.grouped_allgather([mx.nd.ones((2,)), mx.nd.ones((1, 3 + r))], name="agx.g")  # noqa: E731
        want = "tensor 'agx.g.1': shape: rank 0 sent ('*', 3), rank 1 sent ('*', 4)"
    with pytest.raises(MXNetError) as info:
        call()                                 # no wait: the call itself raises
    assert isinstance(info.value, MismatchError), info.value
    assert want in str(info.value), str(info.value)
    mx.nd.waitall()                            # nothing left to surface at the next wait
    out = hvd.allgather(mx.nd.full((1, 2), r), name=f"agx.after.{what}")
    np.testing.assert_array_equal(out.asnumpy(), np.repeat(np.arange(world.size), 2).reshape(-1, 2))
    mx.nd.waitall()


def test_alltoall(world):
    n = world.size
    x = mx.nd.array(np.arange(n * 2 * 3).reshape(n * 2, 3) + 100 * world.rank)
    out = hvd.alltoall(x, name="a2a.eq")
    assert isinstance(out, mx.nd.NDArray)
    ref = np.concatenate([(np.arange(n * 2 * 3).reshape(n * 2, 3) + 100 * r)[2 * world.rank:2 * world.rank + 2]
                          for r in range(n)])
    np.testing.assert_array_equal(out.asnumpy(), ref)
    # rank r sends (dest + 1) rows to rank dest... from a tensor of sum rows
    splits = [d + 1 for d in range(n)]
    rows = sum(splits)
    y = mx.nd.array(np.arange(rows * 2).reshape(rows, 2) + 1000 * world.rank, dtype="int32")
    out, rsplits = hvd.alltoall(y, splits=splits, name="a2a.v")
    assert rsplits.dtype == np.int32
    np.testing.assert_array_equal(rsplits.asnumpy(), np.full(n, world.rank + 1))
    start = sum(splits[:world.rank])
    ref = np.concatenate([(np.arange(rows * 2).reshape(rows, 2) + 1000 * r)[start:start + world.rank + 1]
                          for r in range(n)])
    np.testing.assert_array_equal(out.asnumpy(), ref)
    with pytest.raises(ValueError, match="splits sum"):
        hvd.alltoall(y, splits=[1] * n, name="a2a.bad")
    if n > 1:
        with pytest.raises(ValueError, match="divide"):
            hvd.alltoall(mx.nd.ones((n + 1, 2)), name="a2a.nodiv")


@pytest.mark.parametrize("rows", [6, 7])
def test_reducescatter(world, rows):
    n = world.size
    x = mx.nd.array(data(10, world.rank, shape=(rows, 2), dtype="float64"), dtype="float64")
    total = sum(data(10, r, shape=(rows, 2), dtype="float64") for r in range(n))
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    lo = sum(counts[:world.rank])
    mine = total[lo:lo + counts[world.rank]]
    np.testing.assert_allclose(hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{rows}").asnumpy(), mine)
    np.testing.assert_allclose(hvd.reducescatter(x, name=f"rsa.{rows}").asnumpy(), mine / n)
    np.testing.assert_allclose(hvd.reducescatter(x, op=hvd.Sum, name=f"rss.{rows}", prescale_factor=2.0,
                                                 postscale_factor=0.25).asnumpy(), mine * 0.5)
    outs = hvd.grouped_reducescatter([x, x.astype("int32")], op=hvd.Sum, name=f"grs.{rows}")
    np.testing.assert_allclose(outs[0].asnumpy(), mine)
    assert outs[1].dtype == np.int32
    np.testing.assert_array_equal(outs[1].asnumpy(), mine.astype(np.int32))
    with pytest.raises(ValueError):
        hvd.reducescatter(x, op=hvd.Max)


def test_objects(world):
    obj = {"rank": world.rank, "list": list(range(world.rank + 1)), "text": "x" * (world.rank * 100)}
    got = hvd.broadcast_object(obj, root_rank=world.size - 1)
    assert got == {"rank": world.size - 1, "list": list(range(world.size)), "text": "x" * ((world.size - 1) * 100)}
    everyone = hvd.allgather_object(obj)
    assert [o["rank"] for o in everyone] == list(range(world.size))
    assert everyone[world.rank] == obj
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast_object(obj, root_rank=world.size)
    bad_root = world.size if world.rank == 0 else 0          # only rank 0 is wrong
    _raises_everywhere(lambda: hvd.broadcast_object(obj, root_rank=bad_root), world,
                       local_type=ValueError, bad_rank=0)
    assert hvd.broadcast_object("after", root_rank=0) == "after"


def test_process_sets(world):
    n = world.size
    ranks = [0, n - 1] if n >= 3 else [n - 1]        # all ranks would duplicate the global set
    if n == 2:
        with pytest.raises(ValueError, match="duplicate"):
            hvd.add_process_set([0, 1])
    ps = hvd.add_process_set(ranks)
    assert ps.process_set_id is not None and ps.size() == len(ranks)
    member = world.rank in ranks
    assert ps.included() == member
    x = mx.nd.ones((3,)) * (world.rank + 1)
    if member:
        assert ps.rank() == ranks.index(world.rank)
        out = hvd.allreduce(x, op=hvd.Sum, name="ps.ar", process_set=ps)
        np.testing.assert_array_equal(out.asnumpy(), np.full(3, sum(r + 1 for r in ranks)))
        # root ranks are global ranks, as in Horovod
        b = hvd.broadcast(x, root_rank=n - 1, name="ps.bc", process_set=ps)
        np.testing.assert_array_equal(b.asnumpy(), np.full(3, n))
        with pytest.raises(ValueError, match="root_rank"):
            hvd.broadcast(x, root_rank=1 if n == 3 else 0, name="ps.badroot", process_set=ps)
        g = hvd.allgather(x, name="ps.ag", process_set=ps)
        assert g.shape == (3 * len(ranks),)
    else:
        assert ps.rank() is None
        with pytest.raises(ValueError, match="not a member"):
            hvd.allreduce(x, process_set=ps)
    # the global set keeps working for everyone, in step
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum, name="after.ps").asnumpy(),
                                  np.full(3, sum(range(1, n + 1))))
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(ranks)
    mismatched = [n - 1] if world.rank == 0 else [0]
    with pytest.raises(ValueError):
        hvd.add_process_set(mismatched)
    assert hvd.remove_process_set(ps) and ps.process_set_id is None
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(x, process_set=ps)


def test_process_sets_from_mpi_communicators(world):
    """Each rank passes its own sub-communicator (Horovod's ProcessSet(comm))."""
    sub = world.Split(color=world.rank % 2, key=world.rank)
    mine = [r for r in range(world.size) if r % 2 == world.rank % 2]
    ps = hvd.add_process_set(hvd.ProcessSet(sub))
    try:
        assert ps.ranks == mine and ps.included() and ps.size() == len(mine)
        out = hvd.allreduce(mx.nd.ones((2,)) * (world.rank + 1), op=hvd.Sum, name="ps.comm", process_set=ps)
        np.testing.assert_array_equal(out.asnumpy(), np.full(2, sum(r + 1 for r in mine)))
    finally:
        for p in list(hvd_basics._state["sets"].values()):
            hvd.remove_process_set(p)
        sub.Free()


def test_timeline(world, tmp_path_factory):
    path = os.path.join(tempfile.gettempdir(), f"gradfuse_tl_{os.getpid()}.json")
    hvd.start_timeline(path)
    hvd.allreduce(mx.nd.ones((4,)), name="tl.one")
    hvd.broadcast(mx.nd.ones((4,)), 0, name="tl.two")
    hvd.stop_timeline()
    if world.rank != 0:         # Horovod's rule (issue 15): rank 0 alone writes the timeline
        assert not os.path.exists(path)
        return
    with open(path) as f:
        events = json.load(f)   # Horovod's format: a JSON array, every tensor a "process"
    os.unlink(path)
    tensors = [e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]]
    assert tensors == ["tl.one", "tl.two"]
    assert [e["name"] for e in events if e["ph"] == "B" and e["name"].isupper()][:2] == \
        ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]
    assert all(e["ts"] >= 0 for e in events if "ts" in e)


def test_fresh_arrays_with_queued_first_write(world):
    """Regression: outputs created by a queued MXNet op (lazy allocation) must be viewed
    only after that op ran; reading the pointer earlier raced with the allocation."""
    ref = np.arange(15).reshape(3, 5)
    for it in range(1000):
        dt = ("float16", "float32", "int32")[it % 3]
        x = mx.nd.array(ref + 100 * world.rank, dtype=dt)
        out = hvd.broadcast(x, 0, name=f"fresh{it}")
        np.testing.assert_array_equal(out.asnumpy(), ref)


def test_async_handles(world):
    xs = [mx.nd.ones((4,)) * (world.rank + i) for i in range(3)]
    handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=f"async{i}") for i, x in enumerate(xs)]
    out_h = hvd.allreduce_async(mx.nd.ones((4,)) * 2 * world.rank, name="async.out")
    g = hvd.grouped_allreduce_async_([mx.nd.ones((2,)), mx.nd.ones((3,))], op=hvd.Sum, name="async.g")
    for i, h in enumerate(handles):
        assert hvd.synchronize(h) is xs[i] and hvd.poll(h)
        np.testing.assert_array_equal(xs[i].asnumpy(), np.full(4, sum(r + i for r in range(world.size))))
    avg = sum(2.0 * (r + 0) for r in range(world.size)) / world.size
    np.testing.assert_allclose(out_h.wait().asnumpy(), np.full(4, avg))
    a, b = g.wait()
    np.testing.assert_array_equal(b.asnumpy(), np.full(3, world.size))
    bad = hvd.allreduce_async(mx.nd.ones((2 + world.rank,)), name="async.bad")
    with pytest.raises(MismatchError):
        bad.wait()


def test_in_place_write_waits_for_pending_reads(world):
    """An MXNet op still reading the array when allreduce_ is called must see the old values."""
    x = mx.nd.ones((400, 400)) * (world.rank + 1)
    y = mx.nd.dot(x, x)                       # queued: reads x
    hvd.allreduce_(x, op=hvd.Sum, name="pending.read")
    np.testing.assert_allclose(y.asnumpy(), np.full((400, 400), 400.0 * (world.rank + 1) ** 2))
    np.testing.assert_array_equal(x.asnumpy(), np.full((400, 400), sum(range(1, world.size + 1))))


def test_async_outputs_are_fenced_in_mxnet_engine(world):
    """MXNet ops issued after an async call wait for it (no wait() needed), as with Horovod."""
    for i in range(50):
        x = mx.nd.ones((1000,)) * (world.rank + 1)
        h = hvd.allreduce_async_(x, op=hvd.Sum, name=f"fenced{i}")
        y = x * 2                              # queued behind the collective
        total = sum(range(1, world.size + 1))
        np.testing.assert_array_equal(y.asnumpy(), np.full(1000, 2 * total))
        assert h.wait() is x
    outs = [hvd.allreduce_async(mx.nd.ones((10,)) * world.rank, op=hvd.Max, name=f"fo{i}") for i in range(20)]
    sums = [(o.wait() + 1).asnumpy() for o in outs]
    for s_ in sums:
        np.testing.assert_array_equal(s_, np.full(10, world.size))


def test_async_matched_by_name_in_any_order(world):
    """Like Horovod: async allreduces pair up by name, whatever order each rank issues them."""
    names = [f"anyorder.{i}" for i in range(4)]
    order = names[world.rank % len(names):] + names[:world.rank % len(names)]
    if world.rank % 2:
        order = order[::-1]
    xs = {n: mx.nd.ones((5,)) * (i + 1) * (world.rank + 1) for i, n in enumerate(names)}
    handles = {n: hvd.allreduce_async_(xs[n], op=hvd.Sum, name=n) for n in order}
    for i, n in enumerate(names):
        assert handles[n].wait() is xs[n]
        np.testing.assert_array_equal(xs[n].asnumpy(),
                                      np.full(5, (i + 1) * sum(range(1, world.size + 1))))
    # async calls around a blocking one: any order on each side of it
    a, b = mx.nd.ones((3,)) * world.rank, mx.nd.ones((3,)) * 10 * world.rank
    first, second = ("aa", "bb") if world.rank == 0 else ("bb", "aa")
    arrays = {"aa": a, "bb": b}
    h1 = hvd.allreduce_async_(arrays[first], op=hvd.Sum, name=first)
    blocking = hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum, name="between")
    h2 = hvd.allreduce_async_(arrays[second], op=hvd.Sum, name=second)
    h1.wait(), h2.wait()
    np.testing.assert_array_equal(blocking.asnumpy(), np.full(2, world.size))
    total = sum(range(world.size))
    np.testing.assert_array_equal(a.asnumpy(), np.full(3, total))
    np.testing.assert_array_equal(b.asnumpy(), np.full(3, 10 * total))
    # a name whose shape differs across ranks: the error reaches every rank's wait()
    h = hvd.allreduce_async(mx.nd.ones((2 + world.rank,)), name="anyorder.bad")
    with pytest.raises(MismatchError, match="shape"):
        h.wait()
    with pytest.raises(ValueError, match="already in flight"):
        x = mx.nd.ones((2,))
        h = hvd.allreduce_async_(x, name="dup")
        try:
            hvd.allreduce_async_(mx.nd.ones((2,)), name="dup")
        finally:
            h.wait()
