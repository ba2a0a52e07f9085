"""Numpy definition of DGC's momentum correction kernels (gradfuse/kernels/_momentum.h,
cuda/momentum.cu): the velocity update and momentum factor masking, float32, no FMA."""
import numpy as np

F32 = np.float32


def momentum_update(g, u_in, m, nesterov=0.0):
    """(u_out, out): ``u_out = m * u_in + g`` (two roundings), ``out = u_out`` or, when
    ``nesterov`` (the look-ahead momentum) is not 0, ``nesterov * u_out + g``."""
    m, q = F32(m), F32(nesterov)
    g = np.asarray(g, F32)
    u = np.add(np.multiply(m, np.asarray(u_in, F32), dtype=F32), g, dtype=F32)
    out = np.add(np.multiply(q, u, dtype=F32), g, dtype=F32) if q != 0 else u.copy()
    return u, out


def momentum_mask(e_in, x, e_out, u):
    """``u`` with zeros where ``e_out == 0`` and ``e_in + x != 0``; and the count."""
    c = np.add(np.asarray(e_in, F32), np.asarray(x, F32), dtype=F32)
    hit = (np.asarray(e_out, F32) == 0) & (c != 0)
    u = np.array(u, F32, copy=True)
    u[hit] = 0
    return u, int(hit.sum())
