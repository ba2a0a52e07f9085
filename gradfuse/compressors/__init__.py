"""Compressors: the registry, one small file per compressor, the residual memory and the
exchange jobs (this module is the face: it re-exports the registry and the classes).

Contract of an extension point: a compressor is a class registered under a name with
``register_compressor``. ``Pipeline(compress=NAME, **options)`` looks it up here; an
unknown name raises a ``ValueError`` that lists the valid names. ``get_config()``
returns ``{"name": ..., **options}`` and is part of what the ranks agree on before a
collective. Built in: none, fp16, bf16, 1bit, 2bit, topk, randomk, powersgd (one file each);
the contract a compressor implements is in ``gradfuse.compressors.base``.
"""
from .base import BucketContext, Compressor, NoneCompressor
from .bf16 import BF16
from .fp16 import FP16
from .onebit import OneBit
from .policy import LayerPolicy
from .powersgd import PowerSGD
from .randomk import RandomK
from .registry import available, create, register_compressor
from .topk import TopK
from .twobit import TwoBit

__all__ = ["BucketContext", "Compressor", "NoneCompressor", "FP16", "BF16", "OneBit", "TwoBit", "TopK",
           "RandomK", "PowerSGD", "LayerPolicy", "register_compressor", "available", "create"]
