"""Process-wide state: the default communicator and, per communicator, its
communication thread (``Engine``), control plane (``Coordinator``), the GPU it serves
on this rank and the communicator that carries its GPU buffers."""
import threading

from .. import config
from ..comm.base import Communicator
from . import timeline
from .control import Coordinator
from .engine import Engine

_lock = threading.Lock()
_default = None
_contexts = {}


class Context:
    """A communicator with the one thread and coordinator that all its collectives share."""

    def __init__(self, comm):
        self.comm = comm
        self.coordinator = Coordinator(comm)
        self.engine = Engine(name=f"gradfuse-comm-{comm.kind}")
        # the GPU this rank uses with this communicator (one per rank), and the data-plane
        # communicator for its buffers (made on the first GPU step)
        self.gpu_device = None
        self.gpu_comm = None
        # GRADFUSE_TIMELINE: the first communicator's rank names the file (once per process)
        timeline.start_from_env(config.timeline_path(), comm.rank, comm.size)

    def claim_device(self, dev):
        """Fix GPU ``dev`` as this rank's GPU for this communicator, or raise ValueError.

        One GPU per rank and communicator: its GPU communicator (NCCL) is made for one
        device, collectively. A step on another device is refused before the ranks agree
        (so every rank raises), rather than leaving this rank alone in NCCL's set-up.
        """
        served = self.comm.device
        if served is not None and served != dev:
            raise ValueError(f"the tensors are on GPU {dev} but the communicator {self.comm.describe()} "
                             f"serves GPU {served}")
        with _lock:
            if self.gpu_device is None:
                self.gpu_device = dev
            claimed = self.gpu_device
        if claimed != dev:
            raise ValueError(f"the tensors are on GPU {dev}, but this rank's earlier GPU steps on this "
                             f"communicator used GPU {claimed}; each rank must keep to one GPU")

    def data_comm(self, dev):
        """The communicator for GPU buffers on device ``dev`` (the claimed one).

        Made once, collectively, on the communication thread after the ranks agreed on a
        GPU step: the communicator itself if it carries device memory, else the one it makes
        for its GPU buffers (``device_communicator``: torch.distributed's), else, for MPI,
        NCCL or MPI through pinned host memory (with a warning).
        """
        comm = self.gpu_comm
        if comm is None:
            base = self.comm
            own = None if base.carries("cuda") else base.device_communicator(dev)
            if base.carries("cuda"):
                comm = base
            elif own is not None:
                comm = own
            elif base.kind == "mpi":
                from ..comm.nccl import make_gpu_communicator
                comm = make_gpu_communicator(base, device=dev)
            else:
                raise TypeError(f"{type(base).__name__} cannot carry GPU buffers; give Pipeline an MPI, "
                                f"NCCL or single-process communicator")
            self.gpu_comm = comm
        return comm


def _wrap(comm):
    if isinstance(comm, Communicator):
        return comm
    if comm is None:
        from ..comm.mpi import MPICommunicator
        return MPICommunicator()
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None
    if MPI is not None and isinstance(comm, MPI.Intracomm):
        from ..comm.mpi import MPICommunicator
        return MPICommunicator(comm)
    raise TypeError(f"comm must be a gradfuse Communicator or an mpi4py Intracomm, got {type(comm).__name__}")


def init(comm=None, install_hooks=None):
    """Set up the default communicator (``MPI.COMM_WORLD`` unless ``comm`` is given).

    Calling it again with no argument keeps the existing default.

    Args:
        comm: a gradfuse Communicator or an mpi4py Intracomm; None for COMM_WORLD.
        install_hooks: install the rank-death hooks and the watchdog of
            ``gradfuse.runtime.watchdog`` (an MPI communicator of more than one rank only).
            None (default) reads ``GRADFUSE_HOOKS`` (unset or 1: yes, 0: no).
    """
    global _default
    from . import watchdog
    config.validate()
    hooks = watchdog.hooks_enabled(install_hooks)
    with _lock:
        if _default is not None and comm is None:
            return _default.comm
        _default = _context_locked(comm)
    if hooks:
        watchdog.install(_default.comm, all_contexts)
    return _default.comm


def all_contexts():
    """Every context made so far, the default one first (the watchdog watches them)."""
    out, seen = [], set()
    for ctx in [_default] + [entry[1] for entry in list(_contexts.values())]:
        if ctx is not None and id(ctx) not in seen:
            seen.add(id(ctx))
            out.append(ctx)
    return out


def flush(timeout=None):
    """Wait until every communication thread has run the jobs queued before this call
    (a no-op job queued behind them finishes; nothing is sent). Returns the names of the
    jobs still running on the threads that did not get there within ``timeout`` seconds
    (None: no limit), or an empty list."""
    marks = [(ctx, ctx.engine.submit(lambda: None, "flush")) for ctx in all_contexts()]
    late = []
    for ctx, mark in marks:
        try:
            mark.wait(timeout)
        except TimeoutError:
            running = ctx.engine.inflight
            late.append(running[0] if running else "a queued job")
    return late


def is_initialized():
    """True once ``init()`` has set up the default communicator of this process."""
    return _default is not None


def default_context():
    if _default is None:
        raise ValueError("gradfuse has not been initialized; call gradfuse.init() first")
    return _default


def context(comm=None):
    """The ``Context`` of ``comm``; with None, the default one (initialised on demand)."""
    if comm is None:
        init()
        return _default
    with _lock:
        return _context_locked(comm)


def _context_locked(comm):
    """One Context per communicator object given (an mpi4py comm is wrapped once)."""
    if comm is None:
        return Context(_wrap(None))
    entry = _contexts.get(id(comm))
    if entry is None or entry[0] is not comm:
        entry = (comm, Context(_wrap(comm)))
        _contexts[id(comm)] = entry
    return entry[1]


def _comm():
    return default_context().comm


def rank():
    """This process's rank in the default communicator (after ``init()``)."""
    return _comm().rank


def size():
    """Number of ranks in the default communicator."""
    return _comm().size


def local_rank():
    """Rank among the processes on this host (split by shared memory)."""
    return _comm().local_rank


def local_size():
    """Number of processes on this host."""
    return _comm().local_size


def cross_rank():
    """Index of this host among hosts (ranks with the same local rank)."""
    return _comm().cross_rank


def cross_size():
    """Number of hosts (ranks with the same local rank)."""
    return _comm().cross_size
