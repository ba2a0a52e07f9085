"""Pipeline on one process: structures, dtypes, in-place, out=, bad input, caching.

Runs on both one-process communicators: MPI (mpi4py singleton) and the MPI-free one.
"""
import numpy as np
import pytest

import gradfuse
from gradfuse.comm import SingleProcessCommunicator
from gradfuse.fusion.tables import check_overlaps
from helpers import random_set


@pytest.fixture(params=["single", "mpi"])
def comm(request):
    if request.param == "single":
        return SingleProcessCommunicator()
    from mpi4py import MPI
    return MPI.COMM_SELF


def test_identity_on_one_rank(comm):
    pipe = gradfuse.Pipeline(comm=comm, fusion_threshold=256)
    for seed in range(10):
        t = random_set(seed)
        got = pipe.allreduce(t)
        assert list(got) == list(t)
        for k in t:
            assert got[k].dtype == t[k].dtype and got[k].shape == t[k].shape
            assert got[k].tobytes() == t[k].tobytes()
            assert got[k] is not t[k]


def test_structures_are_kept(comm):
    pipe = gradfuse.Pipeline(comm=comm)
    a, b = np.ones(3, np.float32), np.zeros((2, 2))
    assert isinstance(pipe.allreduce([a, b]), list)
    assert isinstance(pipe.allreduce((a, b)), tuple)
    d = pipe.allreduce({"b": b, "a": a})
    assert list(d) == ["b", "a"]
    assert pipe.allreduce([]) == []


def test_zero_d_empty_and_numpy_scalars(comm):
    pipe = gradfuse.Pipeline(comm=comm)
    got = pipe.allreduce([np.array(2.5, np.float32), np.empty((0, 3)), np.float64(4.0)])
    assert got[0].shape == () and got[0] == np.float32(2.5)
    assert got[1].shape == (0, 3)
    assert got[2] == 4.0


def test_in_place_writes_back(comm):
    pipe = gradfuse.Pipeline(comm=comm, fusion_threshold=64)
    g = [np.arange(100, dtype=np.float32), np.arange(5.0)]
    ids = [id(x) for x in g]
    out = pipe.allreduce_(g)
    assert out is g and [id(x) for x in out] == ids
    assert np.array_equal(g[0], np.arange(100, dtype=np.float32))


def test_non_contiguous_input_is_copied_output_refused(comm):
    pipe = gradfuse.Pipeline(comm=comm)
    x = np.arange(20.0).reshape(4, 5)
    got = pipe.allreduce([x[:, 1], x.T])
    assert np.array_equal(got[0], x[:, 1]) and np.array_equal(got[1], x.T)
    with pytest.raises(ValueError, match="tensor 0 is not C-contiguous"):
        pipe.allreduce_([x[:, 1]])
    with pytest.raises(ValueError, match="tensor 'w' is not C-contiguous"):
        pipe.allreduce({"w": np.ones(3)}, out={"w": np.ones(6)[::2]})


def test_bad_input_errors_name_the_tensor(comm):
    pipe = gradfuse.Pipeline(comm=comm)
    with pytest.raises(TypeError, match=r"tensor 'c': dtype complex128 is not supported"):
        pipe.allreduce({"c": np.ones(2, complex)})
    with pytest.raises(TypeError, match=r"tensor 'b': dtype bool is not supported"):
        pipe.allreduce({"b": np.ones(2, bool)})
    with pytest.raises(TypeError, match=r"tensor 's'.*str is not an array"):
        pipe.allreduce({"s": "abc"})
    with pytest.raises(TypeError, match="list, tuple or dict"):
        pipe.allreduce(np.ones(3))
    with pytest.raises(TypeError, match="dict keys must be str"):
        pipe.allreduce({1: np.ones(3)})
    with pytest.raises(ValueError, match="duplicate tensor names: 'x'"):
        pipe.allreduce([np.ones(1), np.ones(1)], names=["x", "x"])
    with pytest.raises(ValueError, match="got 1 names for 2 tensors"):
        pipe.allreduce([np.ones(1), np.ones(1)], names=["x"])
    # a names tuple is checked once and remembered (fusion.tables.flatten): a bad tuple is
    # refused every time, a good one is not re-checked, and a different tuple is checked
    bad = ("x", "x")
    for _ in range(2):
        with pytest.raises(ValueError, match="duplicate tensor names: 'x'"):
            pipe.allreduce([np.ones(1), np.ones(1)], names=bad)
    good = ("x", "y")
    for _ in range(2):
        assert [a.tolist() for a in pipe.allreduce([np.ones(1), np.ones(1)], names=good)] == [[1.0], [1.0]]
    with pytest.raises(ValueError, match="got 2 names for 3 tensors"):
        pipe.allreduce([np.ones(1)] * 3, names=good)
    with pytest.raises(TypeError, match="tensor names must be str"):
        pipe.allreduce([np.ones(1), np.ones(1)], names=("x", 1.5))
    with pytest.raises(TypeError, match="average=True needs a float dtype"):
        pipe.allreduce({"i": np.ones(2, np.int32)})
    ro = np.ones(3)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="tensor 0 is read-only"):
        pipe.allreduce_([ro])
    assert pipe.allreduce([ro])[0].tolist() == [1, 1, 1]        # reading it is fine
    with pytest.raises(ValueError, match=r"tensor 'w': output has dtype float32 shape \(3,\)"):
        pipe.allreduce({"w": np.ones(3)}, out={"w": np.ones(3, np.float32)})
    big_endian = np.ones(3, dtype=">f4")
    with pytest.raises(TypeError, match="is not supported"):
        pipe.allreduce([big_endian])


