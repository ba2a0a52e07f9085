"""DGC's momentum correction and sparsity warm-up on one process (issue 14, items 2 and 3):
the kernels against their numpy twins, the pipeline against the DGC math written out by
hand, checkpoints, warm-up, options and errors. The MXNet trainers' equivalence with
gluon.Trainer is in tests/test_momentum_mxnet.py; multi-rank bodies in tests/mpi/test_momentum.py.
"""
import os
import sys
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import ref_momentum as ref  # noqa: E402

import gradfuse  # noqa: E402
import gradfuse._core as core  # noqa: E402
from gradfuse.comm import SingleProcessCommunicator  # noqa: E402
from gradfuse.compressors import create  # noqa: E402
from gradfuse.compressors.base import BucketContext  # noqa: E402
from gradfuse.compressors.momentum import warmup_ratio  # noqa: E402

F32 = np.float32
LOSSY = [("1bit", {"block_size": 64}), ("1bit", {"block_size": 32, "algorithm": "twophase"}),
         ("2bit", {"threshold": 0.5}), ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.1, "seed": 3}),
         ("fp16", {}), ("fp16", {"error_feedback": True}), ("bf16", {"error_feedback": True})]
SIZES = (33, 1, 0, 200, 7, 129)


def ids(cases):
    return [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in cases]


@pytest.fixture(scope="module")
def comm():
    return SingleProcessCommunicator()


def grads(step, rank=0, sizes=SIZES):
    rng = np.random.default_rng([step, rank, 5])
    return {f"t{i}": (rng.standard_normal(s) * (0.01 if i % 2 else 1.0)).astype(F32) for i, s in enumerate(sizes)}


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32).tobytes()


