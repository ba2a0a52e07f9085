"""Async collectives matched by name across ranks, in any order (``matcher(ctx)``).

Framework-free: it needs only a runtime context (its engine, coordinator and
communicator); the bindings hand it the collective to run once a name is matched.
"""
import json
import threading
import time
import warnings
from collections import OrderedDict

from .. import config
from .control import Request, StallWarning


class MatchedHandle:
    """The future of an async allreduce that waits to be matched by name across ranks."""

    __slots__ = ("name", "_event", "_error", "_callbacks", "_lock")

    def __init__(self, name):
        self.name = name
        self._event = threading.Event()
        self._error = None
        self._callbacks = []
        self._lock = threading.Lock()

    def done(self):
        return self._event.is_set()

    def wait(self):
        self._event.wait()
        if self._error is not None:
            raise self._error

    def add_done(self, fn):
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def _finish(self, error=None):
        with self._lock:
            self._error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


class Matcher:
    """Matches async allreduces by name across the ranks of one communicator, in any order.

    Every async call queues one *round* on the communication thread. In a round the
    ranks first agree that they are all in a round (a negotiation, so a round never
    pairs with another collective silently), then exchange the names they have pending
    and ready, and reduce the names ready on every rank, sorted by name. A name is
    ready when its arrays can be read without waiting (``ready()`` of ``add``: a binding
    whose framework hands the arrays over later, MXNet's engine, says when). Round k of
    a rank *owes* the names of that rank's first k calls: the ranks keep exchanging
    (polling, without blocking on any one name) until no rank owes a name, so by the
    last round every name issued everywhere has been reduced, also when one call's
    input is computed from another's result. Blocking collectives stay matched by order,
    and the number of async calls between two of them must agree across ranks.
    """

    POLL_S = 2e-4        # pause between exchanges that reduced nothing

    def __init__(self, ctx):
        self.ctx = ctx
        self.pending = OrderedDict()
        self.lock = threading.Lock()
        self.added = 0       # async calls so far on this rank
        self.rounds = 0      # rounds started so far

    def add(self, name, run, handle, ready=None):
        """Queue ``run`` (called on the communication thread once ``name`` is matched)."""
        with self.lock:
            if name in self.pending:
                raise ValueError(f"an async allreduce named {name!r} is already in flight on this rank")
            self.added += 1
            self.pending[name] = (run, handle, ready, self.added)
        self.ctx.engine.submit(self._round, "allreduce.match")

    def _exchange(self, comm, mine):
        if comm.size == 1:
            return [mine]
        req = comm.ctl_iallgather_bytes(json.dumps(mine).encode())
        while not comm.test(req):
            time.sleep(1e-4)
        return [json.loads(b) for b in req.result()]

    def _round(self):
        ctx = self.ctx
        comm = ctx.comm
        self.rounds += 1
        owes_upto = self.rounds
        started = time.monotonic()
        warned = False
        try:
            ctx.coordinator.negotiate(Request("allreduce (async, matched by name)"))
            while True:
                with self.lock:
                    ready = [n for n, (_, _, rd, _) in self.pending.items() if rd is None or rd()]
                    owed = [n for n, (_, _, _, seq) in self.pending.items() if seq <= owes_upto]
                everyone = self._exchange(comm, [ready, owed])
                common = sorted(set(everyone[0][0]).intersection(*(set(e[0]) for e in everyone[1:])))
                for name in common:
                    with self.lock:
                        run, handle, _, _ = self.pending.pop(name)
                    try:
                        run()
                    except BaseException as exc:
                        handle._finish(exc)
                    else:
                        handle._finish()
                left = sorted(set().union(*(set(e[1]) for e in everyone)) - set(common))
                if not left:
                    return
                if not common:
                    if not warned and time.monotonic() - started > config.stall_warning_s():
                        warned = True
                        warnings.warn(f"async allreduce: waiting {time.monotonic() - started:.0f} s for names "
                                      f"issued on some ranks only, or not ready: {', '.join(left[:8])}"
                                      f"{', ...' if len(left) > 8 else ''}", StallWarning, stacklevel=2)
                    time.sleep(self.POLL_S)
        except BaseException as exc:       # fail what waits here, rather than hang it
            with self.lock:
                failed, self.pending = list(self.pending.values()), OrderedDict()
            for _, handle, _, _ in failed:
                handle._finish(exc)


_matchers = {}


def matcher(ctx):
    """The ``Matcher`` of runtime context ``ctx`` (one per context)."""
    m = _matchers.get(id(ctx))
    if m is None or m.ctx is not ctx:
        m = _matchers[id(ctx)] = Matcher(ctx)
    return m
