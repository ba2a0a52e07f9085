"""Compressed float16 gradients, and the non-finite policy ``nonfinite="skip"`` (one rank;
the multi-rank bodies are in tests/mpi/test_nonfinite_skip.py, the GPU twin in
tests/test_gpu_pipeline.py through gpu_pipeline_cases.make_grads' float16 tensor).

A float16 bucket is upcast exactly to float32, compressed with a float32 residual, and
the result rounded once to float16: so it equals the float32 pipeline on the upcast
gradients, rounded with numpy's ``astype(float16)``, bit for bit, step after step.
"""
import numpy as np
import pytest

import gradfuse
from gradfuse.comm import SingleProcessCommunicator

LOSSY = [("1bit", {"block_size": 64}), ("1bit", {"block_size": 64, "algorithm": "twophase"}),
         ("2bit", {"threshold": 0.3}), ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.1, "seed": 3}),
         ("fp16", {"error_feedback": True}), ("bf16", {})]


@pytest.fixture(scope="module")
def comm():
    return SingleProcessCommunicator()


def _grads(step, dtype):
    rng = np.random.default_rng(100 + step)
    return {"w": rng.standard_normal((20, 30)).astype(dtype),
            "b": (rng.standard_normal(30) * 1e-2).astype(dtype),
            "big": rng.standard_normal(3000).astype(dtype)}        # 6000 B: a direct bucket at 4096


@pytest.mark.parametrize("name,opts", LOSSY, ids=lambda x: str(x))
@pytest.mark.parametrize("inplace", [False, True])
def test_float16_buckets_are_compressed_like_float32_then_rounded_once(comm, name, opts, inplace):
    half = gradfuse.Pipeline(compress=name, comm=comm, fusion_threshold=4096, **opts)
    full = gradfuse.Pipeline(compress=name, comm=comm, fusion_threshold=4096, **opts)
    for step in range(4):
        g16 = _grads(step, np.float16)
        g32 = {k: v.astype(np.float32) for k, v in g16.items()}      # exact upcast
        got = half.allreduce_(g16) if inplace else half.allreduce(g16)
        want = full.allreduce(g32)
        for k in g16:
            assert got[k].dtype == np.float16
            assert got[k].tobytes() == want[k].astype(np.float16).tobytes(), (name, step, k)
    # compressed for real: the residuals are float32 and not all zero (fp16 loses nothing
    # of values that came as float16, so its residual stays zero)
    sd = half.state_dict()
    if half.compressor.error_feedback and name != "fp16":
        res = [b["residual"] for b in sd["buckets"].values()]
        assert res and all(r.dtype == np.float32 for r in res) and any(np.any(r != 0) for r in res)
    assert half.stats.bytes_sent == full.stats.bytes_sent


def test_float16_and_float32_tensors_in_one_call(comm):
    pipe = gradfuse.Pipeline(compress="1bit", comm=comm, block_size=32)
    ref = gradfuse.Pipeline(compress="1bit", comm=comm, block_size=32)
    g = {"a": np.linspace(-1, 1, 100).astype(np.float32), "h": np.linspace(-2, 3, 70).astype(np.float16),
         "d": np.arange(5, dtype=np.float64)}
    out = pipe.allreduce(g)
    # the float16 tensor is a bucket of its own (buckets hold one dtype)
    want = ref.allreduce({"a": g["a"], "d": g["d"]})
    want_h = gradfuse.Pipeline(compress="1bit", comm=comm, block_size=32).allreduce({"h": g["h"].astype(np.float32)})
    assert out["h"].tobytes() == want_h["h"].astype(np.float16).tobytes()
    assert out["a"].tobytes() == want["a"].tobytes()
    assert np.array_equal(out["d"], g["d"])                    # float64 is not compressed


def test_nonfinite_skip_makes_every_float_output_nan_and_keeps_the_state(comm):
    pipe = gradfuse.Pipeline(compress="1bit", comm=comm, nonfinite="skip", block_size=32, average=False)
    clean = gradfuse.Pipeline(compress="1bit", comm=comm, block_size=32, average=False)
    good = [{"w": np.random.default_rng(s).standard_normal(200).astype(np.float32),
             "h": np.random.default_rng(s + 50).standard_normal(40).astype(np.float16),
             "i": np.arange(4, dtype=np.int64) + s} for s in range(3)]
    pipe.allreduce(good[0])
    clean.allreduce(good[0])
    before = pipe.state_dict()
    bad = {k: v.copy() for k, v in good[1].items()}
    bad["w"][7] = np.inf
    out = pipe.allreduce(bad)
    assert np.isnan(out["w"]).all() and np.isnan(out["h"]).all()
    assert np.array_equal(out["i"], bad["i"])                  # integers are still reduced (1 rank: as given)
    after = pipe.state_dict()
    assert after["step"] == before["step"]
    for key, b in before["buckets"].items():
        assert after["buckets"][key]["residual"].tobytes() == b["residual"].tobytes()
    assert pipe.stats.nonfinite_steps == 1 and pipe.stats.failed_steps == 0
    # the skipped step did not happen: the run goes on as if it never came
    for g in good[1:]:
        a, b = pipe.allreduce(g), clean.allreduce(g)
        assert all(a[k].tobytes() == b[k].tobytes() for k in g)


def test_nonfinite_raise_is_the_default_and_option_is_checked(comm):
    pipe = gradfuse.Pipeline(compress="topk", comm=comm)
    assert pipe.nonfinite == "raise" and pipe.get_config()["nonfinite"] == "raise"
    with pytest.raises(gradfuse.NonFiniteError):
        pipe.allreduce([np.array([1.0, np.nan], np.float32)])
    with pytest.raises(ValueError, match="nonfinite must be one of 'raise', 'skip', got 'ignore'"):
        gradfuse.Pipeline(compress="topk", comm=comm, nonfinite="ignore")
    again = gradfuse.Pipeline(comm=comm, **gradfuse.Pipeline(compress="1bit", comm=comm,
                                                               nonfinite="skip").get_config())
    assert again.nonfinite == "skip"


def test_nonfinite_skip_in_place_writes_nan_into_the_callers_arrays(comm):
    pipe = gradfuse.Pipeline(compress="randomk", comm=comm, nonfinite="skip", ratio=0.5)
    g = [np.ones(64, np.float32), np.full(10, np.nan, np.float16)]
    res = pipe.allreduce_(g)
    assert res is g and np.isnan(g[0]).all() and np.isnan(g[1]).all()
