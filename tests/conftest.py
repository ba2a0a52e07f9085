import os
import shutil
import sys

import numpy as np
import pytest


def mpiexec_path():
    """mpiexec next to this Python (pip's mpich puts it in the venv), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
