"""1-bit: one sign bit per element and one float32 scale per block, blocks per tensor.

Math for a bucket ``c`` (after error feedback) and block size B (a multiple of 32): the
blocks restart at every tensor of the bucket (a tensor's last block may be short), so a
small tensor never shares a scale with a large one; ``s_b = mean |c|`` over block b in a
fixed order (32 lane partial sums, then a shfl_down-style tree; see docs/compressors.md),
``bit_j = c_j >= 0`` (+0 and -0 give 1, NaN gives 0), decoded ``v_j = s_b if bit_j else -s_b``.

Layout, tensor after tensor: tensor i's ``ceil(n_i/32)`` uint32 words (its element k in
bit k % 32, LSB first, of its word k // 32; padding bits 0), then ``bits`` holds the next
tensor's; ``scales`` holds tensor i's ``ceil(n_i/B)`` float32 after the previous
tensors'. About 1 + 32/B bits per element, plus at most a word and a scale per tensor.

Collectives: ``allgather`` (every rank decodes every payload and sums in rank order), or
``twophase`` (DeepSpeed-style compressed allreduce: alltoall of chunks, each rank
averages its chunk, applies a server-side residual and compresses again, then an
allgather), whose traffic per rank stays about 2(p-1)/p * S/32 as p grows. ``auto``
picks, per bucket and p, the cheaper of the two by the cost model
(``gradfuse.compressors.cost``; docs/compressors.md).

With DGC's momentum correction (``momentum=m``, SGD; gradfuse.compressors.momentum) the
compressor reads the rank's velocity ``u = m * u + g`` and error feedback runs on it.
``velocity="sent"`` (the default) then sets ``u = decode(payload)``, the values this rank
sent, decoded by the receivers' kernel, as 1-bit Adam does with its momentum (Tang et al.
2021; DeepSpeed's ``exp_avg`` becomes the compressed allreduce's result): the mean of the
ranks' velocities is the update every rank applies (two-phase: before the server's
recompression), and what 1-bit failed to send stays in
the residual alone instead of also staying in the velocity. ``velocity="local"`` keeps
DGC's form (the velocity never sees the compressor): the part of ``c`` that 1-bit leaves
unsent then stays in both the residual and the velocity, and the residual grows well
beyond the velocity (docs/compressors.md, "1-bit's velocity" under "Momentum correction
(DGC) and sparsity warm-up"). Nesterov (NAG) keeps DGC's form: the compressor reads ``m * u + g``, not the velocity.
"""
import numpy as np

from .. import _core
from .base import MAX_BLOCK, Compressor, block_parts, kernels, settled_bound

ALGORITHMS = ("auto", "allgather", "twophase")
VELOCITY = ("sent", "local")


