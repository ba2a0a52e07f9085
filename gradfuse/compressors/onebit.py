"""1-bit: one sign bit per element and one float32 scale per block.

Math for a bucket ``c`` (after error feedback) and block size B (a multiple of 32):
``s_b = mean |c|`` over block b in a fixed order (32 lane partial sums, then a
shfl_down-style tree; see docs/compressors.md), ``bit_j = c_j >= 0`` (+0 and -0 give 1,
NaN gives 0), decoded ``v_j = s_b if bit_j else -s_b``.

Layout: ``bits`` = ceil(n/32) uint32 words, element j in bit j % 32 (LSB first) of word
j // 32, padding bits 0; ``scales`` = ceil(n/B) float32. About 1 + 32/B bits per element.

Collectives: ``allgather`` (every rank decodes every payload and sums in rank order), or
``twophase`` (DeepSpeed-style compressed allreduce: alltoall of chunks, each rank
averages its chunk, applies a server-side residual and compresses again, then an
allgather), whose traffic per rank stays about 2(p-1)/p * S/32 as p grows. ``auto``
picks twophase for 3 or more ranks on buckets of at least 65536 elements.
"""
import math

import numpy as np

from .. import _core
from .base import Compressor, kernels

ALGORITHMS = ("auto", "allgather", "twophase")
TWOPHASE_MIN_ELEMENTS = 1 << 16


class OneBit(Compressor):
    name = "1bit"
    error_feedback_default = True
    supports_cuda = True
    OPTIONS = {"block_size": 512, "algorithm": "auto"}

    def validate(self):
        b = self.options["block_size"]
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 32 or b % 32:
            raise ValueError(f"option 'block_size' must be a multiple of 32 and >= 32, got {b!r}")
        self.options["block_size"] = int(b)
        if self.options["algorithm"] not in ALGORITHMS:
            raise ValueError(f"option 'algorithm' must be one of {', '.join(ALGORITHMS)}, "
                             f"got {self.options['algorithm']!r}")

    @property
    def block(self):
        return self.options["block_size"]

    def algorithm_for(self, n, p):
        """The collective for a bucket of n elements on p ranks (the same on every rank)."""
        algo = self.options["algorithm"]
        if algo != "auto":
            return algo
        return "twophase" if p >= 3 and n >= TWOPHASE_MIN_ELEMENTS else "allgather"

    def payload_layout(self, n):
        return [(np.dtype(np.uint32), (n + 31) // 32), (np.dtype(np.float32), math.ceil(n / self.block))]

    def compress(self, c, payloads, ctx):
        empty = np.zeros(0, np.float32)
        _core.onebit_compress_array(np.ascontiguousarray(c, np.float32), empty, empty, self.block,
                                    payloads[0], payloads[1])

    def decompress(self, payloads, n, ctx):
        out = np.empty(n, np.float32)
        _core.onebit_decompress_sum_array(np.ascontiguousarray(payloads[0]).reshape(1, -1),
                                          np.ascontiguousarray(payloads[1]).reshape(1, -1),
                                          self.block, out, 1.0)
        return out

    def compress_table(self, table, e_in, e_out, payloads, ctx):
        src, off, cnt, lo, hi = table
        return kernels(ctx).onebit_compress(src, off, cnt, lo, hi, e_in, e_out, self.block, payloads[0], payloads[1])

    def decompress_sum_table(self, rows, table, divisor, ctx):
        dst, off, cnt, lo, hi = table
        kernels(ctx).onebit_decompress_sum(rows[0], rows[1], self.block, dst, off, cnt, lo, hi, divisor)
        return True
