"""Output arrays reused across out-of-place calls, never while the caller holds them.

Fresh 100 MB outputs pay a page fault per 4 KiB page at their first touch, every step;
``OutputPool`` keeps a cached plan's output sets and hands one out again only when no one
else refers to it.
"""
import sys

import numpy as np

from .. import dtypes as _dt


class OutputPool:
    """The output arrays of one cached plan's out-of-place calls, reused when free.

    An output set is reused only when nothing but this pool refers to any of its arrays
    (``sys.getrefcount``): an array the caller still holds, or any view of it (a view
    refers to its base), is never written again. Callers that keep step k's results while
    step k+1 runs get a second set; ``SETS`` sets are kept, beyond that a fresh set is made
    and the oldest kept one dropped (its arrays stay the caller's).
    """

    SETS = 3
    __slots__ = ("sets",)

    def __init__(self):
        self.sets = []       # [(objs, ptrs)]

    def take(self, entry):
        for k, (objs, ptrs) in enumerate(self.sets):
            if _unreferenced(objs):
                if k:        # most recently used first: the next call finds it at once
                    self.sets.insert(0, self.sets.pop(k))
                return objs, ptrs
        objs = [np.empty(s, dtype=_dt.DTYPE[c]) for c, s in zip(entry.codes, entry.shapes)]
        got = (objs, _pointers(objs))
        self.sets.insert(0, got)
        del self.sets[self.SETS:]
        return got


def _unreferenced(objs):
    """True when each array is referred to only by ``objs`` (the pool's list)."""
    getrefcount = sys.getrefcount
    for a in objs:
        if getrefcount(a) > 3:     # the list, the loop variable and getrefcount's argument
            return False
    return True


def _pointers(objs):
    return np.asarray([a.ctypes.data if a.size else 0 for a in objs], dtype=np.int64)
