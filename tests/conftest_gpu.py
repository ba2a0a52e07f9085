"""Skip-or-fail for GPU tests (Horovod's ``skip_or_fail_gpu_test``).

Without a usable GPU (no cupy, no device, or the kernels cannot be loaded) a GPU test is
skipped, unless ``GRADFUSE_TEST_GPU=1``: then the missing GPU is a failure, so a device
check that silently ran nothing cannot pass.
"""
import os

import pytest


def gpu_required():
    raw = os.environ.get("GRADFUSE_TEST_GPU", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"GRADFUSE_TEST_GPU={raw!r}: expected 0 or 1")
    return raw == "1"


def skip_or_fail(reason):
    if gpu_required():
        pytest.fail(f"GRADFUSE_TEST_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def emulated():
    """GRADFUSE_GPU_EMULATOR=1: run the kernels on the CPU SIMT emulator (tests/cuda_emu)."""
    return os.environ.get("GRADFUSE_GPU_EMULATOR", "").strip() == "1"


def require_gpu():
    """Return ``(cupy, gradfuse.gpu)``, or skip / fail the calling test."""
    from gradfuse import gpu
    if emulated():
        import sys
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu"))
        import fakecupy
        return fakecupy.install(), gpu
    try:
        import cupy
    except Exception as e:          # ImportError, or a broken CUDA install
        skip_or_fail(f"cupy cannot be imported ({type(e).__name__}: {e})")
    if not gpu.available():
        skip_or_fail("no CUDA device is visible to cupy")
    return cupy, gpu
