"""The MPI communicator's data-plane collectives (used by compressors and gradfuse.mxnet)."""
import numpy as np

from gradfuse.comm.mpi import MPICommunicator


def test_collectives(world):
    c = MPICommunicator(world)
    r, p = c.rank, c.size
    a = np.full(3, r + 1.0, np.float32)
    d = np.empty_like(a)
    c.allreduce_op(a, d, "max")
    assert (d == p).all()
    c.allreduce_op(a, d, "prod")
    assert (d == np.prod(np.arange(1, p + 1))).all()
    h = np.full(3, r + 1.0, np.float16)
    hd = np.empty_like(h)
    c.allreduce_op(h, hd, "min")
    assert (hd == 1).all()
    b = np.arange(4.0) * (r == 1)
    c.bcast(b, 1)
    assert (b == np.arange(4.0)).all()
    g = np.empty((p, 2), np.int64)
    c.allgather(np.array([r, r]), g)
    assert (g[:, 0] == np.arange(p)).all()
    cnt = [i + 1 for i in range(p)]
    gv = np.empty(sum(cnt))
    c.allgatherv(np.full(r + 1, float(r)), gv, cnt)
    assert gv.tolist() == sum([[float(i)] * (i + 1) for i in range(p)], [])
    s = np.arange(p * 2, dtype=np.float32) + 100 * r
    t = np.empty_like(s)
    c.alltoall(s, t)
    assert t.tolist() == sum([[100.0 * q + 2 * r, 100.0 * q + 2 * r + 1] for q in range(p)], [])
    sc = [q + 1 for q in range(p)]          # rank r sends q+1 elements to rank q
    rc = [r + 1] * p
    sv = np.concatenate([np.full(q + 1, 10.0 * r + q) for q in range(p)])
    rv = np.empty(sum(rc))
    c.alltoallv(sv, sc, rv, rc)
    assert rv.tolist() == sum([[10.0 * q + r] * (r + 1) for q in range(p)], [])
    rs = np.ones(p * 2, np.float32)
    out = np.empty(2, np.float32)
    c.reduce_scatter(rs, out, [2] * p)
    assert (out == p).all()
    sub = c.split([0])
    assert (sub is not None) == (r == 0)
    if sub is not None:
        assert sub.size == 1


def test_out_of_place_allreduce_matches_mpi(world):
    """``allreduce(src, dst)`` gives MPI_Allreduce's bits on every rank count; on 2 ranks
    large float arrays take the two-exchange path (no copy of src into dst first), odd
    sizes included, and src is left as it was."""
    from mpi4py import MPI
    from gradfuse.comm import mpi as cm
    c = MPICommunicator(world)
    rng = np.random.default_rng(c.rank)
    for dtype in (np.float32, np.float64):
        for n in (cm.OOP2_MIN - 1, cm.OOP2_MIN, cm.OOP2_MIN + 1, 3 * cm.OOP2_MIN + 7):
            src = rng.standard_normal(n).astype(dtype).reshape(-1, 1) if n % 2 else \
                rng.standard_normal(n).astype(dtype)
            keep = src.copy()
            dst = np.full_like(src, np.nan)
            want = np.empty_like(src)
            world.Allreduce(src, want, op=MPI.SUM)
            c.allreduce(src, dst)
            assert np.array_equal(dst.view(np.uint8), want.view(np.uint8)), (dtype, n)
            assert np.array_equal(src, keep)
            # every rank holds the same bits
            mine = dst.reshape(-1).view(np.uint8)
            allb = np.empty((c.size, mine.size), np.uint8)
            world.Allgather(mine, allb)
            assert (allb == allb[0]).all()


def test_pipeline_out_of_place_keeps_held_outputs(world):
    """Step k's outputs, still held by the caller, are not overwritten by step k+1 (the
    output pool reuses only what nobody holds), with large tensors on the direct path."""
    import gradfuse
    rng = np.random.default_rng(world.Get_rank())
    pipe = gradfuse.Pipeline(average=False)
    shapes = [(300, 400), (17,), (1 << 17,), (5, 7)]
    for _ in range(3):
        xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        a = pipe.allreduce(xs)
        snapshot = [t.copy() for t in a]
        ys = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        b = pipe.allreduce(ys)
        for t, s in zip(a, snapshot):
            assert np.array_equal(t, s)
        for t, y in zip(b, ys):
            want = np.empty_like(y)
            world.Allreduce(y, want)
            assert np.array_equal(t, want)
        del a, b
