"""NDArrays in and out of gradfuse: zero-copy views of MXNet's memory (``_view``) and
new NDArrays holding results (``_to_nd``)."""
import ctypes

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, MXNetError, check_call

from .. import collectives as _coll
from ..fusion import intake as _intake


def _view(tensor, name, device_ok=False):
    """Zero-copy writable numpy view of a CPU NDArray (waits for MXNet's pending work),
    or an ``InvalidInput`` that makes every rank raise the error.

    ``device_ok``: a GPU NDArray becomes a ``gradfuse.fusion.intake.DeviceArray`` through
    its writable DLPack capsule, for ``gradfuse.Pipeline`` (DistributedTrainer, the
    KVStore); see docs/gpu.md, "MXNet on the GPU".
    """
    try:
        if not isinstance(tensor, mx.nd.NDArray):
            raise TypeError(f"tensor {name!r}: expected an mxnet NDArray, got {type(tensor).__name__}")
        if tensor.stype != "default":
            raise TypeError(f"tensor {name!r}: {tensor.stype} NDArrays are not supported; "
                            f"use dense arrays (tostype('default'))")
        if tensor.context.device_type == "gpu" and device_ok:
            # WaitToWrite: MXNet's engine has finished every pending write to the array
            # (its GPU kernels included) before gradfuse's stream reads it
            check_call(_LIB.MXNDArrayWaitToWrite(tensor.handle))
            return _intake.as_array(tensor, name)
        if tensor.context.device_type not in ("cpu", "cpu_pinned", "cpu_shared"):
            raise TypeError(f"tensor {name!r} is on {tensor.context}; the Horovod-style collectives of "
                            f"this binding take CPU arrays only (GPU arrays: DistributedTrainer or the "
                            f"dist_gradfuse KVStore, see docs/gpu.md)")
        if tensor.dtype == np.bool_:
            raise TypeError(f"tensor {name!r}: dtype bool is not supported")
        # MXNDArrayGetData turns oneDNN-layout data (conv weights and their gradients
        # after a hybridized forward) back into the default row-major layout, in place;
        # the DLPack export refuses oneDNN data.
        # Wait first: GetData on an array whose first write is still queued races with
        # the engine's lazy allocation of its memory (seen: the view and the copy landed
        # in different buffers).
        check_call(_LIB.MXNDArrayWaitToWrite(tensor.handle))
        ptr = ctypes.c_void_p()
        check_call(_LIB.MXNDArrayGetData(tensor.handle, ctypes.byref(ptr)))
        view = _intake.as_array(tensor, name)
        if view.size and view.ctypes.data != ptr.value:
            raise ValueError(f"tensor {name!r}: MXNet moved the array while it was being read")
        return view
    except (TypeError, ValueError, MXNetError) as exc:
        if isinstance(exc, MXNetError):
            exc = TypeError(f"tensor {name!r}: MXNet cannot export it: {str(exc).strip().splitlines()[-1]}")
        return _coll.InvalidInput(exc)


def _to_nd(arr, like):
    """A new NDArray holding ``arr`` (one copy, written through a view)."""
    out = mx.nd.empty(arr.shape, ctx=like.context, dtype=arr.dtype)
    if arr.size:
        np.copyto(_intake.as_array(out), arr)
    return out
