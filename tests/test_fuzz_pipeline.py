"""Hypothesis fuzzing of ``Pipeline`` on one process: SingleProcessCommunicator and
mpi4py's COMM_SELF. Random structures, shapes, dtypes (unsupported ones included),
names (duplicates included), options and ``out=``. Each case must give the correct
result or a TypeError/ValueError; anything else (another exception, a crash, a hang,
a pipeline that no longer works after an error) fails. The validity oracle is
tests/fuzz_common.build_case. Deterministic: see tests/fuzz_common.py.
"""
import os
import sys

import numpy as np
import pytest
from hypothesis import given

sys.path.insert(0, os.path.dirname(__file__))
from fuzz_common import COUNTS, build_case, fuzz_settings, pipeline_cases, pipeline_kwargs  # noqa: E402

import gradfuse  # noqa: E402
from gradfuse.comm import SingleProcessCommunicator  # noqa: E402

pytestmark = pytest.mark.slow     # deterministic fuzzing, thousands of calls

N = 300                 # cases per communicator
HANG_S = 20             # a single case that takes longer than this is a hang


@pytest.fixture(autouse=True, scope="module")
def _report():
    yield
    print("\npipeline fuzz cases: " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items())))


def _values(x):
    return list(x.values()) if isinstance(x, dict) else list(x)


def check_identity(grads, result, out, case):
    """One rank: the sum (and the mean, divided by 1) of a tensor is the tensor, bit for bit."""
    if out is not None:
        assert result is out
    assert type(result) is type(grads)
    if isinstance(grads, dict):
        assert list(result) == list(grads)
    for g, r in zip(_values(grads), _values(result)):
        g = np.asarray(g)
        assert isinstance(r, np.ndarray) and r.shape == g.shape and r.dtype == g.dtype
        assert r.tobytes() == np.ascontiguousarray(g).tobytes()


def run_case(case, comm):
    grads, out, names, valid, _ = build_case(case, rank=0, world_size=1)
    snapshot = [np.array(g, copy=True) if isinstance(g, np.ndarray) else None for g in
                (_values(grads) if isinstance(grads, (list, tuple, dict)) else [])]
    try:
        pipe = gradfuse.Pipeline(comm=comm, **pipeline_kwargs(case))
        # several collectives in flight at once (in place, one: a second would sum the sum)
        ops = 1 if out is grads else case["async_ops"]
        handles = [pipe.allreduce_async(grads, out=out, names=names) for _ in range(ops)]
        results = [h.wait(timeout=HANG_S) for h in handles]
    except (TypeError, ValueError) as exc:
        assert not valid, f"valid case raised {type(exc).__name__}: {exc}\ncase: {case}"
        assert str(exc), "an error without a message"
        COUNTS["errors"] += 1
        return
    assert valid, f"an invalid case did not raise\ncase: {case}"
    for res in results:
        if out is grads:
            # in place: the inputs still hold their own values
            for s, g in zip(snapshot, _values(grads)):
                assert s is None or s.tobytes() == np.asarray(g).tobytes()
        check_identity(grads, res, out, case)
    COUNTS["correct"] += 1
    # the pipeline still works after whatever this case did
    again = pipe.allreduce([np.ones(3, np.float32)])
    assert again[0].tolist() == [1.0, 1.0, 1.0]


@fuzz_settings(N)
@given(case=pipeline_cases())
def test_fuzz_single_process(case):
    COUNTS["single"] += 1
    run_case(case, SingleProcessCommunicator())


@fuzz_settings(N)
@given(case=pipeline_cases())
def test_fuzz_comm_self(case):
    from mpi4py import MPI
    COUNTS["comm_self"] += 1
    run_case(case, MPI.COMM_SELF)
