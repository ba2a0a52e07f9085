"""``gradfuse.step.overlap`` on one process: the exchange thread's ordering, what an
error does, and the option's validation.
(Across ranks, bit for bit against the serial step: tests/mpi/test_pipelined.py.)"""
import threading
import time

import numpy as np
import pytest

import gradfuse
from gradfuse import config
from gradfuse.comm import SingleProcessCommunicator
from gradfuse.step.overlap import Overlap, enabled, run_jobs


class Job:
    def __init__(self, i):
        self.i = i


def test_second_runs_in_order_on_one_other_thread():
    ov, log, threads = Overlap(), [], set()

    def first(job):
        log.append(("c", job.i))

    def second(job):
        time.sleep(0.002)
        threads.add(threading.get_ident())
        log.append(("x", job.i))
    ov.run([Job(i) for i in range(6)], first, second)
    assert [i for s, i in log if s == "x"] == list(range(6))
    assert [i for s, i in log if s == "c"] == list(range(6))
    assert threads and threading.get_ident() not in threads and len(threads) == 1
    assert log.index(("c", 5)) < log.index(("x", 5))
    ov.close()


def test_ahead_bounds_how_far_the_calling_thread_runs():
    """ahead=1 (the double-buffered 16-bit steps): job i is compressed only once job i-2's
    second stage has finished, so two buffers serve; the order stays the same."""
    ov, log, lock = Overlap(), [], threading.Lock()

    def first(job):
        with lock:
            log.append(("c", job.i))

    def second(job):
        time.sleep(0.03)          # the calling thread would run far ahead without the bound
        with lock:
            log.append(("x", job.i))
    ov.run([Job(i) for i in range(8)], first, second, ahead=1)
    for i in range(2, 8):
        assert log.index(("x", i - 2)) < log.index(("c", i)), log
    assert [i for s, i in log if s == "x"] == list(range(8))
    log.clear()
    ov.run([Job(i) for i in range(8)], first, second)          # unbounded: every job compressed first
    assert [s for s, _ in log[:8]] == ["c"] * 8, log
    ov.close()


def test_after_runs_on_the_calling_thread_in_order_once_second_has():
    ov, log, lock, me = Overlap(), [], threading.Lock(), threading.get_ident()

    def second(job):
        time.sleep(0.005)
        with lock:
            log.append(("x", job.i))

    def after(job):
        assert threading.get_ident() == me
        with lock:
            log.append(("a", job.i))
    ov.run([Job(i) for i in range(6)], lambda job: None, second, ahead=1, after=after)
    assert [i for s, i in log if s == "a"] == list(range(6))
    for i in range(6):
        assert log.index(("x", i)) < log.index(("a", i))
    log.clear()

    def bad(job):
        second(job)
        if job.i == 2:
            raise ValueError("bucket 2")
    with pytest.raises(ValueError, match="bucket 2"):
        ov.run([Job(i) for i in range(6)], lambda job: None, bad, ahead=1, after=after)
    assert ("a", 2) not in log and ("x", 4) not in log       # nothing after the error, no later bucket
    ov.close()


def test_an_exchange_error_drops_the_rest_and_waits():
    ov, ran, armed = Overlap(), [], [True]

    def second(job):
        time.sleep(0.01)
        ran.append(job.i)
        if job.i == 1 and armed[0]:
            raise ValueError("bucket 1")
    with pytest.raises(ValueError, match="bucket 1"):
        ov.run([Job(i) for i in range(5)], lambda job: None, second)
    assert ran == [0, 1]
    time.sleep(0.03)
    assert ran == [0, 1]
    armed[0] = False
    ov.run([Job(i) for i in range(3)], lambda job: None, second)      # the thread serves the next step
    assert ran == [0, 1, 0, 1, 2]
    ov.close()


def test_a_compression_error_still_runs_what_was_handed_over():
    ov, ran = Overlap(), []

    def first(job):
        if job.i == 3:
            raise KeyError("compress 3")

    def second(job):
        time.sleep(0.01)
        ran.append(job.i)
    with pytest.raises(KeyError, match="compress 3"):
        ov.run([Job(i) for i in range(5)], first, second)
    assert ran == [0, 1, 2]          # run returned only after those (the other ranks run them too)
    ov.close()


def test_not_pipelined_on_one_rank_or_a_gpu():
    comm = SingleProcessCommunicator()
    assert not enabled(comm, "cpu")
    order = []
    jobs = [Job(0), Job(1)]
    for j in jobs:
        j.algorithm = "allgather"
    run_jobs(Overlap(), comm, "cpu", jobs, False, lambda j: order.append(("c", j.i)),
             lambda j: order.append(("x", j.i)), lambda j: order.append(("d", j.i)))
    assert order == [("c", 0), ("x", 0), ("c", 1), ("x", 1)]


def test_option_and_variable(monkeypatch):
    monkeypatch.delenv("GRADFUSE_PIPELINE_BUCKETS", raising=False)
    assert config.pipeline_buckets() is config.DEFAULT_PIPELINE_BUCKETS
    monkeypatch.setenv("GRADFUSE_PIPELINE_BUCKETS", "0")
    assert config.pipeline_buckets() is False
    assert config.pipeline_buckets(True) is True
    monkeypatch.setenv("GRADFUSE_PIPELINE_BUCKETS", "yes")
    with pytest.raises(ValueError, match="GRADFUSE_PIPELINE_BUCKETS='yes'"):
        config.pipeline_buckets()
    with pytest.raises(ValueError, match="GRADFUSE_PIPELINE_BUCKETS"):
        gradfuse.Pipeline(comm=SingleProcessCommunicator())
    monkeypatch.delenv("GRADFUSE_PIPELINE_BUCKETS")
    with pytest.raises(TypeError, match="pipeline_buckets must be True, False or None"):
        gradfuse.Pipeline(pipeline_buckets="on", comm=SingleProcessCommunicator())
    p = gradfuse.Pipeline(pipeline_buckets=not config.DEFAULT_PIPELINE_BUCKETS, comm=SingleProcessCommunicator())
    assert p.get_config()["pipeline_buckets"] is (not config.DEFAULT_PIPELINE_BUCKETS)
    assert gradfuse.Pipeline(**p.get_config(), comm=SingleProcessCommunicator()).pipeline_buckets \
        is p.pipeline_buckets
    assert "pipeline_buckets" not in gradfuse.Pipeline(comm=SingleProcessCommunicator()).get_config()
    x = {"w": np.ones(5, np.float32)}
    assert p.allreduce(x)["w"].tolist() == [1.0] * 5


def test_the_watchdog_shows_a_busy_exchange_thread():
    from gradfuse.runtime.engine import Engine
    from gradfuse.runtime.watchdog import _Hooks
    eng, ov, release = Engine(), Overlap(), threading.Event()

    def stuck_exchange(job):
        release.wait(10)
    h = eng.submit(lambda: ov.run([Job(0)], lambda j: None, stuck_exchange))
    time.sleep(0.2)
    text = _Hooks._stack(eng)
    release.set()
    h.wait(10)
    assert "and the exchange thread" in text and "stuck_exchange" in text, text
    assert "and the exchange thread" not in _Hooks._stack(eng)        # idle: not shown
    ov.close()
    eng.shutdown()
