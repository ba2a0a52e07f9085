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
"""
import threading
from collections import OrderedDict

import numpy as np

from . import _core, config, intake, runtime
from . import compressors as _compressors
from . import dtypes as _dt
from .compressors.base import BucketContext
from .control import Request
from .errors import NonFiniteError
from .plan import FusionPlan, parse_signature
from .reduce import JOBS, twophase_chunk
from .state import CompressionState

_F32 = _dt.CODE[np.dtype(np.float32)]
_PLAN_CACHE = 8


class Stats:
    """Counters of one pipeline (read them as attributes or with ``as_dict()``).

    ``bytes_reduced`` counts the gradient bytes a step reduced (uncompressed size), so a
    collective that was stopped by the control plane or the non-finite policy adds 0.
    ``bytes_sent`` estimates the compressed payload bytes this rank put on the wire.
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

    __slots__ = ("plan", "request", "names", "shapes", "codes", "verified")

    def __init__(self, plan, request, names, shapes, codes):
        self.plan, self.request, self.names = plan, request, names
        self.shapes, self.codes = shapes, codes
        self.verified = None     # output pointer table last checked for overlaps


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

    def _intake_inputs(self, objs, names, flags, writable):
        """Slow path for inputs the C scan could not take as they are."""
        objs = list(objs)
        for i in np.flatnonzero(flags & _problems(writable)).tolist():
            f, name = int(flags[i]), names[i]
            if f & _core.FLAG_NOBUFFER:
                arr = intake.as_array(objs[i], name)
                if isinstance(arr, intake.DeviceArray):
                    raise TypeError(f"tensor {name!r} is a CUDA array; this build has only the CPU path")
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

    def _read_tables(self, objs, names, writable):
        sig, ptrs, nbytes, flags = _scan(objs)
        mask = _problems(writable)
        for _ in range(2):
            if not (flags & mask).any():
                break
            objs = self._intake_inputs(objs, names, flags, writable)
            sig, ptrs, nbytes, flags = _scan(objs)
        if (flags & mask).any():
            i = int(np.flatnonzero(flags & mask)[0])
            raise TypeError(f"tensor {names[i]!r}: cannot read {type(objs[i]).__name__} as an array")
        return objs, sig, ptrs, nbytes

    def _entry(self, sig, names, nbytes):
        key = (sig, tuple(names))
        entry = self._plans.get(key)
        if entry is not None:
            self._plans.move_to_end(key)
            return entry
        parsed = parse_signature(sig)
        codes = [c for c, _ in parsed]
        shapes = [s for _, s in parsed]
        sizes = nbytes.tolist()
        plan = FusionPlan(codes, sizes, self.fusion_threshold, self.direct_threshold)
        request = Request("allreduce", names, shapes, [_dt.name(c) for c in codes], self._options())
        if self.average:
            for name, c in zip(names, codes):
                if c not in _dt.FLOAT_CODES:
                    raise TypeError(f"tensor {name!r}: average=True needs a float dtype, got "
                                    f"{_dt.name(c)} (use average=False to sum integers)")
        entry = _Entry(plan, request, names, shapes, codes)
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
        inplace = out is grads
        objs, sig, in_ptrs, nbytes = self._read_tables(objs, names, writable=inplace)
        entry = self._entry(sig, names, nbytes)
        if inplace:
            out_objs, out_ptrs = objs, in_ptrs
        elif out is not None:
            out_objs, out_names = _flatten(out, None if isinstance(out, dict) else names)
            if out_names != names:
                raise ValueError(f"out= must have the same structure and names as the gradients; "
                                 f"got {out_names[:3]}... for {names[:3]}...")
            out_objs, out_sig, out_ptrs, out_nb = self._read_tables(out_objs, names, writable=True)
            if out_sig != sig:
                for i, ((c1, s1), (c2, s2)) in enumerate(zip(parse_signature(sig), parse_signature(out_sig))):
                    if (c1, s1) != (c2, s2):
                        raise ValueError(f"tensor {names[i]!r}: output has dtype {_dt.name(c2)} shape "
                                         f"{s2}, input has dtype {_dt.name(c1)} shape {s1}")
        else:
            out_objs = [np.empty(s, dtype=_dt.DTYPE[c]) for c, s in zip(entry.codes, entry.shapes)]
            _, out_ptrs, _, _ = _scan(out_objs)
        if out is not None and (entry.verified is None or not np.array_equal(entry.verified[0], in_ptrs)
                                or not np.array_equal(entry.verified[1], out_ptrs)):
            check_overlaps(in_ptrs, nbytes, out_ptrs, nbytes, names)
            entry.verified = (in_ptrs, out_ptrs)
        result = grads if inplace else (out if out is not None else _rebuild(grads, out_objs))
        return self._job(entry, objs, out_objs, in_ptrs, out_ptrs, result)

    def _job(self, entry, in_objs, out_objs, in_ptrs, out_ptrs, result):
        plan = entry.plan
        src = in_ptrs[plan.order]
        dst = out_ptrs[plan.order]
        inplace = bool(np.array_equal(src, dst))
        # tensors reduced where they lie go to the communicator as numpy views
        in_objs, out_objs = list(in_objs), list(out_objs)
        for b in plan.buckets:
            if b.direct:
                i = int(plan.order[b.lo])
                in_objs[i], out_objs[i] = _as_ndarray(in_objs[i]), _as_ndarray(out_objs[i])
        ctx, stats = self._ctx, self.stats
        average = self.average
        comp = self.compressor

        def run():
            comm = ctx.comm
            try:
                ctx.coordinator.negotiate(entry.request, self._step_tag())
            except BaseException:
                stats.failed_steps += 1
                raise
            divide = average and comm.size > 1
            size = float(comm.size)
            compressed = []
            if not comp.lossless:
                compressed = self._start_compressed(entry, src, dst, size if average else 1.0)
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
                        _core.div_inplace(int(dst[b.lo]), int(plan.counts[b.lo]), b.code, size)
                else:
                    _core.pack(b.buffer, src, plan.offsets, plan.nbytes, b.lo, b.hi)
                    comm.allreduce_inplace(b.view())
                    if divide:
                        _core.unpack_div(b.buffer, dst, plan.offsets, plan.nbytes, b.lo, b.hi, b.code, size)
                    else:
                        _core.unpack(b.buffer, dst, plan.offsets, plan.nbytes, b.lo, b.hi)
                stats.bytes_reduced += b.nbytes
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

    def _start_compressed(self, entry, src, dst, divisor):
        """Compress and exchange every float32 bucket; raise on every rank if any was non-finite.

        Returns {bucket index: job} for ``finish()`` once the plain buckets are done.
        Warm-up steps (``warmup_steps``) return {} so that everything goes uncompressed.
        """
        comp, comm, state, plan = self.compressor, self.comm, self.state, entry.plan
        if state.step < comp.warmup_steps:
            return {}
        digest = entry.request.digest.hex()
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
            st = state.bucket(key, n if comp.error_feedback else 0, server_n, algorithm)
            ctx = BucketContext(bucket=b.index, step=state.step)
            job = JOBS[algorithm](comm, comp, b, (src, plan.elem_offsets, plan.counts, b.lo, b.hi),
                                  (dst, plan.elem_offsets, plan.counts, b.lo, b.hi), st, ctx, divisor,
                                  self._wire_cache.setdefault(key, {}), self.stats)
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
