"""The network bench's exactness check (gradfuse/bench/network_worker.py): a sum is right
when it is MPI's or the rank-order sum, bit for bit, on every rank; anything else, on any
rank, is wrong on every rank."""
import numpy as np
import pytest

from gradfuse.bench.network_worker import rank_order_sum, sums_match


def _arrays(me):
    rng = np.random.default_rng(11 + me)
    return [rng.standard_normal(n).astype(np.float32) for n in (1, 1000, 4097)]


def _gathered(world, a):
    rows = np.empty((world.Get_size(), a.size), a.dtype)
    world.Allgather(a, rows)
    return rows


def test_rank_order_sum_is_the_left_to_right_sum_on_every_rank(world):
    for a in _arrays(world.Get_rank()):
        rows = _gathered(world, a)
        want = rows[0].copy()
        for r in rows[1:]:
            want += r
        got = rank_order_sum(world, a)
        assert np.array_equal(got, want)
        assert np.array_equal(_gathered(world, got)[0], got)         # the same bits everywhere


@pytest.mark.parametrize("case", ["mpi", "rank order", "one rank off"])
def test_sums_match_takes_mpi_or_rank_order_and_nothing_else(world, case):
    me = world.Get_rank()
    arrays = _arrays(me)
    ordered = [rank_order_sum(world, a) for a in arrays]
    # an "MPI" result in another order: the rank-order sum one ulp off, so that only the
    # fallback can accept the rank-order sum
    other = [np.nextafter(o, np.float32(np.inf)) for o in ordered]
    if case == "mpi":
        work, expected = [o.copy() for o in other], other
    else:
        work, expected = [o.copy() for o in ordered], other
    if case == "one rank off" and me == world.Get_size() - 1:
        work[1][7] = np.nextafter(work[1][7], np.float32(-np.inf))
    assert sums_match(world, arrays, work, expected) == (case != "one rank off")
