"""Sums between the ranks of one host through each other's memory (gradfuse.comm.cma).

The suite's ranks run on one host, so the default communicator sums through cross-memory
attach unless GRADFUSE_CMA=0; a second communicator made with GRADFUSE_CMA=0 is the MPI
library's path to compare against. On 2 ranks both give MPI_Allreduce's bits; from 3 ranks
the intra-host path sums in rank order (each element once, by its owner), so the
reference is the rank-order sum, and every rank holds the same bits."""
import os

import numpy as np
import pytest

import gradfuse
from gradfuse.comm.mpi import MPICommunicator
from gradfuse.errors import GradfuseError


def _off(world, monkeypatch):
    monkeypatch.setenv("GRADFUSE_CMA", "0")
    c = MPICommunicator(world)
    monkeypatch.delenv("GRADFUSE_CMA")
    assert c.cma is None and c.cma_status == "off: GRADFUSE_CMA=0"
    return c


def _rank_order_sum(world, x):
    """Every rank's x, summed in rank order in x's dtype (float16: float32 add rounded once)."""
    flat = np.ascontiguousarray(x).reshape(-1)
    allx = np.empty((world.size,) + flat.shape, flat.dtype)
    world.Allgather(flat.view(np.uint8), allx.view(np.uint8).reshape(world.size, -1))
    acc = allx[0].copy()
    for y in allx[1:]:
        acc = (acc.astype(np.float32) + y.astype(np.float32)).astype(np.float16) if x.dtype == np.float16 \
            else acc + y
    return acc.reshape(x.shape)


def _same_everywhere(world, x):
    mine = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    allb = np.empty((world.size, mine.size), np.uint8)
    world.Allgather(mine, allb)
    return bool((allb == allb[0]).all())


def test_on_between_the_ranks_of_one_host(world):
    from gradfuse.runtime.context import default_context
    c = default_context().comm
    if os.environ.get("GRADFUSE_CMA") == "0":
        assert c.cma is None and c.cma_status == "off: GRADFUSE_CMA=0"
        pytest.skip("GRADFUSE_CMA=0")
    assert c.cma_status.startswith("on"), c.cma_status
    assert c.reduces_rows and c.cma.push, c.cma_status


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
def test_one_array_in_and_out_of_place(world, dtype):
    c = MPICommunicator(world)
    if c.cma is None:
        pytest.skip(c.cma_status)
    rng = np.random.default_rng(world.rank + 7)
    for n in (c.rows_min_bytes // np.dtype(dtype).itemsize, 300_001):
        x = (rng.standard_normal(n) * 50).astype(dtype)
        want = _rank_order_sum(world, x)
        a = x.copy()
        c.allreduce_inplace(a)
        b = np.full_like(x, 3)
        c.allreduce(x, b)
        for got in (a, b):
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (dtype, n)
            assert _same_everywhere(world, got)


def test_pipeline_matches_the_mpi_path(world, monkeypatch):
    """Mixed dtypes, fused and direct buckets, averaged or summed, in place and out of
    place: the intra-host path against the MPI library's (bitwise on 2 ranks)."""
    from gradfuse.runtime.context import default_context
    on = default_context().comm
    if on.cma is None:
        pytest.skip(on.cma_status)
    off = _off(world, monkeypatch)
    rng = np.random.default_rng(world.rank)
    shapes = [(300, 400), (17,), (1 << 17,), (5, 7), (2000,), (3,)]
    for average in (True, False):
        grads = {f"f32.{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
        grads["f16"] = rng.standard_normal(70_000).astype(np.float16)
        grads["f64"] = rng.standard_normal((300, 300))
        if not average:
            grads["i32"] = rng.integers(-1000, 1000, 50_000).astype(np.int32)
            grads["i64"] = rng.integers(-1000, 1000, 9).astype(np.int64)
        pa = gradfuse.Pipeline(average=average, comm=on)
        pb = gradfuse.Pipeline(average=average, comm=off)
        got_out = pa.allreduce(grads)
        ref_out = pb.allreduce(grads)
        got_in = {k: v.copy() for k, v in grads.items()}
        pa.allreduce_(got_in)
        for k, x in grads.items():
            if world.size == 2:
                want = ref_out[k]
            else:
                want = _rank_order_sum(world, x)
                if average:
                    want = (want.astype(np.float32) / np.float32(world.size)).astype(np.float16) \
                        if x.dtype == np.float16 else want / x.dtype.type(world.size)
            for got in (got_out[k], got_in[k]):
                assert np.array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8)), (k, average)
                assert _same_everywhere(world, got)


