#!/usr/bin/env bash
# Device check of the GPU path (issue 6): at most 5 minutes on one GPU, no network. The
# whole script keeps to GPU_CHECK_BUDGET_S (default 300 s): every step has its own time
# limit, cut to what the budget has left, and 100 s are kept for the benchmark, which runs
# last. A first run on an unknown image may allow more (GPU_CHECK_BUDGET_S=560 under a
# 600 s limit), so that nothing is cut; the last line says how long it took.
#
#   bash scripts/gpu_check.sh            # from the repository root, on the GPU machine
#
# Uses the packages already on the image (Python 3.12, numpy 2, cupy-cuda13x, Cython,
# pytest, mpi4py), plus wheels carried in .wheels/ (scripts/fetch_device_wheels.sh: an MPI
# for mpi4py where the image has none that works, setuptools where the image lacks it), and
# a prebuilt gradfuse/_core*.so if carried (used when the in-place build cannot run).
# Steps: build gradfuse in place; 1) compile every kernel with NVRTC (loaded with
# cupy.RawModule) and check subnormals survive; 2) the GPU tests with GRADFUSE_TEST_GPU=1
# (a missing GPU is a failure there; here a skipped communicator or pipeline test is one
# too): kernels, the nvcc/NVRTC checks, communicators, the Pipeline on cupy arrays (1 rank,
# and 2 ranks under mpiexec: host-staged, since NCCL refuses two ranks on one GPU), the
# DDP comm hook on CUDA buckets (torchrun: world size 1 over NCCL, 2 ranks over gloo), the
# example on the GPU; 3) the kernel benchmark on a 256 MB bucket and Pipeline steps on
# ResNet-50, GPU vs host (python -m gradfuse.bench gpu --pipeline), markdown on stdout and
# in $OUT/gpu_bench.md, written row by row. Logs go to $OUT (or /tmp). Exit status:
# non-zero if any step failed or did not run; every step runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# gradfuse is built in place, not installed: scripts and examples import it from here
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# one machine, loopback only: NCCL's bootstrap need not guess an interface (override to debug)
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# an image's Open MPI refuses root without these (harmless for MPICH); MPICH's UCX netmod
# stays on this host's transports
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 UCX_TLS=${UCX_TLS:-self,sm,tcp}
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_INPUT=1
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp}
mkdir -p "$LOGS"
t0=$(date +%s)
DEADLINE=$(( t0 + ${GPU_CHECK_BUDGET_S:-300} ))
BENCH_RESERVE=100
say() { echo "== gpu_check [$(( $(date +%s) - t0 )) s] $*"; }
fail=0
notrun=()

# limit WANT [RESERVE]: WANT seconds, or less if the budget (less RESERVE) has less left
limit() {
    local left=$(( DEADLINE - $(date +%s) - ${2:-$BENCH_RESERVE} ))
    (( left < $1 )) && echo $left || echo $1
}
# step NAME WANT CMD...: run CMD under its limit (keeping STEP_RESERVE, default the
# benchmark's, for what follows); too little time left: NOT RUN, a failure
step() {
    local name=$1 want=$2; shift 2
    local lim; lim=$(limit "$want" "${STEP_RESERVE:-$BENCH_RESERVE}")
    if (( lim < 10 )); then
        say "NOT RUN: $name (the time budget is spent)"; notrun+=("$name"); fail=1; return 99
    fi
    timeout -k 10 "$lim" "$@"
    local rc=$?
    (( rc == 124 || rc == 137 )) && say "$name: TIMED OUT after $lim s"
    return $rc
}

say "machine"
timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader \
    2>/dev/null || echo "(no nvidia-smi)"
timeout 60 $PY -c "
import sys, numpy, cupy
from cupy.cuda import nccl
print('python', sys.version.split()[0], '| numpy', numpy.__version__, '| cupy', cupy.__version__,
      '| devices', cupy.cuda.runtime.getDeviceCount(), '| nccl available', nccl.available)" || fail=1

