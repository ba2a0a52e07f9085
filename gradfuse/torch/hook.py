"""gradfuse's compressors as a DDP communication hook.

    state = gradfuse.torch.CompressionState("1bit", momentum=0.9)
    ddp.register_comm_hook(state, gradfuse.torch.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.0)   # the momentum is in state

DDP hands the hook each ``GradBucket``: one flat, fused buffer of gradients. The hook cuts
it into zero-copy numpy views along ``bucket.gradients()`` (so every tensor keeps its own
1-bit scale and its own top-k / random-k selection), and runs one ``gradfuse.Pipeline``
step on them over a ``TorchCommunicator`` on DDP's process group: the ranks agree on the
bucket, error feedback and compression run in gradfuse's kernels, the payloads travel
through ``torch.distributed``, and the averaged result is written back into the bucket.
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
import torch

from ..pipeline import Pipeline
from ..step.stats import Stats
from . import adam as _adam
from .comm import TorchCommunicator

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}
_HUGE = 1 << 40        # one DDP bucket = one gradfuse bucket, never split, never reduced "direct"


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
                 "last_error", "adam", "_carry")

    def __init__(self, compress="1bit", process_group=None, *, momentum=0.0, start_iter=0, module=None,
                 min_elements=0, nonfinite="raise", adam=None, **options):
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be a non-negative int, got {start_iter!r}")
        self.compress, self.momentum, self.start_iter = compress, float(momentum), start_iter
        self.comm = TorchCommunicator(process_group)
        opts = dict(options, min_elements=min_elements, nonfinite=nonfinite)
        if self.momentum:
            opts["momentum"] = self.momentum
        self.adam = _adam.configure(adam, compress, self.momentum, start_iter, opts)
        self._carry = {}              # with adam: tensor name -> its moments, carried over DDP's rebuild
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
        (``gradfuse.torch.adam.check_optimizer``)."""
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
        """This rank's residuals, velocities and step counters (restore with ``load_state_dict``)."""
        buckets = [{"warm": warm, "index": idx, "names": list(layout[0]),
                    "shapes": [list(s) for s in layout[1]], "dtype": layout[2], "state": pipe.state_dict()}
                   for (warm, idx, layout), (pipe, _) in self._pipes.items()]
        return {"format": "gradfuse-torch-1", "iteration": self.iteration, "calls": self.calls,
                "world_size": self.comm.size, "buckets": buckets}

    def load_state_dict(self, sd):
        """Restore a ``state_dict()`` of this rank, bit-exactly. Returns True if every
        bucket's state was restored."""
        if not isinstance(sd, dict) or sd.get("format") != "gradfuse-torch-1":
            raise ValueError("not a gradfuse.torch CompressionState state_dict (format "
                             f"{sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r})")
        with self._lock:
            self.iteration, self.calls = int(sd["iteration"]), int(sd["calls"])
            self._retire(list(self._pipes))
            ok = True
            for b in sd["buckets"]:
                layout = (tuple(b["names"]), tuple(tuple(s) for s in b["shapes"]), b["dtype"])
                pipe = self._make(bool(b["warm"]))
                ok = pipe.load_state_dict(b["state"]) and ok
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

    def _views(self, bucket):
        """Zero-copy numpy views of the bucket's tensors, their names and layout, the buffer."""
        buf = bucket.buffer()
        idx = bucket.index()
        if buf.device.type != "cpu":
            raise NotImplementedError(f"gradfuse.torch: bucket {idx} is on {buf.device}; only CPU tensors are "
                                      f"supported (the CUDA path through DLPack is not written yet)")
        if buf.dtype not in _NUMPY:
            raise TypeError(f"gradfuse.torch: bucket {idx} holds {buf.dtype} gradients; gradfuse reduces "
                            f"float32, float16 and float64 tensors")
        flat = buf.detach().numpy()
        grads = bucket.gradients()
        params = bucket.parameters()
        names, views, shapes, off = [], [], [], 0
        for j, g in enumerate(grads):
            n = g.numel()
            name = self._names.get(id(params[j])) if j < len(params) else None
            names.append(f"bucket{idx}.{name if name is not None else j}")
            views.append(flat[off:off + n].reshape(tuple(g.shape)))
            shapes.append(tuple(g.shape))
            off += n
        if off != flat.size:
            raise ValueError(f"gradfuse.torch: bucket {idx}: its gradients hold {off} elements, its buffer "
                             f"{flat.size}; the tensor boundaries cannot be read")
        return buf, views, names, (tuple(names), tuple(shapes), str(flat.dtype))

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

    def reduce(self, bucket):
        """Start the averaged exchange of ``bucket``; a Future of its buffer."""
        buf, views, names, layout = self._views(bucket)
        idx = bucket.index()
        warm = self.compress is not None and self.iteration < self.start_iter
        if self._plain:
            # DDP's own arithmetic without a hook: times 1/p (as a float32 scalar), then the sum
            buf.mul_(1.0 / self.comm.size)
        with self._lock:
            pipe = self._pipeline(warm, idx, layout)
            if self.adam is not None:
                _adam.before_step(self, pipe, buf)
            handle = pipe.allreduce_async(views, out=views, names=names)
            self.calls += 1
            if bucket.is_last():
                self.iteration += 1
        fut = torch.futures.Future()

        def finish():
            try:
                handle.wait()
            except BaseException as exc:       # DDP re-raises it in backward's finalization
                self.last_error = exc
                fut.set_exception(exc)
            else:
                fut.set_result(buf)
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
