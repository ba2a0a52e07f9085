"""gradfuse's one timeline: what each collective did, stage by stage, written as a Chrome
trace (chrome://tracing, Perfetto). Framework-free; one record set, several views.

A **record** is one span of work: ``(stage, op, tensors, t0, t1, tid, args)``.

* ``op``: the collective (``"allreduce"``, ``"broadcast"``, ``"allgather"``,
  ``"alltoall"``, ``"reducescatter"``);
* ``stage``: one of ``STAGES``: ``"call"`` (a binding's whole call, on the caller's
  thread), ``"op"`` (a whole negotiated collective of ``gradfuse.collectives`` on the
  communication thread), ``"negotiate"`` (the control plane's agreement), and a bucket's
  data stages (``gradfuse/step/run.py``): ``"pack"``, ``"compress"``, ``"exchange"`` (the
  bucket's or tensor's MPI/NCCL collective: an uncompressed allreduce, a compressor's
  allgather, 16-bit allreduce or two-phase exchange, a data-movement collective's MPI
  call), ``"decompress"`` and ``"unpack"``; ``"verdict"``, a compressed step's agreement
  on its inputs (``args["part"]``: ``"max |x|"``, the pass over them, or ``"agree"``, the
  max-allreduce of the ranks' bounds; ``gradfuse.step.jobs``). ``"reduce"`` and
  ``"decode"`` are accepted as older names of ``"exchange"`` and ``"decompress"``;
* ``tensors``: the names the span covers (a bucket's span names its tensors);
* ``args``: a few JSON-able values (``bucket`` index, ``bytes``, ``algorithm``, ...).

Whoever does the work records it: ``with stage("negotiate", op, names):`` around a
block, or, where a loop must stay cheap, ``rec = recorder()`` once (None while nothing
records), then ``rec(stage, op, names, t0, clock())``. While no timeline records, both
cost one dict read and no name is built (``tensors`` may be a function, called only when
recording), so a step pays nothing per tensor.

**Sinks** decide where records go and how they read; several may record at once (the
records are shared, each sink writes those made while it was open):

* ``"gradfuse"`` (``GRADFUSE_TIMELINE=path.json``, or ``start(path)``): a Chrome trace
  object (``{"traceEvents": [...]}``) of complete events (``"ph": "X"``, ``ts``/``dur``
  in microseconds since the sink started), pid = the rank, **one track (tid) per stage**
  (and per thread, where two threads record the same stage), so spans nest on every track
  even when buckets are pipelined. Event names are ``<stage> b<bucket>`` for a bucket's
  stages, the tensor for ``call`` and the collective for ``op``/``negotiate``. It is
  streamed: records are written in chunks of ``FLUSH_RECORDS`` as they come, and the
  closing bracket at ``stop()`` (or process exit). ``otherData.epoch_us`` is the wall
  time of ``ts`` 0, so ``merge()`` can put the ranks' files on one clock.
* ``"horovod"`` (``gradfuse.mxnet.start_timeline``, ``HOROVOD_TIMELINE``): Horovod
  0.28.1's timeline (horovod/common/timeline.cc): a JSON array, every tensor a "process"
  (``process_name`` metadata), per tensor ``B``/``E`` pairs ``NEGOTIATE_<OP>``, then the
  top-level ``<OP>`` (``ALLREDUCE``, ``BROADCAST``, ...) holding the activities
  ``MEMCPY_IN_FUSION_BUFFER``, ``MPI_ALLREDUCE`` (``MPI_BCAST``, ``MPI_ALLGATHER``,
  ``MPI_ALLTOALL``, ``MPI_REDUCESCATTER``), ``MEMCPY_OUT_FUSION_BUFFER`` (and
  ``COMPRESS``/``DECOMPRESS`` for gradfuse's compressors), ``CYCLE_START`` instants with
  ``mark_cycles``. Written whole at ``stop()``, from rank 0 only (the binding's rule).
"""
import atexit
import json
import os
import threading
import time

