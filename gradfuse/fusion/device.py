"""The device table builder: a call's GPU arrays as pointer tables on their device.

``device_tables`` reads the pointers, byte sizes and signature of cupy arrays (the views
``gradfuse.fusion.intake.read`` made) in the layout ``_core.scan`` gives host arrays;
``new_outputs`` gives an out-of-place call its result arrays on the device.
"""
import numpy as np

from .. import dtypes as _dt


def device_tables(arrays):
    """(signature bytes as ``_core.scan`` makes them, pointers, byte sizes) of cupy arrays."""
    words, ptrs, nbytes = [], [], []
    for a in arrays:
        words += [_dt.CODE[a.dtype], a.ndim, *a.shape]
        ptrs.append(a.data.ptr if a.size else 0)
        nbytes.append(a.size * a.itemsize)
    return (np.asarray(words, np.int64).tobytes(), np.asarray(ptrs, np.int64),
            np.asarray(nbytes, np.int64))


def new_outputs(entry, cp):
    """``(arrays, pointers)`` for an out-of-place call of plan ``entry``: new cupy arrays on
    the current device."""
    arrays = [cp.empty(s, dtype=_dt.DTYPE[c]) for c, s in zip(entry.codes, entry.shapes)]
    return arrays, device_tables(arrays)[1]
