#!/usr/bin/env bash
# Prepare, on a machine with network, what the device check needs on the GPU image (no
# network there) and may not find:
#   .wheels/mpich-*.whl       an MPI: the image has mpi4py but may have no MPI library, and
#                             so no mpiexec for the 2-rank GPU tests and example;
#   .wheels/setuptools-*.whl  the in-place build imports setuptools, which Python 3.12 no
#                             longer bundles;
#   gradfuse/_core.cpython-312-x86_64-linux-gnu.so
#                             the Cython kernels built here for CPython 3.12 (they need
#                             only libc), used if the image cannot build them (no
#                             compiler or no Python headers).
# All git-ignored; the device runner carries them with the working tree:
#
#   bash scripts/fetch_device_wheels.sh
#   # then run with carry [".wheels", "gradfuse/_core.cpython-312-x86_64-linux-gnu.so"]
#
# scripts/gpu_check.sh installs a carried wheel with --no-index --no-deps only where the
# image lacks it, and builds gradfuse in place, falling back to the carried module.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
mkdir -p .wheels
# mpich's wheel is py3-none (any Python 3), manylinux_2_28 x86_64: ~13 MB
$PIP download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.12 \
    -d .wheels "mpich>=4"
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 -d .wheels "setuptools>=70"

if [ -z "${PY312:-}" ]; then
    for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then PY312=$c; break; fi
    done
fi
if [ -n "${PY312:-}" ]; then
    work=$(mktemp -d)
    "$PY312" -m venv "$work/venv"
    "$work/venv/bin/pip" install -q "cython>=3" "setuptools>=70"
    # the tracked files as they are in the working tree, built away from it
    mkdir -p "$work/src" && git ls-files -z | tar --null -T - -cf - | tar -x -C "$work/src"
    (cd "$work/src" && "$work/venv/bin/python" setup.py -q build_ext --inplace > "$work/build.log" 2>&1) \
        || { tail -20 "$work/build.log"; exit 1; }
    cp "$work"/src/gradfuse/_core.cpython-312-*.so gradfuse/
    rm -rf "$work"
    echo "built: $(ls gradfuse/_core.cpython-312-*.so)"
else
    echo "no python3.12 here (set PY312=...): gradfuse/_core for 3.12 not prebuilt; the image must build it"
fi
ls -la .wheels
