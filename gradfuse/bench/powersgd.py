"""PowerSGD's compute on one process, stage by stage: ``python -m gradfuse.bench powersgd``.

On ResNet-50's gradient set (or ``--set``), at each ``--ranks`` (approximation ranks), the
stages of ``gradfuse.step.powersgd.PowerSGDJob`` one after the other, as one bucket of
every tensor: the gather with the residual (``psgd_gather``), Gram-Schmidt of Q and of P
(``psgd_orthogonalize``), the products P = M Q, Q = M^T P and M^ = P Q^T (``--products``:
gradfuse's kernels, ``psgd_products``, as the job runs them up to rank 8, and BLAS through
numpy's matmul, as above rank 8, measured in turn in the same run), and the scatter with the
new residual (``psgd_scatter``); with the kernels also M^ and the scatter fused
(``psgd_scatter_approx``), the job's decode up to rank 8, which then counts in the compute
in place of the two; the median of ``--rounds`` rounds each. Printed: ms per
stage, the orthogonalization's share of the compute, and the rates the cost model takes (``cost.RATES["powersgd"]``: compress = S /
(gather, both Gram-Schmidts and the P and Q products), decode = S / (M^ and the scatter),
S the gradient bytes); beside them a whole one-rank ``Pipeline`` step.
"""
import argparse
import time

import numpy as np

from .sets import make_set, resnet50_shapes


def _median(fn, rounds):
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def stages(shapes, rank, rounds, how="kernel"):
    """{stage: median seconds} of PowerSGD's compute on tensors of ``shapes`` at ``rank``,
    the products by gradfuse's kernels (``how="kernel"``) or numpy's BLAS (``"blas"``)."""
    if how not in ("kernel", "blas"):
        raise ValueError(f"stages: how must be 'kernel' or 'blas', got {how!r}")
    from .. import _core as K
    from ..compressors.powersgd import Layout
    lay = Layout(shapes, rank, 2.0)
    grads = make_set(shapes, 1)
    ptrs = np.array([g.ctypes.data for g in grads], np.int64)
    cnt = np.array([g.size for g in grads], np.int64)
    e = np.zeros(lay.nw, np.float32)
    W, U = np.empty(lay.nw, np.float32), np.empty(lay.nu, np.float32)
    P, Q, A = np.empty(lay.np_, np.float32), np.empty(lay.nq, np.float32), np.empty(lay.nw, np.float32)
    Q[:] = np.random.default_rng(0).standard_normal(lay.nq, dtype=np.float32)
    e_out = np.empty(lay.nw, np.float32)
    outs = [np.empty_like(g) for g in grads]
    optr = np.array([o.ctypes.data for o in outs], np.int64)

    def products(kind):
        if how == "kernel":
            K.psgd_products(kind, lay.mat_tab, W, P, Q, A)
            return
        for (w, n, m, r, po, qo) in lay.mats:
            Mk, Pk, Qk = W[w:w + n * m].reshape(n, m), P[po:po + n * r].reshape(n, r), Q[qo:qo + m * r].reshape(m, r)
            if kind == "P":
                np.matmul(Mk, Qk, out=Pk)
            elif kind == "Q":
                np.matmul(Mk.T, Pk, out=Qk)
            elif r == 1:
                np.multiply(Pk, Qk.T, out=A[w:w + n * m].reshape(n, m))
            else:
                np.matmul(Pk, Qk.T, out=A[w:w + n * m].reshape(n, m))

    fns = {
        "gather": lambda: K.psgd_gather(ptrs, cnt, lay.route, 0, len(grads), e, W, U),
        "orthogonalize Q": lambda: K.psgd_orthogonalize(Q, *lay.q_tab, 0.0),
        "P = M Q": lambda: products("P"),
        "orthogonalize P": lambda: K.psgd_orthogonalize(P, *lay.p_tab, 0.0),
        "Q = M^T P": lambda: products("Q"),
        "M^ = P Q^T": lambda: products("A"),
        "scatter": lambda: K.psgd_scatter(optr, cnt, lay.route, 0, len(grads), A, W, e_out, U, 2.0),
    }
    if how == "kernel":    # the job's decode with the kernels: M^ and the scatter in one pass
        fns["M^ + scatter, fused"] = lambda: K.psgd_scatter_approx(optr, cnt, lay.route, lay.mrow, 0, len(grads),
                                                                   lay.mat_tab, P, Q, W, e_out, U, 2.0)
    for fn in fns.values():
        fn()
    return {k: _median(f, rounds) for k, f in fns.items()}, lay, sum(g.nbytes for g in grads)


