"""The host table builder: a call's host arrays as pointer tables, in one C loop.

``host_tables`` reads every array's pointer, byte size, dtype and shape through the buffer
protocol (``scan``: ``_core.scan``, one C loop over the arrays ``gradfuse.fusion.intake.read``
made of a call's objects), copies non-contiguous inputs and refuses what cannot be read
or written as it is.
"""
import numpy as np

from .. import _core
from .. import dtypes as _dt


def scan(objs):
    """(signature bytes, pointers, byte sizes, flags) of buffer-protocol objects, one C loop."""
    n = len(objs)
    ptrs = np.empty(n, dtype=np.int64)
    nbytes = np.empty(n, dtype=np.int64)
    flags = np.empty(n, dtype=np.int64)
    sig = _core.scan(objs, ptrs, nbytes, flags)
    return sig, ptrs, nbytes, flags


#: the scan flags that stop an array from being read as it is (read-only: outputs only)
PROBLEMS = _core.FLAG_NOBUFFER | _core.FLAG_BADDTYPE | _core.FLAG_NONCONTIG
WRITE_PROBLEMS = PROBLEMS | _core.FLAG_READONLY


def host_tables(objs, names, writable, outs=None):
    """The tables of a call's host arrays: ``(objs, sig, ptrs, nbytes, outs, out_tables)``,
    ``out_tables`` the ``(sig, ptrs, nbytes)`` of ``outs`` (the ``out=`` arrays, read in the
    same pass), None without them. Non-contiguous inputs that are only read are copied (their pointers change);
    anything else ``scan`` flags is refused, naming the tensor: an unsupported dtype, a
    read-only or non-contiguous array that is written, an object without a buffer."""
    sig, ptrs, nbytes, flags = scan(objs)
    parts = [(objs, flags, ptrs, writable)]
    out_tables = None
    if outs is not None:
        out_sig, out_ptrs, out_nbytes, out_flags = scan(outs)
        out_tables = (out_sig, out_ptrs, out_nbytes)
        parts.append((outs, out_flags, out_ptrs, True))
    for arrays, flg, p, written in parts:
        bad = flg & (WRITE_PROBLEMS if written else PROBLEMS)
        for i in np.flatnonzero(bad).tolist():
            f, name = int(flg[i]), names[i]
            if f & _core.FLAG_NOBUFFER:
                raise TypeError(f"tensor {name!r}: cannot read {type(arrays[i]).__name__} as an array")
            if f & _core.FLAG_BADDTYPE:
                raise TypeError(f"tensor {name!r}: dtype {_dtype_of(arrays[i])} is not supported "
                                f"(supported: {_dt.SUPPORTED})")
            if written and f & _core.FLAG_READONLY:
                raise ValueError(f"tensor {name!r} is read-only; the results cannot be written into it")
            if written:
                raise ValueError(f"tensor {name!r} is not C-contiguous; outputs and in-place inputs "
                                 f"must be (use allreduce() without out=, which copies inputs)")
            arrays[i] = np.ascontiguousarray(arrays[i])      # same dtype and shape: the signature holds
            p[i] = arrays[i].ctypes.data if arrays[i].size else 0
    return objs, sig, ptrs, nbytes, outs, out_tables


def _dtype_of(obj):
    try:
        return np.asarray(memoryview(obj)).dtype
    except (TypeError, ValueError):
        return getattr(obj, "dtype", type(obj).__name__)


def as_ndarray(obj):
    """A numpy view of a buffer exporter (no copy)."""
    return obj if isinstance(obj, np.ndarray) else np.asarray(memoryview(obj))
