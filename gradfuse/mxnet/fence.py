"""The MXNet side of the engine hand-off: the C level configured from ctypes, the NDArray
pass of a call, and the pushes into MXNet's engine.

``gradfuse.mxnet._engine`` (C++) holds the code; this module gives it the addresses of
MXNet's C functions (``MXNDArrayGetData``, ``MXEnginePushAsyncND``, ...; on oneDNN builds
also the two ``NDArray::Chunk`` methods that convert a oneDNN layout in place), and
wraps it:

* ``scan(nds)``: one C loop over a call's NDArrays (handles, dtypes, shapes, devices);
* ``new_op(tables, n_read)`` and ``push(op, name)``: one engine operation that reads the first
  ``n_read`` arrays and writes the others, pushed at once; its start callback (C, no
  GIL) reads the data pointers when MXNet has finished every earlier write (and read,
  for written arrays) and marks it ready; ``gradfuse.mxnet.handoff`` waits for that on
  the communication thread, runs the collective and completes it;
* ``reorder_inputs``: on oneDNN builds, the arrays an out-of-place collective only reads
  are first converted to row-major by a short engine operation of their own (a oneDNN
  layout can only be undone with write access).
"""
import collections
import ctypes
import os
import sys

import mxnet as mx
import numpy as np
from mxnet.base import _LIB

from .. import config
from ..fusion.deferred import view_at
from . import _engine, basics

_CPU_PRIORITIZED = 3           # mxnet::FnProperty::kCPUPrioritized, Horovod's choice
# MXNet's dtype codes (mshadow) and the numpy dtypes they are
_MX_DTYPES = {0: np.float32, 1: np.float64, 2: np.float16, 3: np.uint8, 4: np.int32, 5: np.int8,
              6: np.int64, 7: np.bool_, 8: np.int16, 9: np.uint16, 10: np.uint32, 11: np.uint64}
MX_DTYPE = {k: np.dtype(v) for k, v in _MX_DTYPES.items()}
BAD_DEVICE, BAD_STORAGE, BAD_SHAPE, NOT_REDUCIBLE = (_engine.BAD_DEVICE, _engine.BAD_STORAGE,
                                                     _engine.BAD_SHAPE, _engine.NOT_REDUCIBLE)


def _address(name):
    try:
        return ctypes.cast(getattr(_LIB, name), ctypes.c_void_p).value or 0
    except AttributeError:
        return 0


def _onednn():
    try:
        return mx.runtime.Features().is_enabled("MKLDNN")
    except Exception:        # an unknown build: assume oneDNN
        return True


ONEDNN = _onednn()
_is_onednn = _address("_ZNK5mxnet7NDArray5Chunk8IsMKLDNNEv") if ONEDNN else 0
_reorder = _address("_ZN5mxnet7NDArray5Chunk15Reorder2DefaultEv") if ONEDNN else 0
# Pointers may be read in the engine's start callback: always without oneDNN; with it, only
# when the callback can undo a oneDNN layout itself (else the call waits, as before)
DEFERRED = not ONEDNN or bool(_is_onednn and _reorder)
_engine.configure(_address("MXNDArrayGetData"), _address("MXNDArrayGetDType"),
                  _address("MXNDArrayGetStorageType"), _address("MXNDArrayGetContext"),
                  _address("MXNDArrayGetShapeEx"), _address("MXGetLastError"),
                  _address("MXEnginePushAsyncND"), _is_onednn, _reorder)


def _layout_holds():
    """Whether, on this MXNet, an NDArray's data pointer is its storage's address (the first
    word of the ``NDArray::Chunk`` its first member points to) plus a fixed offset: checked
    on a fresh array (offset 0) and on a view into its second row (offset 20 bytes) against
    ``MXNDArrayGetData``. The engine callback then reads a known array's pointer that way
    (``_engine.set_direct``), ~140 ns an array less than MXNet's call."""
    try:
        a = mx.nd.zeros((3, 5), dtype="float32")
        b = a[1:]
        a.wait_to_read()
        for nd, off in ((a, 0), (b, 20)):
            p = ctypes.c_void_p()
            if _LIB.MXNDArrayGetData(nd.handle, ctypes.byref(p)) != 0 or not p.value:
                return False
            chunk = ctypes.c_void_p.from_address(nd.handle.value).value
            if not chunk or ctypes.c_void_p.from_address(chunk).value + off != p.value:
                return False
        return True
    except Exception:      # an MXNet whose arrays look otherwise: MXNet's call for every array
        return False


_engine.set_direct(DEFERRED and config.mxnet_direct() and _layout_holds())


def naive():
    """True under MXNET_ENGINE_TYPE=NaiveEngine, which runs every push to completion."""
    return os.environ.get("MXNET_ENGINE_TYPE", "") == "NaiveEngine"


