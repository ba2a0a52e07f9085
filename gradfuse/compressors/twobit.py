"""2-bit quantization: three levels per element, in one of two formats.

**Scaled (the default, ``threshold=None``).** Blocks of B elements (``block_size``, a
multiple of 32) restart at every tensor of the bucket, as 1-bit's do (a tensor's last
block may be short), so the threshold follows each tensor's own scale. For a block of
``c`` (after error feedback): ``s = mean |c|`` (the 1-bit scale, same order), ``t = factor
* s``; an element is ``+`` if ``c > 0 and c >= t``, ``-`` if ``c < 0 and c <= -t``, else 0;
``v = mean |c|`` over the selected elements (0 when none), decoded ``+v``, ``-v`` or 0, so
a block sends exactly the magnitude its selected elements hold. Layout, tensor after
tensor: tensor i's ``ceil(n_i/16)`` uint32 words (its element k in bits 2(k%16) and
2(k%16)+1 of its word k//16: 0b01 +, 0b10 -, 0b00 zero, padding 0), then ``values``: its
``ceil(n_i/B)`` float32 after the previous tensors'. About 2 + 32/B bits per element.
Collectives as 1-bit's (``algorithm``): allgather, or two-phase (step/twophase.py).

**Absolute (MXNet's kvstore semantics, ``threshold=T``).** Each value becomes +T if
c >= T, -T if c <= -T, else 0; 4 values per byte, element j in bits 2*(j % 4)..+1 of byte
j // 4 (LSB first); ceil(n/4) bytes; T is not sent (the ranks agree on it). Kept for
MXNet compatibility (``set_gradient_compression({'type': '2bit', 'threshold': 0.5})``):
an absolute threshold clips every element above T and starves the ones below it, so it
trains only where T suits every tensor (docs/experiments.md). Allgather only.
"""
import numpy as np

from .. import _core
from .base import FLT_MAX, MAX_BLOCK, Compressor, block_parts, kernels, settled_bound

ALGORITHMS = ("auto", "allgather", "twophase")
DEFAULT_BLOCK, DEFAULT_FACTOR = 512, 1.0


