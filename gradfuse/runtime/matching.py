"""Async collectives matched by name across ranks, in any order (``matcher(ctx)``).

Framework-free: it needs only a runtime context (its engine, coordinator and
communicator); the bindings hand it the collective to run once a name is matched.
"""
import json
import threading
import time
from collections import OrderedDict

from .control import Request


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
    pairs with another collective silently), then exchange the names they have pending,
    and reduce the names pending on every rank, sorted by name. Rounds pair up one to
    one, so the k-th round on every rank sees at least the first k async calls of every
    rank: by the last round every name issued everywhere has been reduced. Blocking
    collectives stay matched by order, and the number of async calls between two of
    them must agree across ranks.
    """

    def __init__(self, ctx):
        self.ctx = ctx
        self.pending = OrderedDict()
        self.lock = threading.Lock()

    def add(self, name, run, handle):
        with self.lock:
            if name in self.pending:
                raise ValueError(f"an async allreduce named {name!r} is already in flight on this rank")
            self.pending[name] = (run, handle)
        self.ctx.engine.submit(self._round, "allreduce.match")

    def _round(self):
        ctx = self.ctx
        comm = ctx.comm
        try:
            ctx.coordinator.negotiate(Request("allreduce (async, matched by name)"))
            with self.lock:
                mine = list(self.pending)
            if comm.size == 1:
                everyone = [mine]
            else:
                req = comm.ctl_iallgather_bytes(json.dumps(mine).encode())
                while not comm.test(req):
                    time.sleep(1e-4)
                everyone = [json.loads(b) for b in req.result()]
        except BaseException as exc:       # fail what waits here, rather than hang it
            with self.lock:
                failed, self.pending = list(self.pending.values()), OrderedDict()
            for _, handle in failed:
                handle._finish(exc)
            return
        common = sorted(set(everyone[0]).intersection(*(set(e) for e in everyone[1:])))
        for name in common:
            with self.lock:
                run, handle = self.pending.pop(name)
            try:
                run()
            except BaseException as exc:
                handle._finish(exc)
            else:
                handle._finish()


_matchers = {}


def matcher(ctx):
    """The ``Matcher`` of runtime context ``ctx`` (one per context)."""
    m = _matchers.get(id(ctx))
    if m is None or m.ctx is not ctx:
        m = _matchers[id(ctx)] = Matcher(ctx)
    return m
