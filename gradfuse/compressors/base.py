"""The compressor contract.

A compressor defines, for one fusion bucket of ``n`` float32 values ``c`` (its tensors'
values one after another, in bucket order):

* ``bucket_layout(ctx)``: the arrays that travel, as ``[(dtype, count), ...]``. Their sizes
  may depend on what every rank knows alike about the bucket: ``ctx.counts``, the element
  counts of its tensors (the ranks agree on the shapes), and the bucket index and step.
  The default is ``payload_layout(ctx.n)``, so a format that depends on ``n`` only (an
  elementwise one, like fp16 or 2-bit) just defines ``payload_layout(n)``, as user
  compressors written for the first contract do (they keep working unchanged);
* ``compress(c, payloads, ctx)``: fill the payload arrays from ``c`` (pure: no state);
* ``decompress(payloads, n, ctx)``: the float32 values a receiver decodes from one payload.

A per-tensor format (scales or selections that restart at every tensor, as 1-bit, top-k
and random-k do) overrides ``bucket_layout`` and reads the tensor boundaries from
``ctx.counts`` in all three (``tensor_counts(ctx, n)``: the counts, or one tensor of all
``n`` values when a caller gave none).

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

``ctx`` is a ``BucketContext`` (bucket index, step, seed, tensor counts) for compressors
that need it (random-k draws its indices from the seed, which every rank derives
identically). Its
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

from . import cost

F32 = np.dtype(np.float32)
FLT_MAX = float(np.finfo(np.float32).max)
#: how far one float32 rounding can move a value: at most a factor 1 + 2^-24 (round to
#: nearest); ``settled_bound`` uses twice that per rounding
ROUNDING = 2.0 ** -23


def settled_bound(c, p, terms=1, limit=0.0):
    """The residual bound of a compressor whose fused kernels, given values with every
    ``|c|`` <= ``c``, write residuals and payloads that decode to at most ``c`` grown by
    ``terms`` float32 roundings (a mean of ``|c|`` over a block, summed in float32, may exceed
    the block's largest ``|c|`` by that much) or at most ``limit`` (a fixed decoded value:
    2-bit's absolute threshold): that bound, or None when ``p`` such payloads, or a sum of
    ``terms`` values, could come within a factor 256 of float32's largest value (then
    the step is not known not to overflow). ``Compressor.settle`` of the built-ins."""
    grown = c * (1.0 + terms * ROUNDING)
    if not grown < float("inf") or not max(grown, limit) * (terms + p) * 256.0 < FLT_MAX:
        return None
    return grown


@dataclass(frozen=True)
class BucketContext:
    """What a compressor may know about one bucket, the same on every rank.

    ``counts``: the element counts of the bucket's tensors, in bucket order (empty: not
    given, the bucket is one tensor); ``n`` is their sum. ``shapes``: the tensors' shapes,
    in the same order (empty: not given; ``tensor_shapes`` then takes each as 1-D), for
    formats that see a tensor as a matrix.
    """

    bucket: int = 0
    step: int = 0
    seed: int = 0
    device: str = "cpu"
    counts: tuple = ()
    shapes: tuple = ()

    @property
    def n(self):
        """The bucket's element count: the sum of ``counts``."""
        return sum(self.counts)


def tensor_counts(ctx, n):
    """The bucket's tensor element counts: ``ctx.counts``, or ``(n,)`` when none were given."""
    counts = ctx.counts if ctx is not None and ctx.counts else (n,)
    if sum(counts) != n:
        raise ValueError(f"the bucket has {n} elements but its tensor counts sum to {sum(counts)}")
    return counts


def tensor_shapes(ctx, n):
    """The bucket's tensor shapes: ``ctx.shapes``, or each tensor as 1-D (its count) when none
    were given."""
    counts = tensor_counts(ctx, n)
    shapes = ctx.shapes if ctx is not None and ctx.shapes else tuple((m,) for m in counts)
    if len(shapes) != len(counts) or any(int(np.prod(s, dtype=np.int64)) != m for s, m in zip(shapes, counts)):
        raise ValueError(f"the bucket's tensor shapes {shapes} do not match its tensor counts {counts}")
    return shapes


