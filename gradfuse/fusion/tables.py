"""A call's arrays as pointer tables: what the kernels and the plan cache read.

Two entry points, called once each per step on the caller's thread:

* ``read_inputs(grads, names, writable)`` shapes the arguments (a list, tuple or dict
  of arrays; names), reads every array's pointer, byte size, dtype and shape in one C
  loop (``_core.scan``, the buffer protocol), takes other arrays (DLPack, MXNet NDArrays,
  CUDA arrays) through ``gradfuse.fusion.intake`` first, and returns ``Inputs``;
* ``read_outputs(inputs, grads, out, entry)`` does the same for the outputs (the inputs
  themselves in place, ``out=``, or new arrays), checks that they match the inputs and
  overlap nothing they must not, and returns ``Outputs``.

Bad input raises ``TypeError``/``ValueError`` naming the tensor; the pipeline announces
it to the other ranks, so that they raise too instead of waiting.

A binding whose arrays get their memory later (MXNet allocates lazily and hands the
memory over in its engine) passes a ``gradfuse.fusion.deferred.Deferred`` instead: names,
signature and byte sizes now, the data pointers on the communication thread.

Out-of-place calls without ``out=`` reuse their output arrays from one call to the next
when the caller no longer holds them (``gradfuse.fusion.pool.OutputPool``, one per
cached plan): fresh 100 MB outputs would pay a page fault per 4 KiB page at their first
touch, every step.

GPU tensors (cupy arrays, ``__cuda_array_interface__``, CUDA DLPack) become cupy views on
their device (no copies, except non-contiguous inputs); all tensors of a call must be on
one device. ``Outputs.ready`` is then an event on the caller's stream that the
communication thread's stream waits for.
"""
import numpy as np

from .. import _core
from .. import dtypes as _dt
from . import intake
from .deferred import Deferred
from .plan import parse_signature


class Inputs:
    """The inputs of one call: objects, names, and the tables the plan is keyed by."""

    __slots__ = ("objs", "names", "sig", "ptrs", "nbytes", "device", "xp", "deferred")

    def __init__(self, objs, names, sig, ptrs, nbytes, device=None, xp=np, deferred=None):
        self.objs, self.names = objs, names
        self.sig, self.ptrs, self.nbytes = sig, ptrs, nbytes
        self.device = device        # None on the host, else the CUDA device id
        self.xp = xp                # numpy, or cupy for GPU tensors
        self.deferred = deferred    # a Deferred: pointers known only when the step runs


class Outputs:
    """Where one call writes: objects, their pointers, what the call returns."""

    __slots__ = ("objs", "ptrs", "result", "ready")

    def __init__(self, objs, ptrs, result, ready=None):
        self.objs, self.ptrs, self.result, self.ready = objs, ptrs, result, ready


# --- argument shaping --------------------------------------------------------------
_NAME_TYPES = {str, int}
#: name tuples ``flatten`` has checked, by id (held, so an id is never reused while here): a
#: binding that passes the same tuple every step (``gradfuse.mxnet``'s group names) skips
#: the two passes over its names (2000 names: ~0.15 ms a call)
_checked = {}
_CHECKED_MAX = 64


def flatten(grads, names):
    """Return (objects, names) for a list/tuple or dict of arrays."""
    if isinstance(grads, dict):
        if names is not None:
            raise TypeError("names= cannot be combined with a dict of gradients (the keys are the names)")
        keys = list(grads)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"gradient dict keys must be str names, got {k!r} ({type(k).__name__})")
        return list(grads.values()), keys
    if isinstance(grads, (list, tuple)):
        objs = list(grads)
        if names is None:
            return objs, list(range(len(objs)))
        given = names
        names = list(names)
        if len(names) != len(objs):
            raise ValueError(f"got {len(names)} names for {len(objs)} tensors")
        if _checked.get(id(given)) is given:      # a tuple checked before (it cannot have changed)
            return objs, names
        if not set(map(type, names)) <= _NAME_TYPES:      # one C pass; the loop names the culprit
            for n in names:
                if not isinstance(n, (str, int)) or isinstance(n, bool):
                    raise TypeError(f"tensor names must be str (or int positions), got {n!r}")
        if len(set(names)) != len(names):
            seen, dups = set(), []
            for n in names:
                if n in seen and n not in dups:
                    dups.append(n)
                seen.add(n)
            raise ValueError(f"duplicate tensor names: {', '.join(repr(d) for d in dups)}")
        if type(given) is tuple:
            if len(_checked) >= _CHECKED_MAX:
                _checked.clear()
            _checked[id(given)] = given
        return objs, names
    raise TypeError(f"gradients must be a list, tuple or dict of arrays, got {type(grads).__name__}; "
                    f"wrap a single array in a list")


