"""The output pool of out-of-place ``Pipeline.allreduce`` (issue 15, item 3): outputs are
reused from one call to the next only when the caller no longer holds them."""
import gc

import numpy as np
import pytest

import gradfuse
from gradfuse.comm import SingleProcessCommunicator
from gradfuse.fusion.pool import OutputPool


@pytest.fixture(params=["single", "mpi"])
def comm(request):
    if request.param == "single":
        return SingleProcessCommunicator()
    from mpi4py import MPI
    return MPI.COMM_SELF


def _grads(k, threshold=256):
    """Step k's gradients: some fused (small), one reduced where it lies (large)."""
    return [np.full(10, k, np.float32), np.full((3, 4), 10 * k, np.float64), np.full(5000, -k, np.float32)]


def _ptrs(outs):
    return [o.ctypes.data for o in outs]


def test_keep_step_k_run_step_k_plus_1_step_k_unchanged(comm):
    pipe = gradfuse.Pipeline(comm=comm, fusion_threshold=256)
    kept = []
    for k in range(1, 7):                   # more steps kept than the pool keeps sets
        out = pipe.allreduce(_grads(k))
        kept.append((k, out))
        for j, o in kept:                  # every result still held is still its step's
            for got, want in zip(o, _grads(j)):
                np.testing.assert_array_equal(got, want)
    ptrs = [tuple(_ptrs(o)) for _, o in kept]
    assert len(set(ptrs)) == len(ptrs), "a held output was handed out again"


def test_a_view_of_an_output_keeps_it(comm):
    pipe = gradfuse.Pipeline(comm=comm, fusion_threshold=256)
    out = pipe.allreduce(_grads(1))
    view = out[2][10:20]                   # only a view of one array is held
    first = _ptrs(out)
    del out
    gc.collect()
    out2 = pipe.allreduce(_grads(2))
    assert _ptrs(out2)[2] != first[2]
    np.testing.assert_array_equal(view, np.full(10, -1, np.float32))
    np.testing.assert_array_equal(out2[2], np.full(5000, -2, np.float32))


def test_outputs_dropped_are_reused(comm):
    """What the pool is for: later calls write into memory already used (no fresh pages).
    At most two output sets take turns: the communication thread still refers to the last
    job's result until it takes the next job (gradfuse.runtime.engine's loop), so the
    set of the call just before is not free yet when the next call takes one."""
    pipe = gradfuse.Pipeline(comm=comm, fusion_threshold=256)
    seen = set()
    for k in range(1, 8):
        out = pipe.allreduce(_grads(k))
        seen.add(tuple(_ptrs(out)))
        for got, want in zip(out, _grads(k)):
            np.testing.assert_array_equal(got, want)
        del out
    assert len(seen) <= 2, f"{len(seen)} output sets for 7 calls whose outputs were dropped"


def test_dict_results_held_are_kept(comm):
    pipe = gradfuse.Pipeline(comm=comm)
    a = pipe.allreduce({"w": np.ones(8), "b": np.zeros(2)})
    b = pipe.allreduce({"w": np.full(8, 2.0), "b": np.full(2, 3.0)})
    np.testing.assert_array_equal(a["w"], np.ones(8))
    np.testing.assert_array_equal(b["b"], np.full(2, 3.0))
    assert a["w"].ctypes.data != b["w"].ctypes.data


def test_async_calls_in_flight_get_their_own_outputs(comm):
    pipe = gradfuse.Pipeline(comm=comm, fusion_threshold=256)
    handles = [pipe.allreduce_async(_grads(k)) for k in range(1, 5)]
    results = [h.wait() for h in handles]
    for k, out in enumerate(results, 1):
        for got, want in zip(out, _grads(k)):
            np.testing.assert_array_equal(got, want)


def test_pool_keeps_at_most_its_sets():
    class Entry:
        codes = [gradfuse.dtypes.CODE[np.dtype(np.float32)]]
        shapes = [(4,)]
    pool, held = OutputPool(), []
    for _ in range(OutputPool.SETS + 2):
        objs, _ = pool.take(Entry)
        held.append(objs[0])
    assert len(pool.sets) == OutputPool.SETS
    assert len({a.ctypes.data for a in held}) == len(held)
