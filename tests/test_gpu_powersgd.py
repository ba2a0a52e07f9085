"""PowerSGD on the GPU: cuda/powersgd.cu against gradfuse._core bit for bit (Gram-Schmidt,
gather, scatter), and gradfuse.Pipeline with ``compress="powersgd"`` on cupy arrays
against the host path (the matrix products are cuBLAS's on a GPU: to tolerance there,
and numpy's on the emulator).

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
from gradfuse.compressors.powersgd import Layout  # noqa: E402

pytestmark = pytest.mark.gpu
F32 = np.float32


@pytest.fixture(scope="module")
def g():
    return require_gpu()


def same(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    na, nb = np.isnan(a), np.isnan(b)
    assert np.array_equal(na, nb)
    assert a[~na].tobytes() == b[~nb].tobytes(), np.flatnonzero(a != b)[:5]


@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_orthogonalize_gpu_equals_cpu(g, eps):
    cp, gpu = g
    rng = np.random.default_rng(1)
    dims = [(1, 1), (31, 2), (33, 3), (70, 4), (5, 1), (64, 2)]
    parts, offs, rows, cols, at = [], [], [], [], 0
    for n, r in dims:
        x = rng.standard_normal((n, r)).astype(F32)
        if r > 1 and n == 70:
            x[:, 1] = 0                      # a zero column stays zero
        parts.append(x.ravel())
        offs.append(at), rows.append(n), cols.append(r)
        at += n * r
    h = np.concatenate(parts)
    d = cp.asarray(h)
    o, n, c = (np.array(v, np.int64) for v in (offs, rows, cols))
    core.psgd_orthogonalize(h, o, n, c, eps)
    gpu.psgd_orthogonalize(d, o, n, c, eps)
    same(d.get(), h)


def test_gather_scatter_gpu_equals_cpu(g):
    cp, gpu = g
    rng = np.random.default_rng(2)
    shapes = [(4, 40), (7,), (0,), (9, 30), (3, 1)]
    lay = Layout(shapes, 1, 2.0)
    hs = [rng.standard_normal(s).astype(F32) for s in shapes]
    hs[1][3] = np.inf
    ds = [cp.asarray(a) for a in hs]
    hp = np.array([a.ctypes.data if a.size else 0 for a in hs], np.int64)
    dp = np.array([a.data.ptr if a.size else 0 for a in ds], np.int64)
    cnt = np.array([a.size for a in hs], np.int64)
    e = rng.standard_normal(lay.nw).astype(F32)
    hW, hU = np.empty(lay.nw, F32), np.empty(lay.nu, F32)
    dW, dU = cp.empty(lay.nw, F32), cp.empty(lay.nu, F32)
    bad = core.psgd_gather(hp, cnt, lay.route, 0, len(hs), e, hW, hU)
    dbad = gpu.psgd_gather(dp, cnt, lay.route, 0, len(ds), cp.asarray(e), dW, dU)
    assert bad == dbad == 1
    same(dW.get(), hW)
    same(dU.get(), hU)
    A = rng.standard_normal(lay.nw).astype(F32)
    he, de = np.empty(lay.nw, F32), cp.empty(lay.nw, F32)
    core.psgd_scatter(hp, cnt, lay.route, 0, len(hs), A, hW, he, hU, 3.0)
    gpu.psgd_scatter(dp, cnt, lay.route, 0, len(ds), cp.asarray(A), dW, de, dU, 3.0)
    same(de.get(), he)
    for a, b in zip(ds, hs):
        same(a.get(), b)


def make_grads(step):
    rng = np.random.default_rng([step, 9])
    return {"conv.w": rng.standard_normal((16, 3, 3, 3)).astype(F32), "conv.b": rng.standard_normal(16).astype(F32),
            "fc.w": rng.standard_normal((40, 50)).astype(F32), "half": rng.standard_normal((8, 20)).astype(np.float16)}


@pytest.mark.parametrize("opts", [{}, {"rank": 2, "momentum": 0.9}, {"rank": 3, "warm_start": False}])
def test_gpu_pipeline_equals_host(g, opts):
    cp, _ = g
    cfg = dict(compress="powersgd", fusion_threshold=4096, comm=SingleProcessCommunicator(), **opts)
    host, dev = gradfuse.Pipeline(**cfg), gradfuse.Pipeline(**cfg)
    for step in range(4):
        gr = make_grads(step)
        want = host.allreduce(gr)
        got = dev.allreduce({k: cp.asarray(v) for k, v in gr.items()})
        for k in gr:
            assert np.allclose(got[k].get().astype(F32), want[k].astype(F32), rtol=1e-4, atol=1e-4), k
    sh, sd = host.state_dict(), dev.state_dict()
    assert sh["step"] == sd["step"] == 4 and sorted(sh["buckets"]) == sorted(sd["buckets"])
    for key, b in sh["buckets"].items():
        assert sorted(b.get("arrays", {})) == sorted(sd["buckets"][key].get("arrays", {}))