def rebuild(template, values):
    """``values`` in the structure of ``template`` (dict, tuple or list)."""
    if isinstance(template, dict):
        return dict(zip(template.keys(), values))
    if isinstance(template, tuple):
        return tuple(values)
    return list(values)


def _out_objects(out, names):
    """The objects of ``out=``, which must have the gradients' structure and names."""
    out_objs, out_names = flatten(out, None if isinstance(out, dict) else names)
    if out_names != names:
        raise ValueError(f"out= must have the same structure and names as the gradients; "
                         f"got {out_names[:3]}... for {names[:3]}...")
    return out_objs


# --- host tables ---------------------------------------------------------------------
def scan(objs):
    """(signature bytes, pointers, byte sizes, flags) of buffer-protocol objects, one C loop."""
    n = len(objs)
    ptrs = np.empty(n, dtype=np.int64)
    nbytes = np.empty(n, dtype=np.int64)
    flags = np.empty(n, dtype=np.int64)
    sig = _core.scan(objs, ptrs, nbytes, flags)
    return sig, ptrs, nbytes, flags


def _problems(writable):
    """The scan flags that need the slow path (read-only matters only for outputs)."""
    mask = _core.FLAG_NOBUFFER | _core.FLAG_BADDTYPE | _core.FLAG_NONCONTIG
    return mask | _core.FLAG_READONLY if writable else mask


def as_ndarray(obj):
    """A numpy view of a buffer exporter (no copy)."""
    return obj if isinstance(obj, np.ndarray) else np.asarray(memoryview(obj))


def _dtype_of(obj):
    try:
        return np.asarray(memoryview(obj)).dtype
    except (TypeError, ValueError):
        return getattr(obj, "dtype", type(obj).__name__)


def _intake_slow(objs, names, flags, writable, role):
    """Slow path for host inputs the C scan could not take as they are."""
    objs = list(objs)
    for i in np.flatnonzero(flags & _problems(writable)).tolist():
        f, name = int(flags[i]), names[i]
        if f & _core.FLAG_NOBUFFER:
            arr = intake.as_array(objs[i], name)
            if isinstance(arr, intake.DeviceArray):
                if role == "output":
                    raise TypeError(f"output {name!r} is on a GPU but the gradients are in host memory")
                raise TypeError(f"tensor {name!r} is on a GPU but tensor {names[0]!r} is in host "
                                f"memory; all tensors of one call must be on the same device")
            objs[i] = arr
            continue
        if f & _core.FLAG_BADDTYPE:
            raise TypeError(f"tensor {name!r}: dtype {_dtype_of(objs[i])} is not supported "
                            f"(supported: {_dt.SUPPORTED})")
        if writable and f & _core.FLAG_READONLY:
            raise ValueError(f"tensor {name!r} is read-only; the results cannot be written into it")
        if f & _core.FLAG_NONCONTIG:
            if writable:
                raise ValueError(f"tensor {name!r} is not C-contiguous; outputs and in-place inputs "
                                 f"must be (use allreduce() without out=, which copies inputs)")
            objs[i] = np.ascontiguousarray(np.asarray(memoryview(objs[i])))
    return objs


def _host_tables(objs, names, writable, role="tensor"):
    sig, ptrs, nbytes, flags = scan(objs)
    mask = _problems(writable)
    for _ in range(2):
        if not (flags & mask).any():
            break
        objs = _intake_slow(objs, names, flags, writable, role)
        sig, ptrs, nbytes, flags = scan(objs)
    if (flags & mask).any():
        i = int(np.flatnonzero(flags & mask)[0])
        raise TypeError(f"tensor {names[i]!r}: cannot read {type(objs[i]).__name__} as an array")
    return objs, sig, ptrs, nbytes


# --- device tables -------------------------------------------------------------------
def _dlpack_device(obj):
    """``obj.__dlpack_device__()`` as (type, id) ints; None without one or if it fails."""
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None:
        return None
    try:
        d = dev()
        return int(d[0]), int(d[1])
    except Exception:
        return None


