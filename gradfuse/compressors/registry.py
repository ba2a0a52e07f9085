"""The compressor registry: names to compressor classes, ``create`` and ``available``.

Contract of an extension point: a compressor is a class registered under a name with
``register_compressor``. ``Pipeline(compress=NAME, **options)`` looks it up here; an
unknown name raises a ``ValueError`` that lists the valid names. ``get_config()``
returns ``{"name": ..., **options}`` and is part of what the ranks agree on before a
collective.
"""
from .base import BucketContext, Compressor, NoneCompressor
from .bf16 import BF16
from .fp16 import FP16
from .onebit import OneBit
from .powersgd import PowerSGD
from .randomk import RandomK
from .topk import TopK
from .twobit import TwoBit

_REGISTRY = {}


def register_compressor(name, cls):
    """Register ``cls`` (a ``Compressor`` subclass) under ``name``; returns ``cls``.

    ``Pipeline(compress=name, **options)`` then creates it (with ``cls(**options)``). A
    name registered again is replaced. A compressor says what it sends
    (``payload_layout(n)`` or ``bucket_layout(ctx)``), fills those arrays from the float32
    bucket ``c`` (``compress``) and decodes one rank's payload (``decompress``); error
    feedback, the exchange and the averaging are the pipeline's (``Compressor``).

    Raises:
        ValueError: ``name`` is not a non-empty string.
        TypeError: ``cls`` is not a ``Compressor`` subclass.

    Example:
        One int8 sign per element and one float32 scale per bucket:

        >>> import numpy as np
        >>> import gradfuse
        >>> from gradfuse.compressors import Compressor
        >>> class Sign8(Compressor):
        ...     name = "sign8"
        ...     error_feedback_default = True
        ...     def payload_layout(self, n):
        ...         return [(np.dtype(np.int8), n), (np.dtype(np.float32), 1)]
        ...     def compress(self, c, payloads, ctx):
        ...         payloads[0][...] = np.where(c >= 0, 1, -1)
        ...         payloads[1][0] = np.abs(c).mean() if c.size else 0.0
        ...     def decompress(self, payloads, n, ctx):
        ...         return payloads[0].astype(np.float32) * payloads[1][0]
        >>> _ = gradfuse.register_compressor("sign8", Sign8)
        >>> pipe = gradfuse.Pipeline(compress="sign8")
        >>> pipe.allreduce([np.array([0.5, -1.5, 2.0], np.float32)])     # one rank
        [array([ 1.3333334, -1.3333334,  1.3333334], dtype=float32)]
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"compressor name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise TypeError(f"compressor {name!r}: {cls!r} is not a gradfuse.compressors.Compressor subclass")
    _REGISTRY[name] = cls
    return cls


def available():
    """The registered compressor names, sorted."""
    return sorted(_REGISTRY)


def create(name=None, **options):
    """Instantiate the compressor registered as ``name`` (None means ``"none"``)."""
    if name is None:
        name = "none"
    if isinstance(name, Compressor):
        if options:
            raise TypeError("options cannot be given together with a compressor instance")
        return name
    if isinstance(name, dict):               # a get_config() dict
        options = {**{k: v for k, v in name.items() if k != "name"}, **options}
        name = name.get("name")
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; valid names: {', '.join(available())}")
    return cls(**options)


for _cls in (NoneCompressor, FP16, BF16, OneBit, TwoBit, TopK, RandomK, PowerSGD):
    register_compressor(_cls.name, _cls)

