"""Numpy definition of the Adam correction's kernels (gradfuse/kernels/_adam.h,
cuda/adam.cu): the moment update, the step, plain Adam, the freeze and the fused 1-bit
pass, float32, no FMA, every operation rounded once in the kernels' order."""
import numpy as np

import ref_quant

F32 = np.float32


def moment(g, m, r, b1, c1):
    """``b1 * m + (c1 * g) * r``: ``c1 * g``, times ``r``, ``b1 * m``, the sum."""
    q = np.multiply(np.multiply(F32(c1), np.asarray(g, F32), dtype=F32), np.asarray(r, F32), dtype=F32)
    p = np.multiply(F32(b1), np.asarray(m, F32), dtype=F32)
    return np.add(p, q, dtype=F32)


def step(m, v, a, b, eps):
    """``(a * m) / (b * sqrt(v) + eps)``."""
    with np.errstate(all="ignore"):
        num = np.multiply(F32(a), np.asarray(m, F32), dtype=F32)
        d = np.multiply(F32(b), np.sqrt(np.asarray(v, F32), dtype=F32), dtype=F32)
        d = np.add(d, F32(eps), dtype=F32)
        return np.divide(num, d, dtype=F32)


def freeze(m, v, b, eps):
    """(mask, r, m in r's units) at the freeze: ``mask = v != 0``, ``r = 1 / (b sqrt(v) + eps)``
    where the mask is set (0 elsewhere), ``m * r``."""
    v = np.asarray(v, F32)
    mask = (v != 0).astype(np.uint8)
    with np.errstate(all="ignore"):
        d = np.add(np.multiply(F32(b), np.sqrt(v, dtype=F32), dtype=F32), F32(eps), dtype=F32)
        r = np.where(mask != 0, np.divide(F32(1), d, dtype=F32), F32(0)).astype(F32)
    return mask, r, np.multiply(np.asarray(m, F32), r, dtype=F32)


def apply(mb, mask, a):
    """(m, out) after the exchange: ``m = mb``, ``out = a * mb``; both 0 where ``mask`` is 0."""
    mb = np.asarray(mb, F32)
    out = np.multiply(F32(a), mb, dtype=F32)
    m = mb.copy()
    if mask is not None and len(mask):
        drop = np.asarray(mask) == 0
        m[drop] = 0
        out[drop] = 0
    return m, out


def plain(g, m, v, b1, c1, b2, c2, a, b, eps):
    """(m, v, out) of plain Adam on the averaged gradient ``g``."""
    g = np.asarray(g, F32)
    m = np.add(np.multiply(F32(b1), np.asarray(m, F32), dtype=F32), np.multiply(F32(c1), g, dtype=F32), dtype=F32)
    r = np.multiply(F32(b2), np.asarray(v, F32), dtype=F32)
    s = np.multiply(F32(c2), np.multiply(g, g, dtype=F32), dtype=F32)
    v = np.add(r, s, dtype=F32)
    return m, v, step(m, v, a, b, eps)


def plain_sums(v_old, v_new, f_new, f_old):
    """The freeze rule's two sums: ``sum |v_new f_new - v_old f_old|`` and ``sum v_new f_new``."""
    hn = np.asarray(v_new, np.float64) * f_new
    return float(np.abs(hn - np.asarray(v_old, np.float64) * f_old).sum()), float(hn.sum())


def onebit_compress(g, m, r, b1, c1, e, block, counts=None):
    """The fused moment + 1-bit pass: 1-bit compression (with error feedback ``e``, or None)
    of the moment ``b1 * m + (c1 * g) * r``; returns ref_quant.onebit_compress's result."""
    return ref_quant.onebit_compress(moment(g, m, r, b1, c1), e, block, counts)


class Model:
    """The Adam correction of one pipeline written out in numpy, per tensor, for ``p`` ranks
    (each tensor its own bucket context: 1-bit's blocks, 2-bit's and top-k's selections
    restart at every tensor, so the fused bucket gives the same bits): warm-up with exact
    Adam on the mean gradient, then at step ``freeze`` + 1 the frozen ``v``, its mask and
    preconditioner ``r`` (``m`` in r's units), the moment with error feedback through the
    compressor's plain methods, and the mean of the decoded moments (in rank order, then
    divided by ``p``) as every rank's ``m``."""

    def __init__(self, comp, spec, freeze, p=1):
        from gradfuse.compressors.base import BucketContext
        self.comp, self.spec, self.freeze, self.p = comp, spec, freeze, p
        self.ctx = BucketContext
        self.m, self.v, self.e, self.mask, self.r, self.t = {}, {}, {}, {}, {}, {}

    def step(self, grads_by_rank, exact=()):
        """The outputs (the same on every rank) of one step; ``grads_by_rank[r]`` is rank r's
        dict; tensors named in ``exact`` stay uncompressed (live v)."""
        from gradfuse.compressors.error_feedback import compress_with_feedback
        from gradfuse.step.exchange import Wire
        sp, p = self.spec, self.p
        out = {}
        for k in grads_by_rank[0]:
            gs = [np.asarray(g[k], F32).reshape(-1) for g in grads_by_rank]
            n = gs[0].size
            m, v = self.m.setdefault(k, np.zeros(n, F32)), self.v.setdefault(k, np.zeros(n, F32))
            t = self.t.get(k, 0) + 1
            self.t[k] = t
            if k in exact or t <= self.freeze or self.comp is None:
                acc = gs[0].copy()
                for g in gs[1:]:
                    acc = np.add(acc, g, dtype=F32)
                mean = np.divide(acc, F32(p), dtype=F32) if p > 1 else acc
                a, b = sp.factors(t, t)
                self.m[k], self.v[k], o = plain(mean, m, v, sp.b1, sp.c1, sp.b2, sp.c2, a, b, sp.eps)
            else:
                if k not in self.mask:
                    self.mask[k], self.r[k], self.m[k] = freeze(m, v, sp.factors(1, self.freeze)[1], sp.eps)
                    m = self.m[k]
                ctx = self.ctx(counts=(n,))
                rows = []
                for r, g in enumerate(gs):
                    x = moment(g, m, self.r[k], sp.b1, sp.c1)
                    e = self.e.setdefault((k, r), np.zeros(n, F32)) if self.comp.error_feedback else np.zeros(0, F32)
                    e_out = np.empty(n, F32) if e.size else e
                    wire = Wire(self.comp.bucket_layout(ctx))
                    pay = [np.zeros(c, d) for d, c in wire.layout]
                    compress_with_feedback(self.comp, x, e, e_out, pay, ctx)
                    if e.size:
                        self.e[(k, r)] = e_out
                    rows.append(pay)
                acc = self.comp.decompress_sum([np.stack([rw[i] for rw in rows]) for i in range(len(rows[0]))], n, ctx)
                mean = np.divide(acc, F32(p), dtype=F32) if p > 1 else acc
                self.m[k], o = apply(mean, self.mask[k], sp.factors(t, self.freeze)[0])
            out[k] = o.reshape(np.shape(grads_by_rank[0][k]))
        return out
