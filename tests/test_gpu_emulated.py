"""The GPU kernel tests on the CPU SIMT emulator (tests/cuda_emu), so CI without a GPU
still runs every kernel of cuda/*.cu against gradfuse._core, bit for bit.

The emulator runs the real .cu sources (g++ with a small CUDA shim, warps as 32 fibers
exchanging values at shfl/ballot, divergence at a full-mask intrinsic aborts). It checks
indexing, layouts, launch geometry, argument passing and the wrappers; it does not
check the GPU's own arithmetic or memory model: scripts/gpu_check.sh does, on a GPU.
Large sizes are left out here to keep CI short (the device check runs them all).
"""
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import run_limited  # noqa: E402

pytestmark = pytest.mark.slow     # the kernel emulator: CUDA kernels compiled for the CPU and run in-process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.one_leg     # the .cu kernels against gradfuse._core: numpy's version plays no part
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the SIMT emulator needs it)")
def test_gpu_kernels_on_simt_emulator():
    env = dict(os.environ)
    env["GRADFUSE_GPU_EMULATOR"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "tests/test_gpu_kernels.py", "-k", "not 1048589 and not 300001 and not 65537"]
    code, out, timed_out = run_limited(cmd, timeout=600, env=env, cwd=ROOT)
    assert not timed_out, out[-4000:]
    assert code == 0, out[-8000:]
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the SIMT emulator needs it)")
def test_gpu_pipeline_on_simt_emulator():
    """gradfuse.Pipeline on (emulated) GPU arrays, one rank: every compressor bit-identical
    to the host path, call forms, checkpoints across devices, errors; the host-staged
    communicator on 1 and 2 ranks and the NCCL communicator on 1 rank (test_gpu_comm.py,
    NCCL through the emulator's one-rank stand-in for cupy.cuda.nccl). Nothing skipped."""
    env = dict(os.environ)
    env["GRADFUSE_GPU_EMULATOR"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rs",
           "tests/test_gpu_pipeline.py", "tests/test_gpu_comm.py", "tests/test_gpu_momentum.py",
           "tests/test_gpu_adam.py", "tests/test_gpu_powersgd.py"]
    code, out, timed_out = run_limited(cmd, timeout=600, env=env, cwd=ROOT)
    assert not timed_out, out[-4000:]
    assert code == 0, out[-8000:]
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert not skipped and " passed" in out, out[-3000:]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the SIMT emulator needs it)")
@pytest.mark.parametrize("ranks", [2, 3])
def test_gpu_pipeline_multi_rank_on_simt_emulator(ranks):
    """The same across 2 and 3 ranks: the GPU communicator falls back to host-staged MPI
    (no NCCL on the emulator), and every rank gets the host path's bits."""
    from conftest import mpiexec_path
    env = dict(os.environ)
    env["GRADFUSE_GPU_EMULATOR"] = "1"
    env.pop("GRADFUSE_STALL_WARNING_S", None)
    env.pop("GRADFUSE_STALL_TIMEOUT_S", None)
    cmd = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", "tests/mpi/test_gpu_pipeline.py"]
    code, out, timed_out = run_limited(cmd, timeout=300, env=env, cwd=ROOT)
    assert not timed_out, out[-4000:]
    assert code == 0, out[-8000:]
    assert out.count(" passed") == ranks and "skipped" not in out, out[-2000:]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the SIMT emulator needs it)")