def onebit_sizes(counts, block):
    """(words, scales) of the 1-bit payload of tensors with these element counts."""
    return (sum((int(c) + 31) // 32 for c in counts), sum(-(-int(c) // block) for c in counts))


class BlockLayout:
    """Where each 1-bit block of a bucket lies (blocks in bucket order, per tensor).

    ``elem[b]`` and ``word[b]``: the bucket position of block b's first element and the
    payload word of its first bit, with one more entry for the end (n, the word count).
    """

    def __init__(self, counts, block):
        c = np.asarray(counts, np.int64).reshape(-1)
        nb, nw = -(-c // block), (c + 31) // 32
        t = np.repeat(np.arange(len(c)), nb)
        first = np.cumsum(nb) - nb
        kb = np.arange(int(nb.sum()), dtype=np.int64) - first[t]
        self.counts, self.block = c, block
        self.starts = np.cumsum(c) - c
        self.elem = np.append(self.starts[t] + kb * block, c.sum()).astype(np.int64)
        self.word = np.append((np.cumsum(nw) - nw)[t] + kb * (block // 32), nw.sum()).astype(np.int64)
        self.nblocks, self.nwords, self.n = int(nb.sum()), int(nw.sum()), int(c.sum())

    def chunk_blocks(self, p, r):
        """Blocks [b0, b1) of chunk r of p (``ceil(nblocks/p)`` each; the last may be short or empty)."""
        cb = max(1, -(-self.nblocks // p))
        return min(r * cb, self.nblocks), min((r + 1) * cb, self.nblocks)

    def pieces(self, e0, e1):
        """Element counts of the tensors' parts inside bucket positions [e0, e1), in order
        (the empty ones left out)."""
        lo = np.clip(self.starts, e0, e1)
        hi = np.clip(self.starts + self.counts, e0, e1)
        m = hi - lo
        return tuple(int(x) for x in m[m > 0])


class OneBit(Compressor):
    """1-bit compression, ``"1bit"``: one sign bit per element and one float32 scale per block.

    The format, the collectives and the momentum handling are in this module's docstring
    (``gradfuse.compressors.onebit``) and docs/compressors.md. Error feedback is on by
    default.

    Args:
        block_size: elements per scale, a multiple of 32 (default 512); blocks restart at
            every tensor of the bucket.
        algorithm: ``"auto"`` (default: the cheaper collective by the cost model),
            ``"allgather"`` or ``"twophase"`` (DeepSpeed-style compressed allreduce).
        velocity: with ``momentum``: ``"sent"`` (default: the velocity becomes the decoded
            values this rank sent) or ``"local"`` (DGC's form).
        **options: the options every compressor takes (``Compressor``).

    Example:
        >>> import gradfuse
        >>> pipe = gradfuse.Pipeline(compress="1bit", block_size=256)   # doctest: +SKIP
    """

    name = "1bit"
    error_feedback_default = True
    supports_cuda = True
    OPTIONS = {"block_size": 512, "algorithm": "auto", "velocity": "sent"}
    AUTO = ("allgather", "twophase")

    def validate(self):
        b = self.options["block_size"]
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 32 <= b <= MAX_BLOCK or b % 32:
            raise ValueError(f"option 'block_size' must be a multiple of 32 in [32, {MAX_BLOCK}], got {b!r}")
        self.options["block_size"] = int(b)
        if self.options["algorithm"] not in ALGORITHMS:
            raise ValueError(f"option 'algorithm' must be one of {', '.join(ALGORITHMS)}, "
                             f"got {self.options['algorithm']!r}")
        if self.options["velocity"] not in VELOCITY:
            raise ValueError(f"option 'velocity' must be one of {', '.join(VELOCITY)}, "
                             f"got {self.options['velocity']!r}")

    def get_config(self):
        """As the base's; ``velocity`` only with ``momentum`` (it means nothing without), so a
        1-bit config, its plan digest and its checkpoints stay what they were before it."""
        cfg = super().get_config()
        if not self.momentum:
            cfg.pop("velocity")
        return cfg

    @property
    def block(self):
        """The block size: elements per float32 scale (option ``block_size``)."""
        return self.options["block_size"]

    def bucket_layout(self, ctx):
        words, scales = onebit_sizes(ctx.counts, self.block)
        return [(np.dtype(np.uint32), words), (np.dtype(np.float32), scales)]

    def compress(self, c, payloads, ctx):
        empty = np.zeros(0, np.float32)
        c = np.ascontiguousarray(c, np.float32)
        for e, w, s, m, nw, ns in block_parts(ctx, c.size, 32, self.block):
            _core.onebit_compress_array(c[e:e + m], empty, empty, self.block, payloads[0][w:w + nw],
                                        payloads[1][s:s + ns])

    def decompress(self, payloads, n, ctx):
        out = np.empty(n, np.float32)
        bits, scales = np.ascontiguousarray(payloads[0]), np.ascontiguousarray(payloads[1])
        for e, w, s, m, nw, ns in block_parts(ctx, n, 32, self.block):
            _core.onebit_decompress_sum_array(bits[w:w + nw].reshape(1, -1), scales[s:s + ns].reshape(1, -1),
                                              self.block, out[e:e + m], 1.0)
        return out

    def sends_velocity(self):
        """Whether the velocity becomes what was sent (``velocity="sent"``, with SGD's
        momentum correction: the table ``compress_table`` reads is then the velocity)."""
        return bool(self.momentum) and not self.nesterov and self.options["velocity"] == "sent"

    def compress_table(self, table, e_in, e_out, payloads, ctx):
        src, off, cnt, lo, hi = table
        k = kernels(ctx)
        bad = k.onebit_compress(src, off, cnt, lo, hi, e_in, e_out, self.block, payloads[0], payloads[1])
        if self.sends_velocity():
            # u = decode(sent): this rank's own payload decoded over the velocity it was
            # compressed from, with the receivers' kernel (so the mean of the ranks'
            # velocities is the update every rank applies)
            k.onebit_decompress_sum(payloads[0].reshape(1, -1), payloads[1].reshape(1, -1), self.block,
                                    src, off, cnt, lo, hi, 1.0)
        return bad

    def compress_moment_table(self, table, moment, e_in, e_out, payloads, ctx):
        """The Adam correction's moment update, error feedback and 1-bit compression in one
        pass (``adam_onebit_compress``)."""
        src, off, cnt, lo, hi = table
        m, r, b1, c1 = moment
        return kernels(ctx).adam_onebit_compress(src, off, cnt, lo, hi, m, r, b1, c1, e_in, e_out, self.block,
                                                 payloads[0], payloads[1])

    def decompress_sum_table(self, rows, table, divisor, ctx):
        dst, off, cnt, lo, hi = table
        kernels(ctx).onebit_decompress_sum(rows[0], rows[1], self.block, dst, off, cnt, lo, hi, divisor)
        return True

    def settle(self, c, p):
        """A block's scale is the mean of its ``|c|`` (lane sums of block / 32 values, a
        5-level tree, a divide), so at most the block's largest ``|c|`` grown by that many
        roundings; a residual c - scale (same sign) is at most the larger of the two."""
        return settled_bound(c, p, terms=self.block // 32 + 8)