def _producer_device(obj):
    """The DLPack device of a producer (``__dlpack__`` and ``__dlpack_device__``), else None."""
    return _dlpack_device(obj) if hasattr(obj, "__dlpack__") else None


def on_device(obj):
    """True for GPU arrays (cupy, ``__cuda_array_interface__``, CUDA DLPack, DeviceArray)."""
    if type(obj) is np.ndarray:
        return False
    if isinstance(obj, intake.DeviceArray):
        return True
    dev = _producer_device(obj)
    if dev is not None:              # a DLPack producer says where it is
        return intake.is_gpu_device(dev)
    cai, cai_error = intake.cuda_interface(obj)
    if cai is not None:
        return True
    if getattr(getattr(obj, "context", None), "device_type", None) == "gpu":
        return True         # an MXNet NDArray on a GPU (read through its DLPack capsule)
    if intake.is_capsule(obj):
        return intake.is_gpu_device(intake.capsule_device(obj))
    # a CUDA array interface whose property raises (PyTorch: a tensor that requires grad)
    # still says the tensor is on a GPU; the GPU intake falls back on DLPack or names it
    return cai_error is not None


def _cupy_for(name):
    """cupy, or a TypeError naming the tensor when the GPU path cannot run here."""
    from .. import gpu
    try:
        cp = gpu.cupy()
    except ImportError as e:
        raise TypeError(f"tensor {name!r} is a CUDA array, and the GPU path needs cupy, which "
                        f"cannot be imported ({e}); install gradfuse[cuda12] or gradfuse[cuda13]") from None
    if not _gpu_seen[0]:
        if not gpu.available():
            raise TypeError(f"tensor {name!r} is a CUDA array, but cupy sees no CUDA device here")
        _gpu_seen[0] = True
    return cp


_gpu_seen = [False]     # a CUDA device was seen once: no device query per step after that


def _device_array(obj, name, first, cp):
    """A cupy view of one GPU tensor (no copy) and whether it is read-only."""
    from ..comm.device import as_device
    if isinstance(obj, cp.ndarray):
        return obj, False       # cupy's own arrays: no protocol, ordered by the caller's stream
    readonly = False
    cai = cai_error = dl_dev = None
    use_dlpack = False
    if not isinstance(obj, intake.DeviceArray):
        # DLPack first: __dlpack__(stream=...) makes the producer order its own work
        # (a side stream's too) before ours; __cuda_array_interface__ may carry no
        # stream (PyTorch's is version 2) or raise (PyTorch: requires_grad)
        dl_dev = _producer_device(obj)
        use_dlpack = intake.is_gpu_device(dl_dev)
        if not use_dlpack:
            cai, cai_error = intake.cuda_interface(obj)
            if cai_error is not None:
                if not hasattr(obj, "__dlpack__"):
                    raise intake.cuda_interface_error(obj, name, cai_error)
                use_dlpack = True
    if cai is not None:
        return cp.asarray(obj), bool(cai["data"][1])
    got = obj
    if use_dlpack:
        # the producer makes the current stream of the tensor's device wait for its work
        # (DLPack: 1 is the legacy default stream); the ready event is recorded on that
        # same stream
        with cp.cuda.Device(dl_dev[1] if dl_dev is not None else cp.cuda.runtime.getDevice()):
            stream = cp.cuda.get_current_stream().ptr or 1
        capsule = intake.dlpack_capsule(obj, stream=stream)
        got = intake.from_dlpack_capsule(capsule, name, source=obj)
    elif not isinstance(obj, intake.DeviceArray):
        got = intake.as_array(obj, name)
    if not isinstance(got, intake.DeviceArray):
        raise TypeError(f"tensor {name!r} is in host memory but tensor {first!r} is on "
                        f"a GPU; all tensors of one call must be on the same device")
    readonly = got.readonly
    return as_device(got), readonly


