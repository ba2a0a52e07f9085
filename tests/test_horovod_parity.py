"""gradfuse.mxnet beside Horovod 0.28.1 itself, where Horovod is installed.

Horovod is never a dependency: .ci/run's Horovod leg builds it outside the project's venv
(docs/notes/benchmarks-history.md, "Baselines") and runs this file with it on ``PYTHONPATH``. Here:

* the suite's own comparisons with Horovod (``tests/test_mxnet_api.py``,
  ``tests/test_mxnet_examples.py``, ``tests/mpi/test_mxnet_semantics_ranks.py`` on 2 ranks)
  run, and none of them may skip;
* Horovod's own ``test/parallel/test_mxnet1.py`` runs on gradfuse.mxnet (``import
  horovod.mxnet`` served by ``tests/horovod_shim``) on 2 ranks and passes whole, where
  ``GRADFUSE_HOROVOD_SOURCE`` names a Horovod 0.28.1 source tree (its tests are not in
  its PyPI package).
"""
import importlib.util
import os
import re
import sys

import pytest

from conftest import mpiexec_path
from helpers import run_limited
from test_mpi_launch import ROOT, _mpi_env, run_ranks, skip_summary

pytestmark = [pytest.mark.mpi, pytest.mark.one_leg]
SHIM = os.path.join(ROOT, "tests", "horovod_shim")

if importlib.util.find_spec("horovod") is None or importlib.util.find_spec("mxnet") is None:
    pytest.skip("Horovod (or MXNet) is not installed here: .ci/run's Horovod leg builds it and runs this file",
                allow_module_level=True)


@pytest.mark.parametrize("ranks,target", [(1, "tests/test_mxnet_api.py tests/test_mxnet_examples.py"),
                                          (2, "tests/mpi/test_mxnet_semantics_ranks.py")])
def test_the_suites_comparisons_with_horovod_run_and_pass(ranks, target):
    env = dict(_mpi_env(), GRADFUSE_TEST_RANKS=str(ranks))
    code, out, timed_out, skips = run_ranks(ranks, target, env, timeout=400)
    lines, unexpected = skip_summary(skips, ranks)
    print(out, f"skips of mpiexec -n {ranks} {target}:", *lines, sep="\n")
    assert not timed_out and code == 0, out[-6000:]
    assert not [s for s in skips if "horovod" in s[1].lower()], lines
    assert not unexpected, unexpected


def test_horovods_own_mxnet_tests_pass_on_gradfuse():
    """Horovod 0.28.1's test_mxnet1.py, unchanged, on gradfuse.mxnet: every test passes
    (the GPU ones skip, as on Horovod without a GPU)."""
    source = os.environ.get("GRADFUSE_HOROVOD_SOURCE")
    if not source:
        pytest.skip("GRADFUSE_HOROVOD_SOURCE is not set (a Horovod 0.28.1 source tree: its tests are not on PyPI)")
    here = os.path.join(source, "test", "parallel")
    assert os.path.isfile(os.path.join(here, "test_mxnet1.py")), f"no test/parallel/test_mxnet1.py in {source}"
    env = _mpi_env()
    # absolute: the run's folder is Horovod's, not this one
    outer = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([ROOT, SHIM] + outer)
    cmd = [mpiexec_path(), "-n", "2", sys.executable, "-m", "pytest",
           "test_mxnet1.py", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    code, out, timed_out = run_limited(cmd, timeout=400, env=env, cwd=here)
    print(out)
    assert not timed_out and code == 0, out[-6000:]
    # every rank's summary: all of them pass; the skips are the GPU tests only
    summaries = re.findall(r"^(\d+) passed(?:, (\d+) skipped)?", out, re.M)
    assert len(summaries) == 2 and all(int(p) == 57 for p, _ in summaries), out[-3000:]
    for line in re.findall(r"^SKIPPED .*$", out, re.M):
        assert "gpu" in line.lower(), line
    assert "gradfuse" in run_limited([sys.executable, "-c", "import horovod.mxnet as h; print(h.__name__)"],
                                     timeout=60, env=env)[1]
