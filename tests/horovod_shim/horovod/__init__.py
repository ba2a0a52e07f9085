"""``import horovod.mxnet`` served by gradfuse.mxnet, for running Horovod's own scripts and
tests unchanged: put this folder's parent first on PYTHONPATH.

``horovod.mxnet`` is ``gradfuse.mxnet``. Where Horovod itself is installed too, its other
modules (``horovod.runner``, ``horovod.common``, which Horovod's test helpers import) come
from it: its folder is appended to this package's path, after this one, so only
``horovod.mxnet`` is taken from here.
"""
import os
import sys

__version__ = "0.28.1"       # the Horovod API gradfuse.mxnet implements (docs/horovod.md)

_here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
for _entry in sys.path:
    _cand = os.path.join(_entry or os.getcwd(), "horovod")
    if os.path.realpath(_cand) != _here and os.path.isfile(os.path.join(_cand, "__init__.py")):
        __path__.append(_cand)
        break