def _device_arrays(objs, names, writable, cp):
    """cupy views of GPU tensors (no copies, except non-contiguous inputs) and their device.

    Raises TypeError/ValueError naming the tensor: host memory mixed in, tensors on
    different devices, unsupported dtypes, read-only or non-contiguous outputs.
    """
    arrays, device, first_device = [], None, None
    for obj, name in zip(objs, names):
        arr, readonly = _device_array(obj, name, names[0], cp)
        if writable and readonly:
            raise ValueError(f"tensor {name!r} is read-only; the results cannot be written into it")
        if arr.dtype not in _dt.CODE:
            raise TypeError(f"tensor {name!r}: dtype {arr.dtype} is not supported (supported: {_dt.SUPPORTED})")
        if first_device is None:
            first_device = arr.device.id
        if arr.size and device is None:
            device = arr.device.id
        elif arr.size and arr.device.id != device:
            raise ValueError(f"tensor {name!r} is on GPU {arr.device.id} but the tensors before it are on "
                             f"GPU {device}; all tensors of one call must be on the same device")
        if not arr.flags.c_contiguous:
            if writable:
                raise ValueError(f"tensor {name!r} is not C-contiguous; outputs and in-place inputs "
                                 f"must be (use allreduce() without out=, which copies inputs)")
            with arr.device:     # on the tensor's own device (and its current stream)
                arr = cp.ascontiguousarray(arr)
        arrays.append(arr)
    if device is None:      # only empty tensors: the device they were made on
        device = first_device if first_device is not None else cp.cuda.runtime.getDevice()
    return arrays, device


def _device_tables(arrays):
    """(signature bytes as ``_core.scan`` makes them, pointers, byte sizes) of cupy arrays."""
    words, ptrs, nbytes = [], [], []
    for a in arrays:
        words += [_dt.CODE[a.dtype], a.ndim, *a.shape]
        ptrs.append(a.data.ptr if a.size else 0)
        nbytes.append(a.size * a.itemsize)
    return (np.asarray(words, np.int64).tobytes(), np.asarray(ptrs, np.int64),
            np.asarray(nbytes, np.int64))


# --- output checks -------------------------------------------------------------------
def _check_out_signature(sig, out_sig, names):
    """Name the first output whose dtype or shape differs from its input."""
    if out_sig == sig:
        return
    for i, ((c1, s1), (c2, s2)) in enumerate(zip(parse_signature(sig), parse_signature(out_sig))):
        if (c1, s1) != (c2, s2):
            raise ValueError(f"tensor {names[i]!r}: output has dtype {_dt.name(c2)} shape "
                             f"{s2}, input has dtype {_dt.name(c1)} shape {s1}")


def _first_overlap(starts, ends, names, labels):
    """Slow path: name the first two intervals that overlap (for the error message)."""
    idx = sorted(range(len(starts)), key=lambda i: starts[i])
    active = []
    for i in idx:
        for j in active:
            if ends[j] > starts[i]:
                return names[j], labels[j], names[i], labels[i]
        active = [j for j in active if ends[j] > starts[i]] + [i]
    return None


def check_overlaps(in_ptrs, in_nb, out_ptrs, out_nb, names):
    """Raise ValueError if outputs overlap each other or another tensor's input.

    An output that *is* its own input (same address, same size) is the in-place
    case and allowed. Vectorised: O(n log n) in numpy, run only when pointers change.
    """
    same = (in_ptrs == out_ptrs) & (in_nb == out_nb)
    w = out_nb > 0
    ws, we = out_ptrs[w], out_ptrs[w] + out_nb[w]
    order = np.argsort(ws, kind="stable")
    bad = bool(ws.size > 1 and np.any(we[order][:-1] > ws[order][1:]))
    r = (~same) & (in_nb > 0)
    if not bad and r.any():
        rs, re = in_ptrs[r], in_ptrs[r] + in_nb[r]
        ro = np.argsort(rs, kind="stable")
        rs, pmax = rs[ro], np.maximum.accumulate(re[ro])
        k = np.searchsorted(rs, we, side="left")
        hit = (k > 0) & (pmax[np.maximum(k - 1, 0)] > ws)
        bad = bool(hit.any())
    if not bad:
        return
    starts = list(out_ptrs) + [p for p, keep in zip(in_ptrs, ~same) if keep]
    ends = list(out_ptrs + out_nb) + [p + s for p, s, keep in zip(in_ptrs, in_nb, ~same) if keep]
    tnames = list(names) + [n for n, keep in zip(names, ~same) if keep]
    labels = ["output"] * len(names) + ["input"] * int((~same).sum())
    found = _first_overlap(starts, ends, tnames, labels)
    if found is None:
        raise ValueError("outputs overlap inputs or each other")
    a, la, b, lb = found
    raise ValueError(f"tensor {a!r} {la} overlaps tensor {b!r} {lb}: outputs may be their own "
                     f"input exactly (in place) but must not partly overlap any input or output")


