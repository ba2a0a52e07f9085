"""gradfuse.runtime.watchdog pieces that need no MPI job (the job-level tests: test_rank_death.py)."""
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
