"""gradfuse.runtime.watchdog pieces that need no MPI job (the job-level tests: test_rank_death.py)."""
import time

import numpy as np
import pytest

import gradfuse
from gradfuse.runtime import abort, engine, watchdog
from gradfuse.comm import SingleProcessCommunicator


@pytest.mark.parametrize("arg,code", [(None, 0), (0, 0), (1, 1), (3, 3), (256, 0), (257, 1),
                                      (True, 1), (False, 0), ("a message", 1), (-1, -1)])
def test_exit_code_as_the_process_reports_it(arg, code):
    assert watchdog._code_of(arg) == code


def test_install_hooks_argument():
    assert watchdog.hooks_enabled(True) is True and watchdog.hooks_enabled(False) is False
    with pytest.raises(TypeError, match="install_hooks"):
        watchdog.hooks_enabled("yes")
    with pytest.raises(TypeError, match="install_hooks"):
        gradfuse.init(SingleProcessCommunicator(), install_hooks=1)


def test_no_hooks_without_a_multi_rank_mpi_communicator():
    assert watchdog.install(SingleProcessCommunicator()) is None


def test_engine_records_the_job_in_flight():
    e = engine.Engine()
    try:
        seen = e.submit(lambda: e.inflight, "probe").wait(5)
        assert seen[0] == "probe" and seen[1] > 0
        assert e.submit(lambda: np.zeros(1), "x").wait(5) is not None
        assert e.inflight is None                   # cleared after the job, also on error
        with pytest.raises(ZeroDivisionError):
            e.submit(lambda: 1 / 0, "bad").wait(5)
        assert e.inflight is None
    finally:
        e.shutdown()


def test_abort_prints_flushes_and_waits_before_aborting(monkeypatch, capsys):
    """The reason is on stderr and mpiexec has had ABORT_GRACE_S to forward it before MPI_Abort."""
    events = []
    monkeypatch.setattr(abort.time, "sleep", lambda s: events.append(("sleep", s)))
    abort.announce_and_abort("gradfuse: stall timeout: waiting for rank 1", lambda c: events.append(("abort", c)), 3)
    assert capsys.readouterr().err == "gradfuse: stall timeout: waiting for rank 1\n"
    assert events == [("sleep", abort.ABORT_GRACE_S), ("abort", 3)] and abort.ABORT_GRACE_S >= 1.0


def test_abort_still_aborts_when_stderr_is_closed(monkeypatch):
    class Closed:
        def write(self, text):
            raise ValueError("I/O operation on closed file")

        def flush(self):
            raise ValueError("I/O operation on closed file")
    codes = []
    monkeypatch.setattr(abort.sys, "stderr", Closed())
    monkeypatch.setattr(abort.sys, "stdout", Closed())
    monkeypatch.setattr(abort.time, "sleep", lambda s: None)
    abort.announce_and_abort("x", codes.append, 1)
    assert codes == [1]


class _NeverArrives:
    """A control channel of ``size`` ranks seen from ``rank`` whose messages never complete."""

    def __init__(self, rank, size=2):
        self.rank, self.size = rank, size

    def ctl_isend(self, buf, dest):
        return object()

    ctl_irecv = ctl_isend

    def ctl_ibcast(self, buf, root):
        return object()

    def test(self, req):
        return False

    def abort(self, code):
        raise AssertionError("announce_and_abort is replaced in this test")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("var", ["GRADFUSE_STALL_TIMEOUT_S", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"])
def test_the_stall_timeout_message_prints_the_value_the_user_set(monkeypatch, rank, var):
    """Every rank prints the timeout as set (and the variable it was set by); a rank other
    than 0, which waits its lead longer so that rank 0 speaks first, says so apart."""
    from gradfuse.runtime import control
    for v in ("GRADFUSE_STALL_TIMEOUT_S", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "GRADFUSE_STALL_WARNING_S",
              "HOROVOD_STALL_CHECK_TIME_SECONDS"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, "0.05")
    monkeypatch.setenv("GRADFUSE_STALL_WARNING_S", "0")
    monkeypatch.setattr(control, "COORDINATOR_LEAD_S", 0.2)     # the real lead (5 s), shortened
    said = []

    def caught(message, abort_fn, code=1):
        said.append(message)
        raise SystemExit(code)
    monkeypatch.setattr(control, "announce_and_abort", caught)
    coord = control.Coordinator(_NeverArrives(rank))
    t0 = time.monotonic()
    with pytest.raises(SystemExit):
        coord.negotiate(control.Request("allreduce", names=["w"], shapes=[(3,)], dtypes=["float32"]))
    waited = time.monotonic() - t0
    msg, = said
    assert msg.startswith(f"gradfuse: stall timeout ({var}=0.05"), msg
    assert "0.25" not in msg, msg
    if rank == 0:
        assert "waiting for rank 1" in msg and "more on ranks other than 0" not in msg, msg
        assert waited < 0.2 + 1.0
    else:
        assert f"({var}=0.05, and 0.2 s more on ranks other than 0 so that rank 0 speaks first)" in msg, msg
        assert "waiting for the coordinator, rank 0" in msg and waited >= 0.25, msg


def test_a_closed_control_plane_refuses_at_once():
    """After the exit protocol's clean end (every rank has ended its script) a collective
    cannot be matched: negotiate raises at once instead of waiting for the stall timeout."""
    from gradfuse.errors import GradfuseError
    from gradfuse.runtime import control
    coord = control.Coordinator(_NeverArrives(1))
    coord.closed = "gradfuse: rank 1: every rank has ended its script"
    t0 = time.monotonic()
    with pytest.raises(GradfuseError, match=r"^gradfuse: rank 1: every rank has ended its script: collective #1 "
                                            r"\(allreduce of \['w'\]\) refused$"):
        coord.negotiate(control.Request("allreduce", names=["w"], shapes=[(3,)], dtypes=["float32"]))
    assert time.monotonic() - t0 < 1.0
