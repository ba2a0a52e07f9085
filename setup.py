"""Build script: the Cython kernels with their compiler directives set in one place.

GRADFUSE_DEBUG_BUILD=1 rebuilds the kernels with bounds checks and wraparound on,
for debugging and for the bounds-checked kernel test run.
"""
import os

from setuptools import Extension, setup
from Cython.Build import cythonize

_raw = os.environ.get("GRADFUSE_DEBUG_BUILD")
if _raw is not None and _raw.strip() not in ("0", "1"):
    raise SystemExit(f"GRADFUSE_DEBUG_BUILD={_raw!r}: expected 0 or 1 (or unset)")
debug = _raw is not None and _raw.strip() == "1"

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": not debug,
    # the compiled functions' docstrings start with their signature (Python's own
    # introspection sees none), in Python syntax so that Sphinx's autodoc renders it
    # (docs/api/kernels.md): ``pack(buf: uint8_t[::1], src: const_int64_t[::1], ...)``
    "embedsignature": True,
    "embedsignature.format": "python",
}

# -ffp-contract=off: no FMA contraction, so scalar, SIMD and GPU paths can agree bit
# for bit. No -march flags: the wheel must run on any x86-64 the user has.
cflags = ["-O3", "-ffp-contract=off", "-fno-fast-math"]
if debug:
    cflags = ["-O0", "-g", "-ffp-contract=off"]

ext = Extension(
    "gradfuse._core",
    ["gradfuse/_core.pyx"],
    include_dirs=["gradfuse/kernels"],
    extra_compile_args=cflags,
)

# gradfuse.mxnet's engine hand-off (C++: MXNet's engine takes a dmlc::Error on failure).
# It calls MXNet only through function pointers handed over at import, so it builds and
# links without MXNet.
engine_ext = Extension(
    "gradfuse.mxnet._engine",
    ["gradfuse/mxnet/_engine.pyx"],
    include_dirs=["gradfuse/mxnet"],
    language="c++",
    extra_compile_args=[f for f in cflags if f != "-ffp-contract=off"] + ["-std=c++14"],
)

# The generated C depends on the directives: regenerate it whenever the build kind
# changes (a normal build after a debug build must not keep the bounds checks).
_stamp = os.path.join("gradfuse", ".build_kind")
_kind = "debug" if debug else "release"
try:
    with open(_stamp) as f:
        _changed = f.read().strip() != _kind
except OSError:
    _changed = True
setup(ext_modules=cythonize([ext, engine_ext], compiler_directives=directives,
                            force=debug or _changed, annotate=False))
try:
    with open(_stamp, "w") as f:
        f.write(_kind)
except OSError:
    pass

