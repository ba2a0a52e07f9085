"""random-k sparsification: k_i positions of every tensor drawn from a seed every rank shares;
only values travel.

k_i as for top-k (per tensor). Per bucket and step the seed is
``seed_b = (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + bucket * 0x8CB92BA72F3D8DD7) mod 2**64``;
the t-th non-empty tensor of the bucket (t = 0, 1, ...) draws from
``s_t = splitmix64_mix(seed_b + (t + 1) * 0x9E3779B97F4A7C15)``, one position in each of k_i equal strata of its n_i elements (stratum m is
``[floor(m n / k), floor((m + 1) n / k))``, position ``start + ((h * length) >> 32)`` with
``h = splitmix64_mix(s_t + (m + 1) * 0x9E3779B97F4A7C15) >> 32``): O(k_i) work, integer
arithmetic only, the same on every device. Every element is chosen with probability
1/length (about k_i/n_i) at every step, independently of the other steps, as with a
uniform draw of k_i of n_i. Payload: the K = sum of k_i float32 values, tensor after
tensor. Collectives: ``allgather``, or ``allreduce`` (the K values summed at the shared
positions, ``gradfuse.step.sparse_allreduce``; the same bits); ``auto`` picks by
the cost model. Residual: c with the sent positions set to 0. The step counter is part of the
pipeline's checkpointed state, so a restored run draws the same positions.

With error feedback, random-k at ratio r sends each element about once every 1/r steps,
so the update is a delayed one of about 1/r steps (Stich and Karimireddy, 2019, "The
error-feedback framework"); at ratios 0.01 and 0.1 with SGD momentum 0.9 and lr 0.1 it did
not train the digits CNN in gradfuse's experiments (0.25 did), where top-k at 0.01 did
(docs/choosing.md).
``warn_delayed_update`` says so, once per process, wherever gradfuse sees both: a
random-k compressor made with DGC's momentum correction (``momentum=``), and the
trainers and the torch hook's ``check_optimizer``, which see the optimizer's momentum.
"""
import warnings

import numpy as np

from .. import _core
from .base import Compressor, array_module, kernels, settled_bound, tensor_counts
from .topk import check_ratio, ks_for

M64 = (1 << 64) - 1
#: random-k below this ratio, with error feedback, meeting momentum at or above DELAY_MOMENTUM warns
DELAY_RATIO, DELAY_MOMENTUM = 0.25, 0.5
_warned = False            # warn_delayed_update warns once per process


class DelayedUpdateWarning(UserWarning):
    """Random-k with error feedback at a small ratio meets momentum (``warn_delayed_update``)."""


def warn_delayed_update(compressors, momentum, who):
    """Warn (``DelayedUpdateWarning``, once per process) when one of ``compressors`` is
    random-k with error feedback at a ratio below ``DELAY_RATIO`` and ``momentum`` (SGD's,
    or DGC's momentum correction) is at least ``DELAY_MOMENTUM``.

    Args:
        compressors: compressor instances (others than random-k are passed over).
        momentum: the momentum they train with (None or 0: none).
        who: what to name in the message (``"gradfuse.mxnet.DistributedTrainer"``).

    Returns:
        True if it warned now.
    """
    global _warned
    if _warned or not momentum or momentum < DELAY_MOMENTUM:
        return False
    for c in compressors:
        if isinstance(c, RandomK) and c.error_feedback and c.options["ratio"] < DELAY_RATIO:
            _warned = True
            r = c.options["ratio"]
            warnings.warn(
                f"{who}: random-k at ratio {r:g} with error feedback and momentum {momentum:g}: each element is "
                f"sent about once every {1 / r:.0f} steps, so this is a delayed update of about {1 / r:.0f} steps "
                f"(Stich and Karimireddy, 2019), and in gradfuse's experiments random-k at ratios 0.01 and 0.1 did "
                f"not train the digits CNN at lr 0.1, momentum 0.9, where top-k at 0.01 did. Use "
                f"compress='topk' or a ratio >= {DELAY_RATIO:g}. (Warned once per process.)",
                DelayedUpdateWarning, stacklevel=3)
            return True
    return False


def step_seed(seed, step, bucket):
    return (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + bucket * 0x8CB92BA72F3D8DD7) & M64


