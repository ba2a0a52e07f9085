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

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import run_limited  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
           "tests/test_gpu_pipeline.py", "tests/test_gpu_comm.py"]
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
    (accuracies, bytes, identical models), which checks the GPU pipeline end to end."""
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
        assert len(rows) == 7 and all(r.rstrip().endswith("| yes |") for r in rows), out[-3000:]
        tables.append(rows)
    assert tables[0] == tables[1], tables
