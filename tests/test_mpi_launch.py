"""Launch the multi-rank suites under mpiexec, with a hard time limit.

Each world size is one mpiexec launch that runs all of tests/mpi, so the suite pays
for MPI start-up twice, not once per test. A hang fails the test (the whole process
group is killed at the limit).
"""
import os
import sys

import pytest

from conftest import mpiexec_path
from helpers import run_limited

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.mpi


def _mpi_env():
    env = dict(os.environ)
    env.pop("GRADFUSE_STALL_WARNING_S", None)
    env.pop("GRADFUSE_STALL_TIMEOUT_S", None)
    return env


# the suite's ranks share one host, so their sums go through each other's memory
# (gradfuse.comm.cma); the MPI library's path for the same sums runs with GRADFUSE_CMA=0
_MPI_PATH = "tests/mpi/test_comm.py tests/mpi/test_collectives.py tests/mpi/test_cma.py tests/mpi/test_battery.py"


@pytest.mark.parametrize("ranks,target,cma", [(2, "tests/mpi", "1"),
                                              pytest.param(3, "tests/mpi", "1", marks=pytest.mark.one_leg),
                                              (2, _MPI_PATH, "0"),
                                              (1, "tests/mpi/test_battery.py", "1"),
                                              pytest.param(4, "tests/mpi/test_battery.py", "1",
                                                           marks=pytest.mark.one_leg)])
def test_multi_rank_suite(ranks, target, cma):
    """All of tests/mpi on 2 and 3 ranks; the reliability battery also on 1 and 4; the
    plain sums through the MPI library (GRADFUSE_CMA=0) on 2."""
    mpiexec = mpiexec_path()
    assert mpiexec, "mpiexec not found: install the mpich extra (see README)"
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "pytest", *target.split(), "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", "-W", "ignore::DeprecationWarning"]
    env = dict(_mpi_env(), GRADFUSE_TEST_RANKS=str(ranks), GRADFUSE_CMA=cma)
    code, out, timed_out = run_limited(cmd, timeout=180, env=env, cwd=ROOT)
    print(out)
    assert not timed_out, f"mpiexec -n {ranks} hung (killed after 180 s):\n{out[-4000:]}"
    assert code == 0, f"mpiexec -n {ranks} failed (exit {code}):\n{out[-6000:]}"
    assert "passed" in out and "failed" not in out.split("\n")[-2]


def test_stall_timeout_aborts_the_job_and_names_the_rank():
    """A rank that never arrives: the job ends (non-zero) soon after the timeout, no hang."""
    mpiexec = mpiexec_path()
    env = _mpi_env()
    env["GRADFUSE_STALL_TIMEOUT_S"] = "2"
    env["GRADFUSE_STALL_WARNING_S"] = "1"
    script = os.path.join(ROOT, "tests", "scripts", "never_arrives.py")
    code, out, timed_out = run_limited([mpiexec, "-n", "2", sys.executable, script], timeout=60, env=env)
    assert not timed_out, out
    assert code != 0
    assert "stall timeout" in out and "waiting for rank 1" in out, out


def test_main_job_demo_runs_and_checks_itself():
    """README's main-job command (shortened): 2 ranks, results bit-identical to per-tensor MPI."""
    code, out, timed_out = run_limited([mpiexec_path(), "-n", "2", sys.executable, "-m", "gradfuse.demo",
                                        "--steps", "2"], timeout=120, env=_mpi_env(), cwd=ROOT)
    assert not timed_out and code == 0, out
    assert out.count("bit-identical to per-tensor MPI.Allreduce") == 2, out
    assert "done: median" in out


def test_compression_accuracy_example():
    code, out, timed_out = run_limited(
        [mpiexec_path(), "-n", "2", sys.executable, "examples/numpy_digits_compression.py",
         "--compress", "all", "--epochs", "3"], timeout=120, env=_mpi_env(), cwd=ROOT)
    assert not timed_out and code == 0, out
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| compressor")}
    assert set(rows) == {"none", "fp16", "bf16", "1bit", "2bit", "topk", "randomk"}, out
    for name, (acc, _, same) in rows.items():
        assert same.strip() == "yes", (name, out)
    assert float(rows["none"][0]) > 0.85 and float(rows["1bit"][0]) > 0.85, out
    # bytes per step per rank (Pipeline.stats.bytes_sent) for the 650 float32 of W and b, 2 ranks:
    # fp32 and fp16 as a bandwidth-optimal allreduce (2(p-1)/p x size), 1-bit far below fp16
    sent = {name: float(v[1]) for name, v in rows.items()}
    assert sent["none"] == 2600 and sent["fp16"] == sent["bf16"] == 1300, out
    assert 0 < sent["1bit"] < sent["fp16"] / 4, out
