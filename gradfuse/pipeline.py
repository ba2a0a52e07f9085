"""``gradfuse.Pipeline``: fuse, agree, reduce, write back.

One step of ``allreduce``:

1. intake (caller's thread): one C loop reads every array's pointer, size, dtype
   and shape through the buffer protocol; other arrays (DLPack, MXNet) go through
   ``gradfuse.intake`` first. Bad input raises ``TypeError``/``ValueError`` naming
   the tensor; the error is still announced to the other ranks, so they raise too
   instead of waiting.
2. plan (cached): the bucket layout, tables and fusion buffers are reused while
   names, shapes and dtypes stay the same.
3. on the communication thread: the ranks agree on the request (one tiny exchange
   when nothing changed), then each bucket is packed (one kernel call), summed by
   the MPI library's own allreduce, and unpacked (one kernel call, dividing by the
   world size on the way out when averaging). Large tensors are summed in place.

Averaging order: sum first, then divide by the number of ranks, in the dtype's
own arithmetic (float16 in float32, rounded once). The divide cannot overflow
where the sum fits.

Non-contiguous inputs are copied to contiguous ones before packing; outputs (and the
in-place variant's inputs) must be C-contiguous and writable, else ``ValueError``.

GPU tensors (cupy arrays, anything with ``__cuda_array_interface__`` or CUDA DLPack)
take the same path on their device (docs/gpu.md): fusion buffers, residuals and
payloads in device memory, the kernels of ``cuda/*.cu``, and a GPU communicator (NCCL,
or MPI through pinned host buffers where NCCL cannot run). The results are the CPU
path's bits. All tensors of one call must be on the same device, on every rank.
"""
import threading
from collections import OrderedDict

import numpy as np

from . import _core, config
from .fusion import intake
from .runtime import context as runtime
from . import compressors as _compressors
from . import dtypes as _dt
from .fusion.backend import HOST, CudaBackend
from .compressors.base import BucketContext
from .runtime.control import Request
from .errors import NonFiniteError
from .fusion.plan import FusionPlan, parse_signature
from .compressors.exchange import JOBS, ring_bytes, twophase_chunk
from .compressors.state import CompressionState

_F32 = _dt.CODE[np.dtype(np.float32)]
_PLAN_CACHE = 8


class Stats:
    """Counters of one pipeline (read them as attributes or with ``as_dict()``).

    ``bytes_reduced`` counts the gradient bytes a step reduced (uncompressed size), so a
    collective that was stopped by the control plane or the non-finite policy adds 0.
    ``bytes_sent`` estimates the bytes this rank put on the wire: a compressed bucket's
    payloads as its collective sends them, an uncompressed allreduce (``none``, warm-up
    steps, non-float32 buckets) as a bandwidth-optimal one's 2(p-1)/p x its size (the MPI
    library or NCCL picks the real algorithm).
    ``cast_overflow``/``cast_underflow`` count fp16/bf16 values that became inf / zero.
    """

    FIELDS = ("steps", "tensors", "buckets", "bytes_reduced", "bytes_sent", "plans_built", "failed_steps",
              "nonfinite_steps", "cast_overflow", "cast_underflow")

    def __init__(self):
        for f in self.FIELDS:
            setattr(self, f, 0)

    def as_dict(self):
        return {f: getattr(self, f) for f in self.FIELDS}

    def __repr__(self):
        return f"Stats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


class _Entry:
    """A cached plan and everything derived from the same signature."""

    __slots__ = ("plan", "request", "names", "shapes", "codes", "verified", "bk", "state_key")

    def __init__(self, plan, request, names, shapes, codes, bk=HOST, state_key=None):
        self.plan, self.request, self.names = plan, request, names
        self.shapes, self.codes = shapes, codes
        self.verified = None     # output pointer table last checked for overlaps
        self.bk = bk             # where the step runs: HOST or a CudaBackend
        # residuals are keyed without the device, so they follow a bucket between host and GPU
        self.state_key = state_key or request.digest.hex()


