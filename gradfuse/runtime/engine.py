"""The communication thread and its handles.

gradfuse makes every MPI call of a communicator from one background thread, in the
order the collectives were submitted (Horovod's design). Callers get a ``Handle``
at once and may compute while the thread packs, negotiates and reduces; the
blocking API is ``submit(...).wait()``. The Cython kernels and mpi4py release the
GIL while they run, so the caller's thread keeps running Python meanwhile.

Call-order rule: collectives submitted through the same communicator must be
submitted in the same order on every rank. The control plane checks this (a
different order is reported as a mismatch naming the tensors), it never guesses.
"""
import queue
import threading
import time


class Handle:
    """The future result of a submitted collective.

    ``wait()`` blocks until it has finished and returns its result, or raises the
    error it ended with (the same error on every rank for cross-rank problems).
    """

    __slots__ = ("_event", "_result", "_error", "_finish", "name")

    def __init__(self, name=""):
        self._event = threading.Event()
        self._result = None
        self._error = None
        self._finish = None
        self.name = name

    def done(self):
        """True when the collective has finished (successfully or not)."""
        return self._event.is_set()

    @property
    def done_event(self):
        """A ``threading.Event`` set when the collective has finished (it holds no result)."""
        return self._event

    def wait(self, timeout=None):
        """Block until done; return the result or raise the collective's error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"collective {self.name!r} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _set(self, result=None, error=None):
        self._result, self._error = result, error
        self._event.set()


class Engine:
    """One background thread that runs jobs for one communicator, first in, first out."""

    def __init__(self, name="gradfuse-comm"):
        self._queue = queue.SimpleQueue()
        # (name, time.monotonic() at start) of the job running now, else None;
        # read by gradfuse.runtime.watchdog to find collectives that run too long
        self.inflight = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, name=""):
        """Queue ``fn()`` for the communication thread; return its ``Handle``."""
        handle = Handle(name)
        self._queue.put((fn, handle))
        return handle

    def on_thread(self):
        """Whether the caller is this engine's communication thread (a job, or a callback
        of one): it cannot wait for a job queued behind the one it runs."""
        return threading.current_thread() is self._thread

    def _loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, handle = item
            self.inflight = (handle.name, time.monotonic())
            try:
                result = fn()
            except BaseException as exc:    # handed to the caller, never lost
                self.inflight = None
                handle._set(error=exc)
            else:
                self.inflight = None
                handle._set(result=result)
            # the job's references go now, not when the next job arrives (an out-of-place
            # call's outputs are free for the output pool sooner; the caller, woken by _set,
            # may still take its next set before this runs, so two sets may take turns)
            del item, fn, handle
            result = None

    def shutdown(self):
        self._queue.put(None)
        self._thread.join()