def block_parts(ctx, n, per_word, block):
    """Per tensor of a block format (codes packed ``per_word`` to a uint32 word, one float32
    per ``block`` elements, both restarting at every tensor): the (element, word, value)
    starts and the (elements, words, values) counts."""
    w = s = e = 0
    for m in tensor_counts(ctx, n):
        nw, ns = -(-m // per_word), -(-m // block)
        yield e, w, s, m, nw, ns
        e, w, s = e + m, w + nw, s + ns


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


ADAM_RULES = ("adam", "adamw")


def _adam_options(name, adam, betas, eps, momentum):
    """``(adam, betas, eps)`` checked: the rule or None, ``(beta1, beta2)``, epsilon."""
    if adam is None:
        if betas is not None or eps is not None:
            raise ValueError(f"compressor {name!r}: options 'betas' and 'eps' belong to the Adam correction; "
                             f"give adam='adam' or adam='adamw' too (got betas={betas!r}, eps={eps!r})")
        return None, None, None
    if adam not in ADAM_RULES:
        raise ValueError(f"compressor {name!r}: option 'adam' must be one of {', '.join(map(repr, ADAM_RULES))} "
                         f"or None, got {adam!r}")
    if momentum:
        raise ValueError(f"compressor {name!r}: options 'adam' and 'momentum' exclude each other (Adam keeps "
                         f"its first moment instead of a velocity), got adam={adam!r}, momentum={momentum!r}")
    betas = (0.9, 0.999) if betas is None else betas
    ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
        not isinstance(b, (bool, np.bool_)) and isinstance(b, (int, float, np.integer, np.floating))
        and 0 <= b < 1 for b in betas)
    if not ok:
        raise ValueError(f"compressor {name!r}: option 'betas' must be two numbers in [0, 1), got {betas!r}")
    eps = 1e-8 if eps is None else eps
    if (isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer, np.floating))
            or not 0 <= eps < float("inf")):
        raise ValueError(f"compressor {name!r}: option 'eps' must be a finite number >= 0, got {eps!r}")
    return adam, (float(betas[0]), float(betas[1])), float(eps)


#: the largest block size the kernels take (their block argument is a C int), a multiple of 32
MAX_BLOCK = 2**31 - 32
#: step counts (``warmup_steps``, ``sparsity_warmup``) compare with the step counter, an int64
MAX_STEPS = 2**63 - 1


def _check_bool(name, value, who=None):
    if not isinstance(value, (bool, np.bool_)):
        prefix = f"compressor {who!r}: " if who else ""
        raise TypeError(f"{prefix}option {name!r} must be True or False, got {value!r}")
    return bool(value)


