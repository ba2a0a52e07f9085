"""Rank death and hangs never leave the other ranks waiting.

With plain mpi4py under MPICH's mpiexec, a rank that leaves with ``sys.exit(0)``,
``sys.exit(1)`` or an uncaught exception hangs the whole job: the leaving rank blocks
in ``MPI_Finalize`` and the others block in their next collective (measured in
docs/reliability.md). A rank killed by a signal, or one that calls ``os._exit``, is
seen by mpiexec, which ends the job. ``gradfuse.init()`` installs three hooks (on an
MPI communicator of more than one rank) that turn every case into a prompt, named,
non-zero end of the job:

* **excepthook**: an uncaught exception prints its traceback, then
  ``gradfuse: rank R: uncaught exception, aborting the job`` and calls ``MPI_Abort``.
* **exit protocol** (atexit): a rank that exits sends a one-word goodbye (its exit
  code) to every other rank and joins a non-blocking barrier on a private duplicate
  of the communicator. When every rank arrives the job ended cleanly (cost: one
  barrier and p-1 eight-byte messages per rank). A rank still running that is, or
  then gets, inside a gradfuse collective with the departed rank aborts the job at
  once, naming it and its exit code (a collective that was already running, which the
  departed rank may have completed just before it left, gets max(``_GRACE_S``, the
  time it had run) to finish).
  If the others never arrive at the barrier (they wait in something that is not a
  gradfuse collective), the leaving rank prints ``gradfuse: rank R exited (code C)
  while other ranks were still running; aborting the job`` after
  ``GRADFUSE_EXIT_TIMEOUT_S`` (default: ``GRADFUSE_STALL_TIMEOUT_S``; 0 = wait as
  long as MPI would) and aborts. A long wait is the default so that a rank that
  legitimately finishes later (rank 0 writing a checkpoint) is not killed.
  The atexit hook cannot see the exit code, so ``sys.exit`` is wrapped to record the
  code it is given; a script that ends, or ``raise SystemExit`` directly, reports
  "code unknown".
* **watchdog thread**: if one job of a communication thread (``gradfuse.runtime.engine``)
  has run longer than ``GRADFUSE_STALL_TIMEOUT_S`` plus ``_CONTROL_GRACE_S`` (the
  control plane's own timeout, which names the missing ranks, goes first), it prints
  what is stuck, with the communication thread's stack, and aborts the job. This
  covers hangs that no hook sees, e.g. a rank that stopped after the agreement step.

Opt out with ``gradfuse.init(install_hooks=False)`` or ``GRADFUSE_HOOKS=0``.
``os._exit`` skips every hook; mpiexec then ends the job itself. So does a death by a
signal (``os.abort()``, SIGKILL, a segfault): mpiexec reports the PID and the signal
and kills the other ranks at once; the hooks enable ``faulthandler`` so that SIGABRT,
SIGSEGV, SIGFPE, SIGBUS and SIGILL also print the Python stack of the dying rank.
"""
import atexit
import faulthandler
import os
import sys
import threading
import time
import traceback

import numpy as np

from .. import config
from .abort import ABORT_GRACE_S, COORDINATOR_LEAD_S, announce_and_abort

_POLL_S = 0.1            # how often the watchdog looks
_GRACE_S = 2.0           # a collective already running when a peer left may still finish
# the watchdog goes after the control plane: every rank's stall message is out (6 s)
_CONTROL_GRACE_S = COORDINATOR_LEAD_S + ABORT_GRACE_S
_TAG_GOODBYE = 11
#: the name of a pipeline's exchange thread (``gradfuse.step.overlap.Overlap``): the watchdog
#: prints the stack of one that is not idle (its ``idle`` attribute) beside the
#: communication thread's
EXCHANGE_THREAD = "gradfuse-exchange"
UNKNOWN_CODE = -(1 << 62)

_hooks = None
_install_lock = threading.Lock()


def hooks_enabled(install_hooks=None):
    """Whether ``init()`` installs the hooks: the argument, else GRADFUSE_HOOKS (default on)."""
    if install_hooks is not None:
        if not isinstance(install_hooks, bool):
            raise TypeError(f"install_hooks must be True, False or None, got {install_hooks!r}")
        return install_hooks
    return config.env_bool("GRADFUSE_HOOKS", True)


def installed():
    """The active hooks object, or None."""
    return _hooks


def install(comm, contexts=tuple):
    """Install the hooks for ``comm`` (a gradfuse MPICommunicator); once per process.

    Collective over ``comm`` (it is duplicated), so every rank must call it: ``init()`` does.
    ``contexts()`` returns the runtime contexts whose communication threads the watchdog
    watches (``gradfuse.runtime.context.all_contexts``: the registry lives above this module).
    """
    global _hooks
    with _install_lock:
        if _hooks is not None:
            return _hooks
        if getattr(comm, "kind", None) != "mpi" or comm.size < 2:
            return None
        _hooks = _Hooks(comm.user_comm, contexts)
        return _hooks


