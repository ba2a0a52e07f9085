#!/usr/bin/env bash
# Download, on a machine with network, the wheels the device check installs offline on the GPU
# image when it lacks them: an MPI (the image has mpi4py but may have no MPI library, and so
# no mpiexec for the 2-rank GPU tests and example). They go to .wheels/ (git-ignored), which
# the device runner carries with the working tree; scripts/gpu_check.sh installs them with
# --no-index --no-deps before it starts.
#
#   bash scripts/fetch_device_wheels.sh      # then carry ".wheels" with the device run
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
mkdir -p .wheels
# mpich's wheel is py3-none (any Python 3), manylinux_2_28 x86_64: ~13 MB
$PIP download --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.12 \
    -d .wheels "mpich>=4"
ls -la .wheels
