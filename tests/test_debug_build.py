"""The kernel tests pass under a bounds-checked build (GRADFUSE_DEBUG_BUILD=1).

scripts/debug_kernel_tests.sh builds a copy of the package in a temporary directory
(the normal build is not touched) and runs the kernel, kernel-fuzz and pipeline tests
against it. About 30 s here (build 4 s at -O0), so it stays in the normal suite.
"""
import os
import sys

from helpers import run_limited

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernel_tests_pass_with_bounds_checks():
    env = dict(os.environ, PYTHON=sys.executable)
    code, out, timed_out = run_limited(["bash", os.path.join(ROOT, "scripts", "debug_kernel_tests.sh")],
                                       timeout=600, env=env, cwd=ROOT)
    print(out[-3000:])
    assert not timed_out, out[-4000:]
    assert code == 0, out[-6000:]
    assert "bounds-checked build:" in out and " passed" in out and "failed" not in out