def _fmt_code(code):
    return "code unknown: end of script or SystemExit raised directly" if code == UNKNOWN_CODE \
        else f"code {code}"


def _code_of(arg):
    """The process exit status that ``sys.exit(arg)`` gives."""
    if arg is None:
        return 0
    if isinstance(arg, bool):
        return int(arg)
    if isinstance(arg, int):
        return arg & 0xFF if arg >= 0 else arg
    return 1                                   # a message: Python prints it and exits 1


class _Hooks:
    def __init__(self, user_comm, contexts=tuple):
        from mpi4py import MPI
        self.MPI = MPI
        self.contexts = contexts
        self.comm = user_comm.Dup()            # private: nothing else matches our messages
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.group = self.comm.Get_group()
        self.exit_code = None
        self.aborting = False
        self.gone = {}                         # peer rank -> (exit code, monotonic time seen)
        self.peers = [r for r in range(self.size) if r != self.rank]
        self._bufs = {r: np.zeros(1, dtype=np.int64) for r in self.peers}
        self._recvs = {r: self.comm.Irecv([self._bufs[r], MPI.INT64_T], source=r, tag=_TAG_GOODBYE)
                       for r in self.peers}
        # the watchdog polls MPI from its own thread: only safe with THREAD_MULTIPLE
        self.poll_mpi = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._member_cache = {}
        self.timeout = config.stall_timeout_s()      # read once (init() validated it)
        self._stop = threading.Event()
        if not faulthandler.is_enabled():
            # a fatal signal (SIGABRT, SIGSEGV, ...) prints the Python stack before mpiexec
            # reports the death and ends the job; ``mpiexec -l`` labels it with the rank
            faulthandler.enable(all_threads=True)
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._orig_exit = sys.exit
        sys.exit = self._exit
        atexit.register(self._at_exit)
        self.thread = threading.Thread(target=self._watch, name="gradfuse-watchdog", daemon=True)
        self.thread.start()

    # --- aborting --------------------------------------------------------------------
    def abort(self, message, code=1):
        """Print ``message`` (flushed) and end the whole job with MPI_Abort."""
        self.aborting = True
        announce_and_abort(message, self.MPI.COMM_WORLD.Abort, code)
        os._exit(code)                         # not reached: MPI_Abort does not return

    # --- excepthook ------------------------------------------------------------------
    def _excepthook(self, etype, value, tb):
        try:
            self._prev_excepthook(etype, value, tb)
        finally:
            self.abort(f"gradfuse: rank {self.rank}: uncaught exception, aborting the job")

    # --- sys.exit wrapper: remember the code for the exit protocol --------------------
    def _exit(self, arg=None):
        if threading.current_thread() is threading.main_thread():
            self.exit_code = _code_of(arg)
        self._orig_exit(arg)

    # --- the watchdog thread ---------------------------------------------------------
    def _contexts(self):
        """Every runtime context now (the ``contexts`` callable given to ``install``)."""
        try:
            return list(self.contexts())
        except RuntimeError:                   # a registry changed while copied: next round
            return []

    def _involves(self, ctx, peer):
        """Whether ``peer`` (a rank of the private communicator) belongs to ctx's communicator."""
        user = getattr(ctx.comm, "user_comm", None)
        if user is None:
            return False
        key = (id(ctx), peer)
        if key not in self._member_cache:
            other = user.Get_group()
            try:
                r = self.MPI.Group.Translate_ranks(self.group, [peer], other)[0]
            finally:
                other.Free()
            self._member_cache[key] = r != self.MPI.UNDEFINED
        return self._member_cache[key]

    def _poll_goodbyes(self):
        now = time.monotonic()
        for r, req in list(self._recvs.items()):
            if r not in self.gone and req.Test():
                self.gone[r] = (int(self._bufs[r][0]), now)

    def _check(self):
        if self.poll_mpi:
            self._poll_goodbyes()
        now = time.monotonic()
        timeout = self.timeout
        for ctx in self._contexts():
            job = ctx.engine.inflight
            if job is None:
                continue
            name, start = job
            for peer, (code, seen) in sorted(self.gone.items()):
                if not self._involves(ctx, peer):
                    continue
                # The peer may have left right after finishing this very collective, which
                # then still ends here within about the time it has run so far.
                if start > seen or now - seen > max(_GRACE_S, seen - start):
                    self.abort(f"gradfuse: rank {self.rank}: rank {peer} exited ({_fmt_code(code)}) "
                               f"while this rank was in collective {name!r} (running for "
                               f"{now - start:.1f} s), which needs it; aborting the job")
            limit = timeout + _CONTROL_GRACE_S
            if timeout and now - start > limit:
                self.abort(f"gradfuse: rank {self.rank}: watchdog: collective {name!r} on the "
                           f"{ctx.comm.describe()} has run {now - start:.1f} s, longer than "
                           f"{config.source('GRADFUSE_STALL_TIMEOUT_S')}={timeout:g} (+{_CONTROL_GRACE_S:g} s for the "
                           f"control plane); the communication thread is stuck in:\n"
                           f"{self._stack(ctx.engine)}aborting the job")

    @staticmethod
    def _stack(engine):
        frames = sys._current_frames()
        frame = frames.get(engine._thread.ident)
        if frame is None:
            return "  (no stack)\n"
        text = "".join(traceback.format_stack(frame))
        # pipelined buckets: the collective itself may sit on a pipeline's exchange thread
        for t in threading.enumerate():
            f = frames.get(t.ident)
            if t.name == EXCHANGE_THREAD and f is not None and not getattr(t, "idle", False):
                text += f"and the exchange thread {t.ident} in:\n" + "".join(traceback.format_stack(f))
        return text

    def _watch(self):
        while not self._stop.wait(_POLL_S):
            try:
                self._check()
            except Exception as exc:         # never let the watchdog die silently
                sys.stderr.write(f"gradfuse: rank {self.rank}: watchdog error: {exc!r}\n")

    # --- exit protocol ---------------------------------------------------------------
    def _drain(self):
        """Wait until every communication thread has run what it holds: collectives the
        script submitted and never waited for (an MXNet engine operation still pending
        when a script ends, e.g. the last update of ``Module.fit``). The watchdog still
        watches meanwhile, so a peer that has left, or a stall, ends the job promptly."""
        marks = []
        for ctx in self._contexts():
            thread = getattr(ctx.engine, "_thread", None)
            if thread is None or not thread.is_alive():     # an engine shut down runs nothing
                continue
            try:
                marks.append(ctx.engine.submit(lambda: None, "end of the script"))
            except Exception:                # a context being torn down: nothing to run
                pass
        for mark in marks:
            mark.wait()

    def _close(self):
        """After a clean end: every rank has left its script, so a collective submitted
        now (by a later atexit hook, or by MXNet's shutdown) could never be matched; each
        context's control plane refuses it at once instead of waiting for the stall
        timeout (as Horovod's 'Horovod has been shut down')."""
        for ctx in self._contexts():
            coordinator = getattr(ctx, "coordinator", None)
            if coordinator is not None:
                coordinator.closed = (f"gradfuse: rank {self.rank}: every rank has ended its script (the exit "
                                      f"protocol ran on all {self.size}), so no rank can take part in this "
                                      f"collective any more")

    def _at_exit(self):
        if self.aborting:
            return
        MPI = self.MPI
        if not MPI.Is_finalized():
            self._drain()
        self._stop.set()
        self.thread.join(1.0)
        if MPI.Is_finalized():
            return
        code = UNKNOWN_CODE if self.exit_code is None else self.exit_code
        word = np.array([code], dtype=np.int64)
        sends = [self.comm.Isend([word, MPI.INT64_T], dest=r, tag=_TAG_GOODBYE) for r in self.peers]
        barrier = self.comm.Ibarrier()
        try:
            limit = config.exit_timeout_s()
        except ValueError as exc:
            sys.stderr.write(f"gradfuse: {exc}; using GRADFUSE_STALL_TIMEOUT_S\n")
            limit = config.DEFAULT_STALL_TIMEOUT_S
        start = time.monotonic()
        noted = False
        while not barrier.Test():
            waited = time.monotonic() - start
            self._poll_goodbyes()
            running = [r for r in self.peers if r not in self.gone]
            if not noted and waited > 1.0:
                noted = True
                sys.stderr.write(f"gradfuse: rank {self.rank} is exiting ({_fmt_code(code)}) while "
                                 f"ranks {running} are still running; waiting "
                                 f"{'without limit' if not limit else f'up to {limit:g} s'} "
                                 f"for them to finish (GRADFUSE_EXIT_TIMEOUT_S)\n")
                sys.stderr.flush()
            if limit and waited > limit:
                self.abort(f"gradfuse: rank {self.rank} exited ({_fmt_code(code)}) while other ranks "
                           f"were still running (ranks {running}, waited {waited:.1f} s); "
                           f"aborting the job")
            time.sleep(min(0.01, 1e-4 + waited / 100))
        # a clean end: complete the goodbye traffic so that MPI_Finalize finds nothing pending
        self._close()
        MPI.Request.Waitall(sends + list(self._recvs.values()))
        self.comm.Free()
        self.group.Free()
