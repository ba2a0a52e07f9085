"""Fusion planning: which tensors share a bucket, where each sits, what is reduced in place.

Rules (documented in docs/design.md):

* Tensors are taken in the order given. Frameworks hand gradients in reverse order
  of readiness, and overlapping communication with the backward pass depends on
  keeping that order.
* Each dtype has one open bucket. A tensor joins the open bucket of its dtype; when
  it would push the bucket past ``fusion_threshold`` bytes, that bucket is closed
  and a new one opened. Buckets run in the order of their first tensor.
* A tensor of at least ``direct_threshold`` bytes (default: the fusion threshold)
  is not packed: it is reduced where it lies, as a bucket of its own. Packing it
  would only add two copies of data that is already large enough to travel well.
* ``fusion_threshold=0`` turns fusion off: every tensor is reduced on its own.
* Slots are packed densely: a tensor's slot starts right after the previous one, at
  its element alignment (the dtype is uniform inside a bucket), so no padding bytes
  travel. Each fusion buffer starts on a 64-byte boundary.
* Empty tensors take part in the agreement (their shape matters) but are never sent.

A plan is cached by the signature of its inputs (names, shapes, dtypes); while that
stays the same, a step reuses the plan, its tables and its fusion buffers.
"""
import numpy as np

from .. import dtypes as _dt

ALIGN = 64


def aligned_empty(nbytes, align=ALIGN):
    """A uint8 array of ``nbytes`` whose data starts on an ``align``-byte boundary."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skip = (-raw.ctypes.data) % align
    return raw[skip:skip + nbytes]


def parse_signature(sig):
    """Decode ``_core.scan``'s signature bytes into ``[(code, shape), ...]``."""
    words = np.frombuffer(sig, dtype=np.int64).tolist()
    out, i = [], 0
    while i < len(words):
        code, ndim = words[i], words[i + 1]
        if ndim < 0:
            out.append((0, None))
            i += 2
            continue
        out.append((code, tuple(words[i + 2:i + 2 + ndim])))
        i += 2 + ndim
    return out


class Bucket:
    """A run ``lo:hi`` of the plan's table reduced by one collective call."""

    __slots__ = ("index", "code", "lo", "hi", "nbytes", "direct", "buffer", "group")

    def __init__(self, index, code, lo, hi, nbytes, direct, group=0):
        self.index, self.code, self.lo, self.hi = index, code, lo, hi
        self.nbytes, self.direct = nbytes, direct
        self.buffer = None
        self.group = group      # which of the pipeline's compressors reduces it (0: none)

    @property
    def dtype(self):
        return _dt.DTYPE[self.code]

    @property
    def count(self):
        """Number of elements in the bucket."""
        return self.nbytes // self.dtype.itemsize

    def view(self):
        """The fusion buffer as an array of the bucket's dtype."""
        return self.buffer.view(self.dtype)

    def __repr__(self):
        kind = "direct" if self.direct else "fused"
        return (f"Bucket({self.index}, {kind}, {self.dtype}, tensors {self.lo}:{self.hi}, "
                f"{self.nbytes} bytes)")


class FusionPlan:
    """The bucket layout of one set of tensors, with its cached tables.

    Attributes:
        order: int64 array mapping plan position -> tensor index (empty tensors left out).
        offsets, nbytes: int64 arrays per plan position (offset inside the bucket).
        buckets: list of ``Bucket`` in execution order.

    ``alloc(nbytes)`` makes the fusion buffers (default: 64-byte-aligned host memory; the
    GPU path passes a device allocator). ``groups``: per tensor, the index of the
    compressor that reduces it (a layer policy); tensors of different groups never share
    a bucket. None: one group.
    """

    def __init__(self, codes, sizes, fusion_threshold, direct_threshold=None, alloc=None, groups=None):
        if direct_threshold is None:
            direct_threshold = fusion_threshold
        self.fusion_threshold = int(fusion_threshold)
        self.direct_threshold = int(direct_threshold)
        tensor_group = groups if groups is not None else [0] * len(codes)
        groups = []          # [first_index, code, [tensor indices], nbytes, direct, compressor group]
        open_by_key = {}
        for i, (code, nb) in enumerate(zip(codes, sizes)):
            if nb == 0:
                continue
            cg = tensor_group[i]
            if self.fusion_threshold == 0 or nb >= self.direct_threshold:
                groups.append([i, code, [i], nb, True, cg])
                continue
            g = open_by_key.get((code, cg))
            if g is None or g[3] + nb > self.fusion_threshold:
                g = [i, code, [], 0, False, cg]
                groups.append(g)
                open_by_key[(code, cg)] = g
            g[2].append(i)
            g[3] += nb
        groups.sort(key=lambda g: g[0])
        order, offsets, nbytes, buckets = [], [], [], []
        for gi, (_, code, members, total, direct, cg) in enumerate(groups):
            lo = len(order)
            off = 0
            for i in members:
                order.append(i)
                offsets.append(off)
                nbytes.append(sizes[i])
                off += sizes[i]
            b = Bucket(gi, code, lo, len(order), total, direct, cg)
            if not direct:
                b.buffer = (alloc or aligned_empty)(total)
            buckets.append(b)
        self.order = np.asarray(order, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.nbytes = np.asarray(nbytes, dtype=np.int64)
        self.buckets = buckets
        # the same table in elements, for kernels that work on typed values
        item = np.ones(len(order), dtype=np.int64)
        for b in buckets:
            item[b.lo:b.hi] = _dt.DTYPE[b.code].itemsize
        self.elem_offsets = self.offsets // item
        self.counts = self.nbytes // item

    def layout(self):
        """A compact description of the layout, part of what the ranks agree on."""
        return [[b.code, b.hi - b.lo, b.nbytes, int(b.direct)] for b in self.buckets]

    def __repr__(self):
        fused = sum(not b.direct for b in self.buckets)
        return (f"<FusionPlan {len(self.order)} tensors in {len(self.buckets)} buckets "
                f"({fused} fused, {len(self.buckets) - fused} direct), "
                f"threshold={self.fusion_threshold}>")
