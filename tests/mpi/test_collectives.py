"""Pipeline.allreduce across ranks, against per-tensor MPI.Allreduce and numpy."""
import numpy as np
import pytest
from mpi4py import MPI

import gradfuse
from gradfuse.comm.mpi import _f16_sum_op
from helpers import random_set


def per_tensor_reference(world, tensors, average):
    """Per-tensor MPI.Allreduce of the same arrays (fp16 through gradfuse's f16 sum op)."""
    out = {}
    for k, a in tensors.items():
        r = np.ascontiguousarray(a).copy()
        if r.size:
            if r.dtype == np.float16:
                world.Allreduce(MPI.IN_PLACE, [r, MPI.UINT16_T], op=_f16_sum_op())
            else:
                world.Allreduce(MPI.IN_PLACE, r)
        if average:
            r = r / r.dtype.type(world.size)
        out[k] = r
    return out


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).tobytes()


@pytest.mark.parametrize("threshold", [0, 64, 1000, 1 << 20])
@pytest.mark.parametrize("average", [False, True])
def test_random_sets_match_per_tensor_allreduce(world, threshold, average):
    pipe = gradfuse.Pipeline(fusion_threshold=threshold, average=average)
    exact = world.size == 2
    for seed in range(12):
        # integral values: sums are exact in any summation order, so bits must match on
        # any number of ranks; random floats: bit-exact on 2 ranks, close on more.
        for integral in (True, False):
            t = random_set(seed, world.rank, integral=integral)
            ref = per_tensor_reference(world, t, average)
            got = pipe.allreduce(t)
            assert list(got) == list(t)
            for k in t:
                assert got[k].shape == t[k].shape and got[k].dtype == t[k].dtype, k
                if exact or integral:
                    assert bits(got[k]) == bits(ref[k]), (seed, k, got[k], ref[k])
                else:
                    tol = 2e-3 if t[k].dtype == np.float16 else 1e-5
                    np.testing.assert_allclose(got[k].astype(np.float64), ref[k].astype(np.float64),
                                               rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [1000, 20000])      # 20000 > RING16_MIN: a ring from 3 ranks on
def test_float16_sum_is_float32_add_rounded_once(world, n):
    """On 2 ranks the fp16 sum must be exactly half(float(a) + float(b)), numpy's rule; on
    more, within the rounding of another order, and the same bits on every rank."""
    rng = np.random.default_rng([7, world.rank])
    a = np.concatenate([rng.standard_normal(n) * 1000,
                        [65504, -65504, 6e-8, 0.0, -0.0, np.inf]]).astype(np.float16)
    assert a.dtype == np.float16
    everyone = world.allgather(a)
    got = gradfuse.Pipeline(average=False).allreduce([a])[0]
    acc = everyone[0]
    for other in everyone[1:]:
        acc = (acc.astype(np.float32) + other.astype(np.float32)).astype(np.float16)
    if world.size == 2:
        assert bits(got) == bits(acc)
    else:
        # another order of p - 1 float16 roundings: each partial sum is off by at most half an
        # ulp, 2**-11 of its size (at most the sum of the terms' magnitudes), in either order
        scale = np.sum([np.abs(e.astype(np.float64)) for e in everyone], axis=0)
        fin = np.isfinite(scale) & np.isfinite(acc)       # the terms' infs and the sums that overflow
        assert bits(got[~fin]) == bits(acc[~fin])
        err = np.abs(got[fin].astype(np.float64) - acc[fin].astype(np.float64))
        assert (err <= 2 * (world.size - 1) * 2.0 ** -11 * scale[fin] + 6e-8).all()
    assert len(set(world.allgather(bits(got)))) == 1


def test_average_float16_does_not_overflow_where_sum_fits(world):
    x = np.full(8, 60000.0 / world.size, dtype=np.float16)   # the sum fits in fp16
    got = gradfuse.Pipeline(average=True).allreduce([x])[0]
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got.astype(np.float32), x.astype(np.float32), rtol=1e-3)


def test_integers_sum(world):
    t = {"i32": np.arange(10, dtype=np.int32) * (world.rank + 1), "i64": np.full((3, 2), 7, np.int64)}
    got = gradfuse.Pipeline(average=False, fusion_threshold=16).allreduce(t)
    tot = sum(range(1, world.size + 1))
    assert np.array_equal(got["i32"], np.arange(10, dtype=np.int32) * tot)
    assert np.array_equal(got["i64"], np.full((3, 2), 7 * world.size, np.int64))


@pytest.mark.parametrize("threshold", [0, 256, 1 << 20])
def test_in_place_and_out(world, threshold):
    pipe = gradfuse.Pipeline(fusion_threshold=threshold)
    t = random_set(99, world.rank, dtypes=[np.float32, np.float64])
    ref = per_tensor_reference(world, t, True)
    copy = {k: v.copy() for k, v in t.items()}
    ret = pipe.allreduce_(copy)
    assert ret is copy
    out = {k: np.empty_like(v) for k, v in t.items()}
    ret2 = pipe.allreduce(t, out=out)
    assert ret2 is out
    for k in t:
        np.testing.assert_allclose(copy[k], ref[k], rtol=1e-6)
        assert bits(out[k]) == bits(copy[k])


def test_list_names_and_async(world):
    pipe = gradfuse.Pipeline(average=False)
    a = [np.full(5, world.rank, np.float32), np.ones((2, 2))]
    h1 = pipe.allreduce_async(a, names=["x", "y"])
    h2 = pipe.allreduce_async([np.ones(3, np.float32)])
    r1, r2 = h1.wait(), h2.wait()
    assert np.array_equal(r1[0], np.full(5, sum(range(world.size)), np.float32))
    assert np.array_equal(r1[1], np.full((2, 2), float(world.size)))
    assert np.array_equal(r2[0], np.full(3, world.size, np.float32))


def test_plan_is_cached(world):
    pipe = gradfuse.Pipeline(fusion_threshold=512)
    t = random_set(5, world.rank, dtypes=[np.float32])
    for _ in range(3):
        pipe.allreduce(t)
    assert pipe.stats.plans_built == 1 and pipe.stats.steps == 3


def test_sub_communicator(world):
    sub = world.Split(color=world.rank % 2, key=world.rank)
    pipe = gradfuse.Pipeline(comm=sub, average=False)
    got = pipe.allreduce([np.ones(4, np.float32)])[0]
    assert np.array_equal(got, np.full(4, sub.size, np.float32))


def test_host_queries(world):
    gradfuse.init()
    assert gradfuse.rank() == world.rank and gradfuse.size() == world.size
    # mpiexec here runs every rank on this host
    assert gradfuse.local_size() == world.size and gradfuse.local_rank() == world.rank
    assert gradfuse.cross_size() == 1 and gradfuse.cross_rank() == 0
