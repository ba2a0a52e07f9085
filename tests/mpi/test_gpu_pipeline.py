"""gradfuse.Pipeline on GPU arrays across ranks: the same bits as the host path.

On a one-GPU machine every rank shares the device, so NCCL is refused and the pipeline
uses the host-staged MPI communicator (with a warning); on the SIMT emulator
(GRADFUSE_GPU_EMULATOR=1, launched by tests/test_gpu_emulated.py) too. Skipped without
a GPU, like every ``gpu`` test.
"""
import os
import sys
import warnings

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from conftest_gpu import require_gpu  # noqa: E402
from gpu_pipeline_cases import COMPRESSORS, case_id, run_steps  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp(world):
    return require_gpu()[0]


@pytest.mark.parametrize("case", COMPRESSORS, ids=case_id)
def test_gpu_equals_host_across_ranks(cp, world, case):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="gradfuse: NCCL is not usable")
        host, dev = run_steps(cp, case[0], case[1], rank=world.Get_rank(), steps=2, mode="out")
    kind = dev._ctx.gpu_comm.kind
    assert kind in ("nccl", "host-staged"), kind


def test_gpu_inplace_across_ranks(cp, world):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="gradfuse: NCCL is not usable")
        run_steps(cp, "1bit", {"algorithm": "twophase", "block_size": 32}, rank=world.Get_rank(),
                  steps=2, mode="inplace")
