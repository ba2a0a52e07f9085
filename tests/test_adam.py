"""The Adam correction on one process (gradfuse.compressors.adam, gradfuse.step.adam): the
pipeline against plain Adam before the freeze, against the numpy model of the correction
(tests/ref_adam.py) bit for bit after it, the fused 1-bit pass against the two-pass path,
the zero-v mask, checkpoints, the adaptive freeze, non-finite steps, options and errors.
MXNet's trainers are in tests/test_adam_mxnet.py, the torch hook in tests/test_torch_ddp.py;
multi-rank bodies in tests/mpi/test_adam.py."""
import os
import sys
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import ref_adam as ref  # noqa: E402

import gradfuse  # noqa: E402
from gradfuse.comm import SingleProcessCommunicator  # noqa: E402
from gradfuse.compressors import OneBit, create  # noqa: E402
from gradfuse.compressors import adam as cadam  # noqa: E402
from gradfuse.errors import GradfuseError, NonFiniteError  # noqa: E402

F32 = np.float32
SIZES = (33, 1, 200, 7, 1029)
LOSSY = [("1bit", {"block_size": 64}), ("1bit", {}), ("2bit", {}), ("topk", {"ratio": 0.1}),
         ("fp16", {"error_feedback": True})]


@pytest.fixture(scope="module")
def comm():
    return SingleProcessCommunicator()


def grads(step, rank=0, sizes=SIZES, scale=1.0):
    rng = np.random.default_rng([step, rank, 11])
    return {f"t{i}": (rng.standard_normal(s) * scale * (0.01 if i % 2 else 1.0)).astype(F32)
            for i, s in enumerate(sizes)}


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32).tobytes()


def adam64(rule, betas=(0.9, 0.999), eps=1e-8):
    """Plain Adam in float64: the steps (``w -= lr * step``) of MXNet's rule (its kernel's
    float32 coefficients: ``beta`` and ``1.f - beta`` in float32) or torch.optim.AdamW's."""
    b1, b2 = betas                  # the bias corrections' (MXNet: in Python, double)
    k1, k2, c1, c2 = b1, b2, 1 - b1, 1 - b2         # the moments'
    if rule == "adam":
        k1, k2 = float(F32(b1)), float(F32(b2))
        c1, c2 = float(F32(1) - F32(b1)), float(F32(1) - F32(b2))
    st = {}

    def step(g):
        out = {}
        for k, x in g.items():
            x = np.asarray(x, np.float64)
            m, v, t = st.get(k, (0.0 * x, 0.0 * x, 0))
            t += 1
            m = k1 * m + c1 * x
            v = k2 * v + c2 * x * x
            st[k] = (m, v, t)
            if rule == "adam":
                out[k] = np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (np.sqrt(v) + eps)
            else:
                out[k] = m / (1 - b1 ** t) / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
        return out
    return step


def rel(a, b):
    """The relative difference of two steps (dicts of tensors, or arrays): ``|a - b| / |b|``
    in the 2-norm over every element."""
    if isinstance(a, dict):
        a, b = (np.concatenate([np.ravel(d[k]) for k in sorted(d)]) for d in (a, b))
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


# ------------------------------------------------------------------ options

def test_options_and_config():
    c = create("1bit", adam="adamw")
    assert (c.adam, c.betas, c.eps) == ("adamw", (0.9, 0.999), 1e-8)
    cfg = c.get_config()
    assert cfg["adam"] == "adamw" and cfg["betas"] == [0.9, 0.999] and cfg["eps"] == 1e-8
    assert create(**cfg).get_config() == cfg
    assert "adam" not in create("1bit").get_config()         # nothing added without it
    assert create("none", adam="adam", betas=[0.8, 0.99], eps=1e-6).betas == (0.8, 0.99)
    assert create("1bit").corrects_by_default and not create("fp16").corrects_by_default
    assert not create("1bit", error_feedback=False).corrects_by_default


@pytest.mark.parametrize("opts, match", [
    ({"adam": "sgd"}, "option 'adam' must be one of 'adam', 'adamw'"),
    ({"betas": (0.9, 0.99)}, "'betas' and 'eps' belong to the Adam correction"),
    ({"adam": "adam", "betas": (0.9, 1.0)}, "'betas' must be two numbers in \\[0, 1\\)"),
    ({"adam": "adam", "betas": 0.9}, "'betas' must be two numbers"),
    ({"adam": "adam", "eps": -1.0}, "'eps' must be a finite number >= 0"),
    ({"adam": "adam", "momentum": 0.9}, "'adam' and 'momentum' exclude each other"),
])
def test_option_errors(opts, match):
    with pytest.raises(ValueError, match=match):
        create("1bit", **opts)


