"""Nothing is unpickled on the data path (or the control plane), even on mismatches.

``pickle.loads``, ``pickle.load``, ``pickle.Unpickler`` and mpi4py's own unpickler
(``MPI.pickle``, reconfigured through its constructor, since its attributes are
read-only) are replaced by functions that record the call and raise. A positive control
shows the patch catches mpi4py's lower-case (pickling) collectives. Then every
compressor in ``gradfuse.compressors.available()`` runs matching, mismatching and
one-rank-invalid allreduces. The number of unpickling attempts, summed over ranks with
a buffer (non-pickle) ``Allreduce``, must be 0.
"""
import pickle

import numpy as np
import pytest

import gradfuse
from gradfuse import MismatchError, RemoteInputError, compressors


@pytest.fixture
def no_unpickling(world):
    from mpi4py import MPI
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[:1])
        raise AssertionError("something tried to unpickle on the gradfuse path")

    class RefusingUnpickler:
        def __init__(self, *a, **k):
            refuse(*a)

    saved = pickle.loads, pickle.load, pickle.Unpickler
    pickle.loads, pickle.load, pickle.Unpickler = refuse, refuse, RefusingUnpickler
    MPI.pickle.__init__(pickle.dumps, refuse)
    try:
        yield calls
    finally:
        pickle.loads, pickle.load, pickle.Unpickler = saved
        MPI.pickle.__init__(pickle.dumps, pickle.loads)


def _total(world, n):
    from mpi4py import MPI
    buf = np.array([n], np.int64)
    world.Allreduce(MPI.IN_PLACE, buf)
    return int(buf[0])


def test_patch_catches_mpi4py_pickling(world, no_unpickling):
    with pytest.raises(AssertionError, match="unpickle"):
        world.allgather(world.Get_rank())           # a pickling collective: must be caught
    assert _total(world, len(no_unpickling)) >= world.Get_size()
    no_unpickling.clear()


@pytest.mark.parametrize("name", compressors.available())
def test_no_unpickling_on_the_data_path(world, no_unpickling, name):
    rank, size = world.Get_rank(), world.Get_size()
    pipe = gradfuse.Pipeline(compress=name, fusion_threshold=256)     # every registered one runs
    rng = np.random.default_rng(rank)
    grads = {f"w{i}": rng.standard_normal(n).astype(dt)
             for i, (n, dt) in enumerate([(3, np.float32), (1000, np.float32), (7, np.float16),
                                          (50, np.float64), (0, np.float32)])}
    ran = 0
    for _ in range(3):                          # first step plans, the next ones reuse the plan
        out = pipe.allreduce(grads)
        assert set(out) == set(grads)
        ran += 1
    handles = [pipe.allreduce_async(grads) for _ in range(3)]
    for h in handles:
        h.wait()
        ran += 1
    # a mismatch: rank 0 names a tensor differently
    bad = dict(grads)
    if rank == 0:
        bad["renamed"] = bad.pop("w0")
    with pytest.raises(MismatchError, match="different tensor names|different order"):
        pipe.allreduce(bad)
    # one rank's input is invalid (a dtype gradfuse does not reduce)
    odd = dict(grads)
    if rank == size - 1:
        odd["w1"] = odd["w1"].astype(np.int16)
    with pytest.raises(TypeError if rank == size - 1 else RemoteInputError):
        pipe.allreduce(odd)
    # a shape mismatch, then the pipeline still works
    shaped = dict(grads)
    shaped["w2"] = np.zeros(7 + rank, np.float16)
    with pytest.raises(MismatchError, match="shape"):
        pipe.allreduce(shaped)
    pipe.allreduce(grads)
    assert _total(world, len(no_unpickling)) == 0, no_unpickling
    assert ran == 6
