"""Pipelined buckets: the exchange of bucket i overlaps the compression of bucket i+1.

``Pipeline(pipeline_buckets=True)`` (the default, ``GRADFUSE_PIPELINE_BUCKETS``) gives the
pipeline a second thread, its *exchange thread*. In a step, the communication thread
compresses the compressed buckets one after the other and hands each to the exchange
thread, which runs the bucket's collective (and, for fp16/bf16 buckets decoded at once,
its decode) while the communication thread compresses the next bucket. The step goes on
(plain buckets, the non-finite verdict, the decode of the others) only once the exchange
thread has run every bucket it was given, so the communicator is used by one thread at a
time, and the collectives run in bucket order on every rank: the same calls, on the same
bytes, in the same order as without the thread, hence bit-identical results.

Why a thread and not non-blocking collectives: MPICH makes progress on a non-blocking
collective only inside MPI calls, so one issued before a compression kernel would mostly
wait until the kernel returned. A blocking collective on a thread of its own makes its
own progress; the Cython kernels and mpi4py's MPI calls release the GIL, so both threads
run at once. This needs ``MPI.Query_thread() == MPI.THREAD_MULTIPLE`` (mpi4py's default);
under a lower thread level, on one rank, on a GPU (the stages run on the backend's
stream) or on a communicator other than MPI's, the step runs serially (``enabled``).

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
import weakref

_thread_multiple = {}      # id(communicator) -> whether its MPI library runs THREAD_MULTIPLE


def enabled(comm, device):
    """Whether a step on ``comm`` (``device``: the backend's) may run its buckets pipelined."""
    if device != "cpu" or comm.size < 2 or getattr(comm, "kind", None) != "mpi":
        return False
    ok = _thread_multiple.get(id(comm))
    if ok is None:
        from ..comm.mpi import mpi
        MPI = mpi()
        ok = _thread_multiple[id(comm)] = MPI.Query_thread() == MPI.THREAD_MULTIPLE
    return ok


def run_jobs(ov, comm, device, jobs, stream, compress, exchange, decode):
    """Compress and exchange the step's compressed ``jobs`` (a list, in bucket order), and
    decode each at once when ``stream`` (fp16/bf16 buckets that cannot fail): pipelined on
    ``ov`` (an ``Overlap``, or None for serial) where ``enabled``, else one after the other.
    Pipelined streamed jobs take two shared 16-bit buffers by turns (``job.slot``)."""
    second = exchange
    if stream:
        def second(job):
            exchange(job)
            decode(job)
    for job in jobs:
        job.stream = stream
    if ov is None or len(jobs) < 2 or not enabled(comm, device):
        for job in jobs:
            compress(job)
            second(job)
        return
    if stream:
        for i, job in enumerate(jobs):
            job.slot = i % 2
    ov.run(jobs, compress, second, ahead=1 if stream else None)


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

    ``run(jobs, first, second, ahead)`` runs ``first(job)`` on the calling thread and then
    ``second(job)`` on the exchange thread, for each job in order; ``first`` of job i runs
    only once ``second`` of job ``i - ahead - 1`` has returned (``ahead=None``: no limit;
    1 for jobs that share two buffers by turns). Returns when every ``second`` has run;
    raises the first error (the calling thread's own first).
    """

    def __init__(self, name="gradfuse-exchange"):
        self.name = name
        self._queue = None
        self._thread = None
        self._lock = threading.Lock()
        self.runs = 0             # steps whose buckets ran pipelined

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
        while True:
            item = q.get()
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

    def run(self, jobs, first, second, ahead=None):
        """See the class docstring."""
        if self._thread is None:
            self._start()
        batch, sent, mine = _Batch(), 0, None
        self.runs += 1
        try:
            for i, job in enumerate(jobs):
                if ahead is not None and i > ahead:
                    batch.wait_done(i - ahead)
                if batch.error is not None:
                    break
                first(job)
                self._queue.put((batch, second, job))
                sent += 1
        except BaseException as exc:
            mine = exc
        batch.wait_done(sent)
        if mine is not None:
            raise mine
        if batch.error is not None:
            error, batch.error = batch.error, None
            raise error

    def close(self):
        """Stop the exchange thread (a later ``run`` starts a new one)."""
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = self._queue = None
