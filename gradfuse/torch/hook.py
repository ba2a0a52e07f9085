"""gradfuse's compressors as a DDP communication hook.

    state = gradfuse.torch.CompressionState("1bit", momentum=0.9)
    ddp.register_comm_hook(state, gradfuse.torch.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.0)   # the momentum is in state

DDP hands the hook each ``GradBucket``: one flat, fused buffer of gradients. The hook cuts
it into zero-copy views along ``bucket.gradients()`` (numpy on the host, cupy through
DLPack on a GPU, a float32 staging buffer for bfloat16: ``gradfuse.torch.buckets``), so
every tensor keeps its own 1-bit scale and its own top-k / random-k selection, and runs
one ``gradfuse.Pipeline`` step on them over a ``TorchCommunicator`` on DDP's process
group: the ranks agree on the bucket, error feedback and compression run in gradfuse's
kernels (CPU or CUDA), the payloads travel through ``torch.distributed`` (CUDA buckets on
the bucket's device: ``gradfuse.torch.device``), and the averaged result is written back
into the bucket.
No MPI and no ``gradfuse.init()`` are involved. The returned ``torch.futures.Future``
completes when the step did (the step runs on gradfuse's communication thread, so the
backward pass goes on meanwhile).

Residuals and velocities are kept per DDP bucket index and layout (the tensors' names,
shapes and dtype): when DDP rebuilds its buckets after the first iteration, the new
layout starts from zero and the old one's state is dropped.
"""
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..compressors import randomk
from ..compressors.policy import LayerPolicy
from ..errors import GradfuseError
from ..pipeline import Pipeline
from ..step.stats import Stats
from . import adam as _adam
from . import buckets as _buckets
from . import checkpoint as _ckpt
from . import regroup as _regroup
from .comm import TorchCommunicator

_HUGE = 1 << 40        # one DDP bucket = one gradfuse bucket, never split, never reduced "direct"


def _delayed_update(state, optimizer):
    m = max((float(g.get("momentum", 0) or 0) for g in optimizer.param_groups), default=0.0)
    if m < randomk.DELAY_MOMENTUM:
        return
    opts = {k: v for k, v in state._opts.items() if k not in ("min_elements", "nonfinite")}
    try:
        policy = LayerPolicy.create(state.compress, 0, **opts)
    except (TypeError, ValueError):
        return
    randomk.warn_delayed_update(policy.compressors[1:], m, f"gradfuse.torch: {type(optimizer).__name__}")