def test_pipeline_refusals(comm):
    with pytest.raises(ValueError, match="needs average=True"):
        gradfuse.Pipeline("1bit", adam="adam", average=False, comm=comm)
    with pytest.raises(ValueError, match="uncompressed_if_faster=True cannot be combined with the Adam"):
        gradfuse.Pipeline("1bit", adam="adam", comm=comm, link_bandwidth="1gbit", uncompressed_if_faster=True)
    with pytest.raises(ValueError, match="disagree on the Adam correction"):
        gradfuse.Pipeline({"a*": {"name": "1bit", "adam": "adam"}, "*": {"name": "topk", "adam": "adamw"}},
                          comm=comm)
    pipe = gradfuse.Pipeline("1bit", adam="adam", comm=comm)
    with pytest.raises(TypeError, match="tensor 'd': the Adam correction .* this one is float64"):
        pipe.allreduce({"d": np.ones(3)})


# ------------------------------------------------------------------ before the freeze: plain Adam

@pytest.mark.parametrize("compress", [None, "1bit", "topk"])
@pytest.mark.parametrize("rule", ["adam", "adamw"])
def test_warmup_is_plain_adam(comm, rule, compress):
    """Every step up to the freeze is plain Adam (1e-6 relative to float64 Adam; with
    compress=None every step)."""
    opts = {"warmup_steps": 30} if compress else {}
    pipe = gradfuse.Pipeline(compress, adam=rule, comm=comm, **opts)
    want = adam64(rule)
    worst = 0.0
    for t in range(30):
        g = grads(t, scale=10.0 ** (t % 3 - 1))
        w = want(g)
        got = pipe.allreduce(g)
        worst = max(worst, rel(got, w))
    assert worst <= 1e-6, worst
    assert pipe.stats.bytes_sent == 0 and pipe.state.step == 30


def test_freeze_then_the_model_bit_for_bit(comm):
    for name, opts in LOSSY:
        for rule in ("adam", "adamw"):
            pipe = gradfuse.Pipeline(name, adam=rule, warmup_steps=4, comm=comm, **opts)
            model = ref.Model(create(name, **opts), cadam.AdamSpec(rule, (0.9, 0.999), 1e-8), 4)
            for t in range(10):
                g = grads(t)
                want = model.step([g])
                got = pipe.allreduce(g)
                for k in g:
                    assert bits(got[k]) == bits(want[k]), (name, opts, rule, t, k)


def test_fused_onebit_equals_the_moment_pass(comm, monkeypatch):
    """The fused moment + 1-bit kernel gives the bits of the moment pass followed by 1-bit."""
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(OneBit, "compress_moment_table", lambda *a, **k: None)
        pipe = gradfuse.Pipeline("1bit", adam="adamw", warmup_steps=2, comm=comm)
        runs.append([pipe.allreduce(grads(t)) for t in range(6)])
    for a, b in zip(*runs):
        for k in a:
            assert bits(a[k]) == bits(b[k])


def test_layer_policy_uncompressed_tensors_keep_a_live_v(comm):
    """A layer policy's None patterns and min_elements keep plain Adam after the freeze."""
    comp = {"name": "1bit", "adam": "adamw", "warmup_steps": 3}
    pipe = gradfuse.Pipeline({"t1": None, "*": comp}, comm=comm, min_elements=10)
    want = adam64("adamw")
    for t in range(8):
        g = grads(t)
        w = want(g)
        got = pipe.allreduce(g)
        keep = ("t1", "t3")             # t1: the None pattern; t3: 7 elements < min_elements
        assert rel({k: got[k] for k in keep}, {k: w[k] for k in keep}) <= 1e-6, t
        if t >= 3:
            assert rel(got["t0"], w["t0"]) > 1e-4      # compressed after the freeze
    frozen = sorted(int(b["arrays"]["adam.freeze"][0]) for b in pipe.state_dict()["buckets"].values())
    assert frozen[0] == 0 and frozen[-1] == 3


def test_float16_tensors(comm):
    """float16 gradients: float32 moments through the staging array, the step rounded once."""
    pipe = gradfuse.Pipeline("1bit", adam="adamw", warmup_steps=2, comm=comm)
    model = ref.Model(create("1bit"), cadam.AdamSpec("adamw", (0.9, 0.999), 1e-8), 2)
    for t in range(5):
        g = {k: v.astype(np.float16) for k, v in grads(t).items()}
        want = model.step([{k: v.astype(F32) for k, v in g.items()}])
        got = pipe.allreduce(g)
        for k in g:
            assert got[k].dtype == np.float16
            assert np.array_equal(got[k], want[k].astype(np.float16)), (t, k)


# ------------------------------------------------------------------ the mask

def test_zero_v_mask_on_an_embedding(comm):
    """Embedding rows that never see a gradient (bytes that never occur) keep a zero step
    after the freeze, although 1-bit cannot send an exact zero; their m stays 0."""
    rng = np.random.default_rng(0)
    vocab, dim = 256, 16
    seen = rng.choice(vocab, 40, replace=False)
    pipe = gradfuse.Pipeline("1bit", adam="adamw", warmup_steps=5, comm=comm)
    for t in range(15):
        emb = np.zeros((vocab, dim), F32)
        emb[seen] = rng.standard_normal((seen.size, dim)).astype(F32)
        out = pipe.allreduce({"embedding": emb, "w": rng.standard_normal(100).astype(F32)})
        unseen = np.setdiff1d(np.arange(vocab), seen)
        assert np.all(out["embedding"][unseen] == 0), t
        if t >= 5:
            assert np.all(out["embedding"][seen] != 0)
    st = next(iter(pipe.state.buckets.values()))
    mask = st.arrays["adam.mask"].reshape(-1)
    assert mask.dtype == np.uint8 and 0 < mask.sum() < mask.size
    assert not np.any(st.arrays["adam.m"][mask == 0])


