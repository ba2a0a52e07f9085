"""top-k sparsification: the k_i largest ``|c|`` of every tensor of a bucket, as values + indices.

Each tensor selects its own k_i = min(n_i, max(1, ceil(ratio * n_i))) elements (0 for an
empty tensor), as GRACE and DGC do, so a small-magnitude tensor is never starved by a
large one in the same bucket. Ties go to the lower index; indices are uint32 bucket
positions, tensor after tensor, ascending. Payload: K = sum of k_i float32 values, then K
uint32 indices. Residual: c, with the sent positions set to 0.
"""
import math

import numpy as np

from .. import _core
from .base import Compressor, array_module, kernels, settled_bound, tensor_counts


def k_for(ratio, n):
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))


def ks_for(ratio, counts):
    """k_i of every tensor (int64 array): ``k_for(ratio, n_i)``, vectorised (the same double
    arithmetic as ``math.ceil(ratio * n)``)."""
    c = np.asarray(counts, np.int64).reshape(-1)
    k = np.minimum(c, np.maximum(1, np.ceil(ratio * c.astype(np.float64)).astype(np.int64)))
    k[c == 0] = 0
    return k


def check_ratio(opts):
    r = opts["ratio"]
    if isinstance(r, bool) or not isinstance(r, (int, float, np.floating, np.integer)) or not 0 < r <= 1:
        raise ValueError(f"option 'ratio' must be a number in (0, 1], got {r!r}")
    opts["ratio"] = float(r)


def table_ks(ratio, table):
    """``ks_for`` of the table rows lo..hi-1 (one k per row, as the sparse kernels take it)."""
    _, _, cnt, lo, hi = table
    return ks_for(ratio, np.asarray(cnt[lo:hi]))


class TopK(Compressor):
    """Top-k sparsification, ``"topk"``: the largest ``|c|`` of every tensor, as values + indices.

    Every tensor of a bucket sends its own ``k_i = min(n_i, max(1, ceil(ratio * n_i)))``
    largest-magnitude elements (ties to the lower index); the payload is the float32 values
    then their uint32 bucket positions, and the ranks' payloads are allgathered and summed.
    Error feedback is on by default (the residual is ``c`` with the sent positions zeroed);
    with ``momentum``, DGC's momentum factor masking is on too.

    Args:
        ratio: the fraction of every tensor's elements sent, in (0, 1] (default 0.01).
        **options: the options every compressor takes (``Compressor``), ``sparsity_warmup``
            included.

    Example:
        >>> import gradfuse
        >>> pipe = gradfuse.Pipeline(compress="topk", ratio=0.001)     # doctest: +SKIP
    """

    name = "topk"
    error_feedback_default = True
    supports_cuda = True
    OPTIONS = {"ratio": 0.01}

    def validate(self):
        check_ratio(self.options)

    def ratio_at(self, ctx):
        """The ratio of the step ``ctx`` describes (every k of the step derives from it)."""
        return self.options["ratio"]

    def bucket_layout(self, ctx):
        k = int(ks_for(self.ratio_at(ctx), ctx.counts).sum())
        return [(np.dtype(np.float32), k), (np.dtype(np.uint32), k)]

    def compress(self, c, payloads, ctx):
        empty = np.zeros(0, np.float32)
        c = np.ascontiguousarray(c, np.float32)
        counts = tensor_counts(ctx, c.size)
        e = o = 0
        for m, k in zip(counts, ks_for(self.ratio_at(ctx), counts).tolist()):
            _core.topk_compress_array(c[e:e + m], empty, empty, k, payloads[0][o:o + k], payloads[1][o:o + k])
            payloads[1][o:o + k] += np.uint32(e)        # tensor positions -> bucket positions
            e, o = e + m, o + k

    def decompress(self, payloads, n, ctx):
        out = np.empty(n, np.float32)
        _core.sparse_decompress_sum_array(np.ascontiguousarray(payloads[0]).reshape(1, -1),
                                          np.ascontiguousarray(payloads[1]).reshape(1, -1), out, 1.0)
        return out

    def compress_table(self, table, e_in, e_out, payloads, ctx):
        src, off, cnt, lo, hi = table
        return kernels(ctx).topk_compress(src, off, cnt, lo, hi, e_in, e_out, table_ks(self.ratio_at(ctx), table),
                                          payloads[0], payloads[1])

    def decompress_sum_table(self, rows, table, divisor, ctx):
        dst, off, cnt, lo, hi = table
        # payload rows of the wire buffer are strided; the sparse kernel wants dense [p, k]
        xp = array_module(ctx)
        kernels(ctx).sparse_decompress_sum(xp.ascontiguousarray(rows[0]), xp.ascontiguousarray(rows[1]),
                                           dst, off, cnt, lo, hi, divisor)
        return True

    def settle(self, c, p):
        """The payload values are c where selected and the residual c elsewhere (0 where
        selected): nothing grows."""
        return settled_bound(c, p)