def _flatten(grads, names):
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
        names = list(names)
        if len(names) != len(objs):
            raise ValueError(f"got {len(names)} names for {len(objs)} tensors")
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
        return objs, names
    raise TypeError(f"gradients must be a list, tuple or dict of arrays, got {type(grads).__name__}; "
                    f"wrap a single array in a list")


def _rebuild(template, values):
    if isinstance(template, dict):
        return dict(zip(template.keys(), values))
    if isinstance(template, tuple):
        return tuple(values)
    return list(values)


def _scan(objs):
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


def _as_ndarray(obj):
    """A numpy view of a buffer exporter (no copy)."""
    return obj if isinstance(obj, np.ndarray) else np.asarray(memoryview(obj))


def _dtype_of(obj):
    try:
        return np.asarray(memoryview(obj)).dtype
    except (TypeError, ValueError):
        return getattr(obj, "dtype", type(obj).__name__)


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


def _on_device(obj):
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


def _device_arrays(objs, names, writable, cp):
    """cupy views of GPU tensors (no copies, except non-contiguous inputs) and their device.

    Raises TypeError/ValueError naming the tensor: host memory mixed in, tensors on
    different devices, unsupported dtypes, read-only or non-contiguous outputs.
    """
    from .comm.nccl import as_device
    arrays, device, first_device = [], None, None
    for obj, name in zip(objs, names):
        if isinstance(obj, cp.ndarray):
            arr = obj          # cupy's own arrays: no protocol, ordered by the caller's stream
        else:
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
                readonly = bool(cai["data"][1])
                arr = cp.asarray(obj)
            else:
                got = obj
                if use_dlpack:
                    # the producer makes the current stream of the tensor's device wait for
                    # its work (DLPack: 1 is the legacy default stream); the ready event is
                    # recorded on that same stream
                    with cp.cuda.Device(dl_dev[1] if dl_dev is not None else cp.cuda.runtime.getDevice()):
                        stream = cp.cuda.get_current_stream().ptr or 1
                    capsule = intake.dlpack_capsule(obj, stream=stream)
                    got = intake.from_dlpack_capsule(capsule, name, source=obj)
                elif not isinstance(obj, intake.DeviceArray):
                    got = intake.as_array(obj, name)
                if not isinstance(got, intake.DeviceArray):
                    raise TypeError(f"tensor {name!r} is in host memory but tensor {names[0]!r} is on "
                                    f"a GPU; all tensors of one call must be on the same device")
                readonly = got.readonly
                arr = as_device(got)
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


def _out_objects(out, names):
    """The objects of ``out=``, which must have the gradients' structure and names."""
    out_objs, out_names = _flatten(out, None if isinstance(out, dict) else names)
    if out_names != names:
        raise ValueError(f"out= must have the same structure and names as the gradients; "
                         f"got {out_names[:3]}... for {names[:3]}...")
    return out_objs


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


