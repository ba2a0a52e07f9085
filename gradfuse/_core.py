"""Stand-in for ``gradfuse._core``, the compiled CPU kernels (``_core.pyx`` + ``kernels/``).

Python imports the compiled extension of the same name (``_core.cpython-*.so``) ahead of
this file, so this runs only where the extension was never built. It also lets static
tools (the import-layer contracts of CI among them) see the kernels as a module.
"""
raise ImportError(
    "gradfuse._core, the compiled kernels, is not built in this checkout "
    f"({__file__.rsplit('/', 1)[0]}): run `pip install -e .` (or "
    "`python setup.py build_ext --inplace`) first; it needs a C compiler and Cython")