STAGES = ("call", "op", "negotiate", "pack", "compress", "exchange", "decompress", "unpack", "verdict")
ALIASES = {"reduce": "exchange", "decode": "decompress"}
FLUSH_RECORDS = 4096          # a streaming sink writes this many records at a time

clock = time.perf_counter
_T0, _WALL0 = clock(), time.time()       # one clock pair per process: perf_counter -> epoch

# "on": any sink open (the one read the record calls make); "records": the shared list,
# "base": the absolute index of records[0] (records every open sink has written are dropped)
_state = {"on": False, "records": [], "base": 0, "sinks": [], "env": None}
_lock = threading.RLock()


def _epoch_us(t):
    return (_WALL0 + (t - _T0)) * 1e6


class Sink:
    """One open timeline file: the records from ``begin`` on, in one view.

    Made by ``start()``; ``stop(sink)`` writes it (the gradfuse view has been streaming).
    """

    def __init__(self, path, view, rank, mark_cycles):
        self.path, self.view, self.rank, self.cycles = str(path), view, int(rank), bool(mark_cycles)
        self.t0 = clock()
        self.begin = None             # absolute index of this sink's first record
        self.tracks = {}              # (stage, thread id) -> tid
        self.first = True
        self.fh = None
        if view == "gradfuse":
            self.fh = open(self.path, "w")
            other = {"rank": self.rank, "epoch_us": round(_epoch_us(self.t0), 3), "tracks": "one per stage"}
            self.fh.write('{"displayTimeUnit": "ms", "otherData": ' + json.dumps(other) + ', "traceEvents": [\n')
            self._emit([{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                         "args": {"name": f"rank {self.rank}"}},
                        {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                         "args": {"sort_index": self.rank}}])

    def _emit(self, events):
        if not events:
            return
        text = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events)
        self.fh.write(text if self.first else ",\n" + text)
        self.first = False

    def write(self, records):
        """Stream ``records`` (gradfuse view) as complete events."""
        self._emit(gradfuse_events(records, self))

    def close(self, records):
        """Write the rest (``records``: this sink's unwritten records) and close the file."""
        if self.view == "gradfuse":
            self.write(records)
            self.fh.write("\n]}\n")
            self.fh.close()
            return
        state = {"t0": self.t0, "wall0": _WALL0 + (self.t0 - _T0), "cycles": self.cycles, "rank": self.rank}
        with open(self.path, "w") as f:
            json.dump(VIEWS[self.view](records, state), f)


def start(path, mark_cycles=False, view="gradfuse", rank=0, record=True):
    """Open a timeline sink on ``path``; ``stop(sink)`` closes it. Returns the sink (None
    with ``record=False``: nothing is recorded or written here, as on Horovod's ranks
    other than 0).

    Args:
        view: "gradfuse" (streamed Chrome trace, one track per stage) or "horovod"
            (Horovod 0.28.1's timeline, written at ``stop``); see ``VIEWS``.
        rank: this process's rank (the gradfuse view's pid).
        mark_cycles: the Horovod view's ``CYCLE_START`` marks.
    """
    if view not in VIEWS:
        raise ValueError(f"timeline view must be one of {sorted(VIEWS)}, got {view!r}")
    if not record:
        return None
    sink = Sink(path, view, rank, mark_cycles)
    with _lock:
        sink.begin = _state["base"] + len(_state["records"])
        _state["sinks"].append(sink)
        _state["on"] = True
        _trim_locked()        # records made while no sink was open
    return sink


def stop(sink=None):
    """Close ``sink`` (None: every open sink) and write what it recorded."""
    with _lock:
        sinks = list(_state["sinks"]) if sink is None else [s for s in _state["sinks"] if s is sink]
        for s in sinks:
            _state["sinks"].remove(s)
            n = len(_state["records"])
            s.close(_state["records"][s.begin - _state["base"]:n])
        _state["on"] = bool(_state["sinks"])
        _trim_locked()