class Pipeline:
    """Fused (and, with a compressor, compressed) gradient allreduce.

    Args:
        compress: compressor name (see ``gradfuse.compressors.available()``) or instance.
            ``None``/``"none"`` uses the MPI library's own allreduce, bit-identical to a
            per-tensor ``MPI.Allreduce``.
        fusion_threshold: bucket size limit in bytes; default ``GRADFUSE_FUSION_THRESHOLD``
            or 1 MiB (measured, see docs/benchmarks.md). 0 turns fusion off.
        average: divide the sum by the number of ranks (sum first, then divide).
        comm: a ``gradfuse.comm.Communicator``, an mpi4py communicator, or None for the
            default (``gradfuse.init()``, i.e. ``MPI.COMM_WORLD``).
        direct_threshold: tensors of at least this many bytes are reduced in place
            without packing (default: the fusion threshold).

    Example:
        >>> pipe = gradfuse.Pipeline()
        >>> grads = pipe.allreduce({"w": np.ones(3, np.float32)})
    """

    def __init__(self, compress=None, fusion_threshold=None, average=True, comm=None,
                 direct_threshold=None, **compressor_options):
        self._compressor = _compressors.create(compress, **compressor_options)
        self._fusion_threshold = config.fusion_threshold(fusion_threshold)
        if direct_threshold is not None:
            direct_threshold = config.fusion_threshold(direct_threshold)
        self._direct_threshold = direct_threshold
        if not isinstance(average, (bool, np.bool_)):
            raise TypeError(f"average must be True or False, got {average!r}")
        self._average = bool(average)
        self._lock = threading.Lock()
        self._ctx = runtime.context(comm)
        self.comm = self._ctx.comm
        self._plans = OrderedDict()
        self.stats = Stats()
        self.state = CompressionState()
        self._wire_cache = {}
        self._backends = {}          # GPU id -> CudaBackend

    # Read-only: plans, agreement digests and residuals are built from these, so a
    # pipeline's configuration is fixed at construction (make a new Pipeline to change it).
    compressor = property(lambda self: self._compressor, doc="The compressor (fixed at construction).")
    fusion_threshold = property(lambda self: self._fusion_threshold, doc="Bucket size limit in bytes.")
    direct_threshold = property(lambda self: self._direct_threshold,
                                doc="Tensors of at least this many bytes are reduced in place.")
    average = property(lambda self: self._average, doc="Whether results are averaged.")

    # --- public API ---------------------------------------------------------------
    def allreduce(self, grads, out=None, names=None):
        """Sum (or average) ``grads`` across ranks; return the results in the same structure.

        Args:
            grads: list/tuple of arrays, or dict name -> array.
            out: optional arrays of the same structure to write into (may be ``grads``).
            names: for lists, the names that identify tensors across ranks
                (default: their positions).
        """
        return self.allreduce_async(grads, out=out, names=names).wait()

    def allreduce_(self, grads, names=None):
        """In-place variant: write the results back into ``grads`` and return it."""
        return self.allreduce_async(grads, out=grads, names=names).wait()

    def allreduce_async(self, grads, out=None, names=None):
        """Submit the allreduce to the communication thread and return a ``Handle``.

        ``handle.wait()`` returns what ``allreduce`` returns. Do not touch the inputs
        or outputs until then.
        """
        with self._lock:       # plan cache and submission order: one caller thread at a time
            try:
                run = self._prepare(grads, out, names)
            except Exception as exc:
                # whatever went wrong here is announced to the other ranks, so that they raise
                # too instead of waiting for this rank (or pairing with its next call)
                request = Request("allreduce", error=exc)
                return self._ctx.engine.submit(lambda: self._refuse(request), "allreduce")
            return self._ctx.engine.submit(run, "allreduce")

    def state_dict(self):
        """This rank's compressor state (residuals, server residuals, step counter).

        Plain numpy arrays and JSON-able values; ``load_state_dict`` restores it bit-exactly.
        Each rank saves and loads its own (see ``save_state``).
        """
        return self.state.state_dict(self.compressor.get_config(), self.comm.size, self.comm.rank)

    def load_state_dict(self, sd):
        """Restore a ``state_dict()``. A state from another world size or compressor config
        is reset with a warning; a residual is only applied to the bucket it was saved for
        (a changed layout is reported by a warning at the next compressed step). Every rank
        must restore the same step. Returns True if the state was restored."""
        return self.state.load_state_dict(sd, self.compressor.get_config(), self.comm.size, self.comm.rank)

    def save_state(self, path):
        """Save this rank's state to ``path`` (numpy .npz, no pickle). Call it on every rank
        with a per-rank path, e.g. ``f"ckpt/gradfuse-rank{gradfuse.rank()}.npz"``."""
        import json
        sd = self.state_dict()
        arrays = {}
        meta = {k: v for k, v in sd.items() if k != "buckets"}
        meta["buckets"] = {}
        for i, (key, b) in enumerate(sd["buckets"].items()):
            arrays[f"r{i}"] = b["residual"]
            arrays[f"s{i}"] = b["server_residual"]
            meta["buckets"][key] = {"n": b["n"], "algorithm": b["algorithm"], "i": i}
        with open(path, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)

    def load_state(self, path):
        """Load a file written by ``save_state`` (this rank's own)."""
        import json
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            buckets = {}
            for key, b in meta["buckets"].items():
                buckets[key] = {"n": b["n"], "algorithm": b["algorithm"],
                                "residual": z[f"r{b['i']}"], "server_residual": z[f"s{b['i']}"]}
        meta["buckets"] = buckets
        return self.load_state_dict(meta)

    def get_config(self):
        """The options that reproduce this pipeline: ``Pipeline(**get_config())``."""
        cfg = {"compress": self.compressor.name, "fusion_threshold": self.fusion_threshold,
               "average": self.average, "direct_threshold": self.direct_threshold}
        cfg.update({k: v for k, v in self.compressor.get_config().items() if k != "name"})
        return cfg

    def __repr__(self):
        return (f"Pipeline(compress={self.compressor.name!r}, fusion_threshold={self.fusion_threshold}, "
                f"average={self.average}, comm={self.comm!r})")

    # --- internals ----------------------------------------------------------------
    def _refuse(self, request):
        self.stats.failed_steps += 1
        self._ctx.coordinator.negotiate(request, self._step_tag())      # raises on every rank

    def _step_tag(self):
        """What of the compressor state the ranks must agree on: its step counter (it drives
        warm-up and random-k's positions). 0 for lossless pipelines."""
        return 0 if self._compressor.lossless else self.state.step

    def _options(self):
        return {"average": self.average, "compress": self.compressor.get_config(),
                "fusion_threshold": self.fusion_threshold,
                "direct_threshold": self.direct_threshold}

    def _intake_inputs(self, objs, names, flags, writable, role="tensor"):
        """Slow path for inputs the C scan could not take as they are."""
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

    def _read_tables(self, objs, names, writable, role="tensor"):
        sig, ptrs, nbytes, flags = _scan(objs)
        mask = _problems(writable)
        for _ in range(2):
            if not (flags & mask).any():
                break
            objs = self._intake_inputs(objs, names, flags, writable, role)
            sig, ptrs, nbytes, flags = _scan(objs)
        if (flags & mask).any():
            i = int(np.flatnonzero(flags & mask)[0])
            raise TypeError(f"tensor {names[i]!r}: cannot read {type(objs[i]).__name__} as an array")
        return objs, sig, ptrs, nbytes

    def _entry(self, sig, names, nbytes, bk=HOST):
        key = (sig, tuple(names), bk.device, bk.device_id)
        entry = self._plans.get(key)
        if entry is not None:
            self._plans.move_to_end(key)
            return entry
        parsed = parse_signature(sig)
        codes = [c for c, _ in parsed]
        shapes = [s for _, s in parsed]
        sizes = nbytes.tolist()
        plan = FusionPlan(codes, sizes, self.fusion_threshold, self.direct_threshold, alloc=bk.empty_bytes)
        dtypes = [_dt.name(c) for c in codes]
        request = Request("allreduce", names, shapes, dtypes, dict(self._options(), device=bk.device))
        state_key = Request("allreduce", names, shapes, dtypes, self._options()).digest.hex()
        if self.average:
            for name, c in zip(names, codes):
                if c not in _dt.FLOAT_CODES:
                    raise TypeError(f"tensor {name!r}: average=True needs a float dtype, got "
                                    f"{_dt.name(c)} (use average=False to sum integers)")
        entry = _Entry(plan, request, names, shapes, codes, bk, state_key)
        self._plans[key] = entry
        self.stats.plans_built += 1
        if len(self._plans) > _PLAN_CACHE:
            _, old = self._plans.popitem(last=False)
            gone = old.request.digest.hex()
            for key in [k for k in self._wire_cache if k[0] == gone]:
                del self._wire_cache[key]
        return entry

    def _prepare(self, grads, out, names):
        objs, names = _flatten(grads, names)
        if objs and _on_device(objs[0]):
            return self._prepare_gpu(grads, objs, out, names)
        inplace = out is grads
        objs, sig, in_ptrs, nbytes = self._read_tables(objs, names, writable=inplace)
        entry = self._entry(sig, names, nbytes)
        if inplace:
            out_objs, out_ptrs = objs, in_ptrs
        elif out is not None:
            out_objs, out_sig, out_ptrs, out_nb = self._read_tables(_out_objects(out, names), names,
                                                                    writable=True, role="output")
            _check_out_signature(sig, out_sig, names)
        else:
            out_objs = [np.empty(s, dtype=_dt.DTYPE[c]) for c, s in zip(entry.codes, entry.shapes)]
            _, out_ptrs, _, _ = _scan(out_objs)
        return self._finish_prepare(entry, grads, out, objs, out_objs, in_ptrs, out_ptrs, nbytes, names)

    def _finish_prepare(self, entry, grads, out, objs, out_objs, in_ptrs, out_ptrs, nbytes, names, ready=None):
        """Overlap check (when the pointers changed), the result object, the job."""
        if out is not None and (entry.verified is None or not np.array_equal(entry.verified[0], in_ptrs)
                                or not np.array_equal(entry.verified[1], out_ptrs)):
            check_overlaps(in_ptrs, nbytes, out_ptrs, nbytes, names)
            entry.verified = (in_ptrs, out_ptrs)
        result = grads if out is grads else (out if out is not None else _rebuild(grads, out_objs))
        return self._job(entry, objs, out_objs, in_ptrs, out_ptrs, result, ready)

    def _prepare_gpu(self, grads, objs, out, names):
        """``_prepare`` for GPU tensors: cupy views, device plan, the caller's stream."""
        from . import gpu
        try:
            cp = gpu.cupy()
        except ImportError as e:
            raise TypeError(f"tensor {names[0]!r} is a CUDA array, and the GPU path needs cupy, which "
                            f"cannot be imported ({e}); install gradfuse[cuda12] or gradfuse[cuda13]") from None
        if not self._backends and not gpu.available():
            raise TypeError(f"tensor {names[0]!r} is a CUDA array, but cupy sees no CUDA device here")
        inplace = out is grads
        arrays, dev = _device_arrays(objs, names, inplace, cp)
        sig, in_ptrs, nbytes = _device_tables(arrays)
        self._claim_device(dev)
        with cp.cuda.Device(dev):
            bk = self._backends.get(dev)
            if bk is None:
                # compiles the kernels here, before the ranks agree: a failure is announced
                bk = self._backends[dev] = CudaBackend(dev)
            entry = self._entry(sig, names, nbytes, bk)
            if inplace:
                out_arrays, out_ptrs = arrays, in_ptrs
            elif out is not None:
                out_objs = _out_objects(out, names)
                if out_objs and not all(_on_device(o) for o in out_objs):
                    bad = next(n for o, n in zip(out_objs, names) if not _on_device(o))
                    raise TypeError(f"output {bad!r} is in host memory but the gradients are on GPU {dev}")
                out_arrays, out_dev = _device_arrays(out_objs, names, True, cp)
                out_sig, out_ptrs, _ = _device_tables(out_arrays)
                if out_dev != dev and any(a.size for a in out_arrays):
                    raise ValueError(f"outputs are on GPU {out_dev} but the gradients are on GPU {dev}")
                _check_out_signature(sig, out_sig, names)
            else:
                out_arrays = [cp.empty(s, dtype=_dt.DTYPE[c]) for c, s in zip(entry.codes, entry.shapes)]
                out_ptrs = _device_tables(out_arrays)[1]
            # the communication thread's stream waits for the work queued so far on the
            # caller's stream (the producer of the gradients)
            ready = cp.cuda.Event(disable_timing=True)
            ready.record(cp.cuda.get_current_stream())
        return self._finish_prepare(entry, grads, out, arrays, out_arrays, in_ptrs, out_ptrs, nbytes, names, ready)

    def _claim_device(self, dev):
        """One GPU per rank and communicator: its GPU communicator (NCCL) is made for one
        device, collectively. A step on another device is refused before the ranks agree
        (so every rank raises), rather than leaving this rank alone in NCCL's set-up."""
        ctx = self._ctx
        from .comm.nccl import _GPUComm
        if isinstance(ctx.comm, _GPUComm) and ctx.comm.device != dev:
            raise ValueError(f"the tensors are on GPU {dev} but the communicator {ctx.comm.describe()} "
                             f"serves GPU {ctx.comm.device}")
        with runtime._lock:
            if ctx.gpu_device is None:
                ctx.gpu_device = dev
            claimed = ctx.gpu_device
        if claimed != dev:
            raise ValueError(f"the tensors are on GPU {dev}, but this rank's earlier GPU steps on this "
                             f"communicator used GPU {claimed}; each rank must keep to one GPU")

    def _gpu_comm(self, dev):
        """The data-plane communicator for GPU buffers on device ``dev`` (the device
        ``_claim_device`` fixed; made once per runtime context, collectively, on the
        communication thread after the ranks agreed on a GPU step): NCCL, else MPI through
        pinned host memory (with a warning)."""
        ctx = self._ctx
        comm = ctx.gpu_comm
        if comm is None:
            from .comm.mpi import MPICommunicator
            from .comm.nccl import _GPUComm, make_gpu_communicator
            from .comm.single import SingleProcessCommunicator
            base = ctx.comm
            if isinstance(base, (_GPUComm, SingleProcessCommunicator)):
                comm = base
            elif isinstance(base, MPICommunicator):
                comm = make_gpu_communicator(base, device=dev)
            else:
                raise TypeError(f"{type(base).__name__} cannot carry GPU buffers; give Pipeline an MPI, "
                                f"NCCL or single-process communicator")
            ctx.gpu_comm = comm
        return comm

    def _job(self, entry, in_objs, out_objs, in_ptrs, out_ptrs, result, ready=None):
        plan = entry.plan
        bk = entry.bk
        src = in_ptrs[plan.order]
        dst = out_ptrs[plan.order]
        inplace = bool(np.array_equal(src, dst))
        src, dst, tables = bk.pointers(src), bk.pointers(dst), bk.plan_tables(plan)
        # tensors reduced where they lie go to the communicator as numpy views
        in_objs, out_objs = list(in_objs), list(out_objs)
        if bk is HOST:
            for b in plan.buckets:
                if b.direct:
                    i = int(plan.order[b.lo])
                    in_objs[i], out_objs[i] = _as_ndarray(in_objs[i]), _as_ndarray(out_objs[i])
        ctx, stats = self._ctx, self.stats
        average = self.average
        comp = self.compressor

        def run():
            try:
                ctx.coordinator.negotiate(entry.request, self._step_tag())
            except BaseException:
                stats.failed_steps += 1
                raise
            if bk is HOST:
                return step(ctx.comm)
            with bk.xp.cuda.Device(bk.device_id), bk.stream:
                comm = self._gpu_comm(bk.device_id)
                bk.stream.wait_event(ready)       # the producer of the gradients is done
                try:
                    return step(comm)
                finally:
                    bk.synchronize()      # nothing of this step still runs when wait() returns

        def step(comm):
            divide = average and comm.size > 1
            size = float(comm.size)
            compressed = []
            if not comp.lossless:
                compressed = self._start_compressed(entry, src, dst, size if average else 1.0, comm, tables)
            # one rank, in place: the sum (and the mean) of one tensor is the tensor itself
            plain = () if comm.size == 1 and inplace else plan.buckets
            for b in plain:
                if b.index in compressed:
                    continue
                if b.direct:
                    i = int(plan.order[b.lo])
                    if src[b.lo] == dst[b.lo]:
                        comm.allreduce_inplace(out_objs[i])
                    else:
                        comm.allreduce(in_objs[i], out_objs[i])
                    if divide:
                        bk.div_inplace(out_objs[i], dst[b.lo], plan.counts[b.lo], b.code, size)
                else:
                    off, nb = tables.offsets, tables.nbytes
                    bk.pack(b.buffer, src, off, nb, b.lo, b.hi)
                    comm.allreduce_inplace(b.view())
                    if divide:
                        outs = () if bk is HOST else [out_objs[int(i)] for i in plan.order[b.lo:b.hi]]
                        bk.unpack_div(b.buffer, dst, off, nb, b.lo, b.hi, b.code, size, outs)
                    else:
                        bk.unpack(b.buffer, dst, off, nb, b.lo, b.hi)
                stats.bytes_reduced += b.nbytes
                stats.bytes_sent += ring_bytes(b.nbytes, comm.size)
            for job in compressed.values() if compressed else ():
                job.finish()
                stats.bytes_reduced += job.bucket.nbytes
            if not comp.lossless:
                self.state.step += 1
            stats.steps += 1
            stats.tensors += len(entry.names)
            stats.buckets += len(plan.buckets)
            return result

        return run

    def _start_compressed(self, entry, src, dst, divisor, comm, tables):
        """Compress and exchange every float32 bucket; raise on every rank if any was non-finite.

        Returns {bucket index: job} for ``finish()`` once the plain buckets are done.
        Warm-up steps (``warmup_steps``) return {} so that everything goes uncompressed.
        """
        comp, state, plan, bk = self.compressor, self.state, entry.plan, entry.bk
        if state.step < comp.warmup_steps:
            return {}
        digest = entry.state_key
        cache_digest = entry.request.digest.hex()
        jobs = {}
        for b in plan.buckets:
            if b.code != _F32:
                continue           # compressors work on float32; other dtypes go uncompressed
            n = b.count
            algorithm = comp.algorithm_for(n, comm.size) if hasattr(comp, "algorithm_for") else comp.collective
            server_n = 0
            if algorithm == "twophase" and comp.error_feedback:
                e0, e1 = twophase_chunk(n, comm.size, comp.block, comm.rank)
                server_n = e1 - e0
            key = (digest, b.index)
            st = state.bucket(key, n if comp.error_feedback else 0, server_n, algorithm, bk)
            ctx = BucketContext(bucket=b.index, step=state.step, device=bk.device)
            off, cnt = tables.elem_offsets, tables.counts
            job = JOBS[algorithm](comm, comp, b, (src, off, cnt, b.lo, b.hi),
                                  (dst, off, cnt, b.lo, b.hi), st, ctx, divisor,
                                  self._wire_cache.setdefault((cache_digest, b.index), {}), self.stats, bk)
            job.start()
            jobs[b.index] = job
        if jobs:
            state.claim_done(digest)
        bad = [j for j in jobs.values() if j.nonfinite_ranks]
        if bad:
            self.stats.nonfinite_steps += 1
            self.stats.failed_steps += 1
            parts = []
            for j in bad:
                names = [entry.names[int(i)] for i in plan.order[j.bucket.lo:j.bucket.hi][:4]]
                who = (f"on rank(s) {', '.join(str(r) for r in j.nonfinite_ranks)}"
                       if "?" not in j.nonfinite_ranks else "")
                parts.append(f"bucket {j.bucket.index} (tensors {', '.join(repr(x) for x in names)}"
                             f"{', ...' if j.bucket.hi - j.bucket.lo > 4 else ''}): non-finite values {who}"
                             f"{'; ' + j.nonfinite_detail if j.nonfinite_detail else ''}")
            raise NonFiniteError(f"{comp.name}: NaN/Inf in the step's gradients; the step was refused on "
                                 f"every rank, no result was written and the residuals are unchanged: "
                                 + "; ".join(parts))
        return jobs
