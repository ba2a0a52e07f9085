"""gradfuse's one timeline: what each collective did, stage by stage, written as a Chrome
trace (chrome://tracing, Perfetto). Framework-free; the views decide how it reads.

A **record** is one span of work: ``(stage, op, tensors, t0, t1, tid, args)``.

* ``op``: the collective (``"allreduce"``, ``"broadcast"``, ``"allgather"``,
  ``"alltoall"``, ``"reducescatter"``);
* ``stage``: one of ``STAGES``: ``"call"`` (a binding's whole call, on the caller's
  thread), ``"negotiate"`` (the control plane's agreement), the data stages of
  ``gradfuse/step.py`` for a bucket (``"pack"``, ``"compress"``, ``"exchange"``,
  ``"decode"``, ``"unpack"``) and ``"reduce"`` (an uncompressed bucket's or tensor's MPI
  reduction, or a data-movement collective's MPI call), and ``"op"`` (the whole
  collective on the communication thread, negotiation included);
* ``tensors``: the names the span covers (a bucket's span names its tensors);
* ``args``: a few JSON-able values (bucket index, bytes, ...).

Whoever does the work records it: ``with stage("negotiate", op, names):`` around a
block, or, where a loop must stay cheap, ``rec = recorder()`` once (None while nothing
records), then ``rec(stage, op, names, t0, clock())``. While no timeline records, both
cost one global read.

**Views** turn the records into trace events when ``stop()`` writes the file:

* ``"gradfuse"``: complete events (``"ph": "X"``), one per record, pid = the rank, tid =
  the thread, name = the tensor (``call``) or the stage; what ``gradfuse`` itself writes;
* ``"horovod"``: Horovod 0.28.1's timeline (horovod/common/timeline.cc): a JSON array,
  every tensor a "process" (``process_name`` metadata), per tensor ``B``/``E`` pairs
  ``NEGOTIATE_<OP>``, then the top-level ``<OP>`` (``ALLREDUCE``, ``BROADCAST``, ...)
  holding the activities ``MEMCPY_IN_FUSION_BUFFER``, ``MPI_ALLREDUCE`` (``MPI_BCAST``,
  ``MPI_ALLGATHER``, ``MPI_ALLTOALL``, ``MPI_REDUCESCATTER``), ``MEMCPY_OUT_FUSION_BUFFER``
  (and ``COMPRESS``/``DECOMPRESS`` for gradfuse's compressors), ``CYCLE_START`` instants
  with ``mark_cycles``. ``gradfuse.mxnet.start_timeline`` writes it, from rank 0 only.
"""
import json
import threading
import time

STAGES = ("call", "op", "negotiate", "pack", "compress", "exchange", "decode", "unpack", "reduce")

_state = {"path": None, "records": [], "cycles": False, "view": "gradfuse", "t0": 0.0, "wall0": 0.0,
          "rank": 0}
_lock = threading.Lock()

clock = time.perf_counter


def start(path, mark_cycles=False, view="gradfuse", rank=0, record=True):
    """Start recording (dropping anything recorded before); ``stop()`` writes ``path``.

    Args:
        view: "gradfuse" or "horovod" (``VIEWS``).
        rank: this process's rank (the gradfuse view's pid).
        record: False to record and write nothing here (Horovod writes from rank 0 only).
    """
    if view not in VIEWS:
        raise ValueError(f"timeline view must be one of {sorted(VIEWS)}, got {view!r}")
    with _lock:
        _state.update(path=str(path) if record else None, records=[], cycles=bool(mark_cycles), view=view,
                      t0=clock(), wall0=time.time(), rank=int(rank))


def stop():
    """Stop recording and write the trace file (nothing if no timeline is recording)."""
    with _lock:
        path, records = _state["path"], _state["records"]
        _state.update(path=None, records=[])
    if path is None:
        return
    events = VIEWS[_state["view"]](records, _state)
    with open(path, "w") as f:
        json.dump(events, f)


def recording():
    """True between ``start()`` and ``stop()`` in a process that writes the file."""
    return _state["path"] is not None


def _append(stage, op, tensors, t0, t1, args=None):
    if callable(tensors):
        tensors = tensors()
    _state["records"].append((stage, str(op), tuple(str(t) for t in tensors), t0, t1,
                              threading.get_ident(), args or {}))


def recorder():
    """The record function while a timeline records, else None: for loops that time
    many small spans (``rec(stage, op, tensors, t0, t1, **args)``)."""
    if _state["path"] is None:
        return None
    return lambda stage, op, tensors, t0, t1, **args: _append(stage, op, tensors, t0, t1, args)


class stage:
    """``with stage(name, op, tensors, **args):`` records one span around the block.

    ``tensors`` may be a function returning the names, called only when recording (a
    bucket's names need not be built while no timeline records).
    """

    __slots__ = ("name", "op", "tensors", "args", "t0")

    def __init__(self, name, op, tensors=(), **args):
        self.name, self.op, self.tensors, self.args = name, op, tensors, args

    def __enter__(self):
        self.t0 = clock() if _state["path"] is not None else None
        return self

    def __exit__(self, *exc):
        if self.t0 is not None and _state["path"] is not None:
            _append(self.name, self.op, self.tensors, self.t0, clock(), self.args)