def pipeline_step(shapes, rank, rounds):
    """Median seconds of a whole one-rank Pipeline step (every stage, no wire)."""
    from ..comm.single import SingleProcessCommunicator
    from ..pipeline import Pipeline
    grads = make_set(shapes, 1)
    pipe = Pipeline(compress="powersgd", rank=rank, comm=SingleProcessCommunicator())
    pipe.allreduce_(grads)
    return _median(lambda: pipe.allreduce_(grads), rounds)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench powersgd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4", help="approximation ranks, e.g. 1,4")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--products", default="kernel,blas",
                    help="how the products run, in turn at each rank: kernel (gradfuse's psgd_products), blas (numpy)")
    args = ap.parse_args(argv)
    kinds = [p for p in args.products.split(",") if p]
    bad = [p for p in kinds if p not in ("kernel", "blas")]
    if bad or not kinds:
        ap.error(f"--products: expected kernel and/or blas, got {args.products!r}")
    shapes = resnet50_shapes()
    stage_names = ["gather", "orth Q", "P = M Q", "orth P", "Q = M^T P", "M^ = P Q^T", "scatter",
                   "M^ + scatter, fused"]
    print("| rank | products | " + " | ".join(stage_names)
          + " | compute ms | orthogonalization share | compress GB/s | decode GB/s | 1-rank step ms | "
            "compressed share | floats sent |")
    print("|---:|---|" + "---:|" * 14)
    prods = {}
    for r, how in [(int(x), how) for x in args.ranks.split(",") for how in kinds]:
        if how == "kernel" and r > 8:
            print(f"| {r} | kernel | (the kernels take ranks up to 8; the job uses BLAS above) |")
            continue
        t, lay, S = stages(shapes, r, args.rounds, how)
        fused = t.pop("M^ + scatter, fused", None)
        dec = t["M^ = P Q^T"] + t["scatter"] if fused is None else fused
        comp = sum(t.values()) - t["M^ = P Q^T"] - t["scatter"]
        total = comp + dec
        orth = t["orthogonalize Q"] + t["orthogonalize P"]
        # the Pipeline runs the kernels up to rank 8, BLAS above
        step = f"{pipeline_step(shapes, r, args.rounds) * 1e3:.1f}" if (how == "kernel") == (r <= 8) else "-"
        cells = [f"{v * 1e3:.1f}" for v in t.values()] + ["-" if fused is None else f"{fused * 1e3:.1f}"]
        print(f"| {r} | {how} | " + " | ".join(cells)
              + f" | {total * 1e3:.1f} | {orth / total:.1%} | {S / comp / 1e9:.2f} | {S / dec / 1e9:.2f} | "
                f"{step} | {lay.compressed_share:.3f} | {lay.floats} |")
        prods[r, how] = (t["P = M Q"] + t["Q = M^T P"] + t["M^ = P Q^T"], total)
    for r in dict.fromkeys(r for r, _ in prods):
        if (r, "kernel") in prods and (r, "blas") in prods:
            (pk, ck), (pb, cb) = prods[r, "kernel"], prods[r, "blas"]
            print(f"rank {r}: products {pk * 1e3:.1f} ms (kernels) / {pb * 1e3:.1f} ms (BLAS) = {pk / pb:.2f}, "
                  f"compute {ck * 1e3:.1f} / {cb * 1e3:.1f} ms = {ck / cb:.2f}")


if __name__ == "__main__":
    main()
