"""PowerSGD on one process: the kernels against their numpy twins bit for bit, the layout
against torch's compression rule, the Pipeline against the numpy reference step, state
restored bit-exactly, non-finite steps refused with the state unchanged, the cost model."""
import os
import sys

import numpy as np
import pytest

import gradfuse
from gradfuse import _core
from gradfuse.compressors import cost
from gradfuse.compressors.base import BucketContext
from gradfuse.compressors.powersgd import Layout, PowerSGD
from gradfuse.errors import NonFiniteError

sys.path.insert(0, os.path.dirname(__file__))
import ref_powersgd as ref  # noqa: E402


def _mats(rng, dims, zero_col=None):
    offs, rows, cols, parts = [], [], [], []
    at = 0
    for n, r in dims:
        x = rng.standard_normal((n, r)).astype(np.float32) * np.float32(rng.uniform(0.01, 100))
        if zero_col is not None and r > zero_col:
            x[:, zero_col] = 0
        parts.append(x.ravel())
        offs.append(at), rows.append(n), cols.append(r)
        at += n * r
    base = np.concatenate(parts + [np.zeros(3, np.float32)])
    return base, np.array(offs, np.int64), np.array(rows, np.int64), np.array(cols, np.int64)


@pytest.mark.parametrize("eps", [0.0, 1e-8])
@pytest.mark.parametrize("zero_col", [None, 0, 1])
def test_orthogonalize_matches_its_twin_bit_for_bit(eps, zero_col):
    rng = np.random.default_rng(3)
    dims = [(1, 1), (5, 1), (31, 2), (32, 2), (33, 3), (64, 4), (100, 1), (257, 4), (3, 3), (2000, 2)]
    base, offs, rows, cols = _mats(rng, dims, zero_col)
    want = base.copy()
    _core.psgd_orthogonalize(base, offs, rows, cols, eps)
    ref.orthogonalize(want, offs, rows, cols, eps)
    assert base.tobytes() == want.tobytes()
    for o, n, r in zip(offs, rows, cols):
        x = base[o:o + n * r].reshape(n, r).astype(np.float64)
        g = x.T @ x
        zero = ~x.any(axis=0)
        assert np.all(np.isfinite(x))
        if zero_col is not None and r > zero_col:
            assert zero[zero_col]            # a zero column stays zero, never NaN
        live = ~zero
        if eps == 0 and n >= r:
            assert np.allclose(g[np.ix_(live, live)], np.eye(int(live.sum())), atol=1e-5)


def test_orthogonalize_matches_torch_qr_up_to_sign():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((50, 3)).astype(np.float32)
    q, _ = np.linalg.qr(x.astype(np.float64))
    y = x.ravel().copy()
    _core.psgd_orthogonalize(y, np.array([0]), np.array([50]), np.array([3]))
    y = y.reshape(50, 3)
    assert np.allclose(np.abs(y), np.abs(q), atol=1e-5)


def test_gather_and_scatter_match_their_twins():
    rng = np.random.default_rng(5)
    shapes = [(4, 6), (7,), (3, 2, 2), (0,), (9, 5)]
    lay = Layout(shapes, 1, 1.0)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads[1][2] = np.inf
    ptrs = np.array([g.ctypes.data for g in grads], np.int64)
    cnt = np.array([g.size for g in grads], np.int64)
    e = rng.standard_normal(lay.nw).astype(np.float32)
    W, U = np.empty(lay.nw, np.float32), np.empty(lay.nu, np.float32)
    bad = _core.psgd_gather(ptrs, cnt, lay.route, 0, len(shapes), e, W, U)
    W2, U2, bad2 = ref.gather(grads, lay.route, e, lay.nw, lay.nu)
    assert (W.tobytes(), U.tobytes(), bad) == (W2.tobytes(), U2.tobytes(), bad2) and bad == 1
    outs = [np.empty(s, np.float32) for s in shapes]
    optr = np.array([o.ctypes.data for o in outs], np.int64)
    A = rng.standard_normal(lay.nw).astype(np.float32)
    e_out = np.empty(lay.nw, np.float32)
    _core.psgd_scatter(optr, cnt, lay.route, 0, len(shapes), A, W, e_out, U, 3.0)
    want, we = ref.scatter(shapes, lay.route, A, W, U, 3.0)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(outs, want)) and e_out.tobytes() == we.tobytes()
    with pytest.raises(ValueError, match="outside W"):
        _core.psgd_gather(ptrs, cnt, lay.route, 0, len(shapes), e[:0], W[:3], U)


