"""Error feedback, defined once for every lossy compressor.

For each bucket and rank, with residual ``e`` (zero at the start):

    c = g + e                      # float32 add
    payload = compress(c)
    e = c - decompress(payload)    # float32 subtract

so what a step fails to send is added to the next step's gradient. The residual is kept
per rank and per fusion bucket (gradfuse.compressors.state). A compressor's fused kernel may do all of
this in one pass over the gradients, but must give the bits of this reference path; the
tests compare the two for every built-in compressor.

``e_in``/``e_out`` are separate arrays (double buffering): the new residual is written to
``e_out`` and only becomes current once every rank has agreed the step was finite, so a
refused step never poisons the residual.
"""
import numpy as np

EMPTY = np.zeros(0, np.float32)


def count_nonfinite(c):
    return int(c.size - np.count_nonzero(np.isfinite(c)))


def compress_with_feedback(compressor, g, e_in, e_out, payloads, ctx):
    """Reference path: residual add, compress, new residual. Returns the non-finite count."""
    if e_in.size:
        c = np.add(g, e_in, dtype=np.float32)
    else:
        c = np.asarray(g, dtype=np.float32)
    compressor.compress(c, payloads, ctx)
    if e_out.size:
        np.subtract(c, compressor.decompress(payloads, c.size, ctx), out=e_out, dtype=np.float32)
    return count_nonfinite(c)
