"""What one call reads and writes: ``Inputs`` and ``Outputs``, with their pointer tables.

``gradfuse.fusion.intake.read`` makes a call's ``Inputs`` (and the ``out=`` arrays'),
``gradfuse.fusion.tables.read_outputs`` its ``Outputs``; the step binds both.
"""
import numpy as np


class Inputs:
    """The inputs of one call: objects, names, and the tables the plan is keyed by (and the
    ``out=`` arrays' objects and tables)."""

    __slots__ = ("objs", "names", "sig", "ptrs", "nbytes", "device", "xp", "deferred", "outs", "out_tables")

    def __init__(self, objs, names, sig, ptrs, nbytes, device=None, xp=np, deferred=None, outs=None,
                 out_tables=None):
        self.objs, self.names = objs, names
        self.sig, self.ptrs, self.nbytes = sig, ptrs, nbytes
        self.device = device        # None on the host, else the CUDA device id
        self.xp = xp                # numpy, or cupy for GPU tensors
        self.deferred = deferred    # a Deferred: pointers known only when the step runs
        # the out= arrays and their (sig, ptrs, nbytes), read in the same pass (None without
        # out=): checked against the inputs by ``gradfuse.fusion.tables.read_outputs``
        self.outs, self.out_tables = outs, out_tables


class Outputs:
    """Where one call writes: objects, their pointers, what the call returns."""

    __slots__ = ("objs", "ptrs", "result", "ready")

    def __init__(self, objs, ptrs, result, ready=None):
        self.objs, self.ptrs, self.result, self.ready = objs, ptrs, result, ready
