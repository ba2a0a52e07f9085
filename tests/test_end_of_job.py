"""The end of an MXNet job (tests/scripts/end_of_job.py under ``mpiexec -n 2``).

What a script leaves pending in MXNet's engine when it ends (``Module.fit``'s last update,
an allreduce nobody waited for) completes before the job ends, on every rank, with the
right values; a collective started after every rank has ended is refused at once; and a
rank that ends with a collective its peers never issue fails within seconds, naming the
rank that has finished, instead of waiting for the stall timeout
(``gradfuse.runtime.watchdog``: the exit protocol drains the communication threads first).
"""
import os
import re
import sys
import time
import uuid

import pytest

pytest.importorskip("mxnet")

from conftest import mpiexec_path  # noqa: E402
from helpers import run_limited  # noqa: E402
from test_rank_death import _job_processes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "end_of_job.py")
STALL_TIMEOUT_S = 40
pytestmark = [pytest.mark.mpi, pytest.mark.one_leg]


def launch(mode, ranks=2):
    marker = f"gfend-{uuid.uuid4().hex[:12]}"
    env = dict(os.environ)
    for var in ("GRADFUSE_STALL_WARNING_S", "GRADFUSE_EXIT_TIMEOUT_S", "GRADFUSE_HOOKS"):
        env.pop(var, None)
    env.update(GRADFUSE_STALL_TIMEOUT_S=str(STALL_TIMEOUT_S), GRADFUSE_TEST_MARKER=marker,
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    code, out, timed_out = run_limited([mpiexec_path(), "-n", str(ranks), sys.executable, SCRIPT, mode, marker],
                                       timeout=STALL_TIMEOUT_S + 60, env=env, cwd=ROOT)
    end = time.monotonic()
    ends = [float(t) for t in re.findall(r"ends its script at monotonic ([0-9.]+)", out)]
    assert not timed_out, f"{mode} hung:\n{out}"
    deadline = time.monotonic() + 3
    left = _job_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _job_processes(marker)
    assert not left, left
    return code, out, end - (max(ends) if ends else t0)


def _clean(out):
    for bad in ("Exception ignored", "rejected its input", "Abort", "aborting", "StallWarning", "Traceback"):
        assert bad not in out, f"{bad!r} in:\n{out}"


def test_an_allreduce_pending_at_the_end_completes_on_every_rank():
    code, out, _ = launch("pending")
    assert code == 0, out
    _clean(out)
    assert out.count("still pending after the exit protocol: []") == 2, out
    assert out.count("sum [3.0, 3.0, 3.0]") == 2, out        # 1 + 2 on each rank


def test_module_fit_ends_cleanly_with_the_last_update_applied_on_every_rank():
    """Horovod's ResNet-50 example in Module mode, in small: fit returns with its last
    update pending; every rank ends with the same parameters."""
    code, out, _ = launch("module")
    assert code == 0, out
    _clean(out)
    params = re.findall(r"rank \d params (\S+)", out)
    assert len(params) == 2 and params[0] == params[1], out


def test_a_collective_after_every_rank_ended_is_refused_at_once():
    code, out, _ = launch("late")
    assert code == 0, out
    m = re.search(r"late allreduce refused after ([0-9.]+) s: GradfuseError: gradfuse: rank 0: every rank has "
                  r"ended its script \(the exit protocol ran on all 2\), so no rank can take part in this "
                  r"collective any more: collective #\d+ \(allreduce of \['late'\]\) refused", out)
    assert m and float(m.group(1)) < 5, out


def test_a_peer_left_waiting_fails_within_seconds_naming_the_rank_that_ended():
    code, out, after_end = launch("peer_waits")
    assert code != 0, out
    assert "gradfuse: rank 0: rank 1 exited (code unknown: end of script or SystemExit raised directly) while " \
           "this rank was in collective 'allreduce'" in out, out
    assert after_end < 15, f"{after_end:.1f} s after the scripts ended (the stall timeout is {STALL_TIMEOUT_S} s):\n{out}"
