"""Which compressor each tensor gets: one compressor for all, or a layer policy.

``Pipeline(compress=...)`` takes a compressor (a name, an instance or a ``get_config()``
dict) for every tensor, or a policy: a dict from shell-style patterns (``fnmatch``,
case-sensitive, matched against each tensor's name in the order given; the first match
wins) to compressors, ``None`` meaning uncompressed::

    Pipeline(compress={"*.bias": None, "*norm*": None, "*": "1bit"})
    Pipeline(compress={"fc*": {"name": "topk", "ratio": 0.01}, "*": "1bit"}, min_elements=1024)

A tensor no pattern matches goes uncompressed. ``min_elements``: a tensor with fewer
elements goes uncompressed whatever the patterns say (BytePS uses 64 KiB; 0, the default,
turns the gate off). Only float32 and float16 tensors are compressed; other dtypes are
summed as they are. The fusion planner puts tensors of different compressors in
different buckets, so uncompressed tensors travel in fused buckets of their own. The
assignment follows from the names, sizes and the policy, all of which the ranks agree
on before any data moves, so every rank makes the same plan.

Integer names (list positions) match a pattern as their decimal string.
"""
from fnmatch import fnmatchcase
from glob import escape

import numpy as np

from .base import Compressor, NoneCompressor
from .registry import create


def _is_config(spec):
    """A ``get_config()`` dict ({"name": ..., options}) rather than a policy of patterns."""
    return isinstance(spec, dict) and isinstance(spec.get("name"), str) and not any(
        isinstance(v, (Compressor, dict)) or v is None for v in spec.values())


def is_policy(compress):
    """Whether ``compress`` is a layer policy (a dict of patterns), not one compressor."""
    return isinstance(compress, dict) and not _is_config(compress)


def rename(compress, names):
    """A layer policy written against other names, as one against the names the pipeline
    sees: ``names`` maps each tensor name to the name the patterns are matched against
    (a framework's parameter name, e.g. Gluon's ``conv0_bias`` for the tensor ``"3"``).
    The result has one exact rule per tensor some pattern matches; a single compressor
    is returned as it is. The policy is validated first, so errors name its patterns."""
    if not is_policy(compress):
        return compress
    LayerPolicy.create(compress)
    out = {}
    for tensor, match in names.items():
        for pattern, spec in compress.items():
            if fnmatchcase(str(match), pattern):
                out[escape(str(tensor))] = spec
                break
    return out


class LayerPolicy:
    """The compressors of one pipeline and the rule that assigns each tensor one of them.

    ``compressors[0]`` is always the uncompressed ``NoneCompressor``; ``group(name, n)``
    is the index of a tensor's compressor, which becomes its fusion buckets' group.
    """

    def __init__(self, rules=None, single=None, min_elements=0):
        none = NoneCompressor()
        self.compressors = [none]
        self.single = single is not None and rules is None
        self.rules = []
        if self.single:
            if not single.lossless:
                self.compressors.append(single)
        else:
            configs = {}          # rules with the same compressor config share it (and its buckets)
            for pattern, comp in rules:
                if comp.lossless:
                    self.rules.append((pattern, 0))
                    continue
                key = repr(sorted(comp.get_config().items()))
                if key not in configs:
                    self.compressors.append(comp)
                    configs[key] = len(self.compressors) - 1
                self.rules.append((pattern, configs[key]))
        if (isinstance(min_elements, bool) or not isinstance(min_elements, (int, np.integer))
                or min_elements < 0):
            raise ValueError(f"min_elements must be a non-negative int, got {min_elements!r}")
        self.min_elements = int(min_elements)
        lossy = self.compressors[1:]
        self.lossless = not lossy
        # the compressor users see as the pipeline's (single: that one; a policy: the first lossy)
        self.main = single if self.single else (lossy[0] if lossy else none)

    @classmethod
    def create(cls, compress, min_elements=0, **options):
        """A policy from ``Pipeline``'s ``compress`` argument (see the module docstring)."""
        if is_policy(compress):
            if options:
                raise TypeError(f"compressor options ({', '.join(sorted(options))}) cannot be given beside a "
                                f"layer policy; give each pattern a config dict, e.g. "
                                f"{{'*': {{'name': 'topk', 'ratio': 0.01}}}}")
            rules = []
            for pattern, spec in compress.items():
                if not isinstance(pattern, str) or not pattern:
                    raise TypeError(f"layer policy: patterns must be non-empty strings, got {pattern!r}")
                try:
                    rules.append((pattern, create(spec)))
                except (TypeError, ValueError) as e:
                    raise type(e)(f"layer policy, pattern {pattern!r}: {e}") from None
            return cls(rules=rules, min_elements=min_elements)
        return cls(single=create(compress, **options), min_elements=min_elements)

    def group(self, name, count):
        """The index in ``compressors`` of the compressor of tensor ``name`` of ``count`` elements."""
        if count < self.min_elements:
            return 0
        if self.single:
            return len(self.compressors) - 1
        text = str(name)
        for pattern, g in self.rules:
            if fnmatchcase(text, pattern):
                return g
        return 0

    def groups(self, names, counts, codes, compressible):
        """Per tensor, its compressor's index (0 for dtypes no compressor takes)."""
        if self.lossless:
            return None
        return [self.group(n, c) if code in compressible else 0
                for n, c, code in zip(names, counts, codes)]

    def get_config(self):
        """What the ranks agree on: the single compressor's config (as before policies
        existed, so residual keys do not change), or the rules."""
        if self.single and not self.min_elements:
            return self.main.get_config()
        cfg = {"policy": [[p, self.compressors[g].get_config()] for p, g in self.rules]} if not self.single \
            else {"policy": [["*", self.main.get_config()]]}
        cfg["min_elements"] = self.min_elements
        return cfg

    def describe(self):
        """The ``compress=`` value that reproduces this policy (for ``get_config``)."""
        if self.single:
            return self.main.name
        return {p: (None if g == 0 else self.compressors[g].get_config()) for p, g in self.rules}

    @property
    def name(self):
        """The single compressor's name, or ``"policy(pattern: name, ...)"`` for a policy."""
        return self.main.name if self.single else "policy(" + ", ".join(
            f"{p}: {self.compressors[g].name}" for p, g in self.rules) + ")"

    def __repr__(self):
        return f"LayerPolicy({self.describe()!r}, min_elements={self.min_elements})"
