"""Pipelined buckets: the exchange of bucket i overlaps the compression of bucket i+1.

``Pipeline(pipeline_buckets=True)`` (the default, ``GRADFUSE_PIPELINE_BUCKETS``) gives the
pipeline a second thread, its *exchange thread*. In a step, the communication thread
compresses the buckets given to ``run_jobs`` one after the other and hands each to the
exchange thread, which runs the bucket's collective while the communication thread
compresses the next bucket. The step goes on (plain buckets, the non-finite verdict, the
decodes) only once the exchange thread has run every bucket it was given, so the
communicator is used by one thread at a time, and the collectives run in the buckets'
order on every rank: the same collectives on the same bytes, in the same order as without
the thread, so the results are bit-identical.

Why a thread: MPICH makes progress on a non-blocking collective only inside MPI calls, so
one posted before a compression kernel would mostly wait until the kernel returned. On
the exchange thread, the collective's request is tested every ``POLL_S`` (``PollingComm``):
it progresses at every test, and between tests the thread sleeps, so the core is free for
the compression (a blocking call, or ``Wait``, spins in MPI's progress loop: with two
ranks on two cores that took the core from the compression, measured in
docs/benchmarks.md). The kernels and mpi4py release the GIL. This needs
``MPI.Query_thread() == MPI.THREAD_MULTIPLE`` (mpi4py's default); under a lower thread
level, on one rank, on a GPU (the stages run on the backend's stream) or on a
communicator other than MPI's, the step runs serially (``enabled``); so does a step of
fp16/bf16 buckets alone from 3 ranks on or on one host (their 16-bit allreduce is a
blocking call with a user-defined op: measured slower pipelined). Between 2 ranks on 2
hosts (``swaps16``) the exchange thread swaps a 16-bit bucket's words with the peer by
polled point-to-point calls instead (``PollingComm.swap16``; added, they are the bits of
MPI's call), at most ``AllreduceJob.PART_WORDS`` at a time, and a step of fp16/bf16
buckets alone runs pipelined (``_run16``): the communication thread casts part i+1 (a
bucket, or a piece of a larger one) while part i crosses, then adds and decodes it.

Buckets that go by allgather or by random-k's sparse allreduce do not come here when a
step has two or more of them: ``gradfuse.step.grouped`` posts their collectives from the
communication thread, in exchange groups, and hands the step's other buckets (two-phase,
16-bit) to ``run_jobs``. The exchange thread then runs two-phase buckets, 16-bit ones
between 2 hosts, and a lone allgather or sparse-allreduce bucket among them.

Errors: the first error of an exchange (a raise in the job, a failed collective) stops
the exchange thread's part of the step: the buckets queued after it are dropped, not
run, so every rank that failed at bucket i runs the collectives of buckets 0..i-1 only,
as it would serially. An error of a compression on the communication thread stops the
hand-over; the buckets already handed over still run (the other ranks run them too).
Either way ``run`` returns only once the exchange thread is idle, so nothing writes into
a bucket's buffers or the outputs after the error reached the caller.
"""
import queue
import threading
import time
import weakref

import numpy as np

from ..runtime.watchdog import EXCHANGE_THREAD

_thread_multiple = []      # [whether the process's MPI runs THREAD_MULTIPLE], once asked