# wheels carried along (scripts/fetch_device_wheels.sh), offline, and only what is missing:
# mpich only where mpi4py has no working MPI or there is no mpiexec, others where the
# package is not installed, so nothing already on the image is replaced
mpi_ok() { timeout 30 $PY -c "from mpi4py import MPI; MPI.COMM_WORLD.Get_rank()" > /dev/null 2>&1; }
find_mpiexec() {
    local data; data=$($PY -c "import sysconfig; print(sysconfig.get_path('data'))" 2>/dev/null)
    for c in "$(dirname "$(command -v $PY)")/mpiexec" "$data/bin/mpiexec" "$(command -v mpiexec)"; do
        [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return; }
    done
}
WHEELS=${GRADFUSE_WHEELS:-.wheels}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    for whl in "$WHEELS"/*.whl; do
        name=$(basename "$whl" | cut -d- -f1)
        if [ "$name" = mpich ]; then
            if mpi_ok && [ -n "$(find_mpiexec)" ]; then echo "wheel mpich: the image's MPI works, kept"; continue; fi
        elif $PY -m pip show -q "$name" > /dev/null 2>&1; then
            echo "wheel $name: already installed, kept"; continue
        fi
        say "install carried wheel $(basename "$whl")"
        timeout 90 $PY -m pip install -q --no-index --no-deps "$whl" || echo "(install of $whl failed)"
        if [ "$name" = mpich ]; then
            # pip's data dir may not be on the loader's path (a system Python's /usr/local)
            data=$($PY -c "import sysconfig; print(sysconfig.get_path('data'))")
            export LD_LIBRARY_PATH="$data/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    done
fi
MPIEXEC=$(find_mpiexec)
timeout 30 $PY -c "from mpi4py import MPI; print('MPI:', MPI.Get_library_version().splitlines()[0])" 2>&1 | tail -1
echo "mpiexec: ${MPIEXEC:-none}"

say "build: $PY setup.py build_ext --inplace"
if ! step build 120 $PY setup.py build_ext --inplace > "$LOGS/gpu_build.log" 2>&1; then
    tail -30 "$LOGS/gpu_build.log"
    if timeout 60 $PY -c "import gradfuse._core" 2>/dev/null; then
        say "BUILD FAILED; going on with the carried gradfuse/_core $($PY -c 'import gradfuse._core as c; print(c.__file__)')"
        fail=1
    else
        say "BUILD FAILED and no usable gradfuse/_core: nothing else can run"; exit 1
    fi
fi

say "1) compile every kernel (NVRTC, cupy.RawModule(path=)) and check subnormals on the device"
step compile 60 $PY - <<'PYEOF' || fail=1
import time
from gradfuse import gpu
t = time.perf_counter()
names = gpu.compile_all()
print(f"{len(names)} kernels compiled in {time.perf_counter() - t:.1f} s with {gpu.OPTIONS}:")
print("  " + "\n  ".join(names))
PYEOF

# each part in its own process: a broken MPI cannot take the kernel results down, and the
# ctypes NVRTC of the compile checks stays out of the process that runs cupy's kernels.
# Skips: the kernel tests may skip what needs a tool the image lacks; the communicator and
# pipeline tests must all run on a GPU machine, so a skip there is a failure.
for part in kernels compile-checks comm pipeline; do
    case $part in
        kernels) files="tests/test_gpu_kernels.py"; want=150 ;;
        compile-checks) files="tests/test_cuda_compile.py"; want=60 ;;
        comm) files="tests/test_gpu_comm.py"; want=90 ;;
        pipeline) files="tests/test_gpu_pipeline.py tests/test_gpu_momentum.py"; want=60 ;;
    esac
    say "2) GPU tests, $part (GRADFUSE_TEST_GPU=1)"
    GRADFUSE_TEST_GPU=1 step "tests $part" $want $PY -m pytest -q -p no:cacheprovider -p no:randomly \
        -o addopts="" -rfEs --tb=short --durations=8 $files > "$LOGS/gpu_tests_$part.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR|SKIPPED)" "$LOGS/gpu_tests_$part.log" | head -40
    tail -12 "$LOGS/gpu_tests_$part.log"
    [ $rc -eq 0 ] || { fail=1; say "GPU TESTS ($part) FAILED (exit $rc; full log $LOGS/gpu_tests_$part.log)"; }
    if [ $part = comm ] || [ $part = pipeline ]; then
        grep -q "^SKIPPED" "$LOGS/gpu_tests_$part.log" && { fail=1; say "GPU TESTS ($part): tests SKIPPED (see above)"; }
    fi
done

# gradfuse.torch's DDP comm hook on CUDA buckets (the image has PyTorch with CUDA): the hook's
# averaged buckets against its host path on the same inputs, bucket by bucket and bit for bit,
# every compressor, fp32 and bf16 models (tests/torch_bodies/cuda_buckets.py). NCCL refuses
# two ranks on one GPU, so: world size 1 over NCCL (torch's NCCL collectives on the device),
# then 2 ranks on the one GPU over gloo (the payloads staged through pinned host memory).
# No MPI: torchrun starts the ranks.
if timeout 60 $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    for ddp in "1 nccl" "2 gloo"; do
        read -r nproc backend <<< "$ddp"
        say "2) DDP comm hook on CUDA buckets: torchrun --nproc_per_node $nproc, backend $backend"
        step "ddp $backend" 75 $PY -m torch.distributed.run --nproc_per_node "$nproc" --master_addr 127.0.0.1 \
            --master_port $(( 29600 + nproc )) tests/torch_bodies/cuda_buckets.py "$backend" \
            > "$LOGS/gpu_ddp_$backend.log" 2>&1
        rc=$?
        grep -E "^(DEVICE|CHECK|ALL OK)|Error|error:" "$LOGS/gpu_ddp_$backend.log" | sort -u | head -20
        if [ $rc -ne 0 ] || [ "$(grep -c '^ALL OK rank' "$LOGS/gpu_ddp_$backend.log")" != "$nproc" ]; then
            tail -30 "$LOGS/gpu_ddp_$backend.log"; fail=1; say "DDP HOOK ON CUDA BUCKETS ($backend) FAILED (exit $rc)"
        fi
    done
else
    say "2) NOT RUN: the DDP hook on CUDA buckets (no PyTorch with CUDA on this image)"
    notrun+=("ddp hook"); fail=1
fi

if [ -n "$MPIEXEC" ]; then
    say "2) GPU pipeline, 2 ranks on one GPU ($MPIEXEC -n 2)"
    GRADFUSE_TEST_GPU=1 GRADFUSE_TEST_RANKS=2 step "2-rank pipeline" 60 "$MPIEXEC" -n 2 $PY -m pytest -q \
        -p no:cacheprovider -p no:randomly -o addopts="" -rfE --tb=short tests/mpi/test_gpu_pipeline.py \
        > "$LOGS/gpu_tests_pipeline2.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR)|world of" "$LOGS/gpu_tests_pipeline2.log" | sort -u | head -20
    tail -4 "$LOGS/gpu_tests_pipeline2.log"
    [ $rc -eq 0 ] || { fail=1; say "2-RANK GPU PIPELINE FAILED (exit $rc)"; }
    say "2) example on the GPU: mpiexec -n 2 examples/numpy_digits_compression.py --device gpu"
    step example 75 "$MPIEXEC" -n 2 $PY examples/numpy_digits_compression.py --device gpu --compress all \
        --epochs 3 > "$LOGS/gpu_example.log" 2>&1
    rc=$?
    grep -E "^\||rank\(s\)" "$LOGS/gpu_example.log"
    if [ $rc -ne 0 ] || grep -q "| NO |" "$LOGS/gpu_example.log" || ! grep -q "^2 rank(s) on gpu" "$LOGS/gpu_example.log"; then
        tail -20 "$LOGS/gpu_example.log"; fail=1; say "GPU EXAMPLE FAILED (exit $rc)"
    fi
else
    # the GPU image may have mpi4py without an MPI library (no mpiexec): say so plainly
    say "2) NOT RUN: no mpiexec on this machine (the 2-rank GPU pipeline and the GPU example need an MPI)"
    notrun+=("2-rank pipeline" "example"); fail=1
fi

say "3) benchmark (256 MB bucket; Pipeline steps on ResNet-50)"
STEP_RESERVE=0 step benchmark 90 $PY -m gradfuse.bench gpu --mb 256 --repeat 20 --pipeline || fail=1
[ -n "${OUT:-}" ] && [ -s "$OUT/gpu_bench.md" ] && echo "(tables in $OUT/gpu_bench.md)"

(( ${#notrun[@]} )) && say "not run: ${notrun[*]}"
say "done, status $fail"
exit $fail
