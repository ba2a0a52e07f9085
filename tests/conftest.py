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


# The fast loop (README: ``pytest -m "not slow"``) leaves out what launches processes or
# builds: every test marked ``mpi`` (mpiexec launches) or ``one_leg`` (rebuilds, compilers,
# the kernel emulator, process deaths, the 3- and 4-rank launches) is ``slow`` too; the
# experiment runs and other long tests carry the mark themselves.
_SLOW_BECAUSE = ("mpi", "one_leg")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(m) is not None for m in _SLOW_BECAUSE):
            item.add_marker(pytest.mark.slow)
