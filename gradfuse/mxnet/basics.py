"""Basics of the binding: init and shutdown, ranks and sizes, the feature flags
(``*_built``, ``*_enabled``), the timeline, and process sets with the communicator each
one runs on (``_comm_of``). The module state (``_state``) lives here."""
import atexit
import threading
import warnings

import numpy as np

from .. import collectives as _coll
from ..runtime import context as _runtime
from ..runtime import timeline as _timeline
from .errors import CollectiveMismatchError

_state = {"initialized": False, "ctx": None, "next_id": 1, "sets": {}, "timeline": None}
#: callables run by ``shutdown()`` (the modules above register what they keep: the scan cache)
on_shutdown = []
_lock = threading.Lock()


def _not_initialized():
    return ValueError("gradfuse.mxnet has not been initialized; use hvd.init().")


def _require_init():
    if not _state["initialized"]:
        raise _not_initialized()
    return _state["ctx"]


def init(comm=None, process_sets=None):
    """Initialise on ``comm`` (an mpi4py communicator, a list of world ranks, or None for
    ``MPI.COMM_WORLD``). ``process_sets``: ProcessSet objects to register now (every
    rank must pass the same list)."""
    from mpi4py import MPI
    if isinstance(comm, (list, tuple)):
        ranks = sorted(int(r) for r in comm)
        world = MPI.COMM_WORLD
        color = 0 if world.Get_rank() in ranks else MPI.UNDEFINED
        comm = world.Split(color=color, key=world.Get_rank())
        if comm == MPI.COMM_NULL:
            raise ValueError(f"rank {world.Get_rank()} is not in init(comm={ranks})")
    with _lock:
        if _state["initialized"] and comm is None:
            ctx = _state["ctx"]
        else:
            _runtime.init(comm)
            ctx = _runtime.default_context()
        _state["ctx"] = ctx
        _state["initialized"] = True
        global_process_set.ranks = list(range(ctx.comm.size))
        global_process_set.process_set_id = 0
        global_process_set._comm = ctx.comm
    _warn_unread(ctx.comm.rank)
    from .. import config
    path, cycles = config.horovod_timeline()
    if path is not None and _state["timeline"] is None:     # HOROVOD_TIMELINE=path, as Horovod's init
        start_timeline(path, mark_cycles=cycles)
        atexit.register(_stop_at_exit)
    for ps in process_sets or ():
        add_process_set(ps)


def _warn_unread(me):
    """Rank 0 warns about Horovod settings that are set and that gradfuse does not read."""
    from .. import config
    unread = config.horovod_unread()
    if unread and me == 0:
        warnings.warn(f"gradfuse.mxnet does not read {', '.join(unread)} (Horovod settings; see docs/horovod.md: "
                      f"it reads HOROVOD_FUSION_THRESHOLD, HOROVOD_STALL_CHECK_TIME_SECONDS and "
                      f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, HOROVOD_TIMELINE and HOROVOD_TIMELINE_MARK_CYCLES)",
                      UserWarning, stacklevel=3)


def shutdown():
    """Mark gradfuse.mxnet as shut down (``is_initialized()`` is then False).

    The communication thread stays, idle; ``init()`` makes it usable again. A timeline
    still recording (``start_timeline``, ``HOROVOD_TIMELINE``) is written now.
    """
    if _state["initialized"] and _state["timeline"] is not None:
        stop_timeline()
    for ps in list(_state["sets"].values()):
        ps._invalidate()
    _state["sets"].clear()
    for fn in on_shutdown:
        fn()
    _state["initialized"] = False


def is_initialized():
    """True between ``init()`` and ``shutdown()``."""
    return _state["initialized"]


def rank():
    """This process's rank in the initialised communicator."""
    return _require_init().comm.rank


def size():
    """The number of ranks."""
    return _require_init().comm.size


def local_rank():
    """Rank among the processes on this host."""
    return _require_init().comm.local_rank


def local_size():
    """Number of processes on this host."""
    return _require_init().comm.local_size


def cross_rank():
    """Index of this host (among ranks with the same local rank)."""
    return _require_init().comm.cross_rank


def cross_size():
    """Number of hosts (ranks with the same local rank)."""
    return _require_init().comm.cross_size