def twobit_sizes(counts, block):
    """(code words, values) of the scaled 2-bit payload of tensors with these counts."""
    return (sum((int(c) + 15) // 16 for c in counts), sum(-(-int(c) // block) for c in counts))


def _number(x):
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, (int, float, np.floating, np.integer))


class TwoBit(Compressor):
    """2-bit quantization, ``"2bit"``: three levels (+v, 0, -v) per element.

    Two formats (this module's docstring, ``gradfuse.compressors.twobit``, gives the math
    and the layouts; docs/compressors.md the details). Error feedback is on by default.

    Args:
        threshold: None (default) selects the scaled format, whose threshold follows each
            block's scale; a number T > 0 selects MXNet's absolute format (+T, 0, -T,
            allgather only).
        factor: scaled format: the threshold is ``factor`` times the block's mean ``|c|``
            (default 1.0).
        block_size: scaled format: elements per block, a multiple of 32 (default 512).
        algorithm: ``"auto"`` (default), ``"allgather"`` or ``"twophase"`` (scaled only).
        **options: the options every compressor takes (``Compressor``).

    Example:
        >>> import gradfuse
        >>> pipe = gradfuse.Pipeline(compress="2bit")                   # doctest: +SKIP
        >>> mxnet_like = gradfuse.Pipeline(compress="2bit", threshold=0.5)  # doctest: +SKIP
    """

    name = "2bit"
    error_feedback_default = True
    supports_cuda = True
    OPTIONS = {"threshold": None, "factor": DEFAULT_FACTOR, "block_size": DEFAULT_BLOCK, "algorithm": "auto"}
    AUTO = ("allgather", "twophase")
    elems_per_word = 16         # the two-phase job's view of the code words

    def validate(self):
        o = self.options
        t, f, b, algo = o["threshold"], o["factor"], o["block_size"], o["algorithm"]
        if algo not in ALGORITHMS:
            raise ValueError(f"option 'algorithm' must be one of {', '.join(ALGORITHMS)}, got {algo!r}")
        if t is not None:
            # the kernels take it as a float32: it must be finite and > 0 there too
            if not _number(t) or not np.isfinite(t) or not 0 < np.float32(t) <= FLT_MAX:
                raise ValueError(f"option 'threshold' must be a finite number > 0 (MXNet's absolute "
                                 f"threshold, in (0, {FLT_MAX:g}] as a float32) or None (the scaled format), "
                                 f"got {t!r}")
            o["threshold"] = float(t)
            if f != DEFAULT_FACTOR or b != DEFAULT_BLOCK:
                raise ValueError(f"options 'factor' and 'block_size' belong to the scaled 2-bit format; "
                                 f"'threshold={t!r}' selects MXNet's absolute format, which has neither "
                                 f"(got factor={f!r}, block_size={b!r})")
            if algo == "twophase":
                raise ValueError("option 'algorithm=\"twophase\"' needs the scaled 2-bit format (per-block "
                                 f"values); 'threshold={t!r}' selects MXNet's absolute format, allgather only")
            return
        if not _number(f) or not np.isfinite(f) or not 0 <= f <= FLT_MAX:
            raise ValueError(f"option 'factor' must be a finite number >= 0, in [0, {FLT_MAX:g}] (threshold = "
                             f"factor * the block's mean |c|, a float32), got {f!r}")
        o["factor"] = float(f)
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 32 <= b <= MAX_BLOCK or b % 32:
            raise ValueError(f"option 'block_size' must be a multiple of 32 in [32, {MAX_BLOCK}], got {b!r}")
        o["block_size"] = int(b)

    @property
    def absolute(self):
        """MXNet's absolute-threshold format (``threshold`` given)."""
        return self.options["threshold"] is not None

    @property
    def block(self):
        """The scaled format's block size (option ``block_size``)."""
        return self.options["block_size"]

    def algorithm_for(self, n, p, link=None, counts=None):
        """The collective for a bucket of n elements on p ranks (the same on every rank):
        the absolute format always allgathers; the scaled one as every compressor does
        (``auto``: the cheaper of ``AUTO`` by the cost model)."""
        if self.absolute:
            return "allgather"
        return super().algorithm_for(n, p, link, counts)

    def bucket_layout(self, ctx):
        if self.absolute:
            return [(np.dtype(np.uint8), (ctx.n + 3) // 4)]
        words, values = twobit_sizes(ctx.counts or (ctx.n,), self.block)
        return [(np.dtype(np.uint32), words), (np.dtype(np.float32), values)]

    def compress(self, c, payloads, ctx):
        empty = np.zeros(0, np.float32)
        c = np.ascontiguousarray(c, np.float32)
        if self.absolute:
            _core.twobit_compress_array(c, empty, empty, self.options["threshold"], payloads[0])
            return
        for e, w, s, m, nw, ns in block_parts(ctx, c.size, 16, self.block):
            _core.twobit_block_compress_array(c[e:e + m], empty, empty, self.block, self.options["factor"],
                                              payloads[0][w:w + nw], payloads[1][s:s + ns])

    def decompress(self, payloads, n, ctx):
        out = np.empty(n, np.float32)
        if self.absolute:
            _core.twobit_decompress_sum_array(np.ascontiguousarray(payloads[0]).reshape(1, -1),
                                              self.options["threshold"], out, 1.0)
            return out
        codes, values = np.ascontiguousarray(payloads[0]), np.ascontiguousarray(payloads[1])
        for e, w, s, m, nw, ns in block_parts(ctx, n, 16, self.block):
            _core.twobit_block_decompress_sum_array(codes[w:w + nw].reshape(1, -1), values[s:s + ns].reshape(1, -1),
                                                    self.block, out[e:e + m], 1.0)
        return out

    def compress_table(self, table, e_in, e_out, payloads, ctx):
        return self.block_compress(kernels(ctx), table, e_in, e_out, payloads)

    def decompress_sum_table(self, rows, table, divisor, ctx):
        self.block_decompress_sum(kernels(ctx), rows, table, divisor)
        return True

    # --- the fused kernels by format (the two-phase job calls these too) ----------------
    def block_compress(self, K, table, e_in, e_out, payloads):
        """Compress the table rows ``lo..hi`` with the kernel set ``K`` (CPU or GPU), in this
        compressor's format, writing the residual to ``e_out`` (the two-phase job calls it)."""
        src, off, cnt, lo, hi = table
        if self.absolute:
            return K.twobit_compress(src, off, cnt, lo, hi, e_in, e_out, self.options["threshold"], payloads[0])
        return K.twobit_block_compress(src, off, cnt, lo, hi, e_in, e_out, self.block, self.options["factor"],
                                       payloads[0], payloads[1])

    def block_decompress_sum(self, K, rows, table, divisor):
        """Decode every rank's payload in ``rows``, sum them in rank order, divide by
        ``divisor`` and write the table rows ``lo..hi`` with the kernel set ``K``."""
        dst, off, cnt, lo, hi = table
        if self.absolute:
            K.twobit_decompress_sum(rows[0], self.options["threshold"], dst, off, cnt, lo, hi, divisor)
        else:
            K.twobit_block_decompress_sum(rows[0], rows[1], self.block, dst, off, cnt, lo, hi, divisor)

    def settle(self, c, p):
        """Scaled format: a block's value is the mean ``|c|`` of its selected elements (the 1-bit
        scale's lane and tree order), so at most their largest ``|c|`` grown by that many
        roundings; a residual is c (unselected) or c - value (same sign). Absolute format:
        the decoded value is the threshold itself, and a residual c or c - threshold
        (``|c|`` >= threshold, same sign)."""
        if self.absolute:
            return settled_bound(c, p, limit=float(self.options["threshold"]))
        return settled_bound(c, p, terms=self.block // 32 + 8)
