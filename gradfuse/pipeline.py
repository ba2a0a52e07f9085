"""``gradfuse.Pipeline``: fuse, agree, reduce, write back.

The Pipeline API: options, the compressor state and its checkpoints.
One step of ``allreduce``:

1. inputs (caller's thread, ``gradfuse.fusion.tables.read_inputs``): the call's arrays
   (and the ``out=`` arrays) in one pass: ``gradfuse.fusion.intake`` decides once what
   kind of arrays they are, and one C loop reads every host array's pointer, size, dtype
   and shape through the buffer protocol. Bad input raises ``TypeError``/``ValueError``
   naming the tensor; the error is still announced to the other ranks, so they raise too
   instead of waiting.
2. plan (``gradfuse.fusion.cache``): the bucket layout, tables and fusion buffers are
   reused while names, shapes and dtypes stay the same.
3. outputs (``read_outputs``): the inputs themselves, ``out=`` or new arrays, checked.
4. on the communication thread (``gradfuse.step``): the ranks agree on the request
   (one tiny exchange when nothing changed), then each bucket is packed (one kernel
   call), summed by the MPI library's own allreduce, and unpacked (one kernel call,
   dividing by the world size on the way out when averaging). Large tensors are summed
   in place.

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

import numpy as np

from . import config
from .compressors import adam as _adam
from .compressors import cost
from .compressors import momentum as _momentum
from .compressors.policy import LayerPolicy
from .compressors.checkpoint import load_npz, save_npz
from .compressors.state import CompressionState
from .errors import GradfuseError
from .fusion import tables
from .fusion.cache import PlanCache, PlanRules
from .runtime import context as runtime
from .runtime.control import Request
from .step.compressed import COMPRESSIBLE
from .step.overlap import Overlap
from .step.run import Step, StepConfig
from .step.stats import Stats
from .step.verdict import NONFINITE

class Pipeline:
    """Fused (and, with a compressor, compressed) gradient allreduce.

    Args:
        compress: compressor name (see ``gradfuse.compressors.available()``), instance or
            ``get_config()`` dict; ``None``/``"none"`` uses the MPI library's own
            allreduce, bit-identical to a per-tensor ``MPI.Allreduce``. Or a layer policy:
            a dict of name patterns to compressors, first match wins, ``None`` for
            uncompressed, e.g. ``{"*.bias": None, "*": "1bit"}``
            (``gradfuse.compressors.policy``).
        min_elements: tensors with fewer elements go uncompressed, in buckets of their
            own (default 0: off).
        fusion_threshold: bucket size limit in bytes; default ``GRADFUSE_FUSION_THRESHOLD``
            or 1 MiB (measured, see docs/benchmarks.md). 0 turns fusion off.
        average: divide the sum by the number of ranks (sum first, then divide).
        comm: a ``gradfuse.comm.Communicator``, an mpi4py communicator, or None for the
            default (``gradfuse.init()``, i.e. ``MPI.COMM_WORLD``).
        direct_threshold: tensors of at least this many bytes are reduced in place
            without packing (default: the fusion threshold).
        nonfinite: what a compressed step with NaN/Inf in any rank's gradients does:
            ``"raise"`` (default): ``NonFiniteError`` on every rank, nothing written;
            ``"skip"``: every float output of the call becomes NaN on every rank (a
            dynamic loss scaler sees the overflow and skips the step), residuals and the
            compressor's step counter stay as they were, ``stats.nonfinite_steps``
            counts it. Uncompressed buckets sum NaN/Inf as the MPI library does.
        link_bandwidth: the network link the cost model (``gradfuse.compressors.cost``)
            assumes for ``algorithm="auto"``: a preset (``"1gbit"``, ``"10gbit"``,
            ``"100gbit"``), a rate (``"2.5gbit"``, ``"400mbit"``) or bytes/s. An option,
            not a probe: nothing is measured, and every rank must pass the same (it is part
            of the agreement). Default None: the model's ``DEFAULT_LINK`` (10 Gbit/s).
        link_latency: seconds per message step (default: the preset's, else 20 us).
        uncompressed_if_faster: opt-in: a float32 bucket whose compressed exchange the cost
            model predicts to be no faster than the fp32 ring allreduce on ``link_bandwidth``
            (which it needs) runs uncompressed; a residual it had is added into that sum
            and cleared, so nothing is lost (docs/compressors.md). Off by default: on
            shared memory nothing pays, and it would silently switch compression off.
        pipeline_buckets: overlap the exchange of each compressed bucket with the
            compression of the next, on a second thread (``gradfuse.step.overlap``);
            the results are bit-identical either way. Default None:
            ``GRADFUSE_PIPELINE_BUCKETS`` (0 or 1), else on (measured in
            docs/notes/benchmarks-history.md, "Pipelined buckets"). It needs MPI at
            ``THREAD_MULTIPLE`` (mpi4py's default) and a host step on two or more ranks;
            elsewhere, and in steps whose compressed buckets are all fp16/bf16, the
            buckets run serially. Ranks need not agree on it.

    Example:
        >>> pipe = gradfuse.Pipeline()
        >>> grads = pipe.allreduce({"w": np.ones(3, np.float32)})
    """

    def __init__(self, compress=None, fusion_threshold=None, average=True, comm=None,
                 direct_threshold=None, nonfinite="raise", min_elements=0, link_bandwidth=None,
                 link_latency=None, uncompressed_if_faster=False, pipeline_buckets=None, **compressor_options):
        self._policy = LayerPolicy.create(compress, min_elements, **compressor_options)
        self._compressor = self._policy.main
        self._fusion_threshold = config.fusion_threshold(fusion_threshold)
        if direct_threshold is not None:
            direct_threshold = config.fusion_threshold(direct_threshold, "direct_threshold")
        self._direct_threshold = direct_threshold
        if not isinstance(average, (bool, np.bool_)):
            raise TypeError(f"average must be True or False, got {average!r}")
        self._average = bool(average)
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {', '.join(map(repr, NONFINITE))}, got {nonfinite!r}")
        self._nonfinite = nonfinite
        if link_bandwidth is None and link_latency is not None:
            raise ValueError(f"link_latency={link_latency!r} needs link_bandwidth (the cost model's link)")
        try:
            self._link = None if link_bandwidth is None else cost.link_from(link_bandwidth, link_latency)
        except (TypeError, ValueError) as e:
            raise type(e)(f"options link_bandwidth={link_bandwidth!r}, link_latency={link_latency!r}: {e}") from None
        if not isinstance(uncompressed_if_faster, (bool, np.bool_)):
            raise TypeError(f"uncompressed_if_faster must be True or False, got {uncompressed_if_faster!r}")
        if uncompressed_if_faster and self._link is None:
            raise ValueError("uncompressed_if_faster=True needs link_bandwidth (e.g. '1gbit'): the cost model "
                             "compares compressed and fp32 exchanges on that link")
        self._uncompressed_if_faster = bool(uncompressed_if_faster)
        if self._uncompressed_if_faster and _momentum.pipeline_momentum(self._policy):
            raise ValueError("uncompressed_if_faster=True cannot be combined with momentum (DGC's momentum "
                             "correction): a bucket switching to uncompressed would have to move its "
                             "residual into the velocity path, which gradfuse does not do")
        self._adam = _adam.pipeline_adam(self._policy)
        if self._adam is not None and self._uncompressed_if_faster:
            raise ValueError("uncompressed_if_faster=True cannot be combined with the Adam correction (adam=...): a "
                             "bucket switching to uncompressed would have to move its residual into Adam's moments, "
                             "which gradfuse does not do")
        if self._adam is not None and not self._average:
            raise ValueError(f"the Adam correction (adam={self._adam.rule!r}) keeps the moments of the averaged "
                             f"gradient: it needs average=True")
        self._pipeline_buckets = config.pipeline_buckets(pipeline_buckets)
        self._lock = threading.Lock()
        # the done event of the last step submitted (``_settle``): not its Handle, whose result
        # would keep the step's outputs referenced (the output pool reuses unreferenced ones)
        self._last = None
        self._ctx = runtime.context(comm)
        self.comm = self._ctx.comm
        self.stats = Stats()
        self.state = CompressionState()
        self._plans = PlanCache(PlanRules(self._policy, self._fusion_threshold, self._direct_threshold, self._average,
                                          COMPRESSIBLE, {dev: self._request_options(dev) for dev in ("cpu", "cuda")},
                                          self._state_options(), self.stats))
        self._cfg = StepConfig(self._ctx, self._policy, self._average, self.state, self.stats,
                               nonfinite, self._link, self._uncompressed_if_faster,
                               Overlap() if self._pipeline_buckets else None, self._adam)

    # Read-only: plans, agreement digests and residuals are built from these, so a
    # pipeline's configuration is fixed at construction (make a new Pipeline to change it).
    compressor = property(lambda self: self._compressor,
                          doc="The compressor (with a layer policy: its first lossy one).")
    policy = property(lambda self: self._policy, doc="Which compressor each tensor gets (a LayerPolicy).")
    fusion_threshold = property(lambda self: self._fusion_threshold, doc="Bucket size limit in bytes.")
    direct_threshold = property(lambda self: self._direct_threshold,
                                doc="Tensors of at least this many bytes are reduced in place.")
    average = property(lambda self: self._average, doc="Whether results are averaged.")
    nonfinite = property(lambda self: self._nonfinite, doc='What a non-finite compressed step does.')
    link = property(lambda self: self._link, doc="The cost model's link (a cost.Link), or None for its default.")
    pipeline_buckets = property(lambda self: self._pipeline_buckets,
                                doc="Whether compressed buckets are pipelined (where the communicator allows).")

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
                step = self._prepare(grads, out, names)
            except Exception as exc:
                # whatever went wrong here is announced to the other ranks, so that they raise
                # too instead of waiting for this rank (or pairing with its next call)
                request = Request("allreduce", error=exc)
                handle = self._ctx.engine.submit(lambda: self._refuse(request), "allreduce")
            else:
                handle = self._ctx.engine.submit(step, "allreduce")
            self._last = handle.done_event
            return handle

    def state_dict(self):
        """This rank's compressor state (residuals, server residuals, step counter, an
        optimizer correction's arrays), after every step submitted so far has finished.

        Plain numpy arrays and JSON-able values; ``load_state_dict`` restores it bit-exactly.
        Each rank saves and loads its own (see ``save_state``). A step still in flight
        (``allreduce_async``) is waited for, so the state is always that of whole steps.
        """
        self._settle("state_dict")
        return self.state.state_dict(self._policy.get_config(), self.comm.size, self.comm.rank,
                                     self._state_options())

    def load_state_dict(self, sd, on_mismatch="raise", where="the state_dict", check_only=False):
        """Restore a ``state_dict()`` (after the steps in flight have finished).

        The state is validated first (finite values, dtypes and sizes, counters >= 0, for
        every compressor's arrays: ``gradfuse.compressors.checkpoint``); a state of another
        compressor config, other options or another rank is refused with a ``GradfuseError``
        naming ``where`` and each difference, and the live state stays as it was.
        ``on_mismatch="reset"`` starts from a fresh state instead, with a warning. A state
        saved on another number of ranks keeps the step counter and what every rank shares
        (an Adam correction's moments, PowerSGD's Q) and starts the residuals and velocities
        from zero, with a warning naming them. Every rank must restore the same step.

        Returns:
            True if the state was restored, False if it was reset (``on_mismatch="reset"``).
            With ``check_only``: the same checks and errors, and nothing changed (what it
            would return).
        """
        if not check_only:
            self._settle("load_state_dict")
        return self.state.load_state_dict(sd, self._policy.get_config(), self.comm.size, self.comm.rank,
                                          self._state_options(), on_mismatch, where, check_only)

    def save_state(self, path):
        """Save this rank's state to ``path`` (numpy .npz, no pickle). Call it on every rank
        with a per-rank path, e.g. ``f"ckpt/gradfuse-rank{gradfuse.rank()}.npz"``.

        The state is that of every step submitted so far (a step in flight is waited for),
        and the file is replaced atomically: a crash during the save leaves the previous one."""
        save_npz(self.state_dict(), path)

    def load_state(self, path, on_mismatch="raise"):
        """Load a file written by ``save_state`` (this rank's own), as ``load_state_dict``
        does; a file that is not one (missing, empty, truncated, another format) raises
        ``GradfuseError`` naming it and the problem."""
        return self.load_state_dict(load_npz(path), on_mismatch, where=f"state file {str(path)!r}")

    def get_config(self):
        """The options that reproduce this pipeline: ``Pipeline(**get_config())``."""
        cfg = {"compress": self._policy.describe(), "fusion_threshold": self.fusion_threshold,
               "average": self.average, "direct_threshold": self.direct_threshold,
               "nonfinite": self.nonfinite, "min_elements": self._policy.min_elements}
        if self._link is not None:
            cfg.update(link_bandwidth=self._link.bandwidth, link_latency=self._link.latency)
        if self._uncompressed_if_faster:
            cfg["uncompressed_if_faster"] = True
        if self._pipeline_buckets != config.DEFAULT_PIPELINE_BUCKETS:
            cfg["pipeline_buckets"] = self._pipeline_buckets
        if self._policy.single:
            cfg.update({k: v for k, v in self.compressor.get_config().items() if k != "name"})
        return cfg

    def __repr__(self):
        return (f"Pipeline(compress={self._policy.describe()!r}, fusion_threshold={self.fusion_threshold}, "
                f"average={self.average}, comm={self.comm!r})")

    # --- internals ----------------------------------------------------------------
    def _settle(self, what):
        """Wait until this pipeline's steps submitted so far have finished (their errors
        are their callers'): the state is then that of whole steps."""
        last = self._last
        if last is None or last.is_set():
            return
        if self._ctx.engine.on_thread():
            raise GradfuseError(f"gradfuse: Pipeline.{what}() was called on the communication thread while a step "
                                f"of this pipeline is queued or in flight; it cannot wait for that step there, and "
                                f"its state would be torn: call it from the training thread")
        last.wait()            # the step's error, if any, is raised to its own caller

    def _refuse(self, request):
        self.stats.failed_steps += 1
        self._ctx.coordinator.negotiate(request, self._cfg.step_tag())      # raises on every rank

    def _options(self):
        opts = {"average": self.average, "compress": self._policy.get_config(),
                "fusion_threshold": self.fusion_threshold,
                "direct_threshold": self.direct_threshold}
        if self.nonfinite != "raise":     # the default adds nothing: residual keys stay as they were
            opts["nonfinite"] = self.nonfinite
        if self._link is not None:        # it picks algorithms: every rank must assume the same
            opts["link"] = [self._link.bandwidth, self._link.latency]
        if self._uncompressed_if_faster:
            opts["uncompressed_if_faster"] = True
        return opts

    def _state_options(self):
        """What keys a plan's residuals: ``_options()`` without the link and the opt-in
        policy, which choose collectives but not the bucket layout, so a checkpoint
        restores into a pipeline told another link (a residual whose server part no
        longer fits starts from zero, with a warning)."""
        opts = self._options()
        opts.pop("link", None)
        opts.pop("uncompressed_if_faster", None)
        return opts

    def _request_options(self, device):
        """The options every rank's request must agree on (a binding may phrase them as its
        other collectives do, so that a mismatch between the two names the option)."""
        return dict(self._options(), device=device)

    def _prepare(self, grads, out, names):
        """The caller's half of a step: inputs (with ``out=``), the plan, outputs; a ``Step``."""
        inputs = tables.read_inputs(grads, names, out)
        if inputs.device is not None:
            self._ctx.claim_device(inputs.device)     # one GPU per rank, refused before the ranks agree
        entry = self._plans.entry(inputs)
        outputs = tables.read_outputs(inputs, grads, out, entry)
        return Step(self._cfg, entry, inputs, outputs)
