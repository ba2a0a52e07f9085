"""Transparent huge pages for MXNet's CPU arrays, as numpy asks for its own.

numpy advises the kernel to back every array of 4 MiB or more with transparent huge pages
(``madvise(MADV_HUGEPAGE)``, where THP is in ``madvise`` mode, the common default); MXNet's
CPU allocator does not, so its arrays sit on 4 KiB pages. MPI's shared-memory copies over
them ran about 10 % slower (ResNet-50's 102 MB on 2 ranks: ``Pipeline.allreduce_`` on views
of MXNet's memory 45.1 ms, on numpy's 40.8 ms, on MXNet's after this advice 39.9 ms:
docs/benchmarks.md). So, the first time a collective of this binding sees an
array of at least ``MIN_BYTES``, the whole 2 MiB pages inside it are advised
``MADV_HUGEPAGE`` and collapsed at once with ``MADV_COLLAPSE`` (Linux 6.1 on; elsewhere
the kernel's khugepaged collapses them in its own time, or nothing happens). The advice
changes no byte of the array; each range is advised once per process (``_seen``).
Nothing happens off Linux or with ``GRADFUSE_MXNET_HUGEPAGES=0`` (0 or 1; another value is
refused by name at the first collective).
"""
import ctypes
import sys

import numpy as np

from ..config import env_bool

MIN_BYTES = 4 << 20           # numpy's own threshold for the same advice
PAGE = 2 << 20                # the huge page (x86-64, aarch64 with 4 KiB base pages)
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25

_seen = set()                 # (first page, end) ranges advised
_madvise = []                 # [libc.madvise] once loaded, [None] where unavailable


def _libc_madvise():
    if not _madvise:
        fn = None
        if sys.platform.startswith("linux") and env_bool("GRADFUSE_MXNET_HUGEPAGES", True):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _madvise.append(fn)
    return _madvise[0]


def advise(ptrs, nbytes):
    """Advise the huge pages inside each array (``ptrs``/``nbytes``: int64 arrays of data
    pointers and sizes) of at least ``MIN_BYTES`` not advised before. One numpy pass; a
    system call per new range only."""
    big = np.flatnonzero(nbytes >= MIN_BYTES)
    if big.size == 0:
        return 0
    fn = _libc_madvise()
    if fn is None:
        return 0
    done = 0
    for i in big.tolist():
        p = int(ptrs[i])
        lo, hi = (p + PAGE - 1) // PAGE * PAGE, (p + int(nbytes[i])) // PAGE * PAGE
        if p == 0 or hi <= lo or (lo, hi) in _seen:
            continue
        _seen.add((lo, hi))
        if fn(lo, hi - lo, MADV_HUGEPAGE) == 0:
            fn(lo, hi - lo, MADV_COLLAPSE)       # EINVAL before Linux 6.1, EAGAIN when busy: fine
            done += 1
    return done
