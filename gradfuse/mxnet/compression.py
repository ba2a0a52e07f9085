"""Horovod's gradient compression interface (``Compression.none``, ``Compression.fp16``);
gradfuse's own compressors are chosen with ``DistributedTrainer(compress=...)``."""


class Compressor:
    """Interface for compressing and decompressing a given tensor (Horovod's)."""

    @staticmethod
    def compress(tensor):
        """Return (compressed tensor, context needed to decompress it)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Return the tensor restored with the context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Default no-op compression."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Cast floating-point tensors to float16 for the allreduce, and back after it."""

    @staticmethod
    def compress(tensor):
        if "float" in str(tensor.dtype):
            return tensor.astype("float16", copy=False), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if "float" in str(ctx):
            return tensor.astype(ctx, copy=False)
        return tensor


class Compression:
    """Optional gradient compression algorithm used during allreduce (Horovod's names).

    For gradfuse's own compressors (1-bit, 2-bit, top-k, ... with error feedback) pass
    ``compress=NAME`` to ``DistributedTrainer`` instead.
    """

    none = NoneCompressor
    fp16 = FP16Compressor