@pytest.mark.parametrize("push", [True, False])
def test_groups_of_rows(world, push):
    """allreduce_rows: several dtypes in one call, rows of every size, empty rows; sums
    pushed into the peers' outputs, or read back by them (where writes are refused)."""
    from gradfuse.runtime.context import default_context
    c = default_context().comm
    if c.cma is None:
        pytest.skip(c.cma_status)
    saved, c.cma.push = c.cma.push, push
    rng = np.random.default_rng(world.rank + 100)
    f32 = [rng.standard_normal(n).astype(np.float32) for n in (5, 0, 100_000, 1, 4099)]
    i64 = [rng.integers(0, 10, n) for n in (3, 70_000)]
    want32 = [_rank_order_sum(world, x) for x in f32]
    want64 = [_rank_order_sum(world, x) for x in i64]
    out32 = [np.empty_like(x) for x in f32]

    def rows(xs):
        return np.array([x.ctypes.data if x.size else 1 for x in xs], np.int64)

    try:
        c.allreduce_rows([(2, rows(f32), rows(out32), np.array([x.size for x in f32], np.int64)),
                          (5, rows(i64), rows(i64), np.array([x.size for x in i64], np.int64))])
    finally:
        c.cma.push = saved
    for got, want in zip(out32 + i64, want32 + want64):
        assert np.array_equal(got, want)


def test_a_failed_read_raises_on_every_rank_and_the_next_call_matches(world):
    """Rank 0 cannot read rank 1 (its pid table names a process that does not exist):
    every rank raises the same error, naming both ranks, and the communicator still
    matches its next collective."""
    from gradfuse.runtime.context import default_context
    c = default_context().comm
    if c.cma is None:
        pytest.skip(c.cma_status)
    gone = next(pid for pid in range(4_000_000, 0, -1) if not os.path.exists(f"/proc/{pid}"))
    x = np.ones(100_000, np.float32)
    rows = np.array([x.ctypes.data], np.int64)
    saved = c.cma.pids.copy()
    if world.rank == 0:
        c.cma.pids[1] = gone
    try:
        with pytest.raises(GradfuseError, match="rank 0 could not read or write rank 1's memory") as info:
            c.allreduce_rows([(2, rows, rows, np.array([x.size], np.int64))])
    finally:
        c.cma.pids[:] = saved
    assert "incomplete on every rank" in str(info.value) and "GRADFUSE_CMA=0" in str(info.value)
    y = np.full(100_000, world.rank + 1.0, np.float32)
    c.allreduce_inplace(y)
    assert (y == world.size * (world.size + 1) / 2).all()
    out = gradfuse.Pipeline(average=False).allreduce([np.ones(70_000, np.float32)])
    assert (out[0] == world.size).all()


def test_off_on_request(world, monkeypatch):
    off = _off(world, monkeypatch)
    with pytest.raises(NotImplementedError, match="GRADFUSE_CMA=0"):
        off.allreduce_rows([])
    a = np.full(1 << 18, 1.0, np.float32)
    off.allreduce_inplace(a)
    assert (a == world.size).all()


def test_the_intra_host_sum_allocates_nothing_in_steady_state(world):
    """2000 small tensors summed through the peers' memory, as a training loop's steps
    call it: from the third call on, ``allreduce_rows`` allocates no block of 4 KiB or
    more (the address tables are kept per layout; ``plain.reduce_rows`` keeps the rows'
    address arrays with the plan)."""
    import tracemalloc
    from gradfuse.runtime.context import default_context
    c = default_context().comm
    if c.cma is None:
        pytest.skip(c.cma_status)
    sizes = np.random.default_rng(5).integers(100, 5000, 2000)        # the same shapes on every rank
    rng = np.random.default_rng(world.rank)
    grads = [rng.standard_normal(int(n)).astype(np.float32) for n in sizes]
    rows = np.array([g.ctypes.data for g in grads], np.int64)
    counts = np.array(sizes, np.int64)
    groups = [(2, rows, rows, counts)]
    for _ in range(2):
        c.allreduce_rows(groups, 2.0)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        cur0, _ = tracemalloc.get_traced_memory()
        for _ in range(3):
            c.allreduce_rows(groups, 2.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - cur0 < 4096, f"the calls' allocations peaked {peak - cur0} bytes above their start"


def test_mxnet_direct_and_fused_tensors_on_either_path(world):
    """gradfuse.mxnet hands its arrays over in MXNet's engine (a deferred step): a large
    tensor reduced where it lies (a direct bucket, 2 MiB) beside small fused ones, in
    place and out of place. This file also runs with GRADFUSE_CMA=0 (the MPI library's
    path, where the step makes numpy views of the direct tensors at MXNet's pointers), and
    both give the rank-order sum."""
    mx = pytest.importorskip("mxnet")
    import gradfuse.mxnet as hvd
    hvd.init()
    rng = np.random.default_rng(world.rank + 3)
    host = [rng.standard_normal(s).astype(np.float32) for s in ((512, 1024), (7,), (300,), (1 << 16,))]
    want = [_rank_order_sum(world, x) for x in host]
    nds = [mx.nd.array(x) for x in host]
    outs = hvd.grouped_allreduce(nds, op=hvd.Sum, name="cma.mx.oop")
    hvd.grouped_allreduce_(nds, op=hvd.Sum, name="cma.mx.inplace")
    for got in (outs, nds):
        for g, w in zip(got, want):
            assert np.array_equal(g.asnumpy(), w)
