"""gradfuse.mxnet under MXNet's NaiveEngine: calls complete before they return and raise
their errors themselves (tests/scripts/mxnet_naive_engine.py, under mpiexec -n 2)."""
import os
import sys

import pytest

from conftest import mpiexec_path
from helpers import run_limited

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.mpi


def test_naive_engine_completes_in_the_call_and_raises_there():
    pytest.importorskip("mxnet")
    env = dict(os.environ, MXNET_ENGINE_TYPE="NaiveEngine", GRADFUSE_EXIT_TIMEOUT_S="20")
    env.pop("GRADFUSE_STALL_TIMEOUT_S", None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])   # this checkout
    script = os.path.join(ROOT, "tests", "scripts", "mxnet_naive_engine.py")
    code, out, timed_out = run_limited([mpiexec_path(), "-n", "2", sys.executable, script], timeout=120,
                                       env=env, cwd=ROOT)
    assert not timed_out, out[-4000:]
    assert code == 0, out[-4000:]
    assert out.count("NaiveEngine OK") == 2, out[-4000:]
    assert f"gradfuse from {ROOT}" in out, out[-4000:]
