"""numpy twins of gradfuse's PowerSGD kernels (``kernels/_powersgd.h``), bit for bit.

``dot`` sums in double in the GPU warp's order: 32 lanes, lane l the rows l, l + 32, ...
in row order (``np.cumsum`` adds sequentially), then the butterfly over lane l ^ h.
``products`` is the twin of ``psgd_products`` (``_psgd_mm.h``), float32 sums in its orders.
"""
import functools

import numpy as np

LANES = 32


def dot(a, b):
    """The kernels' double sum of ``a * b`` (float32 vectors of one length)."""
    prod = a.astype(np.float64) * b.astype(np.float64)
    k = -(-prod.size // LANES) * LANES
    pad = np.zeros(k, np.float64)
    pad[:prod.size] = prod
    lane = np.cumsum(pad.reshape(-1, LANES), axis=0)[-1] if k else np.zeros(LANES)
    # zero padding adds +0.0 to a lane's sum: the same bits as not adding (a sum is never -0.0 here
    # unless every product was -0.0, and -0.0 + 0.0 is +0.0: the kernel starts each lane at +0.0 too)
    h = LANES // 2
    while h >= 1:
        lane = lane + lane[np.arange(LANES) ^ h]
        h //= 2
    return float(lane[0])


def orthogonalize(base, offsets, rows, cols, eps=0.0):
    """Gram-Schmidt in place on every matrix of ``base`` (``_powersgd.h``)."""
    for o, n, r in zip(offsets, rows, cols):
        x = base[o:o + n * r].reshape(n, r)
        for i in range(r):
            s = dot(x[:, i], x[:, i])
            if s == 0.0:
                continue
            d = np.sqrt(s) + eps
            x[:, i] = (x[:, i].astype(np.float64) / d).astype(np.float32)
            for j in range(i + 1, r):
                t = dot(x[:, i], x[:, j])
                x[:, j] = (x[:, j].astype(np.float64) - t * x[:, i].astype(np.float64)).astype(np.float32)


PRODUCT_LANES = 8
MAX_KERNEL_RANK = 8


def _mq(M, Q):
    """P = M Q in the kernel's order: 8 float32 lanes over the columns j, the tail into
    lanes 0.., then lanes l + 4, l + 2, l + 1 folded in."""
    n, m = M.shape
    r = Q.shape[1]
    L = PRODUCT_LANES
    full = m - m % L
    P = np.empty((n, r), np.float32)
    for c in range(r):
        prod = M * Q[:, c][None, :]                     # float32 products, one rounding each
        if full:
            lanes = np.cumsum(prod[:, :full].reshape(n, -1, L), axis=1, dtype=np.float32)[:, -1, :].copy()
        else:
            lanes = np.zeros((n, L), np.float32)
        t = m - full
        lanes[:, :t] += prod[:, full:]
        lanes[:, :4] += lanes[:, 4:8]
        lanes[:, :2] += lanes[:, 2:4]
        P[:, c] = lanes[:, 0] + lanes[:, 1]
    return P


def _mtp(M, P):
    """Q = M^T P in row order k = 0, 1, ... (float32)."""
    s = np.zeros((M.shape[1], P.shape[1]), np.float32)
    for k in range(M.shape[0]):
        s += M[k][:, None] * P[k][None, :]
    return s


def _pqt(P, Q):
    """A = P Q^T in column order c = 0, 1, ... (float32)."""
    A = P[:, 0:1] * Q[:, 0][None, :]
    for c in range(1, P.shape[1]):
        A += P[:, c:c + 1] * Q[:, c][None, :]
    return A


def products(kind, mats, W, P, Q, A=None):
    """Twin of ``psgd_products``: ``"P"``: P = M Q, ``"Q"``: Q = M^T P, ``"A"``: A = P Q^T,
    in place, for every matrix ``(w, n, m, r, p, q)`` of ``mats`` (a Layout's ``mats``)."""
    for (w, n, m, r, po, qo) in mats:
        Mk = None if kind == "A" else W[w:w + n * m].reshape(n, m)
        Pk = P[po:po + n * r].reshape(n, r)
        Qk = Q[qo:qo + m * r].reshape(m, r)
        if kind == "P":
            Pk[...] = _mq(Mk, Qk)
        elif kind == "Q":
            Qk[...] = _mtp(Mk, Pk)
        else:
            A[w:w + n * m] = _pqt(Pk, Qk).ravel()


def gather(grads, route, e, nw, nu):
    """(W, U, non-finite count) from a list of float32 arrays and their routes."""
    W, U = np.zeros(nw, np.float32), np.zeros(nu, np.float32)
    bad = 0
    for g, to in zip(grads, route):
        g = g.ravel()
        if to >= 0:
            v = g + e[to:to + g.size] if e is not None and e.size else g.copy()
            W[to:to + g.size] = v
        else:
            v = g
            U[-1 - to:-1 - to + g.size] = v
        bad += int((~np.isfinite(v)).sum())
    return W, U, bad


def scatter(shapes, route, A, W, U, divisor, feedback=True):
    """(outputs, new residual or None)."""
    outs = []
    e = W - A if feedback else None
    for s, to in zip(shapes, route):
        c = int(np.prod(s, dtype=np.int64))
        if to >= 0:
            outs.append(A[to:to + c].reshape(s).copy())
        else:
            u = U[-1 - to:-1 - to + c]
            outs.append((u if divisor == 1 else u / np.float32(divisor)).astype(np.float32).reshape(s))
    return outs, e


def reference_step(comp, lay, grads, states, bucket, step, divisor, sum_order=None):
    """One PowerSGD step of one bucket on every rank at once, in numpy (the job's math with
    the twins above; the products by the kernels' twin up to rank 8, numpy's matmul above,
    as the job on the host): ``grads[r]``, rank r's list of the bucket's
    tensors; ``states[r]``: a dict with ``"q"`` and ``"residual"`` (updated). Returns the
    outputs (the same for every rank)."""
    o = comp.options
    eps = o["orthogonalization_epsilon"]
    p = len(grads)
    total = (lambda xs: functools.reduce(np.add, xs)) if sum_order is None else sum_order
    Ws, Us = [], []
    for r in range(p):
        e = states[r].get("residual") if comp.error_feedback else None
        W, U, _ = gather(grads[r], lay.route, e, lay.nw, lay.nu)
        Ws.append(W)
        Us.append(U)
    U = total(Us)
    Q0 = states[0].get("q") if o["warm_start"] else None
    Q0 = comp.initial_q(lay, bucket, step) if Q0 is None else Q0.copy()
    orthogonalize(Q0, *lay.q_tab, eps)
    kernel = lay.max_rank <= MAX_KERNEL_RANK
    Ps = []
    for r in range(p):
        P = np.zeros(lay.np_, np.float32)
        if kernel:
            products("P", lay.mats, Ws[r], P, Q0)
            Ps.append(P)
            continue
        for (w, n, m, k, po, qo) in lay.mats:
            P[po:po + n * k] = (Ws[r][w:w + n * m].reshape(n, m) @ Q0[qo:qo + m * k].reshape(m, k)).ravel()
        Ps.append(P)
    P = total(Ps)
    orthogonalize(P, *lay.p_tab, eps)
    Qs = []
    for r in range(p):
        Q = np.zeros(lay.nq, np.float32)
        if kernel:
            products("Q", lay.mats, Ws[r], P, Q)
            Qs.append(Q)
            continue
        for (w, n, m, k, po, qo) in lay.mats:
            Q[qo:qo + m * k] = (Ws[r][w:w + n * m].reshape(n, m).T @ P[po:po + n * k].reshape(n, k)).ravel()
        Qs.append(Q)
    Q = total(Qs)
    if divisor != 1:
        Q = np.divide(Q, np.float32(divisor), dtype=np.float32)
    A = np.zeros(lay.nw, np.float32)
    if kernel:
        products("A", lay.mats, None, P, Q, A)
    for (w, n, m, k, po, qo) in (() if kernel else lay.mats):
        A[w:w + n * m] = (P[po:po + n * k].reshape(n, k) @ Q[qo:qo + m * k].reshape(m, k).T).ravel()
    outs = None
    for r in range(p):
        outs, e = scatter(lay.shapes, lay.route, A, Ws[r], U, divisor, comp.error_feedback)
        if e is not None:
            states[r]["residual"] = e
        if o["warm_start"]:
            states[r]["q"] = Q.copy()
    return outs
