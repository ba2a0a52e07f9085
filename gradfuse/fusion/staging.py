"""float32 staging of a float16 bucket, so that a compressor can take it.

Compressors work on float32. A compressed float16 bucket is packed into a 16-bit buffer
(one pack kernel call, its bytes as they are), upcast exactly into a float32 staging
array (the cast kernel), and the compressor reads the staging array through a pointer
table with the bucket's own tensor boundaries, so per-tensor formats see the tensors as
they are. The decoded float32 result (sum, then division when averaging) is written
into the same staging array, rounded once to float16 (round to nearest even, numpy's
``astype(float16)``; values beyond 65504 become inf) and unpacked into the outputs.
The residual stays float32. The same kernels exist on the host and the GPU, so both
give the same bits.
"""
import numpy as np

from .. import dtypes as _dt

F16 = _dt.CODE[np.dtype(np.float16)]
_FP16 = 1                     # the cast kernels' format code of IEEE half precision


def _address(a):
    """The data address of a host (numpy) or device (cupy) array."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


class Staging:
    """The staging buffers of one float16 bucket, kept across the steps of its plan."""

    __slots__ = ("bk", "bucket", "buf16", "f32", "ptrs")

    def __init__(self, bk, bucket, elem_offsets, rows):
        n = bucket.count
        self.bk, self.bucket = bk, bucket
        self.buf16 = bk.empty_bytes(2 * n)
        self.f32 = bk.empty(n, np.float32)
        # rows lo..hi of a table over the staging array (the kernels read those rows only)
        ptrs = np.zeros(rows, np.int64)
        lo, hi = bucket.lo, bucket.hi
        ptrs[lo:hi] = _address(self.f32) + 4 * np.asarray(elem_offsets[lo:hi], np.int64)
        self.ptrs = bk.pointers(ptrs)

    def table(self, tables):
        """``(pointers, element offsets, counts, lo, hi)`` of the bucket's tensors in staging."""
        return (self.ptrs, tables.elem_offsets, tables.counts, self.bucket.lo, self.bucket.hi)

    def load(self, src, tables):
        """Pack the bucket's float16 tensors and upcast them into the staging array."""
        b, bk = self.bucket, self.bk
        bk.pack(self.buf16, src, tables.offsets, tables.nbytes, b.lo, b.hi)
        if b.count:
            bk.kernels.cast_from16(_FP16, self.buf16.view(np.uint16), self.f32)

    def store(self, dst, tables):
        """Round the staging array once to float16 and unpack it into the outputs."""
        b, bk = self.bucket, self.bk
        if b.count:
            bk.kernels.cast_to16(_FP16, self.f32, self.buf16.view(np.uint16))
        bk.unpack(self.buf16, dst, tables.offsets, tables.nbytes, b.lo, b.hi)


def staging(cache, bk, bucket, plan):
    """The bucket's ``Staging``, made once and kept in the plan's ``cache`` dict."""
    key = ("staging", bucket.index)
    st = cache.get(key)
    if st is None or st.bk is not bk:
        st = cache[key] = Staging(bk, bucket, plan.elem_offsets, len(plan.order))
    return st
