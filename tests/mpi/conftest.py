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
    # a launcher that does not match the MPI library starts every rank as a world of its
    # own, and each would pass alone: whoever launches says how many ranks it started
    want = os.environ.get("GRADFUSE_TEST_RANKS")
    if want and MPI.COMM_WORLD.Get_size() != int(want):
        pytest.exit(f"mpiexec started {want} processes but this one is in a world of "
                    f"{MPI.COMM_WORLD.Get_size()} rank(s): the mpiexec does not belong to the "
                    f"MPI library mpi4py loaded ({MPI.Get_library_version().splitlines()[0]})", returncode=3)
    return MPI.COMM_WORLD
