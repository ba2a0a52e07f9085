"""Numpy definition of the Adam correction's kernels (gradfuse/kernels/_adam.h,
cuda/adam.cu): the moment update, the step, plain Adam and the fused 1-bit pass, float32,
no FMA, every operation rounded once in the kernels' order."""
import numpy as np

import ref_quant

F32 = np.float32


def moment(g, m, b1, c1):
    """``b1 * m + c1 * g``: two products, then their sum."""
    p = np.multiply(F32(b1), np.asarray(m, F32), dtype=F32)
    q = np.multiply(F32(c1), np.asarray(g, F32), dtype=F32)
    return np.add(p, q, dtype=F32)


def step(m, v, a, b, eps):
    """``(a * m) / (b * sqrt(v) + eps)``."""
    with np.errstate(all="ignore"):
        num = np.multiply(F32(a), np.asarray(m, F32), dtype=F32)
        d = np.multiply(F32(b), np.sqrt(np.asarray(v, F32), dtype=F32), dtype=F32)
        d = np.add(d, F32(eps), dtype=F32)
        return np.divide(num, d, dtype=F32)


def apply(mb, v, mask, a, b, eps):
    """(m, out) after the exchange: ``m = mb``, ``out = step(mb, v)``; both 0 where ``mask`` is 0."""
    mb = np.asarray(mb, F32)
    out = step(mb, v, a, b, eps)
    m = mb.copy()
    if mask is not None and len(mask):
        drop = np.asarray(mask) == 0
        m[drop] = 0
        out[drop] = 0
    return m, out


def plain(g, m, v, b1, c1, b2, c2, a, b, eps):
    """(m, v, out) of plain Adam on the averaged gradient ``g``."""
    g = np.asarray(g, F32)
    m = moment(g, m, b1, c1)
    r = np.multiply(F32(b2), np.asarray(v, F32), dtype=F32)
    s = np.multiply(F32(c2), np.multiply(g, g, dtype=F32), dtype=F32)
    v = np.add(r, s, dtype=F32)
    return m, v, step(m, v, a, b, eps)


def plain_sums(v_old, v_new, f_new, f_old):
    """The freeze rule's two sums: ``sum |v_new f_new - v_old f_old|`` and ``sum v_new f_new``."""
    hn = np.asarray(v_new, np.float64) * f_new
    return float(np.abs(hn - np.asarray(v_old, np.float64) * f_old).sum()), float(hn.sum())


def onebit_compress(g, m, b1, c1, e, block, counts=None):
    """The fused moment + 1-bit pass: 1-bit compression (with error feedback ``e``, or None)
    of the moment ``b1 * m + c1 * g``; returns ref_quant.onebit_compress's result."""
    return ref_quant.onebit_compress(moment(g, m, b1, c1), e, block, counts)
