"""fp16 and bf16: 16 bits on the wire, summed by the network in float32, rounded once.

Layout: one uint16 per element, in bucket order. fp16 rounds to nearest even exactly as
numpy's ``astype(float16)`` (NaN keeps its sign and top payload bits); bf16 rounds to
nearest even on the top 16 bits of the float32 pattern, NaN -> quiet NaN with its sign.
The MPI reduction adds two payloads element by element in float32 and rounds once (the
``sum16`` kernel); averaging divides the float32 value after the sum, or, with
``predivide=True``, each rank divides by the number of ranks before casting (smaller
sums, no fp16 overflow where each term fits). ``sum16="nccl"`` (GPU, NCCL only; the
default is ``"exact"``) lets NCCL's own half/bfloat16 allreduce sum the payloads instead,
pre-divided by p when averaging; its order and rounding are NCCL's, and it is untested on
hardware beyond one rank. On other communicators the exact sum runs. An inf or NaN in the summed payload, from
an input or from overflow, raises ``NonFiniteError`` on every rank before any result is
written; values that underflow to zero are counted in the pipeline's stats.
"""
import numpy as np

from .. import _core
from .base import BucketContext, Compressor, kernels


class Cast16(Compressor):
    """Base of the 16-bit cast compressors."""

    collective = "allreduce"
    supports_cuda = True
    fmt = 0
    OPTIONS = {"predivide": False, "sum16": "exact"}

    def validate(self):
        if not isinstance(self.options["predivide"], (bool, np.bool_)):
            raise TypeError(f"option 'predivide' must be True or False, got {self.options['predivide']!r}")
        self.options["predivide"] = bool(self.options["predivide"])
        if self.options["sum16"] not in ("exact", "nccl"):
            raise ValueError(f"option 'sum16' must be 'exact' or 'nccl', got {self.options['sum16']!r}")

    def native_sum(self, comm):
        """Whether this bucket's sum is the network's own 16-bit sum: ``sum16="nccl"`` on a
        communicator that has one (NCCL). Then averaging always pre-divides by p before the
        cast (DDP's fp16 hook does the same), so the half-precision sum cannot overflow
        where each term fits."""
        return self.options["sum16"] == "nccl" and comm.native_sum16

    def payload_layout(self, n):
        return [(np.dtype(np.uint16), n)]

    def compress(self, c, payloads, ctx):
        _core.cast_to16(self.fmt, np.ascontiguousarray(c, np.float32), payloads[0])

    def decompress(self, payloads, n, ctx):
        out = np.empty(n, np.float32)
        _core.cast_from16(self.fmt, np.ascontiguousarray(payloads[0]), out)
        return out

    def pack(self, table, payload, prescale=1.0, ctx=BucketContext()):
        """Fused pack + cast straight from the tensors; returns (overflowed, underflowed) counts."""
        src, off, cnt, lo, hi = table
        return kernels(ctx).pack_cast(self.fmt, payload, src, off, cnt, lo, hi, prescale)

    def decompress_sum_table(self, rows, table, divisor, ctx):
        # rows[0] is the already-summed payload (the network added them)
        dst, off, cnt, lo, hi = table
        kernels(ctx).unpack_cast(self.fmt, rows[0].reshape(-1), dst, off, cnt, lo, hi, divisor)
        return True

    def add16(self, peer, buf):
        """``buf += peer`` for host 16-bit words of this format: each add in float32, rounded
        once (the kernel the MPI user op calls; commutative, so either rank's order)."""
        _core.sum16(self.fmt, peer.reshape(-1), buf.reshape(-1))

    def nonfinite_mask(self):
        """Exponent bits that are all ones for inf/NaN in this format."""
        return 0x7C00 if self.fmt == 1 else 0x7F80

    def count_nonfinite(self, buf, bk):
        """The number of inf/NaN words in a 16-bit payload ``buf`` of backend ``bk`` (host:
        one kernel pass, no temporaries; device: the array module's)."""
        mask = self.nonfinite_mask()
        if bk.device == "cpu":
            return int(_core.count_masked16(buf.reshape(-1), mask))
        return int(bk.xp.count_nonzero((buf & mask) == mask))


class FP16(Cast16):
    """IEEE half precision on the wire (halves the bytes of float32)."""

    name = "fp16"
    fmt = 1