# --- the two entry points ----------------------------------------------------------
def read_inputs(grads, names, writable):
    """The ``Inputs`` of a call; ``writable`` for the in-place form (inputs are outputs)."""
    if isinstance(grads, Deferred):
        if names is not None:
            raise TypeError("names= cannot be combined with a Deferred (it carries its names)")
        objs, names = flatten([None] * len(grads.names), grads.names)
        if type(grads.names) is tuple:
            names = grads.names     # checked; the plan key is then this very tuple (no copy)
        return Inputs(objs, names, grads.sig, grads.ptrs, grads.nbytes, deferred=grads)
    objs, names = flatten(grads, names)
    if objs and on_device(objs[0]):
        cp = _cupy_for(names[0])
        arrays, device = _device_arrays(objs, names, writable, cp)
        sig, ptrs, nbytes = _device_tables(arrays)
        return Inputs(arrays, names, sig, ptrs, nbytes, device, cp)
    objs, sig, ptrs, nbytes = _host_tables(objs, names, writable)
    return Inputs(objs, names, sig, ptrs, nbytes)


def read_outputs(inputs, grads, out, entry):
    """The ``Outputs`` of a call: the inputs (``out is grads``), ``out=``, or new arrays.

    ``entry`` is the cached plan (its ``codes``/``shapes`` shape new outputs, and its
    ``verified`` pair of pointer tables skips the overlap check while they repeat).
    """
    names, in_ptrs = inputs.names, inputs.ptrs
    d = inputs.deferred
    if d is not None:       # the binding's own outputs (or the inputs): nothing to check
        if out is not None and out is not grads:
            raise TypeError("out= cannot be combined with a Deferred (it carries its outputs)")
        if (out is grads) != (d.out_ptrs is None):
            raise ValueError("a Deferred with out_ptrs is reduced out of place (out=None), "
                             "one without in place (out=itself)")
        return Outputs(inputs.objs, in_ptrs if d.out_ptrs is None else d.out_ptrs, d.result)
    if inputs.device is None:
        objs, ptrs = _host_outputs(inputs, grads, out, entry)
        ready = None
    else:
        cp = inputs.xp
        with cp.cuda.Device(inputs.device):
            objs, ptrs = _device_outputs(inputs, grads, out, entry)
            # the communication thread's stream waits for the work queued so far on the
            # caller's stream (the producer of the gradients)
            ready = cp.cuda.Event(disable_timing=True)
            ready.record(cp.cuda.get_current_stream())
    if out is not None and (entry.verified is None or not np.array_equal(entry.verified[0], in_ptrs)
                            or not np.array_equal(entry.verified[1], ptrs)):
        check_overlaps(in_ptrs, inputs.nbytes, ptrs, inputs.nbytes, names)
        entry.verified = (in_ptrs, ptrs)
    result = grads if out is grads else (out if out is not None else rebuild(grads, objs))
    return Outputs(objs, ptrs, result, ready)


def _host_outputs(inputs, grads, out, entry):
    if out is grads:
        return inputs.objs, inputs.ptrs
    if out is not None:
        objs, out_sig, ptrs, _ = _host_tables(_out_objects(out, inputs.names), inputs.names,
                                              writable=True, role="output")
        _check_out_signature(inputs.sig, out_sig, inputs.names)
        return objs, ptrs
    return entry.outputs.take(entry)


def _device_outputs(inputs, grads, out, entry):
    cp, dev, names = inputs.xp, inputs.device, inputs.names
    if out is grads:
        return inputs.objs, inputs.ptrs
    if out is not None:
        out_objs = _out_objects(out, names)
        if out_objs and not all(on_device(o) for o in out_objs):
            bad = next(n for o, n in zip(out_objs, names) if not on_device(o))
            raise TypeError(f"output {bad!r} is in host memory but the gradients are on GPU {dev}")
        arrays, out_dev = _device_arrays(out_objs, names, True, cp)
        out_sig, ptrs, _ = _device_tables(arrays)
        if out_dev != dev and any(a.size for a in arrays):
            raise ValueError(f"outputs are on GPU {out_dev} but the gradients are on GPU {dev}")
        _check_out_signature(inputs.sig, out_sig, names)
        return arrays, ptrs
    arrays = [cp.empty(s, dtype=_dt.DTYPE[c]) for c, s in zip(entry.codes, entry.shapes)]
    return arrays, _device_tables(arrays)[1]
