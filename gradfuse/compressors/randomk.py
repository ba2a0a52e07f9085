"""random-k sparsification: k positions drawn from a seed every rank shares; only values travel.

k as for top-k. Per bucket and step the seed is
``(seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + bucket * 0x8CB92BA72F3D8DD7) mod 2**64``;
position i gets ``h_i = splitmix64_mix(seed + i + 0x9E3779B97F4A7C15) >> 32`` and the k
smallest h_i are chosen (ties: lower index), ascending. Payload: k float32 values.
Residual: c with the sent positions set to 0. The step counter is part of the
pipeline's checkpointed state, so a restored run draws the same positions.
"""
import numpy as np

from .. import _core
from .base import Compressor, array_module, kernels
from .topk import check_ratio, k_for

M64 = (1 << 64) - 1


def step_seed(seed, step, bucket):
    return (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + bucket * 0x8CB92BA72F3D8DD7) & M64


class RandomK(Compressor):
    name = "randomk"
    error_feedback_default = True
    supports_cuda = True
    OPTIONS = {"ratio": 0.01, "seed": 0}

    def validate(self):
        check_ratio(self.options)
        s = self.options["seed"]
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s <= M64:
            raise ValueError(f"option 'seed' must be an int in [0, 2**64), got {s!r}")
        self.options["seed"] = int(s)

    def __init__(self, **options):
        super().__init__(**options)
        self._drawn = {}      # (bucket, step) -> indices drawn by compress, reused by decompress

    def _seed(self, ctx):
        return step_seed(self.options["seed"], ctx.step, ctx.bucket)

    def indices(self, n, ctx):
        idx = np.empty(k_for(self.options["ratio"], n), np.uint32)
        _core.randomk_indices(self._seed(ctx), n, idx.size, idx)
        return idx

    def payload_layout(self, n):
        return [(np.dtype(np.float32), k_for(self.options["ratio"], n))]

    def compress(self, c, payloads, ctx):
        c = np.ascontiguousarray(c, np.float32)
        payloads[0][...] = c[self.indices(c.size, ctx)]

    def decompress(self, payloads, n, ctx):
        out = np.zeros(n, np.float32)
        out[self.indices(n, ctx)] = payloads[0]
        return out

    def compress_table(self, table, e_in, e_out, payloads, ctx):
        src, off, cnt, lo, hi = table
        idx = array_module(ctx).empty(payloads[0].size, np.uint32)
        bad = kernels(ctx).randomk_compress(src, off, cnt, lo, hi, e_in, e_out, self._seed(ctx), idx.size,
                                     payloads[0], idx)
        if any(key[1] != ctx.step for key in self._drawn):
            self._drawn = {k: v for k, v in self._drawn.items() if k[1] == ctx.step}
        self._drawn[(ctx.bucket, ctx.step)] = idx
        return bad

    def decompress_sum_table(self, rows, table, divisor, ctx):
        dst, off, cnt, lo, hi = table
        n = int(off[hi - 1] + cnt[hi - 1]) if hi > lo else 0
        idx = self._drawn.pop((ctx.bucket, ctx.step), None)
        xp = array_module(ctx)
        if idx is None:                    # not compressed here (e.g. a reference path): draw again
            idx = xp.asarray(self.indices(n, ctx))
        rows_idx = xp.ascontiguousarray(xp.broadcast_to(idx, (rows[0].shape[0], idx.size)))
        kernels(ctx).sparse_decompress_sum(xp.ascontiguousarray(rows[0]), rows_idx, dst, off, cnt, lo, hi, divisor)
        return True