class RandomK(Compressor):
    """Random-k sparsification, ``"randomk"``: ``k_i`` positions per tensor drawn from a shared seed.

    Every rank draws the same positions (from ``seed``, the step and the bucket; the
    module docstring, ``gradfuse.compressors.randomk``, gives the draw), so only the
    float32 values travel. ``k_i`` is top-k's. Error feedback is on by default.

    Args:
        ratio: the fraction of every tensor's elements sent, in (0, 1] (default 0.01).
        seed: the shared seed, an int in [0, 2**64) (default 0).
        algorithm: ``"auto"`` (default: by the cost model), ``"allgather"`` or
            ``"allreduce"`` (the values summed at the shared positions).
        **options: the options every compressor takes (``Compressor``), ``sparsity_warmup``
            included.

    Example:
        >>> import gradfuse
        >>> pipe = gradfuse.Pipeline(compress="randomk", ratio=0.01, seed=7)  # doctest: +SKIP
    """

    name = "randomk"
    error_feedback_default = True
    supports_cuda = True
    OPTIONS = {"ratio": 0.01, "seed": 0, "algorithm": "auto"}
    # every rank draws the same positions, so the values can be summed by an allreduce
    # (gradfuse.step.sparse_allreduce); "auto" picks by the cost model
    AUTO = ("allgather", "sparse_allreduce")
    ALGORITHM_NAMES = {"allreduce": "sparse_allreduce"}

    def validate(self):
        check_ratio(self.options)
        s = self.options["seed"]
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s <= M64:
            raise ValueError(f"option 'seed' must be an int in [0, 2**64), got {s!r}")
        self.options["seed"] = int(s)
        if self.options["algorithm"] not in ("auto", "allgather", "allreduce"):
            raise ValueError(f"option 'algorithm' must be one of auto, allgather, allreduce, "
                             f"got {self.options['algorithm']!r}")

    def __init__(self, **options):
        super().__init__(**options)
        warn_delayed_update([self], self.momentum, "compressor 'randomk' with DGC's momentum correction")
        self._drawn = {}      # (bucket, step) -> indices drawn by compress, reused by decompress
        self._ks = {}         # (ratio, tensor counts) -> k_i of each tensor (a bucket's, every step)

    def ks(self, ratio, counts):
        """``ks_for(ratio, counts)`` (int64, one k per tensor), kept per bucket layout: a
        step asks for it for every bucket, several times."""
        key = (ratio, counts if isinstance(counts, tuple) else tuple(np.asarray(counts).tolist()))
        ks = self._ks.get(key)
        if ks is None:
            if len(self._ks) > 4096:
                self._ks.clear()
            ks = self._ks[key] = ks_for(ratio, key[1])
            ks.setflags(write=False)
        return ks

    def ratio_at(self, ctx):
        """The ratio of the step ``ctx`` describes (every k of the step derives from it)."""
        return self.options["ratio"]

    def _seed(self, ctx):
        return step_seed(self.options["seed"], ctx.step, ctx.bucket)

    def indices(self, counts, ctx):
        """The bucket positions drawn for tensors of these element counts (host uint32)."""
        counts = np.ascontiguousarray(counts, np.int64).reshape(-1)
        ks = self.ks(self.ratio_at(ctx), counts)
        idx = np.empty(int(ks.sum()), np.uint32)
        _core.randomk_indices(self._seed(ctx), counts, ks, idx)
        return idx

    def bucket_layout(self, ctx):
        return [(np.dtype(np.float32), int(self.ks(self.ratio_at(ctx), tuple(ctx.counts)).sum()))]

    def compress(self, c, payloads, ctx):
        c = np.ascontiguousarray(c, np.float32)
        payloads[0][...] = c[self.indices(tensor_counts(ctx, c.size), ctx)]

    def decompress(self, payloads, n, ctx):
        out = np.zeros(n, np.float32)
        out[self.indices(tensor_counts(ctx, n), ctx)] = payloads[0]
        return out

    def compress_table(self, table, e_in, e_out, payloads, ctx):
        src, off, cnt, lo, hi = table
        idx = array_module(ctx).empty(payloads[0].size, np.uint32)
        ks = self.ks(self.ratio_at(ctx), tuple(cnt[lo:hi].tolist()))
        bad = kernels(ctx).randomk_compress(src, off, cnt, lo, hi, e_in, e_out, self._seed(ctx),
                                            ks, payloads[0], idx)
        if any(key[1] != ctx.step for key in self._drawn):
            self._drawn = {k: v for k, v in self._drawn.items() if k[1] == ctx.step}
        self._drawn[(ctx.bucket, ctx.step)] = idx
        return bad

    def decompress_sum_table(self, rows, table, divisor, ctx):
        dst, off, cnt, lo, hi = table
        idx = self._drawn.pop((ctx.bucket, ctx.step), None)
        xp = array_module(ctx)
        if idx is None:                    # not compressed here (e.g. a reference path): draw again
            idx = xp.asarray(self.indices(np.asarray(cnt[lo:hi]), ctx))
        if xp is np:     # the rows share the drawn positions: one row of them, the rows as they lie
            _core.sparse_decompress_shared(rows[0], idx, dst, off, cnt, lo, hi, divisor)
            return True
        rows_idx = xp.ascontiguousarray(xp.broadcast_to(idx, (rows[0].shape[0], idx.size)))
        kernels(ctx).sparse_decompress_sum(xp.ascontiguousarray(rows[0]), rows_idx, dst, off, cnt, lo, hi, divisor)
        return True

    def settle(self, c, p):
        """As top-k's: the drawn values are c, the residual c off the drawn positions and 0 on
        them."""
        return settled_bound(c, p)
