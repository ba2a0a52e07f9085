"""The Adam correction across ranks, under mpiexec -n 2 and -n 3 (tests/test_mpi_launch.py):
the pipeline equals the numpy model of the correction (tests/ref_adam.py) bit for bit on
every rank (warm-up on the exact mean gradient, then every rank's moment with error
feedback, the mean of the decoded moments as every rank's m, the frozen-v step), two-phase
1-bit and the pipelined buckets give the same bits everywhere, the adaptive freeze fires
on the same step on every rank, and checkpoints restore the state bit-exactly."""
import os
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ref_adam as ref  # noqa: E402

import gradfuse  # noqa: E402
from gradfuse.compressors import adam as cadam, create  # noqa: E402

F32 = np.float32
MODELLED = [("1bit", {"block_size": 64, "algorithm": "allgather"}), ("2bit", {}), ("topk", {"ratio": 0.1})]


def grads(step, rank, scale=1.0):
    rng = np.random.default_rng([step, rank, 13])
    return {f"t{i}": (rng.standard_normal(s) * scale * (0.01 if i % 2 else 1.0)).astype(F32)
            for i, s in enumerate((33, 1, 200, 7, 1029))}


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32).tobytes()


def same_everywhere(comm, arrays):
    mine = b"".join(bits(a) for a in arrays)
    assert all(x == mine for x in comm.allgather(mine))


@pytest.mark.parametrize("rule", ["adam", "adamw"])
@pytest.mark.parametrize("name,opts", MODELLED, ids=[n for n, _ in MODELLED])
def test_pipeline_equals_the_model(world, name, opts, rule):
    p, r = world.size, world.rank
    pipe = gradfuse.Pipeline(name, adam=rule, warmup_steps=3, fusion_threshold=2000, **opts)
    model = ref.Model(create(name, **opts), cadam.AdamSpec(rule, (0.9, 0.999), 1e-8), 3, p=p)
    for t in range(8):
        want = model.step([grads(t, q) for q in range(p)])
        got = pipe.allreduce(grads(t, r))
        for k in got:
            assert bits(got[k]) == bits(want[k]), (name, rule, t, k)
    same_everywhere(world, [pipe.state_dict()["buckets"][k]["arrays"]["adam.m"]
                            for k in sorted(pipe.state_dict()["buckets"])])


@pytest.mark.parametrize("name,opts", [("1bit", {"block_size": 32, "algorithm": "twophase"}),
                                       ("fp16", {"error_feedback": True}), ("randomk", {"ratio": 0.1})])
@pytest.mark.parametrize("pipelined", [False, True])
def test_other_exchanges_agree_on_every_rank(world, pipelined, name, opts):
    """Two-phase 1-bit (server residuals), fp16 summed by the network, random-k, pipelined
    buckets or not: every rank holds the same step and the same m; the warm-up is plain
    Adam on the mean gradient."""
    p, r = world.size, world.rank
    pipe = gradfuse.Pipeline(name, adam="adamw", warmup_steps=2, fusion_threshold=900, pipeline_buckets=pipelined,
                             **opts)
    model = ref.Model(None, cadam.AdamSpec("adamw", (0.9, 0.999), 1e-8), 2, p=p)
    for t in range(6):
        want = model.step([grads(t, q) for q in range(p)])
        got = pipe.allreduce(grads(t, r))
        if t < 2:
            for k in got:
                assert bits(got[k]) == bits(want[k]), (t, k)
        same_everywhere(world, [got[k] for k in sorted(got)])
    sd = pipe.state_dict()["buckets"]
    same_everywhere(world, [sd[k]["arrays"]["adam.m"] for k in sorted(sd)])
    assert all(b["arrays"]["adam.freeze"][0] == 2 for b in sd.values())
    if opts.get("algorithm") == "twophase":
        assert all(b["server_residual"].size for b in sd.values())


def test_adaptive_freeze_fires_together(world, monkeypatch):
    """Every rank freezes on the same step (the ranks' largest change decides)."""
    monkeypatch.setattr(cadam, "FREEZE_WINDOW", 3)
    pipe = gradfuse.Pipeline("1bit", adam="adamw")
    for t in range(300):
        # rank-dependent gradient noise: the ranks' own measurements would differ
        pipe.allreduce(grads(t, world.rank, scale=1.0 + world.rank))
        if pipe.state.meta.get("adam", {}).get("frozen_at"):
            break
    T = pipe.state.meta["adam"]["frozen_at"]
    assert T > 0
    assert world.allgather(T) == [T] * world.size


def test_checkpoint_continues_bit_exactly(world):
    r = world.rank
    opts = dict(adam="adam", warmup_steps=2, block_size=64, fusion_threshold=2000)
    full = gradfuse.Pipeline("1bit", **opts)
    want = [full.allreduce(grads(t, r)) for t in range(7)]
    first = gradfuse.Pipeline("1bit", **opts)
    for t in range(4):
        first.allreduce(grads(t, r))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"rank{r}.npz")
        first.save_state(path)
        second = gradfuse.Pipeline("1bit", **opts)
        assert second.load_state(path)
    for t in range(4, 7):
        got = second.allreduce(grads(t, r))
        for k in got:
            assert bits(got[k]) == bits(want[t][k]), (t, k)
