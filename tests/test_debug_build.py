"""The kernel tests pass under a bounds-checked build (GRADFUSE_DEBUG_BUILD=1).

scripts/debug_kernel_tests.sh builds a copy of the package in a temporary directory
(the normal build is not touched) and runs the kernel, kernel-fuzz and pipeline tests
against it. About 100 s here (build 24 s at -O0, then 1746 tests). What it checks does not
depend on numpy's version, so CI's numpy-2 leg leaves it out (``one_leg``).
"""
import os
import sys

import pytest

from helpers import run_limited

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.one_leg
def test_kernel_tests_pass_with_bounds_checks():
    env = dict(os.environ, PYTHON=sys.executable)
    code, out, timed_out = run_limited(["bash", os.path.join(ROOT, "scripts", "debug_kernel_tests.sh")],
                                       timeout=600, env=env, cwd=ROOT)
    print(out[-3000:])
    assert not timed_out, out[-4000:]
    assert code == 0, out[-6000:]
    assert "bounds-checked build:" in out and " passed" in out and "failed" not in out