def test_layout_follows_torchs_rule():
    # torch's _should_compress: (n + m) r * rate < n m; the matrix is (shape[0], rest)
    lay = Layout([(64, 3, 3, 3), (10,), (4, 4), (1000, 2048), (2, 100)], 4, 2.0)
    # 1-D; 4x4 at rank 4: (4 + 4) 4 * 2 > 16; 2x100 at rank 2: (2 + 100) 2 * 2 > 200
    assert lay.route[1] < 0 and lay.route[2] < 0 and lay.route[4] < 0
    assert lay.route[0] >= 0 and lay.route[3] >= 0
    assert [m[1:4] for m in lay.mats] == [(64, 27, 4), (1000, 2048, 4)]
    assert lay.floats == 64 * 4 + 27 * 4 + 1000 * 4 + 2048 * 4 + 10 + 16 + 200


@pytest.mark.parametrize("bad", [{"rank": 0}, {"rank": 1.5}, {"min_compression_rate": 0},
                                 {"orthogonalization_epsilon": -1.0}, {"seed": -1}, {"warm_start": 1}])
def test_options_are_checked(bad):
    with pytest.raises((ValueError, TypeError), match=list(bad)[0]):
        PowerSGD(**bad)


def _grads(step, r=0):
    rng = np.random.default_rng([step, r, 11])
    return {"conv": rng.standard_normal((16, 4, 3, 3)).astype(np.float32),
            "bias": rng.standard_normal(16).astype(np.float32),
            "fc": rng.standard_normal((10, 64)).astype(np.float32),
            "tiny": rng.standard_normal((2, 2)).astype(np.float32)}


@pytest.mark.parametrize("opts", [{}, {"rank": 2}, {"rank": 4, "warm_start": False},
                                  {"error_feedback": False}, {"orthogonalization_epsilon": 1e-8}])
def test_pipeline_matches_the_reference_step(opts):
    pipe = gradfuse.Pipeline(compress="powersgd", fusion_threshold=1 << 30, **opts)
    comp = PowerSGD(**opts)
    names = list(_grads(0))
    shapes = [_grads(0)[k].shape for k in names]
    lay = comp.layout(BucketContext(counts=tuple(int(np.prod(s)) for s in shapes), shapes=tuple(shapes)), None
                      if False else sum(int(np.prod(s)) for s in shapes))
    states = [{}]
    for step in range(4):
        g = _grads(step)
        want = ref.reference_step(comp, lay, [[g[k] for k in names]], states, 0, step, 1.0)
        got = pipe.allreduce(g)
        for k, w in zip(names, want):
            assert got[k].tobytes() == w.tobytes(), (k, step)


def test_state_restores_bit_exactly(tmp_path):
    a = gradfuse.Pipeline(compress="powersgd", rank=2)
    for step in range(3):
        a.allreduce(_grads(step))
    path = str(tmp_path / "s.npz")
    a.save_state(path)
    b = gradfuse.Pipeline(compress="powersgd", rank=2)
    b.load_state(path)
    for step in range(3, 6):
        x, y = a.allreduce(_grads(step)), b.allreduce(_grads(step))
        assert all(x[k].tobytes() == y[k].tobytes() for k in x)
    st = next(iter(b.state.buckets.values()))
    assert set(st.arrays) == {"q", "residual"}


def test_a_non_finite_step_is_refused_and_changes_nothing():
    a = gradfuse.Pipeline(compress="powersgd", rank=2)
    b = gradfuse.Pipeline(compress="powersgd", rank=2)
    for step in range(2):
        a.allreduce(_grads(step))
        b.allreduce(_grads(step))
    bad = _grads(9)
    bad["fc"][1, 2] = np.nan
    keep = {k: v.copy() for k, v in bad.items()}
    with pytest.raises(NonFiniteError, match="powersgd"):
        a.allreduce_(bad)
    assert all(bad[k].tobytes() == keep[k].tobytes() for k in bad)      # nothing written
    bad["bias"][0] = np.inf
    for step in range(2, 4):       # a continues exactly as b, which never saw the bad step
        x, y = a.allreduce(_grads(step)), b.allreduce(_grads(step))
        assert all(x[k].tobytes() == y[k].tobytes() for k in x)