def enabled(comm, device):
    """Whether a step on ``comm`` (``device``: the backend's) may run its buckets pipelined."""
    if device != "cpu" or comm.size < 2 or getattr(comm, "kind", None) != "mpi":
        return False
    if not _thread_multiple:
        from ..comm.mpi import mpi
        MPI = mpi()
        _thread_multiple.append(MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    return _thread_multiple[0]


#: the algorithms whose collectives (allgather, alltoall) the exchange thread runs as
#: non-blocking calls it polls (and the 16-bit allreduce where ``swaps16``); a step with
#: none of them runs serially: blocking calls that spin measured slower pipelined
POLLED = frozenset({"allgather", "twophase", "sparse_allreduce"})
POLL_S = 50e-6       # the sleep between two tests of a request (exchange thread, exchange groups; measured)
TAG16 = 13           # the 2-rank 16-bit sum's messages on the data communicator


def polled(job, comm):
    """Whether the exchange thread runs ``job``'s collective as polled non-blocking calls:
    the allgather/alltoall algorithms, and the 16-bit allreduce (fp16/bf16 on MPI, not
    NCCL's native half sum) on 2 ranks on 2 hosts. On one host (shared memory) there is
    no wire time to hide and the serial step was faster (124 against 138 ms on ResNet-50,
    docs/notes/benchmarks-history.md, "Pipelined buckets")."""
    if job.algorithm in POLLED:
        return True
    return job.algorithm == "allreduce" and not getattr(job, "native", False) and swaps16(comm)


def swaps16(comm):
    """Whether 16-bit sums on ``comm`` go as a polled swap of the words (``swap16``): 2 ranks
    on 2 hosts (``local_size`` 1)."""
    return comm.size == 2 and (getattr(comm, "local_size", 1) == 1 or not SERIAL16_ON_ONE_HOST)


#: whether 16-bit allreduces between ranks of one host stay serial (tests turn it off to
#: run the 2-host path on one machine)
SERIAL16_ON_ONE_HOST = True


def run_jobs(ov, comm, device, jobs, stream, compress, exchange, decode):
    """Compress and exchange the step's compressed ``jobs`` (a list, in bucket order), and
    decode each at once when the step streams (fp16/bf16 buckets that cannot fail; ``stream``
    is that verdict, or a function that returns it, called once): pipelined on ``ov`` (an
    ``Overlap``, or None for serial) where ``enabled`` and some job's collective is
    ``polled`` (a streamed step: every job's), else one after the other. The step's
    buckets that ``gradfuse.step.grouped`` runs in exchange groups are not among ``jobs``."""
    on = ov is not None and len(jobs) >= 2 and enabled(comm, device)
    if (on and callable(stream) and all(j.algorithm == "allreduce" and polled(j, comm) and not j.state.cur.size
                                        for j in jobs)):
        return _run16(ov, comm, jobs, stream, compress, exchange, decode)
    if callable(stream):
        stream = stream()
    for job in jobs:
        job.stream = stream
    if not on or not (all(polled(j, comm) for j in jobs) if stream else any(polled(j, comm) for j in jobs)):
        for job in jobs:
            compress(job)
            exchange(job)
            if stream:
                decode(job)
        return
    polling = PollingComm(comm)
    for job in jobs:
        job.comm = polling
    ov.run(jobs, compress, exchange)


#: how many parts the communication thread casts ahead of the transfer in a pipelined
#: 16-bit step (``_run16``): AHEAD16 + 1 cast and as many receive buffers serve the step
AHEAD16 = 1


class _Unstreamed(Exception):
    """The step's check said its 16-bit buckets may fail: stop the streamed hand-over."""


def _run16(ov, comm, jobs, can_stream, compress, exchange, decode):
    """A step of 16-bit buckets alone (no residual) on 2 ranks on 2 hosts, moved as parts
    of at most ``AllreduceJob.PART_WORDS`` words (``AllreduceJob.parts``: a larger bucket,
    such as one large tensor, is cut, so the four shared 16-bit buffers below are bounded
    by that, not by the largest tensor). Part 0 is cast and handed to the
    exchange thread first, and the step's check (``can_stream``: max |x| over every input,
    one max-allreduce) runs while its words cross. Streamed, the communication thread then
    casts part i+1 while part i crosses, and adds and decodes each part after its
    transfer, in two shared cast buffers and two shared receive buffers
    (``Overlap.run(ahead=1)``). If the check says a bucket may fail, part 0 is added at
    once and copied into its bucket's own buffer, and the other parts run as a step that
    is not streamed: each bucket its own buffer, the parts added on the exchange thread,
    every bucket decoded after the step's verdict. The same bits either way (the serial
    step's: the sum is one add per element)."""
    polling = PollingComm(comm)
    parts = []
    for job in jobs:         # double-buffered: the calling thread runs one part ahead
        job.comm, job.stream = polling, True
        parts.extend(job.parts())
    for i, part in enumerate(parts):
        part.slot = i % (AHEAD16 + 1)
    checked = []

    def check():
        if not checked:
            checked.append(bool(can_stream()))
        if not checked[0]:
            raise _Unstreamed

    def first(part):
        if part is not parts[0]:
            check()
        compress(part)

    def after(part):
        check()
        decode(part)
    try:
        ov.run(parts, first, exchange, ahead=AHEAD16, after=after)
        return
    except _Unstreamed:
        pass
    p0 = parts[0]
    p0.add()                 # part 0 crossed: its sum, now, into its bucket's own buffer
    p0.job.own16()[p0.e0:p0.e1] = p0.buf
    for job in jobs:
        job.stream = False
    for part in parts[1:]:
        part.stream = False
    ov.run(parts[1:], compress, exchange)


class PollingComm:
    """``comm`` for the exchange thread: ``allgather`` and ``alltoall`` as MPI's
    non-blocking calls, waited for by testing the request every ``POLL_S`` seconds, so
    that the thread sleeps instead of spinning in MPI's progress loop and leaves the core
    to the next bucket's compression (with 2 ranks per 2 cores, a spinning wait took it:
    docs/notes/benchmarks-history.md, "Pipelined buckets"), and, where ``swaps16``, ``swap16`` for the
    16-bit sums. The same bytes move, so the results are the blocking calls' bits.
    Everything else goes to ``comm`` itself."""

    def __init__(self, comm, poll_s=POLL_S):
        self._comm, self._poll = comm, poll_s
        self.swaps16 = swaps16(comm)        # AllreduceJob.exchange: swap16, not allreduce16

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _wait(self, req):
        while not req.Test():
            time.sleep(self._poll)

    @staticmethod
    def _bytes(arr):
        if not arr.flags.c_contiguous:      # a copy would receive the bytes instead of arr
            raise ValueError(f"PollingComm: a wire buffer of shape {arr.shape} is not contiguous")
        return arr.reshape(-1).view(np.uint8)

    def allgather(self, src, dst):
        """``comm.allgather``, polled."""
        self._wait(self._comm.data.Iallgather([self._bytes(src), _byte()], [self._bytes(dst), _byte()]))
        return dst

    def alltoall(self, src, dst):
        """``comm.alltoall``, polled."""
        self._wait(self._comm.data.Ialltoall([self._bytes(src), _byte()], [self._bytes(dst), _byte()]))
        return dst

    def swap16(self, buf, tmp):
        """2 ranks: send ``buf``'s 16-bit words to the peer and receive the peer's into
        ``tmp`` (polled ``Isend``/``Irecv``); returns ``tmp``. The caller adds them."""
        from ..comm.mpi import mpi
        MPI, c = mpi(), self._comm
        peer = 1 - c.rank
        reqs = [c.data.Irecv([self._bytes(tmp), MPI.BYTE], source=peer, tag=TAG16),
                c.data.Isend([self._bytes(buf), MPI.BYTE], dest=peer, tag=TAG16)]
        while not MPI.Request.Testall(reqs):
            time.sleep(self._poll)
        return tmp


def _byte():
    from ..comm.mpi import mpi
    return mpi().BYTE


class _Batch:
    """One step's hand-over: how many buckets ran, and the first error."""

    __slots__ = ("cond", "done", "error")

    def __init__(self):
        self.cond = threading.Condition()
        self.done = 0
        self.error = None

    def wait_done(self, n):
        with self.cond:
            while self.done < n:
                self.cond.wait()


class Overlap:
    """One pipeline's exchange thread (started at its first pipelined step, a daemon).

    ``run(jobs, first, second)`` runs ``first(job)`` on the calling thread and then
    ``second(job)`` on the exchange thread, for each job in order (the calling thread
    runs ahead: each job's buffers are its own; with ``ahead=k``, at most k jobs ahead of
    the exchange thread's, so k + 1 buffers serve). ``after(job)``, when given, runs on the
    calling thread once the job's ``second`` has, in job order, between two ``first`` calls
    and at the end (none after an error). Returns when every ``second`` (and ``after``)
    has run; raises the first error (the calling thread's own first).
    """

    NAME = EXCHANGE_THREAD     # the threads' name (the watchdog prints their stacks)

    def __init__(self, name=NAME):
        self.name = name
        self._queue = None
        self._thread = None
        self._lock = threading.Lock()
        self.runs = 0             # pipelined hand-overs: runs of this thread, and steps' exchange groups

    def _start(self):
        with self._lock:
            if self._thread is None:
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._queue,), name=self.name,
                                                daemon=True)
                self._thread.start()
                weakref.finalize(self, self._queue.put, None)     # a dropped pipeline's thread ends

    @staticmethod
    def _loop(q):
        me = threading.current_thread()
        while True:
            me.idle = True           # waiting for work: the watchdog skips its stack
            item = q.get()
            me.idle = False
            if item is None:
                return
            batch, fn, job = item
            del item
            error = None
            if batch.error is None:          # after an error, the rest of the step is dropped
                try:
                    fn(job)
                except BaseException as exc:     # handed to the step, never lost
                    error = exc
            with batch.cond:
                if error is not None and batch.error is None:
                    batch.error = error
                batch.done += 1
                batch.cond.notify_all()
            del batch, fn, job, error

    def run(self, jobs, first, second, ahead=None, after=None):
        """See the class docstring."""
        if self._thread is None:
            self._start()
        batch, sent, mine, ended = _Batch(), 0, None, 0
        self.runs += 1
        try:
            for job in jobs:
                if ahead is not None and sent > ahead:
                    batch.wait_done(sent - ahead)      # job sent - ahead - 1 has left its buffer
                if after is not None:
                    ended = self._after(batch, jobs, ended, batch.done, after)
                if batch.error is not None:
                    break
                first(job)
                self._queue.put((batch, second, job))
                sent += 1
        except BaseException as exc:
            mine = exc
        batch.wait_done(sent)
        if mine is not None and not (isinstance(mine, _Unstreamed) and batch.error is not None):
            raise mine
        if batch.error is not None:
            error, batch.error = batch.error, None
            raise error
        if after is not None:
            self._after(batch, jobs, ended, sent, after)

    @staticmethod
    def _after(batch, jobs, ended, upto, after):
        """Run ``after`` on the calling thread for jobs[ended:upto] (their ``second`` ran)."""
        while ended < upto and batch.error is None:
            after(jobs[ended])
            ended += 1
        return ended

    def close(self):
        """Stop the exchange thread (a later ``run`` starts a new one)."""
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = self._queue = None
