"""top-k sparsification: the k largest |c| of each bucket, as values + indices.

k = min(n, max(1, ceil(ratio * n))) per bucket (0 for an empty bucket). Ties go to the
lower index; indices are uint32 positions inside the bucket, ascending. Payload: k float32
values, then k uint32 indices. Residual: c, with the sent positions set to 0.
"""
import math

import numpy as np

from .. import _core
from .base import Compressor, array_module, kernels


def k_for(ratio, n):
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))


def check_ratio(opts):
    r = opts["ratio"]
    if isinstance(r, bool) or not isinstance(r, (int, float, np.floating, np.integer)) or not 0 < r <= 1:
        raise ValueError(f"option 'ratio' must be a number in (0, 1], got {r!r}")
    opts["ratio"] = float(r)


class TopK(Compressor):
    name = "topk"
    error_feedback_default = True
    supports_cuda = True
    OPTIONS = {"ratio": 0.01}

    def validate(self):
        check_ratio(self.options)

    def payload_layout(self, n):
        k = k_for(self.options["ratio"], n)
        return [(np.dtype(np.float32), k), (np.dtype(np.uint32), k)]

    def compress(self, c, payloads, ctx):
        empty = np.zeros(0, np.float32)
        _core.topk_compress_array(np.ascontiguousarray(c, np.float32), empty, empty,
                                  payloads[0].size, payloads[0], payloads[1])

    def decompress(self, payloads, n, ctx):
        out = np.empty(n, np.float32)
        _core.sparse_decompress_sum_array(np.ascontiguousarray(payloads[0]).reshape(1, -1),
                                          np.ascontiguousarray(payloads[1]).reshape(1, -1), out, 1.0)
        return out

    def compress_table(self, table, e_in, e_out, payloads, ctx):
        src, off, cnt, lo, hi = table
        return kernels(ctx).topk_compress(src, off, cnt, lo, hi, e_in, e_out, payloads[0].size, payloads[0], payloads[1])

    def decompress_sum_table(self, rows, table, divisor, ctx):
        dst, off, cnt, lo, hi = table
        # payload rows of the wire buffer are strided; the sparse kernel wants dense [p, k]
        xp = array_module(ctx)
        kernels(ctx).sparse_decompress_sum(xp.ascontiguousarray(rows[0]), xp.ascontiguousarray(rows[1]),
                                           dst, off, cnt, lo, hi, divisor)
        return True
