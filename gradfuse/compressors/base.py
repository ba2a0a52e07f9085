"""The compressor contract.

A compressor defines, for one fusion bucket of ``n`` float32 values ``c``:

* ``payload_layout(n)``: the arrays that travel, as ``[(dtype, count), ...]``; their sizes
  depend on ``n`` only (so every rank's payload has the same size);
* ``compress(c, payloads, ctx)``: fill the payload arrays from ``c`` (pure: no state);
* ``decompress(payloads, n, ctx)``: the float32 values a receiver decodes from one payload.

That is all a user-defined compressor needs (register it with
``gradfuse.register_compressor``). Error feedback is not the compressor's business: the
pipeline wraps every lossy compressor in the same math (``gradfuse.compressors.error_feedback``).

Built-in compressors also provide fused kernels, which must give the same bits as the
plain methods plus the wrapper:

* ``compress_table(table, e_in, e_out, payloads, ctx)``: reads the bucket straight from
  the tensors (a pointer table), adds the residual, compresses and writes the new
  residual in one pass; returns the number of non-finite values seen (0 = clean);
* ``decompress_sum_table(rows, table, divisor, ctx)``: sums the payloads of all ranks
  (``rows``: one ``[p, count]`` array per payload, rank r in row r) in rank order and
  writes ``sum / divisor`` into the tensors.

``collective`` says how payloads travel: ``"allgather"`` (then every rank decodes and
sums every payload), or ``"allreduce"`` for formats the network can sum directly
(fp16/bf16: an MPI user op adds them, pairwise in float32, rounded once).

``ctx`` is a ``BucketContext`` (bucket index, step, seed) for compressors that need it
(random-k draws its indices from the seed, which every rank derives identically). Its
``device`` is ``"cpu"`` or ``"cuda"``: on ``"cuda"`` the table pointers, residuals and
payloads of the fused methods are device memory (cupy arrays); ``kernels(ctx)`` and
``array_module(ctx)`` give ``gradfuse._core`` / numpy or ``gradfuse.gpu`` / cupy, whose
functions take the same arguments, and set ``supports_cuda = True``. Any other
compressor works on both: on the GPU its plain methods run on host copies (slower, same
bits) and its fused methods are not called.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class BucketContext:
    bucket: int = 0
    step: int = 0
    seed: int = 0
    device: str = "cpu"


def kernels(ctx):
    """The kernel module for the bucket's memory: ``gradfuse._core`` or ``gradfuse.gpu``."""
    if ctx.device == "cpu":
        from .. import _core
        return _core
    from .. import gpu
    return gpu


def array_module(ctx):
    """numpy, or cupy for buckets in device memory."""
    if ctx.device == "cpu":
        return np
    from .. import gpu
    return gpu.cupy()


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"option {name!r} must be True or False, got {value!r}")
    return bool(value)


class Compressor(ABC):
    """Base class of gradfuse compressors.

    Args:
        error_feedback: keep the compression error and add it to the next step's
            gradients (``c = g + e; e = c - decompress(compress(c))``). Default: the
            class's ``error_feedback_default`` (on for 1bit, 2bit, topk, randomk).
        warmup_steps: run the first N steps of a pipeline uncompressed.
        **options: the compressor's own options (see ``OPTIONS``).
    """

    name = "abstract"
    lossless = False
    # True when the fused methods (compress_table, decompress_sum_table, pack) also take
    # device memory (kernels(ctx)); otherwise the GPU path uses the plain methods on host
    # copies, so a fused method written for host pointers never sees a device pointer
    supports_cuda = False
    collective = "allgather"
    error_feedback_default = False
    OPTIONS = {}                # option name -> default value

    def __init__(self, error_feedback=None, warmup_steps=0, **options):
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            valid = ", ".join(sorted(self.OPTIONS) + ["error_feedback", "warmup_steps"])
            raise TypeError(f"compressor {self.name!r}: unknown option(s) {', '.join(unknown)}; "
                            f"valid options: {valid}")
        self.options = {k: options.get(k, v) for k, v in self.OPTIONS.items()}
        self.error_feedback = (self.error_feedback_default if error_feedback is None
                               else _check_bool("error_feedback", error_feedback))
        if (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer))
                or warmup_steps < 0):
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
        self.warmup_steps = int(warmup_steps)
        self.validate()

    def validate(self):
        """Check ``self.options``; raise ValueError/TypeError naming the option."""

    def get_config(self):
        """Everything that reproduces this compressor: ``create(**get_config())``."""
        cfg = {"name": self.name, **self.options}
        if not self.lossless:
            cfg["error_feedback"] = self.error_feedback
            cfg["warmup_steps"] = self.warmup_steps
        return cfg

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({opts})"

    # --- the math --------------------------------------------------------------------
    def payload_layout(self, n):
        raise NotImplementedError

    @abstractmethod
    def compress(self, c, payloads, ctx):
        """Fill ``payloads`` (arrays per ``payload_layout``) from float32 ``c``."""

    @abstractmethod
    def decompress(self, payloads, n, ctx):
        """The float32 array of ``n`` values one payload decodes to."""

    def decompress_sum(self, rows, n, ctx):
        """Sum of every rank's decoded payload, in rank order, starting from rank 0's."""
        p = rows[0].shape[0] if rows else 1
        acc = None
        for r in range(p):
            v = self.decompress([row[r] for row in rows], n, ctx).astype(np.float32, copy=False)
            acc = v.copy() if acc is None else np.add(acc, v, out=acc)
        return acc if acc is not None else np.zeros(n, np.float32)

    # --- fused kernels (optional) -----------------------------------------------------
    def compress_table(self, table, e_in, e_out, payloads, ctx):
        """Fused residual + compression straight from the tensors; None if not provided."""
        return None

    def decompress_sum_table(self, rows, table, divisor, ctx):
        """Fused decode-sum-divide into the tensors; False if not provided."""
        return False


class NoneCompressor(Compressor):
    """No compression: buckets go to the MPI library's own allreduce as they are."""

    name = "none"
    lossless = True

    def __init__(self, **options):
        if options:
            raise TypeError(f"compressor 'none' takes no options, got {', '.join(sorted(options))}")
        super().__init__()

    def compress(self, c, payloads, ctx):
        payloads[0][...] = c

    def decompress(self, payloads, n, ctx):
        return payloads[0]
