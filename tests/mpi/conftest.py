"""Multi-rank tests. They run under mpiexec, launched by tests/test_mpi_launch.py.

Every rank runs the same tests in the same order, so collectives match up.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def world():
    import gradfuse
    from mpi4py import MPI
    gradfuse.init()
    return MPI.COMM_WORLD