def recording(view=None):
    """True while a sink (of ``view``, if given) is open in this process."""
    return any(view is None or s.view == view for s in _state["sinks"])


def _trim_locked():
    """Drop the records every open sink has written."""
    recs = _state["records"]
    keep = min((s.begin for s in _state["sinks"]), default=_state["base"] + len(recs))
    cut = keep - _state["base"]
    if cut > 0:
        del recs[:cut]
        _state["base"] = keep


def _flush_locked():
    recs, base = _state["records"], _state["base"]
    n = len(recs)             # other threads may append meanwhile: those wait for the next flush
    for s in _state["sinks"]:
        if s.view == "gradfuse":
            s.write(recs[s.begin - base:n])
            s.begin = base + n
    _trim_locked()


def _append(stage, op, tensors, t0, t1, args=None):
    if callable(tensors):
        tensors = tensors()
    recs = _state["records"]
    recs.append((ALIASES.get(stage, stage), str(op), tuple(str(t) for t in tensors), t0, t1,
                 threading.get_ident(), args or {}))
    if len(recs) >= FLUSH_RECORDS and any(s.view == "gradfuse" for s in _state["sinks"]):
        with _lock:
            if len(_state["records"]) >= FLUSH_RECORDS:
                _flush_locked()


def recorder():
    """The record function while a timeline records, else None: for loops that time
    many small spans (``rec(stage, op, tensors, t0, t1, **args)``)."""
    if not _state["on"]:
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
        self.t0 = clock() if _state["on"] else None
        return self

    def __exit__(self, *exc):
        if self.t0 is not None and _state["on"]:
            _append(self.name, self.op, self.tensors, self.t0, clock(), self.args)


class Span(stage):
    """``with Span(op, name, rank):``: a binding's whole call (stage ``"call"``) of ``op``
    on the tensor ``name`` (``rank`` is kept for old callers; the rank is the sink's)."""

    __slots__ = ()

    def __init__(self, op, name, rank=0):
        super().__init__("call", op, (name,))


# --- GRADFUSE_TIMELINE -----------------------------------------------------------------
def rank_path(path, rank, size):
    """The file rank ``rank`` of ``size`` writes for ``GRADFUSE_TIMELINE=path``: the path
    itself on one rank, else ``<stem>.rank<r><ext>`` (``{rank}`` in the path: formatted)."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if size <= 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


def start_from_env(path, rank, size):
    """Open the process's ``GRADFUSE_TIMELINE`` sink once (the first communicator's rank
    and size name the file) and close it at exit. ``path``: the variable's value or None."""
    with _lock:
        if path is None or _state["env"] is not None:
            return _state["env"]
        where = rank_path(path, rank, size)
        try:
            _state["env"] = start(where, view="gradfuse", rank=rank)
        except OSError as exc:
            raise ValueError(f"GRADFUSE_TIMELINE={path!r}: rank {rank} cannot write {where}: {exc}") from None
    atexit.register(stop, _state["env"])
    return _state["env"]


def merge(paths, out):
    """Write one Chrome trace of several ranks' gradfuse-view files (``paths``) to
    ``out``, on one clock: each file's events shifted by its ``otherData.epoch_us``."""
    loaded = []
    for p in paths:
        with open(p) as f:
            loaded.append(json.load(f))
    origin = min(t["otherData"]["epoch_us"] for t in loaded)
    events = []
    for t in loaded:
        shift = t["otherData"]["epoch_us"] - origin
        for e in t["traceEvents"]:
            events.append({**e, "ts": round(e["ts"] + shift, 3)} if "ts" in e else e)
    with open(out, "w") as f:
        json.dump({"displayTimeUnit": "ms", "otherData": {"epoch_us": origin, "ranks": len(loaded)},
                   "traceEvents": events}, f)


