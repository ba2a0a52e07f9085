"""Across ranks: a layer policy is part of what the ranks agree on."""
import numpy as np
import pytest

import gradfuse
from gradfuse.errors import MismatchError


def _grads(rank):
    rng = np.random.default_rng([rank, 4])
    return {"fc.weight": rng.standard_normal((16, 32)).astype(np.float32),
            "fc.bias": rng.standard_normal(16).astype(np.float32)}


def test_a_policy_gives_every_rank_the_same_bits(world):
    rank = world.Get_rank()
    pipe = gradfuse.Pipeline(compress={"*.bias": None, "*": "1bit"})
    out = pipe.allreduce(_grads(rank))
    everyone = world.allgather({k: v.tobytes() for k, v in out.items()})
    assert all(e == everyone[0] for e in everyone)
    want = sum(_grads(r)["fc.bias"] for r in range(world.Get_size())) / np.float32(world.Get_size())
    assert np.allclose(out["fc.bias"], want, rtol=1e-6)


def test_ranks_with_different_policies_raise_everywhere(world):
    rank = world.Get_rank()
    policy = {"*.bias": None, "*": "1bit"} if rank == 0 else {"*": "1bit"}
    pipe = gradfuse.Pipeline(compress=policy)
    with pytest.raises(MismatchError, match="option 'compress'"):
        pipe.allreduce(_grads(rank))
    gate = gradfuse.Pipeline(compress="1bit", min_elements=10 + rank)
    with pytest.raises(MismatchError, match="option 'compress'"):
        gate.allreduce(_grads(rank))