class Tables:
    """The scan of one call's NDArrays: ``nds`` (inputs, or the in-place arrays) then
    ``outs`` (outputs the binding made), and the data pointers the engine callback fills
    (``ptrs``, in the same order)."""

    __slots__ = ("nds", "outs", "n", "handles", "nbytes", "mxtypes", "flags", "ptrs", "sig", "out_sig", "_parsed",
                 "memo")

    def __init__(self, nds, outs=()):
        n, m = len(nds), len(outs)
        self.nds, self.outs, self.n = nds, outs, n
        self.ptrs = np.zeros(n + m, np.int64)
        known = _scans.get(nds) if not m else None
        if known is not None:          # the same NDArrays as a recent call: their scan holds
            self.handles, self.nbytes, self.mxtypes, self.flags, self.sig, self.memo = known
            self._parsed = None
            self.out_sig = b""
            return
        self.handles = np.empty(n + m, np.int64)
        self.nbytes = np.empty(n + m, np.int64)
        self.mxtypes = np.empty(n + m, np.int64)
        self.flags = np.empty(n + m, np.int64)
        self.sig = _engine.scan(nds, self.handles, self.nbytes, self.mxtypes, self.flags)
        self.out_sig = _engine.scan(outs, self.handles[n:], self.nbytes[n:], self.mxtypes[n:],
                                    self.flags[n:]) if m else b""
        self._parsed = None
        self.memo = None
        if not m:
            self.memo = np.zeros(2 * n, np.int64)      # the engine callback's (storage, offset) per array
            _scans.put(nds, (self.handles, self.nbytes, self.mxtypes, self.flags, self.sig, self.memo))

    def shape(self, i):
        if self._parsed is None:
            self._parsed = _parse(self.sig) + _parse(self.out_sig)
        return self._parsed[i]

    def dtype(self, i):
        return MX_DTYPE.get(int(self.mxtypes[i]))

    def views(self, lo, hi):
        """numpy views of arrays ``lo..hi-1`` (valid once the engine has started the operation)."""
        return [view_at(int(self.ptrs[i]), self.shape(i), self.dtype(i)) for i in range(lo, hi)]


class _ScanCache:
    """The scans of the last calls' input lists, reused when a call passes the very same
    NDArray objects again (a training loop's gradients, every step): an NDArray's handle,
    dtype, storage type, device and (known) shape never change, so the scan of an
    identical list is the same. Identity, not equality: the cache holds the lists (so an
    object it compares against is never a new one at a recycled address), at most
    ``MAX`` of them, and lets go of a list nobody else holds any more at the next miss.
    Lists with an array of unknown shape are never kept (MXNet fixes such a shape later).
    The tables it hands out are shared: nobody writes them after the scan, except ``memo``,
    which engine start callbacks fill (each array's storage and offset, for direct pointers)."""

    MAX = 64

    def __init__(self):
        self._d = collections.OrderedDict()        # (n, id(first)) -> (tuple(nds), tables)

    def get(self, nds):
        if not nds:
            return None
        key = (len(nds), id(nds[0]))
        hit = self._d.get(key)
        if hit is None or not _engine.same_objects(nds, hit[0]):
            return None
        self._d.move_to_end(key)
        return hit[1]

    def put(self, nds, tables):
        if not nds or (tables[3] & BAD_SHAPE).any():
            return
        for key in [k for k, (held, _) in self._d.items() if sys.getrefcount(held[0]) == 2]:
            del self._d[key]          # only this cache holds its first array
        self._d[(len(nds), id(nds[0]))] = (tuple(nds), tables)
        while len(self._d) > self.MAX:
            self._d.popitem(last=False)

    def clear(self):
        self._d.clear()


_scans = _ScanCache()
basics.on_shutdown.append(_scans.clear)       # shutdown() lets go of the arrays it holds


def _parse(sig):
    words = np.frombuffer(sig, dtype=np.int64).tolist()
    out, k = [], 0
    while k < len(words):
        nd = words[k + 1]
        out.append(tuple(words[k + 2:k + 2 + nd]))
        k += 2 + nd
    return out


def new_op(tables, n_read):
    """The engine operation over ``tables.handles`` (the first ``n_read`` read, the rest
    written), not pushed yet. It keeps every NDArray of the call alive until it completes:
    MXNet's engine holds only their variables, and the start callback reads the arrays."""
    return _engine.Op(tables.handles, n_read, tables.ptrs, (tables.nds, tables.outs), naive(), False, tables.memo)


def push(op, name):
    """Push ``op`` into MXNet's engine; returns at once, but under NaiveEngine only after
    the operation has completed, so its collective must be queued before."""
    op.push(name.encode("utf-8", "replace")[:200] or b"gradfuse", _CPU_PRIORITIZED)


_reorders = []       # layout operations whose arrays are kept alive until they ran


def reorder_inputs(tables, n):
    """On oneDNN builds, an operation that converts the first ``n`` arrays (read-only in
    the collective that follows) to row-major first, with write access."""
    if not ONEDNN or n == 0:
        return
    _reorders[:] = [op for op in _reorders if not op.done]
    op = _engine.Op(tables.handles[:n].copy(), 0, np.zeros(n, np.int64), list(tables.nds[:n]), naive(), True)
    op.push(b"gradfuse.reorder", _CPU_PRIORITIZED)
    _reorders.append(op)


def wait_at_call(nds):
    """Where pointers cannot be read in the engine callback (see ``DEFERRED``): wait for
    MXNet's pending work on every array and read its pointer now (which undoes a oneDNN
    layout), as the binding did before the hand-off."""
    p = ctypes.c_void_p()
    for nd in nds:
        mx.base.check_call(_LIB.MXNDArrayWaitToWrite(nd.handle))
        mx.base.check_call(_LIB.MXNDArrayGetData(nd.handle, ctypes.byref(p)))
