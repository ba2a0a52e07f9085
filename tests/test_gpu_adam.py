"""The Adam correction on the GPU: cuda/adam.cu against gradfuse._core bit for bit, and
gradfuse.Pipeline with ``adam`` on cupy arrays against the host path (outputs and every
named array), for the lossy compressors and ``compress=None``, before and after the freeze.

Marked ``gpu``: skipped without a GPU, failed with GRADFUSE_TEST_GPU=1, and run on the CPU
SIMT emulator by tests/test_gpu_emulated.py (GRADFUSE_GPU_EMULATOR=1).
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest_gpu import require_gpu  # noqa: E402
import ref_adam as ref  # noqa: E402

import gradfuse  # noqa: E402
import gradfuse._core as core  # noqa: E402
from gradfuse.comm.single import SingleProcessCommunicator  # noqa: E402

pytestmark = pytest.mark.gpu
F32 = np.float32
B1, C1, B2, C2 = 0.9, F32(1) - F32(0.9), 0.999, F32(1) - F32(0.999)
SIZES = [(1,), (5, 0, 33, 700, 1), (0, 4097, 256)]


@pytest.fixture(scope="module")
def g():
    return require_gpu()


def same(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    na, nb = np.isnan(a), np.isnan(b)
    assert np.array_equal(na, nb)
    assert a[~na].tobytes() == b[~nb].tobytes(), np.flatnonzero(a != b)[:5]


def tables(arrs, dev=False):
    ptrs = np.array([(a.data.ptr if dev else a.ctypes.data) if a.size else 0 for a in arrs], np.int64)
    counts = np.array([a.size for a in arrs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return ptrs, offsets, counts


def data(sizes, seed):
    rng = np.random.default_rng(seed)
    hs = [(rng.standard_normal(s) * 3).astype(F32) for s in sizes]
    n = sum(sizes)
    m = rng.standard_normal(n).astype(F32)
    v = (rng.standard_normal(n) * 0.1).astype(F32) ** 2
    v[::6] = 0
    r = ref.freeze(m, v, 1.3, 1e-8)[1]
    return hs, n, m, v, r


@pytest.mark.parametrize("sizes", SIZES)
def test_moment_gpu_equals_cpu(g, sizes):
    cp, gpu = g
    hs, n, m, _, r = data(sizes, 1)
    hp, off, cnt = tables(hs)
    ds = [cp.asarray(a) for a in hs]
    dp, _, _ = tables(ds, dev=True)
    x, dx = np.empty(n, F32), cp.empty(n, F32)
    core.adam_moment(hp, off, cnt, 0, len(hs), m, r, B1, C1, x)
    gpu.adam_moment(dp, off, cnt, 0, len(ds), cp.asarray(m), cp.asarray(r), B1, C1, dx)
    same(dx.get(), x)


@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("block", [32, 512, 2048])
@pytest.mark.parametrize("sizes", SIZES)
def test_onebit_fused_gpu_equals_cpu(g, sizes, block, ef):
    cp, gpu = g
    hs, n, m, _, r = data(sizes, 2)
    if hs[-1].size:
        hs[-1][0] = np.nan
    e = (np.random.default_rng(3).standard_normal(n) * 0.1).astype(F32) if ef else np.zeros(0, F32)
    hp, off, cnt = tables(hs)
    ds = [cp.asarray(a) for a in hs]
    dp, _, _ = tables(ds, dev=True)
    nw, ns = sum((s + 31) // 32 for s in sizes), sum(-(-s // block) for s in sizes)
    bits, scales, e_out = np.zeros(nw, np.uint32), np.zeros(ns, F32), np.empty(n if ef else 0, F32)
    dbits, dscales, de_out = cp.zeros(nw, np.uint32), cp.zeros(ns, F32), cp.empty(n if ef else 0, F32)
    bad = core.adam_onebit_compress(hp, off, cnt, 0, len(hs), m, r, B1, C1, e, e_out, block, bits, scales)
    dbad = gpu.adam_onebit_compress(dp, off, cnt, 0, len(ds), cp.asarray(m), cp.asarray(r), B1, C1, cp.asarray(e),
                                    de_out, block, dbits, dscales)
    assert bad == dbad
    same(dbits.get(), bits)
    same(dscales.get(), scales)
    if ef:
        same(de_out.get(), e_out)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("sizes", SIZES)
def test_apply_and_plain_gpu_equal_cpu(g, sizes, masked):
    cp, gpu = g
    hs, n, m, v, _ = data(sizes, 4)
    mask = (v != 0).astype(np.uint8) if masked else np.zeros(0, np.uint8)
    ds = [cp.asarray(a) for a in hs]
    hp, off, cnt = tables(hs)
    dp, _, _ = tables(ds, dev=True)
    hm, dm = m.copy(), cp.asarray(m)
    core.adam_apply(hp, off, cnt, 0, len(hs), hm, mask, 1.7)
    gpu.adam_apply(dp, off, cnt, 0, len(ds), dm, cp.asarray(mask), 1.7)
    same(dm.get(), hm)
    for a, b in zip(ds, hs):
        same(a.get(), b)
    hv, dv = v.copy(), cp.asarray(v)
    sums = core.adam_plain(hp, off, cnt, 0, len(hs), hm, hv, B1, C1, B2, C2, 3.1, 0.7, 1e-8, 1.5, 1.25, True)
    dsums = gpu.adam_plain(dp, off, cnt, 0, len(ds), dm, dv, B1, C1, B2, C2, 3.1, 0.7, 1e-8, 1.5, 1.25, True)
    same(dm.get(), hm)
    same(dv.get(), hv)
    for a, b in zip(ds, hs):
        same(a.get(), b)
    assert dsums == pytest.approx(sums, rel=1e-12, abs=1e-300)


def make_grads(step):
    rng = np.random.default_rng([step, 4])
    gr = {"emb": np.zeros((64, 8), F32), "conv.b": rng.standard_normal(16).astype(F32),
          "fc.w": rng.standard_normal((40, 50)).astype(F32), "fc.b": (rng.standard_normal(50) * 1e-3).astype(F32),
          "half": rng.standard_normal(33).astype(np.float16)}
    gr["emb"][::3] = rng.standard_normal((22, 8)).astype(F32)       # rows never seen: the mask
    return gr


CASES = [("none", {}), ("1bit", {"block_size": 64}), ("1bit", {"block_size": 64, "algorithm": "twophase"}),
         ("2bit", {}), ("topk", {"ratio": 0.05}), ("fp16", {"error_feedback": True})]


@pytest.mark.parametrize("rule", ["adam", "adamw"])
@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_gpu_pipeline_with_adam_equals_host(g, name, opts, rule):
    cp, _ = g
    comm = SingleProcessCommunicator()
    cfg = dict(compress=name, adam=rule, fusion_threshold=4096, comm=comm, **opts)
    if name != "none":
        cfg["warmup_steps"] = 2
    host, dev = gradfuse.Pipeline(**cfg), gradfuse.Pipeline(**cfg)
    for step in range(5):
        gr = make_grads(step)
        want = host.allreduce(gr)
        got = dev.allreduce({k: cp.asarray(v) for k, v in gr.items()})
        for k in gr:
            same(got[k].get(), want[k])
        sh, sd = host.state_dict(), dev.state_dict()
        assert sh["step"] == sd["step"] and sorted(sh["buckets"]) == sorted(sd["buckets"])
        for key, b in sh["buckets"].items():
            assert sorted(b["arrays"]) == sorted(sd["buckets"][key]["arrays"])
            for name_, a in b["arrays"].items():
                same(sd["buckets"][key]["arrays"][name_], a)


def test_gpu_adam_checkpoint_moves_between_host_and_gpu(g, tmp_path):
    cp, _ = g
    comm = SingleProcessCommunicator()
    cfg = dict(compress="1bit", adam="adamw", warmup_steps=2, fusion_threshold=4096, comm=comm)
    dev = gradfuse.Pipeline(**cfg)
    for step in range(3):
        dev.allreduce({k: cp.asarray(v) for k, v in make_grads(step).items()})
    path = str(tmp_path / "a.npz")
    dev.save_state(path)
    host = gradfuse.Pipeline(**cfg)
    assert host.load_state(path)
    gr = make_grads(3)
    want = host.allreduce(gr)
    got = dev.allreduce({k: cp.asarray(v) for k, v in gr.items()})
    for k in gr:
        same(got[k].get(), want[k])