class Span(stage):
    """``with Span(op, name, rank):``: a binding's whole call (stage ``"call"``) of ``op``
    on the tensor ``name`` (``rank`` is kept for old callers; the rank is ``start``'s)."""

    __slots__ = ()

    def __init__(self, op, name, rank=0):
        super().__init__("call", op, (name,))


# --- views ------------------------------------------------------------------------------
def _us(t, state):
    return round((t - state["t0"]) * 1e6, 3)


def gradfuse_trace(records, state):
    """Complete events, one per record (pid: the rank, tid: the thread, in first-seen order)."""
    tids, events = {}, []
    for stage_, op, tensors, t0, t1, tid, args in sorted(records, key=lambda r: r[3]):
        name = tensors[0] if stage_ == "call" and tensors else stage_
        a = {"op": op, "tensors": list(tensors[:8]), "count": len(tensors), **args}
        events.append({"name": name, "cat": op, "ph": "X", "ts": _us(t0, state), "dur": _us(t1, state) - _us(t0, state),
                       "pid": state["rank"], "tid": tids.setdefault(tid, len(tids)), "args": a})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


HOROVOD_OPS = {"allreduce": "ALLREDUCE", "broadcast": "BROADCAST", "allgather": "ALLGATHER",
               "alltoall": "ALLTOALL", "reducescatter": "REDUCESCATTER"}
HOROVOD_MPI = {"allreduce": "MPI_ALLREDUCE", "broadcast": "MPI_BCAST", "allgather": "MPI_ALLGATHER",
               "alltoall": "MPI_ALLTOALL", "reducescatter": "MPI_REDUCESCATTER"}
HOROVOD_ACTIVITIES = {"pack": "MEMCPY_IN_FUSION_BUFFER", "unpack": "MEMCPY_OUT_FUSION_BUFFER",
                      "compress": "COMPRESS", "decode": "DECOMPRESS"}


def horovod_activity(stage_, op):
    """Horovod's name of a data stage of ``op`` (None: not in Horovod's view)."""
    if stage_ in ("reduce", "exchange"):
        return HOROVOD_MPI.get(op, "MPI_" + op.upper())
    return HOROVOD_ACTIVITIES.get(stage_)


def horovod_trace(records, state):
    """Horovod 0.28.1's timeline of the records: a JSON array of trace events, every tensor a
    process. Per tensor and collective: ``NEGOTIATE_<OP>`` (B/E), then ``<OP>`` (B/E) from
    the end of the negotiation to the end of the collective, holding its activities."""
    events = [{"name": "process_name", "ph": "M", "pid": 0,
               "args": {"start_time_since_epoch_in_micros": int(state["wall0"] * 1e6)}},
              {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}]
    pids = {}
    # per tensor, its collectives in order: [op, negotiate (t0, t1) | None, [activities], start, end]
    cycles, ops, marks = {}, [], []
    for stage_, op, tensors, t0, t1, _tid, args in sorted(records, key=lambda r: (r[3], r[4])):
        if stage_ == "call":
            continue
        if stage_ == "op":
            ops.append((op, tensors, t0, t1))
            continue
        name = None if stage_ == "negotiate" else horovod_activity(stage_, op)
        if stage_ != "negotiate" and name is None:
            continue
        if stage_ == "negotiate" and state["cycles"]:   # gradfuse's cycle: one collective
            marks.append((t0, {"ph": "i", "name": "CYCLE_START", "s": "g"}))
        for t in tensors:
            mine = cycles.setdefault(t, [])
            if stage_ == "negotiate":
                mine.append([op, (t0, t1), [], t0, t1])
                continue
            if not mine or mine[-1][0] != op:
                mine.append([op, None, [], t0, t1])
            cur = mine[-1]
            cur[2].append((name, t0, t1, args))
            cur[4] = max(cur[4], t1)
    for op, tensors, t0, t1 in ops:       # a collective's end: its "op" span (scaling included)
        for t in tensors:
            for cur in cycles.get(t, ()):
                if cur[0] == op and t0 <= cur[3] <= t1:
                    cur[4] = max(cur[4], t1)
    timed = marks
    for tensor, mine in cycles.items():
        pid = pids.setdefault(tensor, len(pids) + 1)
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tensor}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        seq = []        # this tensor's events in order; times made non-decreasing so B/E nest

        def put(t, ev):
            seq.append((max(t, seq[-1][0]) if seq else t, ev))
        for op, neg, acts, _start, end in mine:
            top = HOROVOD_OPS.get(op, op.upper())
            if neg:
                put(neg[0], {"ph": "B", "name": "NEGOTIATE_" + top, "pid": pid})
                put(neg[1], {"ph": "E", "pid": pid})
            put(neg[1] if neg else (acts[0][1] if acts else end), {"ph": "B", "name": top, "pid": pid})
            for name, a0, a1, args in acts:
                put(a0, {"ph": "B", "name": name, "pid": pid, **({"args": args} if args else {})})
                put(a1, {"ph": "E", "pid": pid})
            put(end, {"ph": "E", "pid": pid})
        timed.extend(seq)
    # a stable sort by time only: each tensor's own order is kept where times tie
    for t, ev in sorted(timed, key=lambda x: x[0]):
        events.append({**ev, "ts": _us(t, state)})
    return events


VIEWS = {"gradfuse": gradfuse_trace, "horovod": horovod_trace}
