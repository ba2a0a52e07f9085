#!/usr/bin/env bash
# Build the Cython kernels with bounds checks (GRADFUSE_DEBUG_BUILD=1: boundscheck,
# wraparound, initializedcheck on, -O0 -g) in a temporary copy of the package, and run
# the kernel tests against that build. The normal in-place build is not touched.
#
#   scripts/debug_kernel_tests.sh [extra pytest args]
#
# PYTHON selects the interpreter (default: the checkout's .venv/bin/python, as README sets it
# up, else python3). Exit status: pytest's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/gradfuse-debug.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
# copy the sources only (no built .so, no generated .c: cythonize must regenerate them)
mkdir -p "$TMP/gradfuse"
(cd "$ROOT" && tar cf - --exclude='*.so' --exclude='_core.c' --exclude='_engine.cpp' --exclude='__pycache__' \
    gradfuse tests setup.py pyproject.toml) | (cd "$TMP" && tar xf -)
cd "$TMP"
t0=$(date +%s)
GRADFUSE_DEBUG_BUILD=1 "$PYTHON" setup.py build_ext --inplace -q >build.log 2>&1 || {
    cat build.log; echo "debug build failed" >&2; exit 1; }
t1=$(date +%s)
echo "debug build: $((t1 - t0)) s in $TMP"
# the extension must really be the bounds-checked one: Cython emits an index check per
# memoryview access (0 in the normal build), and the module must load from the copy
checks=$(grep -c "__Pyx_RaiseBufferIndexError(" gradfuse/_core.c || true)
[ "$checks" -gt 0 ] || { echo "no bounds checks in the generated C: not a debug build" >&2; exit 1; }
where=$(cd "$TMP" && PYTHONPATH="$TMP" "$PYTHON" -c "import gradfuse._core as c; print(c.__file__)")
case "$where" in "$TMP"/*) ;; *) echo "imported $where, not the debug build" >&2; exit 1;; esac
echo "bounds-checked build: $checks index checks in _core.c, loaded from $where"
PYTHONPATH="$TMP" "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts= \
    tests/test_core.py tests/test_kernels_cast.py tests/test_kernels_quant.py \
    tests/test_kernels_sparse.py tests/test_fuzz_kernels.py tests/test_pipeline.py "$@"
t2=$(date +%s)
echo "kernel tests under the bounds-checked build: $((t2 - t1)) s (build $((t1 - t0)) s)"