def table(arrs):
    ptrs = np.array([a.ctypes.data if a.size else 0 for a in arrs], np.int64)
    counts = np.array([a.size for a in arrs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return ptrs, offsets, counts


# ------------------------------------------------------------------ kernels

@pytest.mark.parametrize("nesterov", [0.0, 0.9])
@pytest.mark.parametrize("sizes", [(0,), (1,), (5, 0, 33, 700, 1), (4097,)])
def test_momentum_update_kernel_equals_numpy(sizes, nesterov):
    rng = np.random.default_rng(1)
    gs = [(rng.standard_normal(s) * 10).astype(F32) for s in sizes]
    n = sum(sizes)
    u = rng.standard_normal(n).astype(F32)
    ptrs, off, cnt = table(gs)
    want_u, want_out = ref.momentum_update(np.concatenate(gs), u, 0.9 * 1.7, nesterov)
    # out into separate arrays, u double-buffered
    outs = [np.empty(s, F32) for s in sizes]
    u_out = np.empty(n, F32)
    core.momentum_update(ptrs, off, cnt, 0, len(gs), u, u_out, 0.9 * 1.7, table(outs)[0], nesterov)
    assert bits(u_out) == bits(want_u) and bits(np.concatenate(outs)) == bits(want_out)
    # in place: u_out is u_in, out is the gradients themselves
    core.momentum_update(ptrs, off, cnt, 0, len(gs), u, u, 0.9 * 1.7, ptrs, nesterov)
    assert bits(u) == bits(want_u) and bits(np.concatenate(gs)) == bits(want_out)


def test_momentum_update_kernel_no_out_and_errors():
    g = np.arange(6, dtype=F32)
    u, uo = np.ones(6, F32), np.empty(6, F32)
    ptrs, off, cnt = table([g])
    core.momentum_update(ptrs, off, cnt, 0, 1, u, uo, 0.5, np.zeros(0, np.int64), 0.0)
    assert uo.tolist() == (0.5 + g).tolist() and g.tolist() == list(range(6))
    with pytest.raises(ValueError, match="velocity of 5 elements too short for row 0"):
        core.momentum_update(ptrs, off, cnt, 0, 1, u[:5], uo[:5], 0.5, np.zeros(0, np.int64), 0.0)
    with pytest.raises(ValueError, match="u_in has 6 elements and u_out 5"):
        core.momentum_update(ptrs, off, cnt, 0, 1, u, uo[:5], 0.5, np.zeros(0, np.int64), 0.0)
    with pytest.raises(ValueError, match="row 0 of the output table has a null address"):
        core.momentum_update(ptrs, off, cnt, 0, 1, u, uo, 0.5, np.zeros(1, np.int64), 0.0)
    with pytest.raises(IndexError, match="table range 0:2"):
        core.momentum_update(ptrs, off, cnt, 0, 2, u, uo, 0.5, np.zeros(0, np.int64), 0.0)
    with pytest.raises(ValueError, match="finite"):
        core.momentum_update(ptrs, off, cnt, 0, 1, u, uo, float("nan"), np.zeros(0, np.int64), 0.0)


def test_momentum_mask_kernel_equals_numpy():
    rng = np.random.default_rng(2)
    n = 1000
    e_in = rng.standard_normal(n).astype(F32)
    x = rng.standard_normal(n).astype(F32)
    e_out = np.where(rng.random(n) < 0.3, 0, 1).astype(F32)
    e_out[:5] = -0.0                        # a cleared residual may be -0
    x[5:10], e_in[5:10], e_out[5:10] = 1.0, -1.0, 0.0      # c == 0: not masked (nothing was sent)
    u = rng.standard_normal(n).astype(F32)
    want, count = ref.momentum_mask(e_in, x, e_out, u)
    assert core.momentum_mask(e_in, x, e_out, u) == count and bits(u) == bits(want)
    assert (u[5:10] != 0).all() and (u[:5] == 0).all()
    with pytest.raises(ValueError, match="same length"):
        core.momentum_mask(e_in[:3], x, e_out, u)


# ------------------------------------------------------------------ the pipeline, lossless

@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("threshold", [0, 300, 1 << 20])
def test_uncompressed_velocity_is_momentum(comm, threshold, nesterov):
    """compress=None with momentum: every output is this rank's u (or m u + g), bit for bit;
    one rank in place too (the one-rank shortcut must not skip the velocity)."""
    pipe = gradfuse.Pipeline(compress=None, momentum=0.9, nesterov=nesterov, comm=comm, fusion_threshold=threshold)
    u = {}
    for step in range(4):
        g = grads(step)
        want = {}
        for k, v in g.items():
            u[k], want[k] = ref.momentum_update(v, u.get(k, np.zeros_like(v)), 0.9, 0.9 if nesterov else 0.0)
        got = pipe.allreduce_(g) if step % 2 else pipe.allreduce(g)
        for k in g:
            assert bits(got[k]) == bits(want[k]), (step, k)
    vel = [b["velocity"] for b in pipe.state_dict()["buckets"].values()]
    # the state holds the same values (bucket order, which differs from the tensor order)
    assert bits(np.sort(np.concatenate(vel))) == bits(np.sort(np.concatenate([u[k] for k in grads(0)])))


def test_float16_uncompressed_velocity_rounds_once(comm):
    """A float16 tensor of a momentum pipeline: float32 velocity of the upcast gradient,
    rounded once to float16 for the sum (the fused and the direct bucket)."""
    for threshold in (1 << 20, 0):
        pipe = gradfuse.Pipeline(compress=None, momentum=0.5, comm=comm, fusion_threshold=threshold)
        rng = np.random.default_rng(0)
        u = np.zeros(37, F32)
        for step in range(3):
            g = {"h": rng.standard_normal(37).astype(np.float16), "w": rng.standard_normal(5).astype(F32)}
            u, _ = ref.momentum_update(g["h"].astype(F32), u, 0.5)
            out = pipe.allreduce(g)
            assert out["h"].dtype == np.float16 and out["h"].tobytes() == u.astype(np.float16).tobytes()


def test_float64_with_momentum_is_refused_naming_the_tensor(comm):
    pipe = gradfuse.Pipeline(compress="1bit", momentum=0.9, comm=comm)
    with pytest.raises(TypeError, match="tensor 'd': momentum=0.9 keeps a float32 velocity.*float64"):
        pipe.allreduce({"w": np.ones(3, F32), "d": np.ones(3, np.float64)})
    summed = gradfuse.Pipeline(compress="1bit", momentum=0.9, comm=comm, average=False)
    assert summed.allreduce({"w": np.ones(3, F32), "i": np.ones(3, np.int64)})["i"].tolist() == [1, 1, 1]


# ------------------------------------------------------------------ the pipeline, compressed

def bucket_names(pipe):
    """State key -> the names of its bucket's tensors, in bucket order (one cached plan)."""
    (entry,) = pipe._plans.values()
    plan = entry.plan
    return {f"{entry.state_key}/{b.index}": [entry.names[int(i)] for i in plan.order[b.lo:b.hi]]
            for b in plan.buckets}


def sends_velocity(comp, nesterov):
    """1-bit's ``velocity="sent"`` (its default, SGD's correction): the velocity becomes the
    decoded payload this rank sent."""
    return comp.name == "1bit" and comp.options["velocity"] == "sent" and not nesterov


def own_decode(comp, c, counts):
    """What a receiver decodes from this rank's payload of ``c`` (the compressor's plain
    methods, which the fused kernels match bit for bit)."""
    ctx = BucketContext(counts=counts)
    payloads = [np.zeros(n, dt) for dt, n in comp.bucket_layout(ctx)]
    comp.compress(c, payloads, ctx)
    return comp.decompress(payloads, c.size, ctx)


def dgc_reference(name, opts, nesterov=False, masking=None, steps=5, threshold=300, comm=None, rank=0,
                  warmup=0, feed=None):
    """DGC written out: this rank's velocity by hand (ref_momentum), fed to the same
    compressor without momentum (error feedback on), masked where its residual was cleared
    (1-bit: set to this rank's decoded payload, ``velocity="sent"``)."""
    plain = gradfuse.Pipeline(compress=name, comm=comm, fusion_threshold=threshold, warmup_steps=warmup, **opts)
    comp = plain.compressor
    mask = (("ratio" in comp.options) and comp.error_feedback) if masking is None else masking
    u, outs = {}, []
    for step in range(steps):
        g = feed(step) if feed else grads(step, rank)
        x = {}
        for k, v in g.items():
            u[k], x[k] = ref.momentum_update(v, u.get(k, np.zeros_like(v)), 0.9, 0.9 if nesterov else 0.0)
        before = {key: b["residual"] for key, b in plain.state_dict()["buckets"].items()}
        outs.append(plain.allreduce(x))
        if sends_velocity(comp, nesterov) and step >= warmup:
            for key, names in bucket_names(plain).items():
                e_in = before.get(key)
                flat_x = np.concatenate([x[k] for k in names])
                c = np.add(flat_x, e_in if e_in is not None else np.zeros_like(flat_x), dtype=F32)
                sent = own_decode(comp, c, tuple(g[k].size for k in names))
                pos = 0
                for k in names:
                    u[k] = sent[pos:pos + g[k].size]
                    pos += g[k].size
        if mask and step >= warmup:
            res = plain.state_dict()["buckets"]
            for key, names in bucket_names(plain).items():
                e_in = before.get(key, np.zeros_like(res[key]["residual"]))
                flat_u, _ = ref.momentum_mask(e_in, np.concatenate([x[k] for k in names]), res[key]["residual"],
                                              np.concatenate([u[k] for k in names]))
                pos = 0
                for k in names:
                    u[k] = flat_u[pos:pos + g[k].size]
                    pos += g[k].size
    return outs, plain


@pytest.mark.parametrize("name,opts", LOSSY, ids=ids(LOSSY))
@pytest.mark.parametrize("nesterov", [False, True])
def test_compressed_momentum_equals_dgc_written_out(comm, name, opts, nesterov):
    want, plain = dgc_reference(name, opts, nesterov=nesterov, comm=comm)
    pipe = gradfuse.Pipeline(compress=name, momentum=0.9, nesterov=nesterov, comm=comm, fusion_threshold=300, **opts)
    for step in range(5):
        got = pipe.allreduce(grads(step))
        for k in got:
            assert bits(got[k]) == bits(want[step][k]), (name, step, k)
    a, b = pipe.state_dict()["buckets"], plain.state_dict()["buckets"]
    for key in b:       # the same residuals (the keys differ: momentum is in the config)
        ka = [x for x in a if x.endswith("/" + key.rsplit("/", 1)[1])][0]
        assert bits(a[ka]["residual"]) == bits(b[key]["residual"]), key


@pytest.mark.parametrize("name", ["topk", "randomk"])
def test_momentum_factor_masking(comm, name):
    """Masking zeroes the velocity exactly where top-k/random-k sent a value; off, it does not."""
    opts = {"ratio": 0.1}
    on = gradfuse.Pipeline(compress=name, momentum=0.9, comm=comm, fusion_threshold=1 << 20, **opts)
    off = gradfuse.Pipeline(compress=name, momentum=0.9, momentum_masking=False, comm=comm,
                            fusion_threshold=1 << 20, **opts)
    g = grads(0)
    on.allreduce(g)
    off.allreduce(g)
    (b_on,), (b_off,) = on.state_dict()["buckets"].values(), off.state_dict()["buckets"].values()
    flat = np.concatenate([v for v in g.values() if v.size])
    sent = b_on["residual"] == 0
    assert 0.1 * flat.size <= sent.sum() < 0.1 * flat.size + len(g)     # k per tensor
    assert (b_on["velocity"][sent] == 0).all() and (b_on["velocity"][~sent] == flat[~sent]).all()
    assert bits(b_off["velocity"]) == bits(flat)
    want, _ = dgc_reference(name, opts, masking=False, comm=comm, threshold=1 << 20)
    for step in range(1, 4):
        got = off.allreduce(grads(step))
        assert all(bits(got[k]) == bits(want[step][k]) for k in got)
    assert on.compressor.momentum_masking and not create("1bit", momentum=0.9).momentum_masking


def test_warmup_steps_keep_the_velocity(comm):
    """warmup_steps: uncompressed steps run the velocity too; compression then continues it."""
    want, _ = dgc_reference("topk", {"ratio": 0.1}, comm=comm, warmup=2)
    pipe = gradfuse.Pipeline(compress="topk", ratio=0.1, warmup_steps=2, momentum=0.9, comm=comm, fusion_threshold=300)
    for step in range(5):
        got = pipe.allreduce(grads(step))
        assert all(bits(got[k]) == bits(want[step][k]) for k in got), step


def test_scale_velocity_folds_into_the_momentum(comm):
    pipe = gradfuse.Pipeline(compress=None, momentum=0.9, comm=comm)
    g0, g1 = np.arange(4, dtype=F32), np.ones(4, F32)
    pipe.allreduce({"w": g0})
    pipe.state.scale_velocity(10.0)
    u1, _ = ref.momentum_update(g1, g0, 0.9 * 10.0)
    assert bits(pipe.allreduce({"w": g1})["w"]) == bits(u1)
    u2, _ = ref.momentum_update(g1, u1, 0.9)          # applied once
    assert bits(pipe.allreduce({"w": g1})["w"]) == bits(u2)
    with pytest.raises(ValueError, match="finite and > 0"):
        pipe.state.scale_velocity(0.0)


# ------------------------------------------------------------------ checkpoints

@pytest.mark.parametrize("name,opts", [("1bit", {"block_size": 64}), ("topk", {"ratio": 0.1}),
                                       ("randomk", {"ratio": 0.1}), ("none", {})])
def test_checkpoint_restores_velocity_and_residual_bit_exactly(comm, tmp_path, name, opts):
    cfg = dict(compress=name, momentum=0.9, comm=comm, fusion_threshold=300, **opts)
    a = gradfuse.Pipeline(**cfg)
    for step in range(3):
        a.allreduce(grads(step))
    a.state.scale_velocity(2.0)              # a learning-rate change pending at the checkpoint
    sd = a.state_dict()
    path = str(tmp_path / "ckpt.npz")
    a.save_state(path)
    want = [a.allreduce(grads(step)) for step in (3, 4)]
    for restore in ("dict", "npz"):
        b = gradfuse.Pipeline(**cfg)
        assert (b.load_state_dict(sd) if restore == "dict" else b.load_state(path))
        for i, step in enumerate((3, 4)):
            got = b.allreduce(grads(step))
            assert all(bits(got[k]) == bits(want[i][k]) for k in got), (restore, step)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["step"] == sb["step"]
        for key, st in sa["buckets"].items():
            assert bits(st["velocity"]) == bits(sb["buckets"][key]["velocity"])
            assert bits(st["residual"]) == bits(sb["buckets"][key]["residual"])
    # without the velocity the run would differ
    c = gradfuse.Pipeline(**cfg)
    c.load_state_dict({**sd, "buckets": {k: {kk: vv for kk, vv in v.items() if kk != "velocity"}
                                         for k, v in sd["buckets"].items()}})
    got = c.allreduce(grads(3))
    assert any(bits(got[k]) != bits(want[0][k]) for k in got)


def test_old_checkpoint_without_velocity_still_loads(comm, tmp_path):
    """A pipeline without momentum writes what it wrote before (no velocity arrays, the same
    config and keys), and such files load."""
    a = gradfuse.Pipeline(compress="1bit", comm=comm)
    a.allreduce(grads(0))
    path = str(tmp_path / "old.npz")
    a.save_state(path)
    with np.load(path) as z:
        assert not [f for f in z.files if f.startswith("v")]
    assert "momentum" not in a.compressor.get_config() and "sparsity_warmup" not in a.get_config()
    b = gradfuse.Pipeline(compress="1bit", comm=comm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert b.load_state(path)
        assert all(bits(x) == bits(y) for x, y in zip(a.allreduce(grads(1)).values(), b.allreduce(grads(1)).values()))


# ------------------------------------------------------------------ sparsity warm-up

def test_warmup_ratio_schedule():
    c = create("topk", ratio=0.001, sparsity_warmup=400, warmup_steps=10)
    got = [warmup_ratio(c, s) for s in (0, 9, 10, 109, 110, 209, 210, 309, 310, 409, 410, 10_000)]
    assert got == [None, None, 0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.00390625, 0.00390625,
                   None, None]
    c = create("randomk", ratio=0.01, sparsity_warmup=30)
    assert [warmup_ratio(c, s) for s in (0, 9, 10, 20, 29, 30)] == [0.25, 0.25, 0.0625, 0.015625, 0.015625, None]
    assert warmup_ratio(create("topk", ratio=0.5, sparsity_warmup=30), 0) is None
    assert warmup_ratio(create("topk", ratio=0.01), 0) is None
    with pytest.raises(ValueError, match="'sparsity_warmup' ramps the 'ratio' of top-k and random-k"):
        create("2bit", sparsity_warmup=10)
    with pytest.raises(TypeError, match="unknown option.*valid options: .*sparsity_warmup"):
        create("topk", sparsity_warmpu=10)


@pytest.mark.parametrize("name", ["topk", "randomk"])
def test_sparsity_warmup_sends_the_stage_k(comm, name, tmp_path):
    """The bytes each step sends follow the ramp; a checkpoint mid-ramp resumes the stage."""
    cfg = dict(compress=name, ratio=0.01, sparsity_warmup=6, comm=SingleProcessCommunicator(),
               fusion_threshold=1 << 20, momentum=0.9)
    n = 4000
    rng = np.random.default_rng(0)
    gs = [{"w": rng.standard_normal(n).astype(F32)} for _ in range(9)]
    layouts = []
    pipe2 = gradfuse.Pipeline(**cfg)
    for step in range(9):
        pipe2.allreduce(gs[step])
        (wire,) = [v for k, v in next(iter(pipe2._plans.values())).wire.items() if isinstance(k, int)]
        layouts.append(max(k[1] for k in wire if isinstance(k, tuple) and k[0] == "allgather"))
    per = 8 if name == "topk" else 4
    want = [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01, 0.01]
    for got, r in zip(layouts, want):
        assert abs(got - (8 + per * int(np.ceil(r * n)))) < 16, (got, r)
    # restore at step 3 (stage 2) and continue bit-identically
    a = gradfuse.Pipeline(**cfg)
    for step in range(3):
        a.allreduce(gs[step])
    sd = a.state_dict()
    want_out = [a.allreduce(gs[s])["w"] for s in range(3, 9)]
    b = gradfuse.Pipeline(**cfg)
    b.load_state_dict(sd)
    assert all(bits(b.allreduce(gs[s])["w"]) == bits(want_out[s - 3]) for s in range(3, 9))
    assert pipe2.compressor.get_config()["sparsity_warmup"] == 6


@pytest.mark.parametrize("algorithm", ["allgather", "twophase"])
def test_onebit_velocity_is_what_was_sent(comm, algorithm):
    """1bit, velocity="sent" (default): after a step the velocity is this rank's decoded
    payload (residual = c - velocity, in real arithmetic); "local" keeps DGC's u = m*u + g;
    Nesterov keeps DGC's form too."""
    g = grads(0)
    flat = np.concatenate([v for v in g.values() if v.size])
    kw = dict(compress="1bit", momentum=0.9, comm=comm, fusion_threshold=1 << 20, block_size=64, algorithm=algorithm)
    sent, local = gradfuse.Pipeline(**kw), gradfuse.Pipeline(velocity="local", **kw)
    nag = gradfuse.Pipeline(nesterov=True, **kw)
    for pipe in (sent, local, nag):
        pipe.allreduce(g)
    (b_sent,), (b_local,), (b_nag,) = (p.state_dict()["buckets"].values() for p in (sent, local, nag))
    counts = tuple(v.size for v in g.values())
    want = own_decode(create("1bit", block_size=64), flat, counts)
    assert bits(b_sent["velocity"]) == bits(want)
    assert np.allclose(b_sent["velocity"] + b_sent["residual"], flat, rtol=1e-6, atol=1e-6)
    assert bits(b_local["velocity"]) == bits(flat) and bits(b_nag["velocity"]) == bits(flat)
    assert bits(b_local["residual"]) == bits(b_sent["residual"])
    # the next step starts from the sent velocity: u = 0.9 * decode(sent) + g
    g1 = grads(1)
    sent.allreduce(g1)
    (b1,) = sent.state_dict()["buckets"].values()
    flat1 = np.concatenate([v for v in g1.values() if v.size])
    u1, _ = ref.momentum_update(flat1, want, 0.9)
    c1 = np.add(u1, b_sent["residual"], dtype=F32)
    assert bits(b1["velocity"]) == bits(own_decode(create("1bit", block_size=64), c1, counts))
    with pytest.raises(ValueError, match="option 'velocity' must be one of sent, local, got 'dgc'"):
        create("1bit", momentum=0.9, velocity="dgc")


# ------------------------------------------------------------------ options, config, non-finite

def test_options_and_errors():
    c = create("1bit", momentum=0.9, nesterov=True)
    cfg = c.get_config()
    assert cfg["momentum"] == 0.9 and cfg["nesterov"] is True and cfg["momentum_masking"] is False
    assert create(cfg).get_config() == cfg
    assert "momentum" not in create("1bit").get_config()
    assert "velocity" not in create("1bit").get_config()          # the config of before, without momentum
    assert create("1bit", momentum=0.9).get_config()["velocity"] == "sent"
    assert create("none", momentum=0.5).get_config() == {"name": "none", "momentum": 0.5, "nesterov": False,
                                                         "momentum_masking": False}
    with pytest.raises(ValueError, match="'momentum' must be a number in \\[0, 1\\), got 1.0"):
        create("topk", momentum=1.0)
    with pytest.raises(ValueError, match="'momentum' must be a number"):
        create("topk", momentum=True)
    with pytest.raises(ValueError, match="'nesterov=True' needs momentum > 0"):
        create("2bit", nesterov=True)
    with pytest.raises(ValueError, match="'momentum_masking=True' needs error_feedback=True"):
        create("topk", momentum=0.9, momentum_masking=True, error_feedback=False)
    with pytest.raises(TypeError, match="takes no options \\(but momentum and nesterov\\), got ratio"):
        create("none", ratio=1)
    p = gradfuse.Pipeline(compress="topk", momentum=0.9, sparsity_warmup=5, comm=SingleProcessCommunicator())
    again = gradfuse.Pipeline(comm=SingleProcessCommunicator(), **p.get_config())
    assert again.get_config() == p.get_config()


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_refused_step_leaves_the_velocity(comm, mode):
    pipe = gradfuse.Pipeline(compress="1bit", momentum=0.9, comm=comm, nonfinite=mode, fusion_threshold=1 << 20)
    pipe.allreduce(grads(0))
    before = pipe.state_dict()["buckets"]
    bad = grads(1)
    bad["t0"][3] = np.nan
    if mode == "raise":
        with pytest.raises(gradfuse.NonFiniteError):
            pipe.allreduce(bad)
    else:
        assert np.isnan(pipe.allreduce(bad)["t0"]).all()
    after = pipe.state_dict()["buckets"]
    for key in before:
        assert bits(before[key]["velocity"]) == bits(after[key]["velocity"])
        assert bits(before[key]["residual"]) == bits(after[key]["residual"])


def test_layer_policy_uncompressed_tensors_get_the_velocity(comm):
    """The velocity is the pipeline's: a policy's None patterns get it too; its lossy
    compressors must agree on it."""
    pipe = gradfuse.Pipeline(compress={"t1": None, "t3": None, "*": {"name": "1bit", "momentum": 0.9}}, comm=comm,
                             fusion_threshold=300)
    ref_1bit, _ = dgc_reference("1bit", {}, comm=comm, threshold=300,
                                feed=lambda s: {k: v for k, v in grads(s).items() if k not in ("t1", "t3")})
    u = {}
    for step in range(3):
        g = grads(step)
        got = pipe.allreduce(g)
        for k in ("t1", "t3"):
            u[k], _ = ref.momentum_update(g[k], u.get(k, np.zeros_like(g[k])), 0.9)
            assert bits(got[k]) == bits(u[k]), (step, k)
        for k in ref_1bit[step]:
            assert bits(got[k]) == bits(ref_1bit[step][k]), (step, k)
    bad = gradfuse.Pipeline(compress={"a": {"name": "1bit", "momentum": 0.9}, "*": "topk"}, comm=comm)
    with pytest.raises(ValueError, match="compressors disagree on the momentum correction.*'1bit' has momentum=0.9"):
        bad.allreduce({"a": np.ones(3, F32), "b": np.ones(3, F32)})
