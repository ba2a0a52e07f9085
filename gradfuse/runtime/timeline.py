"""A timeline of collectives: spans (name, category, start, duration, rank) recorded in
memory between ``start(path)`` and ``stop()``, which writes them as a Chrome trace
(chrome://tracing, Perfetto). Framework-free; the bindings decide what to record."""
import json
import time

_timeline = {"path": None, "events": [], "cycles": False}


def start(path, mark_cycles=False):
    """Start recording (dropping anything recorded before); ``stop()`` writes ``path``."""
    _timeline.update(path=str(path), events=[], cycles=bool(mark_cycles))


def stop():
    """Stop recording and write the trace file (nothing if no timeline is recording)."""
    path = _timeline["path"]
    if path is None:
        return
    _timeline["path"] = None
    with open(path, "w") as f:
        json.dump({"traceEvents": _timeline["events"], "displayTimeUnit": "ms"}, f)


def recording():
    """True between ``start()`` and ``stop()``."""
    return _timeline["path"] is not None


class Span:
    """``with Span(op, name, rank):`` records one complete event around the block.

    ``rank`` (the trace's pid) is an int or a function returning one, called only when
    the span is recorded: while no timeline records, a span reads only the clock.
    """

    __slots__ = ("op", "name", "rank", "t0")

    def __init__(self, op, name, rank=0):
        self.op, self.name, self.rank = op, name, rank

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if _timeline["path"] is not None:
            t1 = time.perf_counter()
            pid = self.rank() if callable(self.rank) else self.rank
            _timeline["events"].append({"name": str(self.name), "cat": self.op, "ph": "X",
                                        "ts": self.t0 * 1e6, "dur": (t1 - self.t0) * 1e6,
                                        "pid": pid, "tid": 0, "args": {"op": self.op}})
