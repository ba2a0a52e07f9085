#!/usr/bin/env bash
# Device check of the GPU path (issue 6): about 4-5 minutes on one GPU, no network; every
# step has its own time limit (585 s in all at worst), so run it with a 600 s limit.
#
#   bash scripts/gpu_check.sh            # from the repository root, on the GPU machine
#
# Uses the packages already on the image (Python 3.12, numpy 2, cupy-cuda13x, Cython,
# pytest, mpi4py), plus any wheels carried in .wheels/ (scripts/fetch_device_wheels.sh:
# an MPI, where the image has none). Steps: build gradfuse in place; 1) compile every kernel with
# NVRTC (loaded with cupy.RawModule) and check subnormals survive; 2) the GPU tests with GRADFUSE_TEST_GPU=1 (a missing GPU is a
# failure there): kernels, communicators, the Pipeline on cupy arrays (1 rank, and 2 ranks
# under mpiexec: host-staged, since NCCL refuses two ranks on one GPU); 3) the kernel
# benchmark on a 256 MB bucket and Pipeline steps on ResNet-50, GPU vs host
# (python -m gradfuse.bench_gpu --pipeline), markdown on stdout and in $OUT/gpu_bench.md. Logs go to $OUT
# (or /tmp). Exit status: non-zero if any step failed; every step runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
# one machine, loopback only: NCCL's bootstrap need not guess an interface (override to debug)
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp}
mkdir -p "$LOGS"
t0=$(date +%s)
say() { echo "== gpu_check [$(( $(date +%s) - t0 )) s] $*"; }
fail=0

say "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
$PY -c "import sys, numpy, cupy; print('python', sys.version.split()[0], '| numpy', numpy.__version__, '| cupy', cupy.__version__, '| devices', cupy.cuda.runtime.getDeviceCount())" || fail=1

# wheels carried along (scripts/fetch_device_wheels.sh: an MPI where the image has none);
# offline, and only packages the image lacks, so nothing already there is replaced
WHEELS=${GRADFUSE_WHEELS:-.wheels}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    for whl in "$WHEELS"/*.whl; do
        name=$(basename "$whl" | cut -d- -f1)
        if $PY -m pip show -q "$name" > /dev/null 2>&1; then
            echo "wheel $name: already installed, kept"
        else
            say "install carried wheel $(basename "$whl")"
            timeout 60 $PY -m pip install -q --no-index --no-deps "$whl" || echo "(install of $whl failed)"
        fi
    done
fi
$PY -c "from mpi4py import MPI; print('MPI:', MPI.Get_library_version().splitlines()[0])" 2>&1 | tail -1

say "build: $PY setup.py build_ext --inplace"
if ! timeout 120 $PY setup.py build_ext --inplace > "$LOGS/gpu_build.log" 2>&1; then
    tail -40 "$LOGS/gpu_build.log"; say "BUILD FAILED"; exit 1
fi

say "1) compile every kernel (NVRTC, cupy.RawModule(path=)) and check subnormals on the device"
timeout 60 $PY - <<'PYEOF' || fail=1
import time
from gradfuse import gpu
t = time.perf_counter()
names = gpu.compile_all()
print(f"{len(names)} kernels compiled in {time.perf_counter() - t:.1f} s with {gpu.OPTIONS}:")
print("  " + "\n  ".join(names))
PYEOF

# kernels and communicators in two processes: a broken MPI cannot take the kernel results down
for part in kernels comm pipeline; do
    if [ $part = kernels ]; then files="tests/test_gpu_kernels.py tests/test_cuda_compile.py"; limit=120
    elif [ $part = comm ]; then files="tests/test_gpu_comm.py"; limit=45
    else files="tests/test_gpu_pipeline.py"; limit=45; fi
    say "2) GPU tests, $part (GRADFUSE_TEST_GPU=1)"
    GRADFUSE_TEST_GPU=1 timeout $limit $PY -m pytest -q -p no:cacheprovider -o addopts="" -rfEs --tb=short \
        --durations=8 $files > "$LOGS/gpu_tests_$part.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR)" "$LOGS/gpu_tests_$part.log" | head -40
    tail -20 "$LOGS/gpu_tests_$part.log"
    [ $rc -eq 0 ] || { fail=1; say "GPU TESTS ($part) FAILED (exit $rc; full log $LOGS/gpu_tests_$part.log)"; }
done

MPIEXEC=$(dirname "$(command -v $PY)")/mpiexec
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || true)
if [ -n "$MPIEXEC" ]; then
    say "2) GPU pipeline, 2 ranks on one GPU ($MPIEXEC -n 2)"
    GRADFUSE_TEST_GPU=1 timeout 60 "$MPIEXEC" -n 2 $PY -m pytest -q -p no:cacheprovider -o addopts="" -rfE \
        --tb=short tests/mpi/test_gpu_pipeline.py > "$LOGS/gpu_tests_pipeline2.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR)" "$LOGS/gpu_tests_pipeline2.log" | sort -u | head -20
    tail -4 "$LOGS/gpu_tests_pipeline2.log"
    [ $rc -eq 0 ] || { fail=1; say "2-RANK GPU PIPELINE FAILED (exit $rc)"; }
    say "2) example on the GPU: mpiexec -n 2 examples/numpy_digits_compression.py --device gpu"
    timeout 45 "$MPIEXEC" -n 2 $PY examples/numpy_digits_compression.py --device gpu --compress all --epochs 3 \
        > "$LOGS/gpu_example.log" 2>&1
    rc=$?
    grep -E "^\||rank\(s\)" "$LOGS/gpu_example.log"
    if [ $rc -ne 0 ] || grep -q "| NO |" "$LOGS/gpu_example.log"; then
        tail -20 "$LOGS/gpu_example.log"; fail=1; say "GPU EXAMPLE FAILED (exit $rc)"
    fi
else
    # the GPU image may have mpi4py without an MPI library (no mpiexec): say so plainly
    say "2) NOT RUN: no mpiexec on this machine (the 2-rank GPU pipeline and the GPU example need an MPI)"
fi

say "3) benchmark (256 MB bucket; Pipeline steps on ResNet-50)"
timeout 90 $PY -m gradfuse.bench_gpu --mb 256 --repeat 20 --pipeline || fail=1

say "done, status $fail"
exit $fail