def test_cost_model_counts_powersgds_bytes_and_three_allreduces():
    shapes = [(64, 3, 3, 3), (64,), (1000, 2048)]
    counts = [int(np.prod(s)) for s in shapes]
    n = sum(counts)
    lay = Layout(shapes, 4, 2.0)
    P = cost.payload_bytes("powersgd", n, {"rank": 4}, counts, shapes=shapes)
    assert P == 4 * (lay.floats + 1)
    b = cost.bytes_per_rank("powersgd", "powersgd", n, 4, {"rank": 4}, counts, shapes=shapes)
    assert b == pytest.approx(2 * 3 / 4 * P)
    link = cost.link_from("1gbit")
    t = cost.predict("powersgd", "powersgd", n, 4, link, options={"rank": 4}, counts=counts, shapes=shapes)
    t0 = cost.predict("powersgd", "powersgd", n, 4, cost.Link(link.bandwidth, 0.0), options={"rank": 4},
                      counts=counts, shapes=shapes)
    assert t - t0 == pytest.approx(3 * 2 * 3 * link.latency)      # three ring allreduces
    assert t < cost.predict("none", "ring", n, 4, link)


def _product_case(rank, seed=5):
    rng = np.random.default_rng(seed)
    # widths around the 8 lanes' multiples and tails, heights around the 4-row groups
    shapes = [(1, 9), (3, 5), (4, 8), (5, 17), (7, 3, 3), (9, 16), (13, 100), (64, 3, 3, 3), (130, 257), (2, 1000)]
    lay = Layout(shapes, rank, 0.5)
    W = (rng.standard_normal(lay.nw) * rng.uniform(0.01, 100)).astype(np.float32)
    P = rng.standard_normal(lay.np_).astype(np.float32)
    Q = rng.standard_normal(lay.nq).astype(np.float32)
    return lay, W, P, Q


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5, 8])
def test_products_match_their_twin_bit_for_bit_and_float64_to_tolerance(rank, scalar):
    lay, W, P, Q = _product_case(rank)
    assert lay.max_rank == rank
    _core.set_simd(scalar)
    try:
        for kind in "PQA":
            got = [W.copy(), P.copy(), Q.copy(), np.full(lay.nw, np.nan, np.float32)]
            want = [a.copy() for a in got]
            _core.psgd_products(kind, lay.mat_tab, *got)
            ref.products(kind, lay.mats, *want)
            for g, w in zip(got, want):
                assert g.tobytes() == w.tobytes(), kind
            for (w, n, m, r, po, qo) in lay.mats:
                M = W[w:w + n * m].reshape(n, m).astype(np.float64)
                Pk = P[po:po + n * r].reshape(n, r).astype(np.float64)
                Qk = Q[qo:qo + m * r].reshape(m, r).astype(np.float64)
                exact, out = {"P": (M @ Qk, got[1][po:po + n * r].reshape(n, r)),
                              "Q": (M.T @ Pk, got[2][qo:qo + m * r].reshape(m, r)),
                              "A": (Pk @ Qk.T, got[3][w:w + n * m].reshape(n, m))}[kind]
                # float32 sums of n, m or r terms: a few ulps of the sum of |terms|
                terms = {"P": np.abs(M) @ np.abs(Qk), "Q": np.abs(M.T) @ np.abs(Pk), "A": np.abs(Pk) @ np.abs(Qk.T)}
                tol = 4 * np.finfo(np.float32).eps * max(n, m) * terms[kind] + 1e-30
                assert (np.abs(out - exact) <= tol).all(), (kind, n, m, r)
    finally:
        _core.set_simd(os.environ.get("GRADFUSE_FORCE_SCALAR") == "1")


