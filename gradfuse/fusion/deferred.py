"""Host arrays whose memory is handed over later: ``Deferred`` and ``view_at``.

A binding whose framework allocates lazily (MXNet hands an array's memory over only in
its engine, when every earlier write has finished) describes a call's arrays by names,
signature and byte sizes; their data pointers arrive on the communication thread, where
``Deferred.bind()`` waits for them before the step reads any (``gradfuse.step.Step``).
"""
import numpy as np


class Deferred:
    """Host arrays described now, whose data pointers arrive on the communication thread.

    Args:
        names: the tensors' names (as ``names=`` of a list call).
        sig, nbytes: the signature (``_core.scan``'s format) and byte sizes.
        ptrs: int64 table of the input pointers, written before ``bind`` returns.
        out_ptrs: the outputs' table (out of place), or None: the results are written
            into the inputs.
        bind: called on the communication thread before the step reads any pointer; it
            waits until they are there and raises if one could not be read.
        finish: ``finish(error)`` after the step, with its exception or None.
        result: what the call returns.

    The pipeline takes it as ``allreduce_async(d, out=d)`` (in place) or
    ``allreduce_async(d)`` (out of place, into ``out_ptrs``). ``taken`` becomes True
    when a step was made of it; if not, the call was refused and ``finish`` never runs.
    """

    __slots__ = ("names", "sig", "nbytes", "ptrs", "out_ptrs", "bind", "finish", "result", "taken")

    def __init__(self, names, sig, nbytes, ptrs, out_ptrs, bind, finish, result):
        self.names, self.sig, self.nbytes, self.ptrs = names, sig, nbytes, ptrs
        self.out_ptrs, self.bind, self.finish, self.result = out_ptrs, bind, finish, result
        self.taken = False


class _Interface:
    __slots__ = ("__array_interface__",)

    def __init__(self, ptr, shape, typestr):
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr, "version": 3}


def view_at(ptr, shape, dtype):
    """A writable numpy array over memory someone else owns (``ptr``), without a copy."""
    dtype = np.dtype(dtype)
    if not int(np.prod(shape, dtype=np.int64)):
        return np.zeros(shape, dtype)
    if not ptr:
        raise ValueError("view_at: a null pointer for a non-empty array")
    return np.asarray(_Interface(int(ptr), tuple(int(d) for d in shape), dtype.str))
