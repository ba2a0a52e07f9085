"""Reliability battery (docs/reliability.md): sizes, zeros, fp16 range, mismatches with
compressor state, checkpoints of every compressor. Runs on 1, 2, 3 and 4 ranks."""
import numpy as np
import pytest

import gradfuse
from gradfuse.compressors import BucketContext, create
from gradfuse.errors import NonFiniteError

LOSSY = ["fp16", "bf16", "1bit", "2bit", "topk", "randomk"]


def sizes_for(p):
    return sorted({0, 1, 7, 8, 9, 31, 32, 33, 97, 1009, max(p - 1, 0), p, p + 1})


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


@pytest.mark.parametrize("name", ["none"] + LOSSY)
def test_sizes_against_numpy_reference(world, name):
    """Every size, one tensor per bucket (threshold 0), against each rank's reference decode."""
    p = world.size
    pipe = gradfuse.Pipeline(compress=name, fusion_threshold=0, average=False)
    comp = create(name)
    for n in sizes_for(p):
        everyone = [np.random.default_rng([n, r]).standard_normal(n).astype(np.float32) for r in range(p)]
        got = pipe.allreduce({f"n{n}": everyone[world.rank]})[f"n{n}"]
        assert got.shape == (n,) and not np.isnan(got).any()
        if name == "none":
            ref = everyone[0].copy()
            for x in everyone[1:]:
                ref += x
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
            continue
        if name in ("fp16", "bf16"):
            tol = 1e-2 if name == "fp16" else 6e-2
            np.testing.assert_allclose(got, np.sum(everyone, axis=0), rtol=tol, atol=tol * p)
            continue
        # the first step of an error-feedback compressor: residual 0, so c = g
        ctx = BucketContext(bucket=0, step=pipe.state_dict()["step"] - 1, counts=(n,))
        dec = []
        for x in everyone:
            pl = [np.zeros(c, d) for d, c in comp.bucket_layout(ctx)]
            comp.compress(x, pl, ctx)
            dec.append(comp.decompress(pl, n, ctx))
        ref = dec[0].copy() if n else np.zeros(0, np.float32)
        for v in dec[1:]:
            ref += v
        if name == "1bit" and comp.algorithm_for(n, p) == "twophase":
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        else:
            assert bits(got) == bits(ref), (name, n)
        assert len(set(world.allgather(bits(got)))) == 1


@pytest.mark.parametrize("name", ["none"] + LOSSY)
def test_all_zero_gives_zero_and_zero_residual(world, name):
    pipe = gradfuse.Pipeline(compress=name)
    g = {"z": np.zeros(1000, np.float32), "e": np.zeros(0, np.float32), "s": np.zeros((), np.float32)}
    for _ in range(2):
        out = pipe.allreduce(g)
        assert all(not v.any() and not np.isnan(v).any() for v in out.values())
    for b in pipe.state_dict()["buckets"].values():
        assert not b["residual"].any() and not b["server_residual"].any()
    assert pipe.allreduce({"only_empty": np.zeros((0, 4), np.float32)})["only_empty"].shape == (0, 4)


FP16_VALUES = [65504.0, 65520.0, 1e5, 6e-8, 1e-8]


@pytest.mark.parametrize("value", FP16_VALUES)
@pytest.mark.parametrize("predivide", [False, True])
def test_fp16_range(world, value, predivide):
    """Overflow to inf is reported (NonFiniteError on every rank), underflow is counted."""
    p = world.size
    pipe = gradfuse.Pipeline(compress="fp16", predivide=predivide)
    x = {"v": np.full(8, value, np.float32)}
    term = value / p if predivide else value            # what each rank casts
    with np.errstate(over="ignore"):
        term16 = np.float16(term)
        total = np.float32(term16) * p if not predivide else np.float32(term16) * p
        total16 = np.float16(total) if p > 1 else term16
    if np.isinf(term16) or np.isinf(total16):
        with pytest.raises(NonFiniteError, match="overflowed fp16"):
            pipe.allreduce(x)
        assert pipe.stats.bytes_reduced == 0
        assert len(set(world.allgather(pipe.stats.nonfinite_steps))) == 1
        return
    out = pipe.allreduce(x)["v"]
    assert np.isfinite(out).all()
    if term16 == 0:
        assert pipe.stats.cast_underflow == 8
        assert not out.any()
    else:
        np.testing.assert_allclose(out, value, rtol=2e-3, atol=6e-8)     # fp16 subnormal step


@pytest.mark.parametrize("name", LOSSY)
def test_checkpoint_of_every_compressor_is_bit_exact(world, name):
    opts = {"warmup_steps": 1}
    a = gradfuse.Pipeline(compress=name, fusion_threshold=300, **opts)
    grads = lambda s: {f"t{i}": np.random.default_rng([s, world.rank, i]).standard_normal(n).astype(np.float32)
                       for i, n in enumerate((40, 3, 129, 0, 77))}                       # noqa: E731
    for s in range(3):
        a.allreduce(grads(s))
    sd = a.state_dict()
    tail_a = [a.allreduce(grads(s)) for s in range(3, 6)]
    b = gradfuse.Pipeline(compress=name, fusion_threshold=300, **opts)
    assert b.load_state_dict(sd)
    tail_b = [b.allreduce(grads(s)) for s in range(3, 6)]
    for x, y in zip(tail_a, tail_b):
        assert all(bits(x[k]) == bits(y[k]) for k in x)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["step"] == sb["step"] == 6
    assert sa["buckets"].keys() == sb["buckets"].keys()
    for k in sa["buckets"]:
        for field in ("residual", "server_residual"):
            assert bits(sa["buckets"][k][field]) == bits(sb["buckets"][k][field])


@pytest.mark.parametrize("name", ["1bit", "topk"])
def test_mismatch_moves_no_data_and_keeps_residuals(world, name):
    if world.size < 2:
        pytest.skip("needs 2 ranks")
    pipe = gradfuse.Pipeline(compress=name)
    g = {"w": np.random.default_rng(world.rank).standard_normal(300).astype(np.float32)}
    pipe.allreduce(g)
    before, reduced = pipe.state_dict(), pipe.stats.bytes_reduced
    bad = {"w": g["w"][:299 if world.rank == 1 else 300]}
    with pytest.raises(gradfuse.MismatchError, match=r"tensor 'w': shape: ranks? 0.* sent \(300,\), rank 1 sent \(299,\)"):
        pipe.allreduce(bad)
    after = pipe.state_dict()
    assert pipe.stats.bytes_reduced == reduced and after["step"] == before["step"]
    for k, b in before["buckets"].items():
        assert bits(after["buckets"][k]["residual"]) == bits(b["residual"])