# --- views ------------------------------------------------------------------------------
def _us(t, t0):
    return round((t - t0) * 1e6, 3)


def _track(sink, stage_, tid, events):
    """The tid of ``stage_`` recorded on thread ``tid`` (new tracks get their metadata)."""
    key = (stage_, tid)
    track = sink.tracks.get(key)
    if track is None:
        k = sum(1 for s, _ in sink.tracks if s == stage_)
        order = STAGES.index(stage_) if stage_ in STAGES else len(STAGES)
        track = sink.tracks[key] = 1 + order * 16 + k
        events.append({"name": "thread_name", "ph": "M", "pid": sink.rank, "tid": track,
                       "args": {"name": stage_ if k == 0 else f"{stage_} ({k + 1})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": sink.rank, "tid": track,
                       "args": {"sort_index": track}})
    return track


def gradfuse_events(records, sink):
    """Complete events of ``records`` for ``sink`` (pid: its rank, one tid per stage)."""
    events = []
    for stage_, op, tensors, t0, t1, tid, args in sorted(records, key=lambda r: r[3]):
        track = _track(sink, stage_, tid, events)
        if stage_ == "call" and tensors:
            name = tensors[0]
        elif "bucket" in args:
            name = f"{stage_} b{args['bucket']}"
        else:
            name = op if stage_ in ("op", "negotiate") else stage_
        ts = _us(t0, sink.t0)
        events.append({"name": name, "cat": stage_, "ph": "X", "ts": ts, "dur": round(_us(t1, sink.t0) - ts, 3),
                       "pid": sink.rank, "tid": track,
                       "args": {"op": op, "tensors": list(tensors[:8]), "count": len(tensors), **args}})
    return events


HOROVOD_OPS = {"allreduce": "ALLREDUCE", "broadcast": "BROADCAST", "allgather": "ALLGATHER",
               "alltoall": "ALLTOALL", "reducescatter": "REDUCESCATTER"}
HOROVOD_MPI = {"allreduce": "MPI_ALLREDUCE", "broadcast": "MPI_BCAST", "allgather": "MPI_ALLGATHER",
               "alltoall": "MPI_ALLTOALL", "reducescatter": "MPI_REDUCESCATTER"}
HOROVOD_ACTIVITIES = {"pack": "MEMCPY_IN_FUSION_BUFFER", "unpack": "MEMCPY_OUT_FUSION_BUFFER",
                      "compress": "COMPRESS", "decompress": "DECOMPRESS"}


def horovod_activity(stage_, op):
    """Horovod's name of a data stage of ``op`` (None: not in Horovod's view)."""
    stage_ = ALIASES.get(stage_, stage_)
    if stage_ == "exchange":
        return HOROVOD_MPI.get(op, "MPI_" + op.upper())
    return HOROVOD_ACTIVITIES.get(stage_)


def horovod_trace(records, state):
    """Horovod 0.28.1's timeline of the records: a JSON array of trace events, every tensor a
    process. Per tensor and collective: ``NEGOTIATE_<OP>`` (B/E), then ``<OP>`` (B/E) from
    the end of the negotiation to the end of the collective, holding its activities.
    ``state``: ``t0`` (ts 0), ``wall0`` (its wall time), ``cycles`` (``CYCLE_START`` marks)."""
    t_zero = state["t0"]
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
        events.append({**ev, "ts": _us(t, t_zero)})
    return events


def gradfuse_trace(records, state):
    """The gradfuse view of ``records`` as one trace object (what a sink streams), for a
    process of rank ``state["rank"]`` whose ts 0 is ``state["t0"]``."""
    sink = Sink.__new__(Sink)
    sink.rank, sink.t0, sink.tracks = state.get("rank", 0), state["t0"], {}
    return {"traceEvents": gradfuse_events(records, sink), "displayTimeUnit": "ms"}


VIEWS = {"gradfuse": gradfuse_trace, "horovod": horovod_trace}