def mpi_threads_supported():
    """True if MPI was initialised with MPI_THREAD_MULTIPLE (gradfuse needs only
    MPI_THREAD_SERIALIZED: all its MPI calls come from one thread)."""
    _require_init()
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled():
    """True: gradfuse's communicator here is MPI (mpi4py)."""
    ctx = _state["ctx"]
    return ctx is None or ctx.comm.kind == "mpi"


def mpi_built():
    """True when mpi4py can be imported."""
    try:
        import mpi4py  # noqa: F401
        return True
    except ImportError:
        return False


def gloo_enabled():
    """False: gradfuse has no Gloo controller."""
    return False


def gloo_built():
    """False: gradfuse has no Gloo controller."""
    return False


def nccl_built():
    """0 (Horovod's "not built"): this binding takes CPU arrays only."""
    return 0


def ddl_built():
    """False: gradfuse has no IBM DDL support (Horovod's query, kept for compatibility)."""
    return False


def ccl_built():
    """False: gradfuse has no oneCCL support (Horovod's query, kept for compatibility)."""
    return False


def cuda_built():
    """False: this binding reduces CPU NDArrays only."""
    return False


def rocm_built():
    """False: gradfuse has no ROCm build (Horovod's query, kept for compatibility)."""
    return False


# --- timeline ----------------------------------------------------------------------
def start_timeline(file_path, mark_cycles=False):
    """Record what every collective does and write it at ``stop_timeline()`` as Horovod's
    timeline: a Chrome trace (chrome://tracing, Perfetto), one "process" per tensor with
    Horovod's phases (``NEGOTIATE_ALLREDUCE``, ``ALLREDUCE``, ``MEMCPY_IN_FUSION_BUFFER``,
    ``MPI_ALLREDUCE``, ``MEMCPY_OUT_FUSION_BUFFER``, ...; ``CYCLE_START`` marks with
    ``mark_cycles``). As in Horovod, only rank 0 records and writes ``file_path``; the
    other ranks may call it too (they record nothing). It is a Horovod-named view of
    gradfuse's one timeline (``gradfuse.runtime.timeline``)."""
    _require_init()
    if not file_path:
        raise ValueError("start_timeline needs a file path")
    me = rank()
    if _state["timeline"] is not None:        # a second start replaces the first (written now)
        _timeline.stop(_state["timeline"])
    _state["timeline"] = _timeline.start(file_path, mark_cycles, view="horovod", rank=me, record=me == 0)


def stop_timeline():
    """Stop recording and write the trace file (rank 0).

    The collectives this rank called before ``stop_timeline()`` are in the file: it first
    waits until gradfuse's communication thread has run them (their engine operations
    started, their data moved; Horovod's stop takes effect at its background thread's next
    cycle, so what it records of work still queued varies). It waits at most
    GRADFUSE_STALL_WARNING_S (the stall warning's time), then warns with the collective that
    still runs and writes what was recorded."""
    _require_init()
    sink, _state["timeline"] = _state["timeline"], None
    if sink is not None:
        from .. import config
        from ..runtime.control import StallWarning
        limit = config.stall_warning_s()
        late = _runtime.flush(limit if limit > 0 else None)
        if late:
            warnings.warn(f"stop_timeline: {', '.join(late)} still running after {limit:g} s; the timeline "
                          f"is written without the collectives not finished yet", StallWarning, stacklevel=2)
        _timeline.stop(sink)


def _stop_at_exit():
    """HOROVOD_TIMELINE's file is written at exit if nobody stopped it (no wait: the
    communication thread may be gone)."""
    sink, _state["timeline"] = _state["timeline"], None
    if sink is not None:
        _timeline.stop(sink)


def _span(op, name):
    """A timeline span of this binding's collective ``op`` named ``name`` (pid: the rank)."""
    return _timeline.Span(op, name, rank)


