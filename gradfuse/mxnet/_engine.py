"""Stand-in for ``gradfuse.mxnet._engine``, the compiled engine hand-off (``_engine.pyx``,
C++, with ``_engine_op.h``).

Python imports the compiled extension of the same name (``_engine.cpython-*.so``) ahead
of this file, so this runs only where the extension was never built. It also lets static
tools (the import-layer contracts) see the module.
"""
raise ImportError(
    "gradfuse.mxnet._engine, the compiled MXNet engine hand-off, is not built in this checkout "
    f"({__file__.rsplit('/', 1)[0]}): run `pip install -e .` (or "
    "`python setup.py build_ext --inplace`) first; it needs a C++ compiler and Cython")
