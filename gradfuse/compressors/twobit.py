"""2-bit threshold quantization with MXNet kvstore semantics.

Each value (after error feedback) becomes +t if c >= t, -t if c <= -t, else 0; the
residual keeps the rest (error feedback is the residual MXNet keeps: there is exactly one).
Layout: 4 values per byte, element j in bits 2*(j % 4)..2*(j % 4)+1 of byte j // 4
(LSB first): 0b00 = 0, 0b01 = +t, 0b10 = -t; ceil(n/4) bytes. t is not sent: the ranks
agree on it through the control plane.
"""
import numpy as np

from .. import _core
from .base import Compressor, kernels


class TwoBit(Compressor):
    name = "2bit"
    error_feedback_default = True
    supports_cuda = True
    OPTIONS = {"threshold": 0.5}

    def validate(self):
        t = self.options["threshold"]
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating, np.integer)) \
                or not np.isfinite(t) or not np.float32(t) > 0:
            raise ValueError(f"option 'threshold' must be a finite number > 0, got {t!r}")
        self.options["threshold"] = float(t)

    def payload_layout(self, n):
        return [(np.dtype(np.uint8), (n + 3) // 4)]

    def compress(self, c, payloads, ctx):
        empty = np.zeros(0, np.float32)
        _core.twobit_compress_array(np.ascontiguousarray(c, np.float32), empty, empty,
                                    self.options["threshold"], payloads[0])

    def decompress(self, payloads, n, ctx):
        out = np.empty(n, np.float32)
        _core.twobit_decompress_sum_array(np.ascontiguousarray(payloads[0]).reshape(1, -1),
                                          self.options["threshold"], out, 1.0)
        return out

    def compress_table(self, table, e_in, e_out, payloads, ctx):
        src, off, cnt, lo, hi = table
        return kernels(ctx).twobit_compress(src, off, cnt, lo, hi, e_in, e_out, self.options["threshold"], payloads[0])

    def decompress_sum_table(self, rows, table, divisor, ctx):
        dst, off, cnt, lo, hi = table
        kernels(ctx).twobit_decompress_sum(rows[0], self.options["threshold"], dst, off, cnt, lo, hi, divisor)
        return True