class CompressionState:
    """The state of ``comm_hook``: the compressor, its residuals and velocities, counters.

    Args:
        compress: a compressor name (``"1bit"``, ``"2bit"``, ``"topk"``, ``"randomk"``,
            ``"fp16"``, ``"bf16"``), ``None`` (uncompressed: exactly DDP's own allreduce,
            scaled by 1/world size first as DDP does), a ``get_config()`` dict, or a
            layer policy dict of name patterns (``{"*.bias": None, "*": "1bit"}``; names
            are ``module``'s parameter names).
        process_group: DDP's process group (None: the world group).
        momentum: DGC's momentum correction: each rank keeps a velocity ``u = m*u + g``
            that error feedback accumulates. The optimizer must then run with momentum 0
            (``check_optimizer`` warns otherwise).
        start_iter: DDP iterations before this one are reduced uncompressed (with
            ``momentum``, their velocity is not carried over into compression). Default 0.
        adam: the Adam correction (``gradfuse.torch.adam``): a dict of ``betas``, ``eps``,
            ``freeze_iter`` and ``clip`` (``{}`` for the defaults). The hook keeps Adam's
            moments (exact Adam until the freeze, then the frozen ``v`` and the first moment
            compressed with error feedback) and returns AdamW's step; the optimizer must
            then be SGD with momentum 0 (its ``weight_decay`` is AdamW's decoupled decay).
        module: the model (or its DDP wrapper), to name tensors by parameter name for the
            layer policy and error messages; else they are ``bucket<i>.<j>``.
        min_elements: as ``gradfuse.Pipeline``.
        nonfinite: as ``gradfuse.Pipeline``.
        **options: the compressor's options, as ``gradfuse.Pipeline`` takes them (``ratio``,
            ``block_size``, ``error_feedback``, ``warmup_steps``, ``nesterov``, ...).

    Each DDP bucket index and layout (its tensors' names, shapes, dtype) has a pipeline
    of its own, with its own residuals, velocity and step counter. When a bucket index
    comes with a new layout (DDP rebuilds its buckets after the first iteration), the new
    layout starts from zero and the old layout's state is dropped; a layout restored by
    ``load_state_dict`` waits until a bucket with that layout arrives (a restarted DDP
    runs its first iteration on its initial layout).

    Must be made on every rank of the group, after ``init_process_group``.
    """

    __slots__ = ("compress", "momentum", "start_iter", "comm", "iteration", "calls", "layout_changes",
                 "_opts", "_names", "_pipes", "_retired", "_warned", "_lock", "_finisher", "_plain",
                 "last_error", "_regroup", "adam", "_carry", "_now")

    def __init__(self, compress="1bit", process_group=None, *, momentum=0.0, start_iter=0, module=None,
                 min_elements=0, nonfinite="raise", adam=None, **options):
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be a non-negative int, got {start_iter!r}")
        self.compress, self.momentum, self.start_iter = compress, float(momentum), start_iter
        self.comm = TorchCommunicator(process_group)
        opts = dict(options, min_elements=min_elements, nonfinite=nonfinite)
        if self.momentum:
            opts["momentum"] = self.momentum
        self.adam = _adam.configure(adam, self.momentum, start_iter, opts)
        self._carry = {}              # with adam: tensor name -> its moments, carried over DDP's rebuild
        self._now = 0                 # the DDP iteration of the bucket being handed to a pipeline
        # compress=None without momentum or Adam is DDP's own arithmetic: scale by 1/p, then the backend's sum
        self._plain = compress is None and not self.momentum and self.adam is None
        self._opts = opts
        Pipeline(compress, comm=self.comm, **opts)      # the options are checked here, on every rank
        self.iteration = 0            # DDP iterations completed (a bucket with is_last() ends one)
        self.calls = 0                # buckets reduced
        self.layout_changes = 0       # times a bucket index came with a new layout (DDP's rebuild)
        self._names = {}
        if module is not None:
            self._names = {id(p): n for n, p in module.named_parameters()}
        # (warm, bucket index, layout) -> [Pipeline, used since made or restored]
        self._pipes = {}
        self._retired = Stats()       # counters of the pipelines dropped so far
        self._warned = False
        # DDP re-raises a hook's error as a RuntimeError carrying its message; the original
        # (a NonFiniteError, a MismatchError, ...) stays here, for code that must tell them apart
        self.last_error = None
        self._regroup = None          # a restarted DDP's first iteration on restored layouts
        self._lock = threading.Lock()
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="gradfuse-ddp-hook")

    def _make(self, warm):
        if warm:
            mom = {"momentum": self.momentum} if self.momentum else {}
            return Pipeline(None, fusion_threshold=_HUGE, direct_threshold=_HUGE, comm=self.comm,
                            average=not self._plain, **mom)
        return Pipeline(self.compress, fusion_threshold=_HUGE, direct_threshold=_HUGE, comm=self.comm,
                        average=not self._plain, **self._opts)

    # --- what the user reads ---------------------------------------------------------
    @property
    def stats(self):
        """Counters summed over every bucket's pipeline (``steps``, ``bytes_sent``, ...)."""
        total = dict(self._retired.as_dict())
        for pipe, _ in list(self._pipes.values()):
            for k, v in pipe.stats.as_dict().items():
                total[k] += v
        return total

    def check_optimizer(self, optimizer, scaler=None):
        """Warn (once) if ``momentum`` is set here and ``optimizer`` has momentum too: the
        velocity would be applied twice (DGC's correction moves it out of the optimizer).
        With ``adam``: warn (once) when the optimizer would apply Adam (or momentum) again,
        and refuse a ``scaler`` (an enabled ``torch.amp.GradScaler``) with a ValueError;
        without either: warn when an Adam-family optimizer meets a lossy compressor
        (``gradfuse.torch.adam.check_optimizer``). Apart from these, random-k below ratio 0.1
        with error feedback warns once per process when the optimizer's momentum is 0.5 or
        more (``gradfuse.compressors.randomk.warn_delayed_update``)."""
        _delayed_update(self, optimizer)
        if self.adam is not None or not self.momentum:
            return _adam.check_optimizer(self, optimizer, scaler)
        if self._warned:
            return False
        for group in optimizer.param_groups:
            m = group.get("momentum", 0) or 0
            betas = group.get("betas")
            if m or betas:
                self._warned = True
                warnings.warn(f"gradfuse.torch: CompressionState(momentum={self.momentum}) keeps the momentum, "
                              f"but {type(optimizer).__name__} has "
                              f"{'momentum=' + str(m) if m else 'betas=' + str(betas)}; run SGD with momentum=0 "
                              f"(the velocity would otherwise be applied twice)", RuntimeWarning, stacklevel=2)
                return True
        return False

    def state_dict(self):
        """This rank's residuals, velocities and step counters (restore with ``load_state_dict``).

        Returns:
            A dict of CPU tensors and plain Python values (``gradfuse.torch.checkpoint``):
            ``torch.save`` writes it and ``torch.load`` (``weights_only=True``) reads it back.

        Example:
            >>> torch.save(state.state_dict(), f"ckpt/hook-rank{dist.get_rank()}.pt")
        """
        buckets = [{"warm": warm, "index": idx, "names": list(layout[0]),
                    "shapes": [list(s) for s in layout[1]], "dtype": layout[2],
                    "state": _ckpt.to_tensors(pipe.state_dict())}
                   for (warm, idx, layout), (pipe, _) in self._pipes.items()]
        return {"format": _ckpt.FORMAT, "iteration": self.iteration, "calls": self.calls,
                "world_size": self.comm.size, "buckets": buckets}

    def load_state_dict(self, sd, on_mismatch="raise", where="the hook state_dict"):
        """Restore a ``state_dict()`` of this rank, bit-exactly (``gradfuse-torch-1`` dicts
        too; another format is refused by name).

        Every bucket's state is validated and compared with this hook before any is
        restored, as ``gradfuse.Pipeline.load_state_dict`` does: non-finite values, wrong
        dtypes or sizes, negative counters, another compressor or another rank raise
        ``GradfuseError`` naming ``where``, the bucket and the problem, and the live state
        stays as it was (``on_mismatch="reset"``: start fresh instead). A state saved on
        another number of ranks keeps what every rank shares and zeroes the residuals and
        velocities, with a warning. Returns True if every bucket's state was restored."""
        _ckpt.check_format(sd)
        sd = _ckpt.to_numpy(sd)
        for field in ("iteration", "calls"):
            v = sd.get(field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise GradfuseError(f"gradfuse.torch: {where}: {field} is {v!r}; it must be an integer >= 0")
        loads = []
        for b in sd["buckets"]:
            layout = (tuple(b["names"]), tuple(tuple(s) for s in b["shapes"]), b["dtype"])
            pipe = self._make(bool(b["warm"]))
            at = (f"{where}, DDP bucket {int(b['index'])}{' (warm-up)' if b['warm'] else ''} of "
                  f"{len(layout[0])} tensors ({', '.join(layout[0][:2])}{', ...' if len(layout[0]) > 2 else ''})")
            pipe.load_state_dict(b["state"], on_mismatch, at, check_only=True)
            loads.append((pipe, b, layout, at))
        with self._lock:
            self.iteration, self.calls = int(sd["iteration"]), int(sd["calls"])
            self._retire(list(self._pipes))
            self._regroup = None
            ok = True
            for pipe, b, layout, at in loads:
                ok = pipe.load_state_dict(b["state"], on_mismatch, at) and ok
                self._pipes[(bool(b["warm"]), int(b["index"]), layout)] = [pipe, False]
        return ok

    def __repr__(self):
        adam = "" if self.adam is None else f"adam={self.adam!r}, "
        return (f"gradfuse.torch.CompressionState(compress={self.compress!r}, momentum={self.momentum}, {adam}"
                f"start_iter={self.start_iter}, iteration={self.iteration}, {self.comm.describe()})")

    # --- one bucket --------------------------------------------------------------------
    def _retire(self, keys):
        for key in keys:
            pipe, _ = self._pipes.pop(key)
            if self.adam is not None:
                _adam.harvest(self, key, pipe)
            for k, v in pipe.stats.as_dict().items():
                setattr(self._retired, k, getattr(self._retired, k) + v)

    def _pipeline(self, warm, idx, layout):
        """The pipeline of this bucket index and layout; a new layout drops the old ones' state."""
        key = (warm, idx, layout)
        entry = self._pipes.get(key)
        if entry is None:
            stale = [k for k, (_, used) in self._pipes.items() if k[1] == idx and used]
            if any(k[0] == warm for k in stale):
                self.layout_changes += 1
            self._retire(stale)
            entry = self._pipes[key] = [self._make(warm), True]
            if self.adam is not None:
                _adam.carry(self, entry[0], layout)
        elif not entry[1]:                    # a restored layout, now in use: the others go
            self._retire([k for k, (_, used) in self._pipes.items() if k[1] == idx and used])
            entry[1] = True
        return entry[0]

    def _regrouped(self, warm, idx, io):
        """The ``Regroup`` that takes this bucket (a restarted DDP's first buckets, whose
        tensors a restored layout holds in DDP's rebuilt grouping), or None."""
        rg = self._regroup
        if rg is not None and not rg.done and rg.covers(io):
            return rg
        if rg is not None:
            rg.flush(self._submit_group, io)      # no bucket's future may wait for tensors that never come
        self._regroup = None
        if not self._names or (warm, idx, io.layout) in self._pipes:
            return None
        restored = {k: k[2] for k, (_, used) in self._pipes.items() if not used and k[0] == warm}
        rg = _regroup.Regroup(restored, self._finisher, self._failed) if restored else None
        if rg is None or not rg.covers(io):
            return None
        self._regroup = rg
        return rg

    def _submit_group(self, key, layout, views, src):
        """Start a regrouped step: ``views`` (laid out as ``layout``) on the pipeline of ``key``."""
        pipe = self._pipeline(key[0], key[1], layout)
        if self.adam is not None:
            _adam.freeze_if_due(self, pipe, self._now)
        return src.submit(pipe, views, layout[0])

    def _failed(self, exc):
        self.last_error = exc

    def reduce(self, bucket):
        """Start the averaged exchange of ``bucket``; a Future of its buffer."""
        idx = bucket.index()
        warm = self.compress is not None and self.iteration < self.start_iter
        if self._plain:
            # DDP's own arithmetic without a hook: times 1/p (as a float32 scalar), then the sum
            bucket.buffer().mul_(1.0 / self.comm.size)
        io = _buckets.read(bucket, self._names)
        if self.adam is not None:
            _adam.clip(self, io)
        with self._lock:
            self.calls += 1
            last = bucket.is_last()
            self._now = self.iteration
            if last:
                self.iteration += 1
            rg = self._regrouped(warm, idx, io)
            if rg is not None:
                return rg.add(io, self._submit_group, last)
            pipe = self._pipeline(warm, idx, io.layout)
            if self.adam is not None:
                _adam.freeze_if_due(self, pipe, self._now)
            handle = io.submit(pipe)
        fut = io.future()

        def finish():
            try:
                handle.wait()
                io.finish()
            except BaseException as exc:       # DDP re-raises it in backward's finalization
                self.last_error = exc
                fut.set_exception(exc)
            else:
                fut.set_result(io.buf)
        self._finisher.submit(finish)
        return fut


def comm_hook(state, bucket):
    """The DDP communication hook: ``ddp.register_comm_hook(state, comm_hook)``.

    Args:
        state: a ``gradfuse.torch.CompressionState``.
        bucket: DDP's ``dist.GradBucket``.

    Returns:
        A ``torch.futures.Future`` of the bucket's averaged buffer.
    """
    return state.reduce(bucket)