class Compressor(ABC):
    """Base class of gradfuse compressors.

    Args:
        error_feedback: keep the compression error and add it to the next step's
            gradients (``c = g + e; e = c - decompress(compress(c))``). Default: the
            class's ``error_feedback_default`` (on for 1bit, 2bit, topk, randomk).
        warmup_steps: run the first N steps of a pipeline uncompressed.
        momentum: DGC's momentum correction (``gradfuse.compressors.momentum``): each rank
            keeps a velocity ``u = m * u + g`` per bucket, and error feedback accumulates
            ``u`` instead of ``g`` (the optimizer must then run without momentum). 0, the
            default, is off; a number in [0, 1). The MXNet trainers set it from the
            optimizer (docs/mxnet.md).
        nesterov: with ``momentum``, send the Nesterov value ``m * u + g`` (DGC's variant).
        momentum_masking: zero the velocity where the compressor sent a value (DGC's
            momentum factor masking). Default: on for the sparsifiers (compressors with a
            ``ratio`` option: top-k, random-k) when they keep error feedback, else off.
        sparsity_warmup: top-k / random-k only: over the first N compressed steps the ratio
            ramps down exponentially, 25%, 6.25%, 1.5625%, ... (each stage 4x sparser, equal
            stages) to ``ratio`` (DGC's warm-up). 0, the default, is off.
        adam: the Adam correction (``gradfuse.compressors.adam``): ``"adam"`` (MXNet's
            Adam: its bias correction in the step size, epsilon added to the uncorrected
            ``sqrt(v)``) or ``"adamw"`` (``torch.optim.AdamW``'s). Each rank's first moment
            is kept in the compressor state and error feedback runs on it; the second moment
            is updated exactly during a warm-up and then frozen. The pipeline's results are
            then the preconditioned steps (the optimizer must apply them as they are, without
            Adam). ``warmup_steps`` is the freeze point (DeepSpeed's ``freeze_step``); 0, the
            default, freezes by the adaptive rule. None, the default, is off.
        betas: with ``adam``: the moments' decay rates ``(beta1, beta2)``, default (0.9, 0.999).
        eps: with ``adam``: epsilon, default 1e-8.
        **options: the compressor's own options (see ``OPTIONS``).

    ``momentum``, ``adam`` and ``sparsity_warmup`` appear in ``get_config()`` only when set,
    so the config (and the plan digests, residual keys and checkpoints) of a compressor
    without them is what it was before they existed.
    """

    name = "abstract"
    lossless = False
    # True when the fused methods (compress_table, decompress_sum_table, pack) also take
    # device memory (kernels(ctx)); otherwise the GPU path uses the plain methods on host
    # copies, so a fused method written for host pointers never sees a device pointer
    supports_cuda = False
    collective = "allgather"
    # the collectives ``algorithm="auto"`` chooses among by the cost model (job algorithms
    # of gradfuse.step.jobs; empty: always ``collective``), and the option values
    # that name a job algorithm differently
    AUTO = ()
    ALGORITHM_NAMES = {}
    error_feedback_default = False
    #: whether the trainers turn an optimizer correction (DGC's momentum correction for SGD,
    #: the Adam correction for Adam and AdamW) on by default for this compressor when it is
    #: lossy and keeps error feedback (``corrects_by_default``); a compressor whose own
    #: algorithm rules the correction out sets it False
    optimizer_correction = True
    OPTIONS = {}                # option name -> default value

    def __init__(self, error_feedback=None, warmup_steps=0, momentum=0.0, nesterov=False,
                 momentum_masking=None, sparsity_warmup=0, adam=None, betas=None, eps=None, **options):
        sparse = "ratio" in self.OPTIONS
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            common = ["error_feedback", "warmup_steps", "momentum", "nesterov", "momentum_masking"]
            valid = ", ".join(sorted(list(self.OPTIONS) + common + (["sparsity_warmup"] if sparse else [])))
            raise TypeError(f"compressor {self.name!r}: unknown option(s) {', '.join(unknown)}; "
                            f"valid options: {valid}; "
                            f"with the Adam correction: adam, betas, eps")
        self.options = {k: options.get(k, v) for k, v in self.OPTIONS.items()}
        self.error_feedback = (self.error_feedback_default if error_feedback is None
                               else _check_bool("error_feedback", error_feedback, self.name))
        if (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer))
                or not 0 <= warmup_steps <= MAX_STEPS):
            raise ValueError(f"compressor {self.name!r}: option 'warmup_steps' must be an int in [0, 2**63 - 1] "
                             f"(steps), got {warmup_steps!r}")
        self.warmup_steps = int(warmup_steps)
        # DGC's momentum correction and sparsity warm-up (gradfuse.compressors.momentum)
        if (isinstance(momentum, (bool, np.bool_)) or not isinstance(momentum, (int, float, np.integer, np.floating))
                or not 0 <= momentum < 1):
            raise ValueError(f"compressor {self.name!r}: option 'momentum' must be a number in [0, 1), "
                             f"got {momentum!r}")
        self.momentum = float(momentum)
        self.nesterov = _check_bool("nesterov", nesterov, self.name)
        if self.nesterov and not self.momentum:
            raise ValueError(f"compressor {self.name!r}: option 'nesterov=True' needs momentum > 0, got "
                             f"momentum={momentum!r}")
        if momentum_masking is None:
            self.momentum_masking = bool(sparse and self.error_feedback and self.momentum)
        else:
            self.momentum_masking = _check_bool("momentum_masking", momentum_masking, self.name)
            if self.momentum_masking and not self.momentum:
                raise ValueError(f"compressor {self.name!r}: option 'momentum_masking=True' needs momentum > 0, "
                                 f"got momentum={momentum!r}")
            if self.momentum_masking and not self.error_feedback:
                raise ValueError(f"compressor {self.name!r}: option 'momentum_masking=True' needs "
                                 f"error_feedback=True (it masks where the residual was cleared), got "
                                 f"error_feedback=False")
        if (isinstance(sparsity_warmup, bool) or not isinstance(sparsity_warmup, (int, np.integer))
                or not 0 <= sparsity_warmup <= MAX_STEPS):
            raise ValueError(f"compressor {self.name!r}: option 'sparsity_warmup' must be an int in "
                             f"[0, 2**63 - 1] (steps), got {sparsity_warmup!r}")
        if sparsity_warmup and not sparse:
            raise ValueError(f"compressor {self.name!r}: option 'sparsity_warmup' ramps the 'ratio' of top-k "
                             f"and random-k, and {self.name!r} has no ratio (got sparsity_warmup={sparsity_warmup})")
        self.sparsity_warmup = int(sparsity_warmup)
        self.adam, self.betas, self.eps = _adam_options(self.name, adam, betas, eps, self.momentum)
        try:
            self.validate()
        except (TypeError, ValueError) as e:
            # every option error names the compressor, user compressors' too
            if str(e).startswith(f"compressor {self.name!r}"):
                raise
            raise type(e)(f"compressor {self.name!r}: {e}") from None

    @property
    def corrects_by_default(self):
        """Whether the trainers turn an optimizer correction on by default for this
        compressor: lossy, with error feedback, and ``optimizer_correction``."""
        return bool(self.optimizer_correction and not self.lossless and self.error_feedback)

    def validate(self):
        """Check ``self.options``; raise ValueError/TypeError naming the option."""

    def get_config(self):
        """Everything that reproduces this compressor: ``create(**get_config())``."""
        cfg = {"name": self.name, **self.options}
        if not self.lossless:
            cfg["error_feedback"] = self.error_feedback
            cfg["warmup_steps"] = self.warmup_steps
        if self.momentum:
            cfg["momentum"] = self.momentum
            cfg["nesterov"] = self.nesterov
            cfg["momentum_masking"] = self.momentum_masking
        if self.sparsity_warmup:
            cfg["sparsity_warmup"] = self.sparsity_warmup
        if self.adam:
            cfg.update(adam=self.adam, betas=list(self.betas), eps=self.eps)
        return cfg

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({opts})"

    def algorithm_for(self, n, p, link=None, counts=None):
        """The collective for a bucket of ``n`` elements on ``p`` ranks: the ``algorithm``
        option, or with ``"auto"`` the cheapest of ``AUTO`` by the cost model
        (``gradfuse.compressors.cost.best`` on ``link``, default ``cost.DEFAULT_LINK``;
        ``counts``: the bucket's tensor sizes). The same on every rank: it depends only on
        values the ranks agreed on (options, sizes, p, the pipeline's link) and constants.
        """
        algo = self.options.get("algorithm", "auto")
        if algo != "auto":
            return self.ALGORITHM_NAMES.get(algo, algo)
        if len(self.AUTO) < 2 or p < 2:
            return self.AUTO[0] if self.AUTO else self.collective
        key = (n, p, link, counts)
        memo = self.__dict__.setdefault("_auto_memo", {})
        algo = memo.get(key)
        if algo is None:
            if len(memo) > 4096:
                memo.clear()
            algo = memo[key] = cost.best(self, self.AUTO, n, p, cost.DEFAULT_LINK if link is None else link,
                                         counts=counts)
        return algo

    # --- the math --------------------------------------------------------------------
    def bucket_layout(self, ctx):
        """The payload arrays of the bucket ``ctx`` describes, ``[(dtype, count), ...]``."""
        return self.payload_layout(ctx.n)

    def payload_layout(self, n):
        """The payload arrays of a bucket of ``n`` values (formats that depend on n only)."""
        raise NotImplementedError(f"compressor {self.name!r} ({type(self).__name__}) defines neither "
                                  f"bucket_layout(ctx) nor payload_layout(n)")

    @abstractmethod
    def compress(self, c, payloads, ctx):
        """Fill ``payloads`` (arrays per ``bucket_layout``) from float32 ``c``."""

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

    def compress_moment_table(self, table, moment, e_in, e_out, payloads, ctx):
        """The Adam correction's moment update fused into ``compress_table``: compress
        ``c = (b1 m + (c1 g) r) + e`` with ``moment = (m, r, b1, c1)`` (``m``, ``r`` indexed by
        bucket position), the bits of ``adam_moment`` followed by ``compress_table``; None if
        not provided (the pipeline then runs the moment pass first)."""
        return None

    def settle(self, c, p):
        """None (the default), or a bound on the residuals the fused kernels write when
        every value they compress (c = g + e) has ``|c|`` <= ``c`` on each of ``p`` ranks,
        provided no payload, residual or decoded sum of p payloads can then overflow
        float32 (``settled_bound``). With it, a pipelined host step whose inputs are finite
        decodes each bucket as soon as its exchange completes, before the step's
        non-finite verdict: it knows that verdict will be clean (``gradfuse.step``,
        "settled steps"); the residual bounds it keeps also come from here. A compressor
        that cannot promise this (every user-defined one, unless it says so) keeps
        decoding after the verdict."""
        return None


class NoneCompressor(Compressor):
    """No compression: buckets go to the MPI library's own allreduce as they are."""

    name = "none"
    lossless = True

    def __init__(self, momentum=0.0, nesterov=False, adam=None, betas=None, eps=None, **options):
        # momentum: the velocity of DGC's correction on uncompressed tensors too
        # (gradfuse.compressors.momentum), e.g. Pipeline(compress=None, momentum=0.9); adam:
        # plain Adam on the averaged gradients (gradfuse.compressors.adam)
        if options:
            raise TypeError(f"compressor 'none' takes no options (but momentum and nesterov), got "
                            f"{', '.join(sorted(options))} (the Adam correction's adam, betas and eps are taken too)")
        super().__init__(momentum=momentum, nesterov=nesterov, adam=adam, betas=betas, eps=eps)

    def compress(self, c, payloads, ctx):
        payloads[0][...] = c

    def decompress(self, payloads, n, ctx):
        return payloads[0]
