"""Across ranks: ``nonfinite="skip"`` (NaN/Inf on one rank only makes every rank's float
outputs NaN, and nobody's state moves), and compressed float16 gradients (the float32
pipeline on the upcast values, rounded once, on every rank)."""
import numpy as np
import pytest

import gradfuse


def _grads(rank, step):
    rng = np.random.default_rng([rank, step, 9])
    return {"w": rng.standard_normal(300).astype(np.float32),
            "h": rng.standard_normal(80).astype(np.float16),
            "i": np.arange(3, dtype=np.int64) + rank}


@pytest.mark.parametrize("name,opts", [("1bit", {"block_size": 32}), ("1bit", {"algorithm": "twophase"}),
                                       ("topk", {"ratio": 0.1}), ("fp16", {}), ("randomk", {"ratio": 0.2})])
def test_nan_on_one_rank_skips_the_step_everywhere(world, name, opts):
    rank, size = world.Get_rank(), world.Get_size()
    pipe = gradfuse.Pipeline(compress=name, nonfinite="skip", average=False, **opts)
    clean = gradfuse.Pipeline(compress=name, average=False, **opts)
    pipe.allreduce(_grads(rank, 0))
    clean.allreduce(_grads(rank, 0))
    before = pipe.state_dict()
    bad = _grads(rank, 1)
    if rank == size - 1:
        bad["w"][5] = np.nan
    out = pipe.allreduce(bad)
    assert np.isnan(out["w"]).all() and np.isnan(out["h"]).all(), rank
    assert out["i"].tolist() == [sum(r + j for r in range(size)) for j in range(3)]
    after = pipe.state_dict()
    assert after["step"] == before["step"]
    for key, b in before["buckets"].items():
        assert after["buckets"][key]["residual"].tobytes() == b["residual"].tobytes()
        assert after["buckets"][key]["server_residual"].tobytes() == b["server_residual"].tobytes()
    assert pipe.stats.nonfinite_steps == 1 and pipe.stats.failed_steps == 0
    for step in (2, 3):
        a, b = pipe.allreduce(_grads(rank, step)), clean.allreduce(_grads(rank, step))
        assert all(a[k].tobytes() == b[k].tobytes() for k in a), (name, step)


@pytest.mark.parametrize("name,opts", [("1bit", {"block_size": 32}), ("2bit", {"threshold": 0.5}),
                                       ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.1, "seed": 5})])
def test_float16_gradients_are_compressed_on_every_rank(world, name, opts):
    rank = world.Get_rank()
    half = gradfuse.Pipeline(compress=name, **opts)
    full = gradfuse.Pipeline(compress=name, **opts)
    for step in range(3):
        g = {"h": np.random.default_rng([rank, step]).standard_normal(500).astype(np.float16)}
        got = half.allreduce(g)["h"]
        want = full.allreduce({"h": g["h"].astype(np.float32)})["h"].astype(np.float16)
        assert got.tobytes() == want.tobytes(), (name, step)
        everyone = world.allgather(got.tobytes())
        assert all(e == everyone[0] for e in everyone)
    assert half.stats.bytes_sent == full.stats.bytes_sent < 2 * 500 * 3
