"""The hook's CUDA bucket path on the kernel emulator (tests/cuda_emu), 1 and 2 ranks.

tests/torch_bodies/cuda_buckets.py runs DDP with gradfuse's hook where CPU tensors stand
in for CUDA tensors: the bucket reaches gradfuse's GPU path through the real DLPack intake
(the emulator's cupy), the Pipeline's CudaBackend runs the CUDA kernels of cuda/ on the
SIMT emulator, and the device communicator the hook's TorchCommunicator makes moves the
payloads with torch's collectives (direct, NCCL's role, at 1 and 2 ranks; host-staged at
2). Every compressor, fp32 and bf16 models, the Adam correction, every bucket of every
step: bit-identical to the host path on the same inputs; PowerSGD to tolerance (its
matrix products are BLAS's on the device path, gradfuse's kernels on the host path). The same body runs on a GPU in scripts/gpu_check.sh's
DDP section (DLPack to CUDA tensors, NCCL, streams: what only a GPU shows).
"""
import os
import shutil

import pytest

pytest.importorskip("torch")

from helpers import run_limited  # noqa: E402
from test_torch_ddp import ROOT, _env, _torchrun  # noqa: E402

pytestmark = pytest.mark.slow     # the kernel emulator: CUDA kernels compiled for the CPU

BODY = os.path.join(ROOT, "tests", "torch_bodies", "cuda_buckets.py")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the SIMT emulator needs it)")
@pytest.mark.parametrize("n, mode", [(1, "direct"), (2, "direct"), (2, "staged")])
def test_cuda_buckets_on_the_kernel_emulator(n, mode):
    env = dict(_env(), GRADFUSE_GPU_EMULATOR="1")
    code, out, timed_out = run_limited(_torchrun(n, BODY, "gloo", mode), timeout=600, env=env, cwd=ROOT)
    assert not timed_out, f"hung (killed after 600 s):\n{out[-4000:]}"
    assert code == 0, out[-6000:]
    for r in range(n):
        assert f"ALL OK rank {r} of {n}" in out, out[-4000:]
        for check in ("every_compressor_fp32", "bf16_model", "adam_correction", "powersgd"):
            assert f"CHECK check_{check} ok rank {r}" in out, out[-4000:]
