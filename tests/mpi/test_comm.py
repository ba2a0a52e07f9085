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
