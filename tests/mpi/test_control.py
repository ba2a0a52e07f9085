"""Control plane: every rank raises the same error, naming both values, before data moves."""
import os
import warnings

import numpy as np
import pytest

import gradfuse
from gradfuse.runtime.control import StallWarning


def f32(*shape):
    return np.ones(shape, np.float32)


# Each case: a function of the rank returning (pipeline kwargs, grads), and a fragment of
# the expected message. Rank 1 (and rank 2 where present) deviate from rank 0.
CASES = {
    "shape": (lambda r: ({}, {"fc1.weight": f32(17 + (r > 0), 3)}),
              "tensor 'fc1.weight': shape: rank 0 sent (17, 3), rank"),
    "dtype": (lambda r: ({}, {"w": np.ones(3, np.float32 if r == 0 else np.float64)}),
              "tensor 'w': dtype: rank 0 sent 'float32', rank"),
    "name": (lambda r: ({}, {("a" if r == 0 else "b"): f32(3)}),
             "different tensor names, at position 0: rank 0 sent 'a', rank"),
    "order": (lambda r: ({}, {"a": f32(2), "b": f32(3)} if r == 0 else {"b": f32(3), "a": f32(2)}),
              "tensors in a different order, at position 0: rank 0 sent 'a', rank"),
    "count": (lambda r: ({}, {"a": f32(2)} if r == 0 else {"a": f32(2), "extra": f32(1)}),
              "ranks sent different numbers of tensors: rank 0 sent 1, rank"),
    "average": (lambda r: ({"average": r == 0}, {"a": f32(2)}),
                "option 'average': rank 0 sent True, rank"),
    "threshold": (lambda r: ({"fusion_threshold": 1024 if r == 0 else 0}, {"a": f32(2)}),
                  "option 'fusion_threshold': rank 0 sent 1024, rank"),
    "bad dtype on one rank": (lambda r: ({}, {"a": np.ones(2, np.complex64 if r == 1 else np.float32)}),
                              "rank 1 rejected its input for allreduce: tensor 'a': dtype complex64"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_mismatch_raises_same_error_everywhere_and_moves_no_data(world, kind):
    make, fragment = CASES[kind]
    kwargs, grads = make(world.rank)
    pipe = gradfuse.Pipeline(**kwargs)
    before = pipe.stats.bytes_reduced
    # the rank whose own input was bad raises its TypeError; the others a ValueError
    with pytest.raises((ValueError, TypeError)) as info:
        pipe.allreduce(grads)
    msg = str(info.value)
    assert fragment in msg, msg
    messages = world.allgather(msg)
    assert len(set(messages)) == 1, messages        # the very same message on every rank
    assert pipe.stats.bytes_reduced == before == 0
    # the next (consistent) step works
    ok = gradfuse.Pipeline(average=False).allreduce({"z": f32(4)})
    assert np.array_equal(ok["z"], np.full(4, world.size, np.float32))


def test_mismatch_names_three_ranks(world):
    if world.size < 3:
        pytest.skip("needs 3 ranks")
    with pytest.raises(ValueError) as info:
        gradfuse.Pipeline().allreduce({"x": f32(world.rank + 1)})
    assert "rank 0 sent (1,), rank 1 sent (2,), rank 2 sent (3,)" in str(info.value)


def test_duplicate_names_and_bad_structure_raise_on_every_rank(world):
    pipe = gradfuse.Pipeline()
    with pytest.raises(ValueError, match="duplicate tensor names: 'a'"):
        pipe.allreduce([f32(1), f32(1)], names=["a", "a"])
    with pytest.raises(TypeError, match="list, tuple or dict"):
        pipe.allreduce(f32(3))
    assert pipe.allreduce([f32(1)])[0].shape == (1,)


def test_invalid_input_on_one_rank_does_not_hang_the_others(world):
    pipe = gradfuse.Pipeline()
    # a non-contiguous input is copied, not refused
    grads = [f32(3)] if world.rank != 1 else [np.ones(6, np.float32)[::2]]
    assert np.array_equal(pipe.allreduce(grads)[0], f32(3))
    bad = {"w": f32(3)} if world.rank != 1 else {"w": "not an array"}
    with pytest.raises((TypeError, ValueError)) as info:
        pipe.allreduce(bad)
    assert "rank 1 rejected its input" in str(info.value)
    if world.rank == 1:
        assert isinstance(info.value, TypeError)
    else:
        assert isinstance(info.value, gradfuse.RemoteInputError)


def test_stall_warning_names_missing_rank(world, monkeypatch):
    import time
    monkeypatch.setenv("GRADFUSE_STALL_WARNING_S", "0.3")
    pipe = gradfuse.Pipeline()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if world.rank == 1:
            time.sleep(1.0)
        pipe.allreduce([f32(2)])
    stalls = [str(w.message) for w in caught if issubclass(w.category, StallWarning)]
    if world.rank == 0:
        assert stalls and "waiting for rank 1" in stalls[0], stalls
    elif world.rank == 1:
        assert not stalls


def test_any_local_error_is_announced(world):
    """Not only TypeError/ValueError: a producer that cannot export its buffer, for example."""
    class Unexportable:
        def __dlpack__(self, **kw):
            raise BufferError("cannot export (e.g. a torch tensor that requires grad)")
    pipe = gradfuse.Pipeline()
    bad = {"w": f32(3)} if world.rank != 1 else {"w": Unexportable()}
    with pytest.raises(Exception) as info:
        pipe.allreduce(bad)
    if world.rank == 1:
        assert isinstance(info.value, BufferError)
    else:
        assert isinstance(info.value, gradfuse.RemoteInputError)
        assert "rank 1 rejected its input for allreduce: BufferError: cannot export" in str(info.value)
    ok = pipe.allreduce({"w": f32(3)})                       # and the ranks stay in step
    assert np.array_equal(ok["w"], f32(3))


def test_buffer_exporters_reduced_in_place(world):
    """memoryview / array.array tensors, also large enough to skip packing."""
    import array
    pipe = gradfuse.Pipeline(fusion_threshold=0, average=False)
    a = array.array("f", [1.0] * 5)
    m = memoryview(bytearray(np.full(4, 2.0, np.float32).tobytes())).cast("f")
    out = pipe.allreduce_([a, m])
    assert list(out[0]) == [float(world.size)] * 5 and list(out[1]) == [2.0 * world.size] * 4