# ------------------------------------------------------------------ checkpoints

@pytest.mark.parametrize("at", [2, 6])
def test_checkpoint_restores_bit_exactly(comm, tmp_path, at):
    """save_state / load_state before and after the freeze: the resumed run continues with
    the same bits; m, v, step, freeze and mask are named arrays of the state."""
    def run(pipe, t0, t1):
        return [pipe.allreduce(grads(t)) for t in range(t0, t1)]
    opts = dict(adam="adamw", warmup_steps=4, block_size=64)
    full = gradfuse.Pipeline("1bit", comm=comm, **opts)
    want = run(full, 0, 10)
    first = gradfuse.Pipeline("1bit", comm=comm, **opts)
    run(first, 0, at)
    path = str(tmp_path / "s.npz")
    first.save_state(path)
    sd = gradfuse.compressors.state.load_npz(path)
    names = set(next(iter(sd["buckets"].values()))["arrays"])
    assert names >= {"adam.m", "adam.v", "adam.step", "adam.freeze"}
    assert ("adam.mask" in names) == (at > 4)
    second = gradfuse.Pipeline("1bit", comm=comm, **opts)
    assert second.load_state(path)
    got = run(second, at, 10)
    for a, b in zip(got, want[at:]):
        for k in a:
            assert bits(a[k]) == bits(b[k])
    assert second.state_dict()["step"] == 10


def test_adaptive_freeze_meta_round_trips(comm, tmp_path, monkeypatch):
    monkeypatch.setattr(cadam, "FREEZE_WINDOW", 3)
    pipe = gradfuse.Pipeline("1bit", adam="adamw", comm=comm)
    for t in range(400):
        pipe.allreduce(grads(t))
        if pipe.state.meta.get("adam", {}).get("frozen_at"):
            break
    T = pipe.state.meta["adam"]["frozen_at"]
    assert 10 < T < 400 and T == pipe.state.step
    st = next(iter(pipe.state.buckets.values()))
    assert st.cur.size == 0 and st.arrays["adam.freeze"][0] == 0
    pipe.allreduce(grads(T))
    assert st.cur.size > 0 and st.arrays["adam.freeze"][0] == T       # compressed from the next step on
    path = str(tmp_path / "a.npz")
    pipe.save_state(path)
    again = gradfuse.Pipeline("1bit", adam="adamw", comm=comm)
    again.load_state(path)
    assert again.state.meta == pipe.state.meta


def test_old_state_files_load(comm, tmp_path):
    """A state written without named arrays (a pipeline without the correction) loads."""
    pipe = gradfuse.Pipeline("1bit", comm=comm)
    pipe.allreduce(grads(0))
    path = str(tmp_path / "old.npz")
    pipe.save_state(path)
    sd = gradfuse.compressors.state.load_npz(path)
    assert "meta" not in sd and all("arrays" not in b for b in sd["buckets"].values())
    again = gradfuse.Pipeline("1bit", comm=comm)
    assert again.load_state(path)
    adam = gradfuse.Pipeline("1bit", adam="adam", comm=comm)
    with pytest.raises(GradfuseError, match=r"old\.npz.* does not fit this pipeline: compressor adam: saved unset, "
                                            r"here 'adam'"):
        adam.load_state(path)                    # another compressor config: refused, naming the option
    with pytest.warns(RuntimeWarning, match="on_mismatch='reset': starting from a fresh state"):
        assert not adam.load_state(path, on_mismatch="reset")


# ------------------------------------------------------------------ non-finite steps

@pytest.mark.parametrize("when", [1, 5])
def test_nonfinite_steps_leave_the_moments(comm, when):
    """NaN in a warm-up step (when=1) or a compressed one (when=5): raised, and the moments,
    counters and residuals are as before; with nonfinite='skip' the outputs are NaN."""
    for policy in ("raise", "skip"):
        pipe = gradfuse.Pipeline("1bit", adam="adamw", warmup_steps=3, comm=comm, nonfinite=policy)
        ref_pipe = gradfuse.Pipeline("1bit", adam="adamw", warmup_steps=3, comm=comm)
        for t in range(when):
            pipe.allreduce(grads(t))
            ref_pipe.allreduce(grads(t))
        bad = grads(99)
        bad["t2"][3] = np.nan
        if policy == "raise":
            with pytest.raises(NonFiniteError):
                pipe.allreduce(bad)
        else:
            out = pipe.allreduce(bad)
            assert all(np.isnan(v).all() for v in out.values())
        assert pipe.state.step == when
        for t in range(when, when + 3):
            a, b = pipe.allreduce(grads(t)), ref_pipe.allreduce(grads(t))
            for k in a:
                assert bits(a[k]) == bits(b[k]), (policy, t, k)
