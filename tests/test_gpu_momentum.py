"""DGC's momentum correction on the GPU: cuda/momentum.cu against gradfuse._core bit for
bit, and gradfuse.Pipeline with ``momentum`` on cupy arrays against the host path
(outputs, residuals and velocities), for every lossy compressor and ``compress=None``.

Marked ``gpu``: skipped without a GPU, failed with GRADFUSE_TEST_GPU=1, and run on the CPU
SIMT emulator by tests/test_gpu_emulated.py (GRADFUSE_GPU_EMULATOR=1).
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest_gpu import require_gpu  # noqa: E402

import gradfuse  # noqa: E402
import gradfuse._core as core  # noqa: E402
from gradfuse.comm.single import SingleProcessCommunicator  # noqa: E402

pytestmark = pytest.mark.gpu
F32 = np.float32
EMPTY = np.zeros(0, np.int64)


@pytest.fixture(scope="module")
def g():
    return require_gpu()


def same(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    na, nb = np.isnan(a), np.isnan(b)          # NaN payloads are not in the contract
    assert np.array_equal(na, nb)
    assert a[~na].tobytes() == b[~nb].tobytes(), np.flatnonzero(a != b)[:5]


def tables(arrs, dev=False):
    ptrs = np.array([(a.data.ptr if dev else a.ctypes.data) if a.size else 0 for a in arrs], np.int64)
    counts = np.array([a.size for a in arrs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return ptrs, offsets, counts


@pytest.mark.parametrize("nesterov", [0.0, 0.9])
@pytest.mark.parametrize("sizes", [(1,), (5, 0, 33, 700, 1), (0, 4097, 256)])
@pytest.mark.parametrize("mode", ["out", "none", "inplace"])
def test_momentum_update_gpu_equals_cpu(g, sizes, nesterov, mode):
    cp, gpu = g
    rng = np.random.default_rng(sum(sizes))
    hs = [(rng.standard_normal(s) * 3).astype(F32) for s in sizes]
    if hs and hs[-1].size:
        hs[-1][0] = np.nan
    n = sum(sizes)
    u = rng.standard_normal(n).astype(F32)
    ds = [cp.asarray(a) for a in hs]
    du = cp.asarray(u)
    hp, off, cnt = tables(hs)
    dp, _, _ = tables(ds, dev=True)
    m = 0.9 * 1.25                        # a pending velocity scale folded into the decay
    if mode == "inplace":
        core.momentum_update(hp, off, cnt, 0, len(hs), u, u, m, hp, nesterov)
        gpu.momentum_update(dp, off, cnt, 0, len(ds), du, du, m, dp, nesterov)
        same(du.get(), u)
        for a, b in zip(ds, hs):
            same(a.get(), b)
        return
    ho = [np.empty(s, F32) for s in sizes]
    do = [cp.empty(s, F32) for s in sizes]
    hu, duo = np.empty(n, F32), cp.empty(n, F32)
    hout = tables(ho)[0] if mode == "out" else EMPTY
    dout = tables(do, dev=True)[0] if mode == "out" else EMPTY
    core.momentum_update(hp, off, cnt, 0, len(hs), u, hu, m, hout, nesterov)
    gpu.momentum_update(dp, off, cnt, 0, len(ds), du, duo, m, dout, nesterov)
    same(duo.get(), hu)
    if mode == "out":
        for a, b in zip(do, ho):
            same(a.get(), b)


def test_momentum_mask_gpu_equals_cpu(g):
    cp, gpu = g
    rng = np.random.default_rng(3)
    n = 5000
    e_in, x = rng.standard_normal(n).astype(F32), rng.standard_normal(n).astype(F32)
    e_out = np.where(rng.random(n) < 0.2, 0, 1).astype(F32)
    x[:7], e_in[:7], e_out[:7] = 2.0, -2.0, 0.0
    u = rng.standard_normal(n).astype(F32)
    du = cp.asarray(u)
    core.momentum_mask(e_in, x, e_out, u)
    gpu.momentum_mask(cp.asarray(e_in), cp.asarray(x), cp.asarray(e_out), du)
    same(du.get(), u)
    with pytest.raises(ValueError, match="same length"):
        gpu.momentum_mask(cp.asarray(e_in[:3]), cp.asarray(x), cp.asarray(e_out), du)


CASES = [("none", {}), ("none", {"nesterov": True}), ("fp16", {}), ("1bit", {"block_size": 64}),
         ("1bit", {"block_size": 64, "algorithm": "twophase"}), ("2bit", {"threshold": 0.05}),
         ("topk", {"ratio": 0.05}), ("topk", {"ratio": 0.05, "nesterov": True, "sparsity_warmup": 2}),
         ("randomk", {"ratio": 0.05, "seed": 7})]


def make_grads(step):
    rng = np.random.default_rng([step, 4])
    return {"conv.w": rng.standard_normal((16, 3, 3, 3)).astype(F32), "conv.b": rng.standard_normal(16).astype(F32),
            "fc.w": rng.standard_normal((40, 50)).astype(F32), "fc.b": (rng.standard_normal(50) * 1e-3).astype(F32),
            "half": rng.standard_normal(33).astype(np.float16), "big_half": rng.standard_normal(2100).astype(np.float16),
            "empty": np.zeros((0, 3), F32)}


def state(pipe):
    sd = pipe.state_dict()
    return sd["step"], {k: (v["residual"], v["server_residual"], v.get("velocity")) for k, v in sd["buckets"].items()}


@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_gpu_pipeline_with_momentum_equals_host(g, name, opts):
    cp, _ = g
    comm = SingleProcessCommunicator()
    cfg = dict(compress=name, momentum=0.9, fusion_threshold=4096, comm=comm, **opts)
    host, dev = gradfuse.Pipeline(**cfg), gradfuse.Pipeline(**cfg)
    for step in range(4):
        if step == 2:
            host.state.scale_velocity(2.0)
            dev.state.scale_velocity(2.0)
        gr = make_grads(step)
        want = host.allreduce(gr)
        got = dev.allreduce({k: cp.asarray(v) for k, v in gr.items()})
        for k in gr:
            same(got[k].get(), want[k])
        (sh, rh), (sd, rd) = state(host), state(dev)
        assert sh == sd and sorted(rh) == sorted(rd)
        for key in rh:
            for a, b in zip(rh[key], rd[key]):
                assert (a is None) == (b is None)
                if a is not None:
                    same(a, b)


def test_gpu_velocity_checkpoint_moves_between_host_and_gpu(g, tmp_path):
    cp, _ = g
    comm = SingleProcessCommunicator()
    cfg = dict(compress="topk", ratio=0.05, momentum=0.9, fusion_threshold=4096, comm=comm)
    dev = gradfuse.Pipeline(**cfg)
    for step in range(2):
        dev.allreduce({k: cp.asarray(v) for k, v in make_grads(step).items()})
    path = str(tmp_path / "v.npz")
    dev.save_state(path)
    host = gradfuse.Pipeline(**cfg)
    assert host.load_state(path)
    gr = make_grads(2)
    want = host.allreduce(gr)
    got = dev.allreduce({k: cp.asarray(v) for k, v in gr.items()})
    for k in gr:
        same(got[k].get(), want[k])