def test_digits_example_gpu_branch_on_simt_emulator():
    """examples/numpy_digits_compression.py --device gpu on 2 ranks, every compressor: on
    the emulator the model math is numpy's, so the table must equal the CPU run's exactly
    (accuracies, bytes, identical models), which checks the GPU pipeline end to end.
    PowerSGD is the exception: its matrix products run on gradfuse's kernels on the host
    and on cuBLAS (numpy on the emulator) on the device, equal to rounding only, so its
    row must match in bytes and identical models, its accuracy within 2 points."""
    from conftest import mpiexec_path
    env = dict(os.environ)
    env.pop("GRADFUSE_STALL_WARNING_S", None)
    env.pop("GRADFUSE_STALL_TIMEOUT_S", None)
    base = [mpiexec_path(), "-n", "2", sys.executable]
    args = ["examples/numpy_digits_compression.py", "--compress", "all", "--epochs", "2"]
    tables = []
    for cmd in (base + args, base + ["tests/scripts/run_emulated.py"] + args + ["--device", "gpu"]):
        code, out, timed_out = run_limited(cmd, timeout=300, env=env, cwd=ROOT)
        assert not timed_out and code == 0, out[-6000:]
        rows = sorted(line for line in out.splitlines() if line.startswith("| ") and "compressor" not in line)
        assert len(rows) == 8 and all(r.rstrip().endswith("| yes |") for r in rows), out[-3000:]
        tables.append(rows)
    exact = [[r for r in t if not r.startswith("| powersgd |")] for t in tables]
    assert exact[0] == exact[1], tables
    psgd = [[c.strip() for c in next(r for r in t if r.startswith("| powersgd |")).strip("|").split("|")]
            for t in tables]
    assert psgd[0][2:] == psgd[1][2:] and abs(float(psgd[0][1]) - float(psgd[1][1])) <= 0.02, psgd


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the SIMT emulator needs it)")
def test_emulator_is_as_strict_as_cupy(tmp_path):
    """Where real cupy 14 refuses or misreads a call, the emulator must refuse it too, or it
    hides the bug until the first GPU run: an argument whose width or kind differs from the
    kernel parameter (cupy passes each value with its own type's width), a grid that is not
    a tuple, a wrong argument count, NCCL's unique id given as anything but bytes, and
    UnownedMemory on a null pointer without a device."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "cuda_emu"))
    import fakecupy as cp
    src = ('extern "C" __global__ void k(float* x, int n, long long m, unsigned long long u) '
           '{ unsigned i = blockIdx.x * blockDim.x + threadIdx.x; '
           'if (i < (unsigned) n) x[i] = (float) (m + (long long) u); }')
    nvrtc = cp.cuda.nvrtc
    prog = nvrtc.createProgram(src, "k.cu", [], [])
    nvrtc.compileProgram(prog, ["-ftz=false", "-arch=sm_90"])
    path = tmp_path / "k.cubin"
    path.write_bytes(nvrtc.getCUBIN(prog))
    mod = cp.RawModule(path=str(path))
    assert mod.file_path == str(path)
    k = mod.get_function("k")
    assert k.params == ["p8", "i4", "i8", "u8"]
    x = cp.zeros(40, cp.float32)
    k((2,), (32,), (x, np.int32(40), np.int64(5), np.uint64(2)))
    assert (x.get() == 7).all()
    with pytest.raises(TypeError, match=r"argument 1 is i8"):
        k((2,), (32,), (x, np.int64(40), np.int64(5), np.uint64(2)))
    with pytest.raises(TypeError, match=r"argument 2 is i4"):
        k((2,), (32,), (x, np.int32(40), np.int32(5), np.uint64(2)))
    with pytest.raises(TypeError, match=r"argument 3 is f4"):
        k((2,), (32,), (x, np.int32(40), np.int64(5), np.float32(2)))
    with pytest.raises(TypeError, match="untyped"):
        k((2,), (32,), (x, 40, np.int64(5), np.uint64(2)))
    with pytest.raises(TypeError, match="3 arguments for 4"):
        k((2,), (32,), (x, np.int32(40), np.int64(5)))
    with pytest.raises(TypeError, match="grid must be a tuple"):
        k([2], (32,), (x, np.int32(40), np.int64(5), np.uint64(2)))
    nccl = cp.cuda.nccl
    uid = nccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(TypeError, match="expected bytes, got tuple"):
        nccl.NcclCommunicator(1, tuple(uid), 0)
    nccl.NcclCommunicator(1, uid, 0)
    with pytest.raises(ValueError, match="explicit device ID"):
        cp.cuda.UnownedMemory(0, 0, None, -1)


_FIBERS = r'''
import sys
import numpy as np
sys.path.insert(0, "tests/cuda_emu")
import fakecupy as cp
src = r"""
extern "C" __global__ void red(const float* x, float* out, int n) {
    __shared__ float part[32];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n ? x[i] : 0.0f;
    for (int off = 16; off; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (unsigned w = 0; w < blockDim.x / 32; w++) s += part[w];
        out[blockIdx.x] = s;
    }
}
extern "C" __global__ void diverge(float* x) {
    if (threadIdx.x < 16) x[0] = __shfl_sync(0xffffffffu, 1.0f, 0);
}
extern "C" __global__ void nobarrier(float* x) {
    if (threadIdx.x < 32) return;
    __syncthreads();
}
"""
prog = cp.cuda.nvrtc.createProgram(src, "f.cu", [], [])
cp.cuda.nvrtc.compileProgram(prog, ["-ftz=false", "-arch=sm_90"])
open(sys.argv[2], "wb").write(cp.cuda.nvrtc.getCUBIN(prog))
mod = cp.RawModule(path=sys.argv[2])
if sys.argv[1] == "red":
    x = cp.asarray(np.arange(1000, dtype=np.float32))
    out = cp.zeros(4, cp.float32)
    mod.get_function("red")((4,), (256,), (x, out, np.int32(1000)))
    got = out.get()
    want = [float(np.arange(1000, dtype=np.float64)[256 * b:256 * b + 256].sum()) for b in range(4)]
    assert got.tolist() == want, (got, want)
    print("fibers ok")
else:
    mod.get_function(sys.argv[1])((1,), (64,), (cp.zeros(1, cp.float32),))
'''


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the SIMT emulator needs it)")
def test_emulator_fibers_exchange_values_and_abort_on_divergence(tmp_path):
    """The emulator's own lanes (a bare stack switch on x86-64, ucontext elsewhere): a warp
    shuffle reduction across 8 warps and 4 blocks with a barrier gives the exact sums, and
    a shuffle only half a warp reaches, or a barrier some threads never reach, aborts with
    the emulator's message instead of returning."""
    script = tmp_path / "fibers.py"
    script.write_text(_FIBERS)
    run = lambda what: run_limited([sys.executable, str(script), what, str(tmp_path / f"{what}.cubin")],
                                   timeout=120, env=dict(os.environ), cwd=ROOT)
    code, out, timed_out = run("red")
    assert code == 0 and "fibers ok" in out, out[-3000:]
    code, out, timed_out = run("diverge")
    assert code != 0 and "warp divergence at __shfl_sync" in out, out[-3000:]
    code, out, timed_out = run("nobarrier")
    assert code != 0 and "__syncthreads not reached by every thread" in out, out[-3000:]
