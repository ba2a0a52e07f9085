"""CUDA kernels of gradfuse, shipped as package data (``gradfuse.cuda``).

The ``.cu`` files here are compiled at run time with ``cupy.RawModule`` (NVRTC) by the
GPU path. This folder sits at the top of the repository and setup maps it into the
package, so ``source(name)`` finds a kernel however gradfuse is installed.
"""
from importlib import resources


def source(name):
    """Return the text of the kernel file ``name`` (e.g. ``"pack.cu"``)."""
    return resources.files(__name__).joinpath(name).read_text()


def available():
    """Names of the ``.cu`` files shipped with this installation."""
    return sorted(p.name for p in resources.files(__name__).iterdir() if p.name.endswith(".cu"))
