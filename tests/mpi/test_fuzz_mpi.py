"""Multi-rank hypothesis fuzzing of Pipeline.allreduce (runs under mpiexec -n 2 / -n 3).

Every rank draws the same cases (derandomized, same max_examples), so names, shapes
and options agree; values differ per rank. Valid cases are checked against a
per-tensor ``MPI.Allreduce`` of the same data (float16 with gradfuse's own 16-bit sum
op, which MPI lacks). Invalid cases must raise TypeError/ValueError on every rank; a
fault on one rank only (a bad dtype, shape, name or tensor count there) must raise
the rank's own TypeError there and RemoteInputError elsewhere, or the same
MismatchError on every rank.
"""
import os
import sys

import numpy as np
import pytest
from hypothesis import Phase, given, settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fuzz_common import COUNTS, build_case, fuzz_settings, pipeline_cases, pipeline_kwargs  # noqa: E402

import gradfuse  # noqa: E402
from gradfuse import MismatchError, RemoteInputError  # noqa: E402
from gradfuse.comm import mpi as gmpi  # noqa: E402

N = 120
HANG_S = 60


def _values(x):
    return list(x.values()) if isinstance(x, dict) else list(x)


def reference(world, g, average):
    """Per-tensor MPI.Allreduce of one tensor (then / size in the dtype, as gradfuse averages)."""
    from mpi4py import MPI
    x = np.array(g, order="C", copy=True)     # (ascontiguousarray would make 0-d arrays 1-d)
    ref = np.empty_like(x)
    if x.dtype == np.float16:
        world.Allreduce([x.view(np.uint16), MPI.UINT16_T], [ref.view(np.uint16), MPI.UINT16_T],
                        op=gmpi._f16_sum_op())
    else:
        world.Allreduce(x, ref, op=MPI.SUM)
    if average:
        with np.errstate(all="ignore"):
            ref = (ref / x.dtype.type(world.Get_size())).astype(x.dtype)
    return ref


def same_bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype.kind == "f":
        nan = np.isnan(a)
        assert np.array_equal(nan, np.isnan(b))
        assert a[~nan].tobytes() == b[~nan].tobytes()
    else:
        assert a.tobytes() == b.tobytes()


@settings(fuzz_settings(N), phases=[Phase.explicit, Phase.generate])   # no shrinking: the
@given(case=pipeline_cases())                                          # ranks must stay in step
def test_fuzz_allreduce(world, case):
    """Pass or fail together: a rank that fails alone would leave the others waiting."""
    try:
        run_case(world, case)
        failure = None
    except AssertionError as exc:
        failure = f"rank {world.Get_rank()}: {exc}"
    failures = [f for f in world.allgather(failure) if f]
    assert not failures, "\n".join(failures)


def run_case(world, case):
    rank, size = world.Get_rank(), world.Get_size()
    COUNTS["mpi_cases"] += 1
    grads, out, names, valid, fault = build_case(case, rank=rank, world_size=size)
    if fault is not None and not build_case(case, rank=rank, world_size=1)[3]:
        fault = "also-invalid"     # this rank's input is invalid anyway: its own error wins
    inputs = [np.array(g, copy=True) for g in _values(grads)] if valid else None
    try:
        pipe = gradfuse.Pipeline(**pipeline_kwargs(case))
        # several collectives in flight at once (in place, one: a second would sum the sum)
        ops = 1 if out is grads else case["async_ops"]
        handles = [pipe.allreduce_async(grads, out=out, names=names) for _ in range(ops)]
        errors = []
        results = []
        for h in handles:                       # wait for all, so every rank stays in step
            try:
                results.append(h.wait(timeout=HANG_S))
            except (TypeError, ValueError) as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
    except (TypeError, ValueError) as exc:
        assert not valid, f"rank {rank}: valid case raised {type(exc).__name__}: {exc}\n{case}"
        COUNTS["mpi_errors"] += 1
        msgs = world.allgather((type(exc).__name__, str(exc)))
        if fault == "dtype":
            br = case["bad_rank"]
            assert isinstance(exc, TypeError if rank == br else RemoteInputError), (rank, exc)
            if rank != br:
                assert f"rank {br} rejected its input" in str(exc), str(exc)
        elif fault in ("shape", "name", "count"):
            assert isinstance(exc, MismatchError), (rank, fault, exc)
            assert len(set(msgs)) == 1, msgs    # the same message on every rank
        return
    assert valid, f"rank {rank}: an invalid case did not raise\n{case}"
    assert fault is None
    COUNTS["mpi_correct"] += 1
    avg = bool(case["average"])
    for res in results:
        for x, r in zip(inputs, _values(res)):
            same_bits(np.asarray(r), reference(world, x, avg))
        COUNTS["mpi_tensors_checked"] += len(inputs)


def test_fuzz_report(world):
    counts = world.allgather(dict(COUNTS))
    if world.Get_rank() == 0:
        print(f"\nmpi fuzz cases per rank: {counts[0]}")
    assert all(c == counts[0] for c in counts)          # every rank ran the same cases
    assert counts[0].get("mpi_cases", 0) >= N
