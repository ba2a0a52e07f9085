"""A rank that dies mid-training never leaves the others hanging (gradfuse.runtime.watchdog).

Each test launches tests/scripts/die.py under ``mpiexec -l -n N`` with a small
GRADFUSE_STALL_TIMEOUT_S. The last rank dies at step 3 while the others are inside or
entering an allreduce. Asserted: the job exits non-zero within the timeout + 10 s, the
output names the rank and how it died, and no process of the job is left (found by a
marker in the command line and the environment, which hydra's proxies inherit too).
"""
import os
import re
import sys
import time
import uuid

import pytest

from conftest import mpiexec_path
from helpers import run_limited

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "die.py")
STALL_TIMEOUT_S = 5
pytestmark = [pytest.mark.mpi, pytest.mark.one_leg]     # process deaths: numpy's version plays no part


def _job_processes(marker):
    """PIDs of live processes whose command line or environment holds ``marker``."""
    found = []
    needle = marker.encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue                       # a zombie is already dead
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in cmd or needle in env:
            found.append((int(pid), cmd.replace(b"\0", b" ").decode(errors="replace")))
    return found


def launch(mode, ranks, timeout_s=STALL_TIMEOUT_S, extra_env=None):
    """Run die.py MODE on ``ranks`` ranks; return (code, output, seconds, leftovers).

    The seconds run from the victim's death (the instant it prints) to the end of the
    job, so MPI start-up on a loaded machine does not count; without a death, from launch.
    """
    mpiexec = mpiexec_path()
    assert mpiexec, "mpiexec not found"
    marker = f"gfdeath-{uuid.uuid4().hex[:12]}"
    env = dict(os.environ)
    for var in ("GRADFUSE_STALL_WARNING_S", "GRADFUSE_EXIT_TIMEOUT_S", "GRADFUSE_HOOKS"):
        env.pop(var, None)
    env["GRADFUSE_STALL_TIMEOUT_S"] = str(timeout_s)
    env["GRADFUSE_TEST_MARKER"] = marker
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    cmd = [mpiexec, "-l", "-n", str(ranks), sys.executable, SCRIPT, mode, marker]
    t0 = time.monotonic()
    code, out, timed_out = run_limited(cmd, timeout=timeout_s + 30, env=env, cwd=ROOT)
    end = time.monotonic()
    death = re.search(r"dies now \(\w+\) at monotonic ([0-9.]+)", out)
    elapsed = end - (float(death.group(1)) if death else t0)
    assert not timed_out, f"{mode} on {ranks} ranks hung (killed after {timeout_s + 30} s):\n{out}"
    deadline = time.monotonic() + 3            # give the kernel a moment to reap
    left = _job_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _job_processes(marker)
    return code, out, elapsed, left


# mode -> what the output must say (the victim is the last rank, R)
EXPECT = {
    "exit0": ["rank {R} exited (code 0) while"],
    "exit1": ["rank {R} exited (code 1) while"],
    "exception": ["RuntimeError: user code failed at step 3",
                  "gradfuse: rank {R}: uncaught exception, aborting the job"],
    # a signal death is reported by mpiexec (PID and exit code, not the rank: which PID
    # it names is racy when several die); faulthandler's stack carries the rank label
    "abort": ["[{R}] Fatal Python error:", "Fatal Python error: Aborted", "BAD TERMINATION"],
    "sigkill": ["rank {R} dies now (sigkill)", "BAD TERMINATION", "EXIT CODE: 9"],
}


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("mode", sorted(EXPECT))
def test_rank_death_ends_the_job(mode, ranks):
    code, out, elapsed, left = launch(mode, ranks)
    print(f"{mode} on {ranks} ranks: exit {code}, {elapsed:.1f} s after the death")
    assert code != 0, out
    assert elapsed <= STALL_TIMEOUT_S + 10, f"took {elapsed:.1f} s:\n{out}"
    # mpiexec -l labels each chunk a rank writes, sometimes in mid-line: compare without them
    plain = re.sub(r"\[\d+\] ", "", out)
    for text in EXPECT[mode]:
        text = text.format(R=ranks - 1)
        assert text in (out if text.startswith("[") else plain), f"{text!r} missing:\n{out}"
    assert "finished all" not in out, out
    assert "dies now" in out
    assert not left, f"processes left behind: {left}"


def test_exit_while_others_wait_outside_gradfuse():
    """Others wait in a plain MPI barrier, which no gradfuse hook sees: the leaver's exit
    timeout (GRADFUSE_EXIT_TIMEOUT_S, default the stall timeout) ends the job."""
    code, out, elapsed, left = launch("exit0_plainwait", 3)
    assert code != 0
    assert elapsed <= STALL_TIMEOUT_S + 10, out
    assert "rank 2 exited (code 0) while other ranks were still running (ranks [0, 1]" in out, out
    assert not left, left


def test_exit_before_the_others_enter_the_collective():
    """The goodbye arrives while the others compute: they abort as soon as they enter."""
    code, out, elapsed, left = launch("exit0_slow", 2)
    assert code != 0
    assert elapsed <= STALL_TIMEOUT_S + 10, out
    assert "rank 1 exited (code 0) while this rank was in collective 'allreduce'" in out, out
    assert not left, left


def test_os_exit_ends_the_job():
    """os._exit skips every hook; mpiexec sees a rank leave without MPI_Finalize."""
    code, out, elapsed, left = launch("os_exit", 2)
    # mpiexec reports the first exit status it collects: the rank's 3, or, on a loaded
    # machine, the SIGKILL (9) it sent to the rank it cleaned up first
    assert code in (3, 9), out
    assert "dies now (os_exit)" in out, out
    assert elapsed <= STALL_TIMEOUT_S + 10
    assert not left, left


def test_watchdog_aborts_a_stuck_data_plane_collective():
    """A rank never enters a collective that was already agreed on: only the watchdog sees it."""
    code, out, elapsed, left = launch("data_hang", 2, timeout_s=2)
    assert code != 0
    assert elapsed <= 2 + 10, f"took {elapsed:.1f} s:\n{out}"
    assert "rank 0: watchdog: collective 'raw-allreduce'" in out, out
    assert "allreduce_inplace" in out, out      # the communication thread's stack
    assert not left, left


@pytest.mark.parametrize("mode,ranks", [("clean", 2), ("clean", 3), ("clean_late", 2)])
def test_clean_end_of_job_exits_zero(mode, ranks):
    """All ranks finish (one of them 3 s later than the rest): exit 0, nothing aborted."""
    code, out, elapsed, left = launch(mode, ranks)
    assert code == 0, out
    assert out.count("finished all 12 steps") == ranks, out
    assert "aborting" not in out and "Abort" not in out, out
    if mode == "clean_late":
        assert "rank 0 saved its checkpoint" in out, out
    assert not left, left


def test_hooks_can_be_turned_off():
    """GRADFUSE_HOOKS=0: the plain MPI behaviour comes back (a clean job still exits 0)."""
    code, out, elapsed, left = launch("clean", 2, extra_env={"GRADFUSE_HOOKS": "0"})
    assert code == 0, out
    assert not left, left