def test_products_refuse_bad_tables():
    lay, W, P, Q = _product_case(2)
    A = np.zeros(lay.nw, np.float32)
    with pytest.raises(ValueError, match="kind must be"):
        _core.psgd_products("B", lay.mat_tab, W, P, Q, A)
    with pytest.raises(ValueError, match="6 int64 per matrix"):
        _core.psgd_products("P", lay.mat_tab[:-1].copy(), W, P, Q, A)
    deep = lay.mat_tab.copy()
    deep[3] = 9
    with pytest.raises(ValueError, match="ranks 1 to 8"):
        _core.psgd_products("P", deep, W, P, Q, A)
    with pytest.raises(ValueError, match="outside W"):
        _core.psgd_products("P", lay.mat_tab, W[:-1].copy(), P, Q, A)
    with pytest.raises(ValueError, match="outside A"):
        _core.psgd_products("A", lay.mat_tab, W, P, Q, A[:-1].copy())
    with pytest.raises(ValueError, match="P .* lies outside P"):
        _core.psgd_products("Q", lay.mat_tab, W, P[:-1].copy(), Q, A)
    with pytest.raises(ValueError, match="Q .* lies outside Q"):
        _core.psgd_products("P", lay.mat_tab, W, P, Q[:-1].copy(), A)


def test_pipeline_above_the_kernels_rank_uses_blas_and_matches_the_reference_step():
    pipe = gradfuse.Pipeline(compress="powersgd", rank=9, fusion_threshold=1 << 30)
    comp = PowerSGD(rank=9)
    g0 = {"w": np.ones((100, 80), np.float32), "b": np.ones(4, np.float32)}
    shapes = [v.shape for v in g0.values()]
    lay = comp.layout(BucketContext(counts=tuple(int(np.prod(s)) for s in shapes), shapes=tuple(shapes)), 8004)
    assert lay.max_rank == 9
    states = [{}]
    rng = np.random.default_rng(2)
    for step in range(3):
        g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in g0.items()}
        want = ref.reference_step(comp, lay, [list(g.values())], states, 0, step, 1.0)
        got = pipe.allreduce(g)
        for k, w in zip(g, want):
            assert got[k].tobytes() == w.tobytes(), (k, step)


@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("rank", [1, 3, 8])
def test_scatter_approx_is_the_product_then_the_scatter_bit_for_bit(rank, feedback):
    lay, W, P, Q = _product_case(rank)
    shapes = lay.shapes + ((7,), (3, 2))
    lay = Layout(shapes, rank, 0.5)
    rng = np.random.default_rng(9)
    W = rng.standard_normal(lay.nw).astype(np.float32)
    P = rng.standard_normal(lay.np_).astype(np.float32)
    Q = rng.standard_normal(lay.nq).astype(np.float32)
    U = rng.standard_normal(lay.nu).astype(np.float32)
    A = np.zeros(lay.nw, np.float32)
    ref.products("A", lay.mats, None, P, Q, A)
    want, we = ref.scatter(shapes, lay.route, A, W, U, 3.0, feedback)
    outs = [np.full(s, np.nan, np.float32) for s in shapes]
    ptrs = np.array([o.ctypes.data for o in outs], np.int64)
    cnt = np.array([o.size for o in outs], np.int64)
    e_out = np.full(lay.nw if feedback else 0, np.nan, np.float32)
    _core.psgd_scatter_approx(ptrs, cnt, lay.route, lay.mrow, 0, len(shapes), lay.mat_tab, P, Q, W, e_out, U, 3.0)
    for o, w in zip(outs, want):
        assert o.tobytes() == w.tobytes()
    if feedback:
        assert e_out.tobytes() == we.tobytes()
    wrong = lay.mrow.copy()
    k = int(np.flatnonzero(lay.route >= 0)[1])
    wrong[k] = 0
    with pytest.raises(ValueError, match=f"row {k} .* is not matrix 0"):
        _core.psgd_scatter_approx(ptrs, cnt, lay.route, wrong, 0, len(shapes), lay.mat_tab, P, Q, W, e_out, U, 3.0)
    with pytest.raises(ValueError, match="mrow has"):
        _core.psgd_scatter_approx(ptrs, cnt, lay.route, lay.mrow[:-1].copy(), 0, len(shapes), lay.mat_tab, P, Q,
                                  W, e_out, U, 3.0)
    with pytest.raises(ValueError, match="P lies outside P"):
        _core.psgd_scatter_approx(ptrs, cnt, lay.route, lay.mrow, 0, len(shapes), lay.mat_tab, P[:-1].copy(), Q,
                                  W, e_out, U, 3.0)