def test_partial_overlap_is_refused_exact_alias_allowed(comm):
    pipe = gradfuse.Pipeline(comm=comm)
    base = np.arange(10.0)
    a, b = base[0:6], base[4:10]
    with pytest.raises(ValueError, match="overlaps"):
        pipe.allreduce_([a, b])                      # in place: two results, shared memory
    with pytest.raises(ValueError, match="tensor 0 output overlaps tensor 1 input"):
        pipe.allreduce([np.ones(6), base[4:10]], out=[base[0:6], np.empty(6)])
    x = np.arange(4.0)
    got = pipe.allreduce([x], out=[x])               # output *is* input: in place
    assert got[0] is x
    # read-only aliasing between inputs is harmless
    same = np.arange(3.0)
    r = pipe.allreduce([same, same], names=["p", "q"])
    assert np.array_equal(r[0], same) and np.array_equal(r[1], same)


def test_check_overlaps_vectorised():
    p = np.array([0, 100, 200], np.int64)
    n = np.array([100, 100, 100], np.int64)
    check_overlaps(p, n, p, n, ["a", "b", "c"])                  # in place, disjoint
    with pytest.raises(ValueError, match="tensor 'a' output overlaps tensor 'b' output"):
        check_overlaps(p, n, np.array([1000, 1050, 2000]), n, ["a", "b", "c"])
    with pytest.raises(ValueError, match="tensor 'c' input overlaps tensor 'b' output"):
        check_overlaps(p, n, np.array([1000, 250, 2000]), n, ["a", "b", "c"])


def test_plan_cache_and_stats(comm):
    pipe = gradfuse.Pipeline(comm=comm, fusion_threshold=100)
    t = {"a": np.ones(10, np.float32), "b": np.ones(40, np.float32), "c": np.ones(3)}
    for _ in range(3):
        pipe.allreduce(t)
    assert pipe.stats.plans_built == 1
    assert pipe.stats.steps == 3 and pipe.stats.tensors == 9
    assert pipe.stats.bytes_reduced == 3 * (40 + 160 + 24)
    pipe.allreduce({"a": np.ones(11, np.float32)})
    assert pipe.stats.plans_built == 2


def test_get_config_round_trips(comm):
    pipe = gradfuse.Pipeline(comm=comm, fusion_threshold=12345, average=False)
    cfg = pipe.get_config()
    assert cfg == {"compress": "none", "fusion_threshold": 12345, "average": False, "direct_threshold": None,
                   "nonfinite": "raise", "min_elements": 0}
    again = gradfuse.Pipeline(comm=comm, **cfg)
    assert again.get_config() == cfg
    assert "fusion_threshold=12345" in repr(pipe)


def test_options_are_validated(comm):
    with pytest.raises(ValueError, match="unknown compressor 'nope'; valid names: 1bit, 2bit, bf16, fp16, none, powersgd, randomk, topk"):
        gradfuse.Pipeline(comm=comm, compress="nope")
    with pytest.raises(ValueError, match="fusion_threshold"):
        gradfuse.Pipeline(comm=comm, fusion_threshold=-1)
    with pytest.raises(TypeError, match="average must be True or False"):
        gradfuse.Pipeline(comm=comm, average="yes")
    with pytest.raises(TypeError, match="comm must be"):
        gradfuse.Pipeline(comm="world")


def test_env_threshold(monkeypatch, comm):
    monkeypatch.setenv("GRADFUSE_FUSION_THRESHOLD", "4096")
    assert gradfuse.Pipeline(comm=comm).fusion_threshold == 4096
    monkeypatch.setenv("GRADFUSE_FUSION_THRESHOLD", "4 MiB")
    with pytest.raises(ValueError, match="GRADFUSE_FUSION_THRESHOLD='4 MiB'"):
        gradfuse.Pipeline(comm=comm)


def test_async_handle(comm):
    pipe = gradfuse.Pipeline(comm=comm)
    h = pipe.allreduce_async([np.ones(3)])
    assert h.wait(timeout=30)[0].tolist() == [1, 1, 1]
    assert h.done()


def test_configuration_is_read_only(comm):
    pipe = gradfuse.Pipeline(comm=comm)
    for attr, value in (("average", False), ("fusion_threshold", 0), ("direct_threshold", 1),
                        ("compressor", None)):
        with pytest.raises(AttributeError):
            setattr(pipe, attr, value)


def test_single_process_communicator_refuses_a_non_contiguous_destination():
    """Its copies write through a flat view; a strided destination would get a copy and
    the result would be lost, so it is an error (the pipeline always passes contiguous)."""
    from gradfuse.comm.single import SingleProcessCommunicator
    comm = SingleProcessCommunicator()
    dst = np.zeros((4, 4), np.float32)[:, :2]
    with pytest.raises(ValueError, match="destination arrays must be C-contiguous"):
        comm.allreduce(np.ones((4, 2), np.float32), dst)
    ok = np.zeros((4, 2), np.float32)
    comm.allreduce(np.ones((4, 2), np.float32), ok)
    assert ok.sum() == 8.0
