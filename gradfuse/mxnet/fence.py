"""A fence in MXNet's engine around a collective in flight (``_fence``).

An asynchronous engine operation (``MXEnginePushAsyncND``, through ctypes) that mutates
the collective's output NDArrays and completes only when gradfuse's communication
thread has finished the collective, so MXNet operations issued afterwards that use the
arrays wait for the result, as they would for Horovod's engine ops.
"""
import ctypes
import os
import threading

import mxnet as mx
from mxnet.base import _LIB, check_call


class _DevCtx(ctypes.Structure):
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int)]


class _OnComplete(ctypes.Structure):
    """mxnet::engine::CallbackOnComplete: a function, the engine, a parameter."""
    _fields_ = [("fn", ctypes.c_void_p), ("engine", ctypes.c_void_p), ("param", ctypes.c_void_p)]


_ENGINE_ASYNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_ENGINE_DONE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_fences = {}
_fence_lock = threading.Lock()
_fence_ids = iter(range(1, 1 << 62))


def _fence_started(rctx, on_complete, param):
    """MXNet calls this (on an engine thread) once the fenced arrays are free; the
    op stays in flight until gradfuse's collective has finished."""
    cb = _OnComplete.from_address(on_complete)
    saved = (cb.fn, cb.engine, cb.param)
    with _fence_lock:
        state = _fences[param]
        state["cb"] = saved
        finished = state["finished"]
        if finished:
            del _fences[param]
    if not finished and state["naive"]:
        state["event"].wait()       # NaiveEngine needs the op complete before it returns
        with _fence_lock:
            _fences.pop(param, None)
        finished = True
    if finished:
        _ENGINE_DONE(saved[0])(saved[1], saved[2], None)


_FENCE_STARTED = _ENGINE_ASYNC(_fence_started)


def _fence(ctx, nds, name, on_done=None):
    """Tell MXNet's engine that ``nds`` are being written by the collective just submitted
    to ``ctx``'s communication thread: MXNet operations issued afterwards that use them
    wait until it has finished (as Horovod's engine ops do). ``on_done(fn)`` registers
    the completion when it is not simply the next job of the communication thread."""
    key = next(_fence_ids)
    naive = os.environ.get("MXNET_ENGINE_TYPE", "") == "NaiveEngine"
    state = {"cb": None, "finished": False, "naive": naive, "event": threading.Event()}
    with _fence_lock:
        _fences[key] = state

    def finished():                 # on the communication thread, after the collective
        with _fence_lock:
            state["finished"] = True
            cb = state["cb"]
            if cb is not None:
                _fences.pop(key, None)
        state["event"].set()
        if cb is not None and not naive:
            _ENGINE_DONE(cb[0])(cb[1], cb[2], None)

    if on_done is None:
        ctx.engine.submit(finished, f"{name}.fence")     # FIFO: runs after the collective
    else:
        on_done(finished)
    c = nds[0].context
    dev = _DevCtx(c.device_typeid, c.device_id)
    check_call(_LIB.MXEnginePushAsyncND(
        _FENCE_STARTED, ctypes.c_void_p(key), None, ctypes.byref(dev), None, 0,
        mx.base.c_handle_array(nds), len(nds), None, 0, ctypes.c_char_p(b"gradfuse"),
        ctypes.c_bool(False)))
