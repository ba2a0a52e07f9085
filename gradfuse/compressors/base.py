"""The compressor base class."""
from abc import ABC


class Compressor(ABC):
    """A gradient compressor.

    Subclasses set ``name``, accept their options as keyword arguments, and describe
    themselves with ``get_config()``, which must round-trip through the constructor.
    ``lossless`` compressors take the plain MPI allreduce path.
    """

    name = "abstract"
    lossless = False

    def __init__(self, **options):
        if options:
            raise TypeError(f"compressor {self.name!r} takes no options, got {sorted(options)}")
        self.options = {}

    def get_config(self):
        return {"name": self.name, **self.options}

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"


class NoneCompressor(Compressor):
    """No compression: buckets go to the MPI library's own allreduce as they are."""

    name = "none"
    lossless = True