# --- process sets ------------------------------------------------------------------
class ProcessSet:
    """A subset of the ranks that run collectives together (an MPI sub-communicator).

    ``ProcessSet([0, 2])`` or ``ProcessSet(mpi4py_comm)``; register it with
    ``add_process_set`` (or ``init(process_sets=[...])``) on every rank. Root ranks of
    broadcasts stay global ranks, as in Horovod.
    """

    process_set_id = None
    ranks = None
    mpi_comm = None
    _comm = None

    def __init__(self, ranks_or_comm):
        try:
            from mpi4py import MPI
        except ImportError:
            MPI = None
        if MPI is not None and isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                             "an mpi4py Comm object") from None
        if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                             "an mpi4py Comm object")
        self.ranks = [int(r) for r in ranks]

    def _invalidate(self):
        self.process_set_id = None
        self._comm = None

    def __reduce__(self):
        # the global set pickles by reference; others without their communicator
        # (a pickled copy is unregistered: add it again where it is loaded)
        if self is global_process_set:
            return "global_process_set"
        return (ProcessSet, (self.ranks if self.ranks is not None else [],))

    def size(self):
        """Number of ranks in the set, or None if it is not registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self):
        """This process's rank within the set (None if not registered or not a member)."""
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(rank())

    def included(self):
        """Whether this process belongs to the set (None if its ranks are unknown)."""
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def add_process_set(process_set):
    """Register a process set (a ProcessSet or a list of ranks) and return it.

    Collective: every rank of the job calls it, in the same order. With a list of ranks
    every rank passes the same list. With ``ProcessSet(mpi4py_comm)`` each rank passes
    its own sub-communicator (e.g. from ``COMM_WORLD.Split``): every distinct one is
    registered, in the order of the lowest rank that passed it, and each rank gets the
    set of its own communicator.
    """
    ctx = _require_init()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    world = ctx.comm
    kind = "ranks"
    if process_set.mpi_comm is not None and process_set.ranks is None:
        kind = "comm"
        grp = process_set.mpi_comm.Get_group()
        process_set.ranks = sorted(grp.Translate_ranks(list(range(grp.Get_size())),
                                                       world.user_comm.Get_group()))
    ranks = process_set.ranks
    bad = [r for r in ranks if not 0 <= r < world.size]
    error = None
    if bad:
        error = ValueError(f"process set {ranks}: ranks {bad} do not exist (size {world.size})")
    elif len(set(ranks)) != len(ranks) or not ranks:
        error = ValueError(f"process set {ranks}: ranks must be distinct and non-empty")
    # agree before splitting, so that a bad or mismatched set raises everywhere
    got = _coll.allgather_object(["error" if error else "ok", kind, [] if error else ranks],
                                 name="add_process_set", comm=world)
    if error is not None:
        raise error
    if any(g[0] != "ok" for g in got) or len({g[1] for g in got}) > 1 or \
            (kind == "ranks" and any(g[2] != ranks for g in got)):
        raise CollectiveMismatchError("add_process_set: ranks passed different sets: " + ", ".join(
            f"rank {r} sent {g[2] if g[0] == 'ok' else 'an invalid set'} ({g[1]})"
            for r, g in enumerate(got)))
    lists = []
    for g in got:
        if g[2] not in lists:
            lists.append(g[2])
    existing = [global_process_set.ranks] + [p.ranks for p in _state["sets"].values()]
    dup = [lst for lst in lists if lst in existing]
    if dup:
        raise ValueError(f"Attempted to add a duplicate process set: ranks {dup[0]}")
    for lst in lists:
        target = process_set if lst == ranks else ProcessSet(lst)
        target._comm = world.split(lst)       # collective over every rank
        target.process_set_id = _state["next_id"]
        _state["next_id"] += 1
        _state["sets"][target.process_set_id] = target
    return process_set


def remove_process_set(process_set):
    """Unregister ``process_set``; False for the global set or an unknown one."""
    if process_set is global_process_set or process_set.process_set_id in (None, 0):
        return False
    if _state["sets"].pop(process_set.process_set_id, None) is None:
        return False
    process_set._invalidate()
    return True


def _comm_of(process_set):
    ctx = _require_init()
    if process_set is None or process_set is global_process_set or process_set.process_set_id == 0:
        return ctx.comm
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered (add_process_set) or was removed")
    if not process_set.included():
        raise ValueError(f"rank {rank()} is not a member of {process_set}")
    return process_set._comm


def _ranks_of(process_set):
    if process_set is None or process_set.process_set_id == 0:
        return global_process_set.ranks
    return process_set.ranks

