"""Horovod 0.28.1's CPU arithmetic stated in numpy (horovod/common/ops/collective_operations.h,
``ScaleBufferCPUImpl``; mpi_operations.cc, ``MPIAllreduce``/``MPIReducescatter``; half.cc,
``float16_sum``), so the tests check gradfuse's bits without Horovod installed."""
import numpy as np


def horovod_scale(x, factor):
    """``ScaleBufferCPUImpl``: float16 and float32 times float32(factor) in float32, rounded
    once to the dtype; float64 in double; integers times the double factor, truncated."""
    x = np.asarray(x)
    if factor == 1.0:
        return x.copy()
    if x.dtype == np.float16:
        return (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    if x.dtype == np.float32:
        return (x * np.float32(factor)).astype(np.float32)
    if x.dtype == np.float64:
        return x * np.float64(factor)
    return np.trunc(x.astype(np.float64) * float(factor)).astype(x.dtype)


def horovod_sum(xs):
    """Sum in rank order; float16 pairwise in float32, rounded after each add (``float16_sum``)."""
    acc = xs[0].copy()
    for x in xs[1:]:
        if acc.dtype == np.float16:
            acc = (acc.astype(np.float32) + x.astype(np.float32)).astype(np.float16)
        else:
            acc = acc + x
    return acc


def horovod_allreduce(xs, op, prescale=1.0, postscale=1.0):
    """Every rank's input ``xs`` (rank order) -> the result. op: "sum" or "average"; Horovod
    averages through the postscale factor (``postscale_factor /= size``, in double)."""
    total = horovod_sum([horovod_scale(x, prescale) for x in xs])
    return horovod_scale(total, postscale / len(xs) if op == "average" else postscale)


def horovod_reducescatter(xs, op, rank, prescale=1.0, postscale=1.0):
    """This rank's rows of ``horovod_allreduce`` (``n // size`` rows, +1 on the first ``n % size``)."""
    full = horovod_allreduce(xs, op, prescale, postscale)
    p = len(xs)
    rows = [full.shape[0] // p + (1 if r < full.shape[0] % p else 0) for r in range(p)]
    lo = sum(rows[:rank])
    return full[lo:lo + rows[rank]]
