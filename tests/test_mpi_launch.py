"""Launch the multi-rank suites under mpiexec, with a hard time limit.

Each world size is one mpiexec launch that runs all of tests/mpi, so the suite pays
for MPI start-up twice, not once per test. A hang fails the test (the whole process
group is killed at the limit).

An mpiexec run's exit code counts failures only, so every rank also reports the tests it
skipped (``tests/skip_report.py``): the launch prints them, grouped by reason, and fails
on a skip that ``expected_skip`` does not explain (a missing rank count, a module this
interpreter lacks, no GPU, the MPI library's path). ``GRADFUSE_TEST_ALLOW_SKIPS`` (a
regular expression) allows more reasons on a machine that needs it.
"""
import importlib.util
import json
import os
import re
import sys
import tempfile

import pytest

from conftest import mpiexec_path
from helpers import run_limited

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
pytestmark = pytest.mark.mpi

_WORDS = {"two": 2, "three": 3, "four": 4}


def _importable(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def expected_skip(reason, ranks, cma="1"):
    """Why a skip inside an mpiexec run of ``ranks`` ranks is expected, or None (a failure)."""
    need = re.match(r"needs (\d+|two|three|four) ranks", reason)
    if need:
        n = _WORDS.get(need.group(1)) or int(need.group(1))
        return f"the launch has {ranks} rank(s)" if ranks < n else None
    if reason.endswith("on one rank"):
        return "the launch has 1 rank" if ranks == 1 else None
    imp = re.match(r"could not import '([\w.]+)'", reason)
    if imp:
        return (f"{imp.group(1)} is not installed in this interpreter"
                if not _importable(imp.group(1).split(".")[0]) else None)
    if reason.startswith(("cupy cannot be imported", "no CUDA device is visible")):
        # conftest_gpu.skip_or_fail: with GRADFUSE_TEST_GPU=1 these fail by themselves
        return "no GPU here" if os.environ.get("GRADFUSE_TEST_GPU") != "1" else None
    if "GRADFUSE_CMA=0" in reason:
        return "the MPI library's path (GRADFUSE_CMA=0)" if cma == "0" else None
    extra = os.environ.get("GRADFUSE_TEST_ALLOW_SKIPS")
    if extra and re.search(extra, reason):
        return "GRADFUSE_TEST_ALLOW_SKIPS"
    return None


def run_ranks(ranks, target, env, timeout, cwd=ROOT):
    """``pytest TARGET`` on ``ranks`` ranks under mpiexec, each rank reporting its skips.

    Returns (code, output, timed_out, skips): ``skips`` maps (test id, reason) to the
    ranks that skipped it.
    """
    with tempfile.TemporaryDirectory(prefix="gf-skips-") as folder:
        cmd = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "pytest", *target.split(), "-q",
               "-p", "no:cacheprovider", "-o", "addopts=", "-W", "ignore::DeprecationWarning", "-p", "skip_report"]
        env = dict(env, GRADFUSE_SKIP_REPORT=folder,
                   PYTHONPATH=os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p))
        code, out, timed_out = run_limited(cmd, timeout=timeout, env=env, cwd=cwd)
        skips = {}
        for r in range(ranks):
            path = os.path.join(folder, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    for nodeid, reason in json.load(f):
                        skips.setdefault((nodeid, reason), []).append(r)
    return code, out, timed_out, skips


def skip_summary(skips, ranks, cma="1"):
    """The report of a launch's skips (one line per reason) and the unexpected ones."""
    by_reason = {}
    for (nodeid, reason), rs in sorted(skips.items()):
        by_reason.setdefault(reason, []).append((nodeid, rs))
    lines, unexpected = [], []
    for reason, tests in sorted(by_reason.items()):
        why = expected_skip(reason, ranks, cma)
        lines.append(f"  {len(tests):3d} skipped: {reason}  [{why or 'UNEXPECTED'}]")
        if why is None:
            unexpected += [f"{nodeid} (ranks {rs}): {reason}" for nodeid, rs in tests]
    return lines, unexpected


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
    assert mpiexec_path(), "mpiexec not found: install the mpich extra (see README)"
    env = dict(_mpi_env(), GRADFUSE_TEST_RANKS=str(ranks), GRADFUSE_CMA=cma)
    code, out, timed_out, skips = run_ranks(ranks, target, env, timeout=180)
    print(out)
    lines, unexpected = skip_summary(skips, ranks, cma)
    print(f"skips inside mpiexec -n {ranks} (GRADFUSE_CMA={cma}), by reason:", *lines, sep="\n")
    assert not timed_out, f"mpiexec -n {ranks} hung (killed after 180 s):\n{out[-4000:]}"
    assert code == 0, f"mpiexec -n {ranks} failed (exit {code}):\n{out[-6000:]}"
    assert "passed" in out and "failed" not in out.split("\n")[-2]
    assert not unexpected, ("skips that nothing explains (a missing feature must fail, not skip):\n  "
                            + "\n  ".join(unexpected))


def test_the_launcher_reports_skips_and_fails_on_unexpected_ones(tmp_path):
    """Two ranks, one test file: a skip for a missing rank count is reported and allowed, a
    skip that hides a missing feature is reported and refused, and a passing test is not a
    skip."""
    (tmp_path / "test_some_skips.py").write_text(
        "import pytest\n"
        "def test_runs():\n    pass\n"
        "def test_wants_more_ranks():\n    pytest.skip('needs 3 ranks')\n"
        "def test_hides_a_feature():\n    pytest.skip(\"compressor 'x' is not in this build\")\n")
    code, out, timed_out, skips = run_ranks(2, str(tmp_path / "test_some_skips.py"), _mpi_env(), timeout=120,
                                            cwd=str(tmp_path))
    assert code == 0 and not timed_out, out
    assert sorted(skips) == [("test_some_skips.py::test_hides_a_feature", "compressor 'x' is not in this build"),
                             ("test_some_skips.py::test_wants_more_ranks", "needs 3 ranks")], skips
    assert all(rs == [0, 1] for rs in skips.values()), skips
    lines, unexpected = skip_summary(skips, 2)
    assert unexpected == ["test_some_skips.py::test_hides_a_feature (ranks [0, 1]): compressor 'x' is not in "
                          "this build"], unexpected
    assert any("needs 3 ranks  [the launch has 2 rank(s)]" in line for line in lines), lines
    assert skip_summary(skips, 3)[1] == unexpected + ["test_some_skips.py::test_wants_more_ranks (ranks [0, 1]): "
                                                      "needs 3 ranks"]


@pytest.mark.parametrize("reason,ranks,cma,expected", [
    ("needs 3 ranks", 2, "1", True), ("needs 3 ranks", 3, "1", False), ("needs two ranks", 1, "1", True),
    ("needs two ranks", 2, "1", False), ("needs 3 ranks (a proper subset of at least 2)", 2, "1", True),
    ("DistributedOptimizer reduces nothing on one rank", 1, "1", True),
    ("DistributedOptimizer reduces nothing on one rank", 2, "1", False),
    ("could not import 'surely_not_a_module_gf': No module named 'surely_not_a_module_gf'", 2, "1", True),
    ("could not import 'numpy': something", 2, "1", False),
    ("GRADFUSE_CMA=0", 2, "0", True), ("off: GRADFUSE_CMA=0", 2, "1", False),
    ("compressor '1bit' is not in this build", 2, "1", False)])
def test_expected_skips(monkeypatch, reason, ranks, cma, expected):
    monkeypatch.delenv("GRADFUSE_TEST_ALLOW_SKIPS", raising=False)
    assert (expected_skip(reason, ranks, cma) is not None) == expected


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
    assert set(rows) == {"none", "fp16", "bf16", "1bit", "2bit", "topk", "randomk", "powersgd"}, out
    for name, (acc, _, same) in rows.items():
        assert same.strip() == "yes", (name, out)
    assert float(rows["none"][0]) > 0.85 and float(rows["1bit"][0]) > 0.85, out
    # bytes per step per rank (Pipeline.stats.bytes_sent) for the 650 float32 of W and b, 2 ranks:
    # fp32 and fp16 as a bandwidth-optimal allreduce (2(p-1)/p x size), 1-bit far below fp16
    sent = {name: float(v[1]) for name, v in rows.items()}
    assert sent["none"] == 2600 and sent["fp16"] == sent["bf16"] == 1300, out
    assert 0 < sent["1bit"] < sent["fp16"] / 4, out
