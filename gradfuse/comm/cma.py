"""Allreduce between the ranks of one host, through each other's memory.

When every rank of an MPI communicator runs on one host, its sums need not go through
the MPI library's shared-memory path (which copies every byte into a shared cell and out
again, and, for a large allreduce, through a temporary buffer). Linux's cross-memory
attach (``process_vm_readv``, ``process_vm_writev``) copies straight between processes'
memory in one kernel copy. ``CMAReducer`` uses it to sum tensors where they lie, with no
fusion buffer, no pack and no unpack (the kernels and their contract:
``gradfuse/kernels/_peer.h``):

1. the ranks publish their tensors' addresses (one ``MPI_Allgather`` per call);
2. rank r sums its stripes of the tensors (the concatenation of one dtype's tensors, cut
   in stripes of about 2 MiB, stripe c rank c % p's): a piece at a time, it reads the
   peers' values of the piece, adds them in rank order (divides when averaging), writes
   the sums into its own outputs and from there into every peer's outputs (``push``);
3. every rank reports how that went (a small ``MPI_Allgather``: the fence, after which no
   rank returns, and lets its caller overwrite a tensor, while a peer may still read or
   write it; every rank learns of any failure).

Where the OS lets the ranks read each other but not write (``push`` off), step 2 keeps the
sums at home and a second phase follows: after the fence, rank r copies every other
stripe from its owner's outputs, and a second fence ends the call.

Each element is summed once, by its owner, and copied to the others: every rank gets
the same bits, with p = 2 those of ``MPI_Allreduce`` (a + b == b + a). Per rank and byte
of data it moves one read and one write when pushing (the sums leave from the cache), 1.5
reads and one write when reading the sums back.

It is on when the ranks share one host (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``
holds them all), the OS lets each rank read the others (probed at start-up: every rank
reads a random token from every peer and checks it; containers without
``CAP_SYS_PTRACE`` under a strict seccomp profile, or Yama's ptrace_scope 2 or 3, refuse
it) and ``GRADFUSE_CMA`` is not 0. The probe's verdict is agreed by all ranks and kept
in ``MPICommunicator.cma_status``. Ranks on several hosts keep the MPI library's
allreduce (so does the emulated cluster of ``gradfuse.bench.netns``, whose ranks MPICH
sees as separate hosts).
"""
import collections
import os

import numpy as np

from .. import _core
from ..errors import GradfuseError

_ALIGN = 64           # stripe boundaries on 64-byte multiples of the elements


def _l2_bytes(root="/sys/devices/system/cpu/cpu0/cache"):
    """This machine's level-2 cache per core, in bytes (sysfs), or 0 where unknown."""
    try:
        for idx in sorted(os.listdir(root)):
            d = os.path.join(root, idx)
            with open(os.path.join(d, "level")) as f:
                if f.read().strip() != "2":
                    continue
            with open(os.path.join(d, "size")) as f:
                text = f.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
            return int(text.rstrip("KM")) * mult
    except (OSError, ValueError):
        pass
    return 0


def _piece_bytes(l2):
    """An eighth of the level-2 cache, between 64 KiB and 1 MiB (256 KiB where unknown):
    the peer's values of a piece and this rank's own are then summed from the core's cache."""
    if l2 <= 0:
        return 256 << 10
    return min(1 << 20, max(64 << 10, l2 // 8 // _ALIGN * _ALIGN))


#: per-rank scratch slot for the peers' values of one piece (bytes): each process_vm_readv
#: call costs ~5 us and a page walk of the peer's memory, so pieces are not tiny, but they
#: are summed from the core's own cache only while a piece and the peer's copy of it fit
#: there: with a 2 MiB L2, 256 KiB pieces summed ResNet-50's 102 MB on 2 ranks in 15-20 ms,
#: 1 MiB pieces in 22-26 ms (docs/notes/benchmarks-history.md, runs 16-19)
PIECE_BYTES = _piece_bytes(_l2_bytes())
#: the stripes each rank sums are about this long (bytes), taken from the whole of a call's
#: tensors in turn: the small tensors of a gradient list come first and cost more per byte
#: than the large ones (4 KiB pages, one row each), so contiguous halves left one rank
#: waiting for the other at the fence (docs/benchmarks.md)
STRIPE_BYTES = 2 << 20
#: below this many bytes in a call, the MPI library's allreduce (a few microseconds of
#: latency) beats the address exchange and the two fences
MIN_BYTES = 64 << 10
_TOKEN = 64


def _describe(err):
    return f"[Errno {err}] {os.strerror(err)}" if err else "a wrong token (another process at that pid?)"


class CMAReducer:
    """Sums tensors across the ranks of one host through ``process_vm_readv``.

    Made by ``probe`` (collectively); used from the communication thread only.

    Attributes:
        MAX_LAYOUTS: how many group layouts' address tables are kept for reuse.

    Args:
        comm: the mpi4py communicator its messages use (all on one host).
        pids: every rank's process id, by rank.
    """

    MAX_LAYOUTS = 64

    def __init__(self, comm, pids):
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.pids = np.asarray(pids, dtype=np.int64)
        piece = max(_ALIGN, PIECE_BYTES // max(1, self.size // 4) // _ALIGN * _ALIGN)
        self.scratch = np.empty(piece * self.size + _ALIGN, dtype=np.uint8)
        skip = (-self.scratch.ctypes.data) % _ALIGN
        self.scratch = self.scratch[skip:skip + piece * self.size]
        self._status = np.zeros(2, dtype=np.int64)
        self._statuses = np.zeros((self.size, 2), dtype=np.int64)
        self._layouts = collections.OrderedDict()      # groups' (code, rows) -> address tables
        self.push = True         # sums written into the peers' memory (else: they read them)

    @classmethod
    def probe(cls, comm):
        """``(reducer, status)`` on every rank alike: a reducer when every rank could read
        every other rank's memory, else ``(None, why not)``. Writing into the peers'
        memory (``process_vm_writev``) is probed too: where it works the reducer pushes
        each sum to the peers (``push``), else they read it. Collective over ``comm``."""
        from mpi4py import MPI
        size, rank = comm.Get_size(), comm.Get_rank()
        if not _core.PEER_SUPPORTED:
            return None, "off: no cross-memory attach on this OS"
        token = np.frombuffer(os.urandom(_TOKEN), dtype=np.uint8).copy()
        inbox = np.zeros((size, _TOKEN), np.uint8)        # each peer writes its token in its row
        mine = np.concatenate([np.array([os.getpid(), token.ctypes.data, inbox.ctypes.data], np.int64),
                               token.view(np.int64)])
        everyone = np.empty((size, mine.size), np.int64)
        comm.Allgather([mine, MPI.INT64_T], [everyone, MPI.INT64_T])
        verdict = np.zeros(3, np.int64)            # (errno or -1 for a wrong token, peer, write errno)
        got = np.empty(_TOKEN, np.uint8)
        for q in range(size):
            if q == rank:
                continue
            err = _core.peer_read(int(everyone[q, 0]), int(everyone[q, 1]), got)
            if err or not np.array_equal(got, everyone[q, 3:].view(np.uint8)):
                verdict[:2] = (err or -1, q)
                break
            werr = _core.peer_write(int(everyone[q, 0]), int(everyone[q, 2]) + rank * _TOKEN, token)
            if werr and not verdict[2]:
                verdict[2] = werr
        comm.Barrier()                              # every write has landed
        for q in range(size):
            if q != rank and not verdict[2] and not np.array_equal(inbox[q], everyone[q, 3:].view(np.uint8)):
                verdict[2] = -1
        verdicts = np.empty((size, 3), np.int64)
        comm.Allgather([verdict, MPI.INT64_T], [verdicts, MPI.INT64_T])
        del token, inbox                            # read and written by the peers until the gather above
        bad = [r for r in range(size) if verdicts[r, 0]]
        if bad:
            r = bad[0]
            err, q = int(verdicts[r, 0]), int(verdicts[r, 1])
            return None, (f"off: rank {r} could not read rank {q}'s memory with process_vm_readv: "
                          f"{_describe(max(err, 0))}")
        reducer = cls(comm, everyone[:, 0].copy())
        reducer.push = not verdicts[:, 2].any()
        how = "each rank's sums written into the others' memory" if reducer.push else \
            "each rank reads the others' sums (process_vm_writev refused)"
        return reducer, f"on: cross-memory attach between the ranks of this host; {how}"

    # --- the collective ----------------------------------------------------------------
    def _cuts(self, n, itemsize):
        """The stripes' cut points of ``n`` elements, on 64-byte multiples: a multiple of
        the ranks' count of stripes of about ``STRIPE_BYTES`` (at least one per rank);
        stripe c is rank c % size's."""
        step = max(1, _ALIGN // itemsize)
        stripes = self.size * max(1, round(n * itemsize / (STRIPE_BYTES * self.size)))
        per = -(-n // stripes)
        per = -(-per // step) * step
        return np.minimum(np.arange(stripes + 1, dtype=np.int64) * per, n)

    def _fence(self, err, who, phase):
        """Every rank's (errno, peer) of a phase; raise the same error on every rank if
        any rank failed."""
        MPI = self._MPI
        self._status[:] = (err, who)
        self.comm.Allgather([self._status, MPI.INT64_T], [self._statuses, MPI.INT64_T])
        bad = np.flatnonzero(self._statuses[:, 0])
        if bad.size:
            r = int(bad[0])
            e, q = int(self._statuses[r, 0]), int(self._statuses[r, 1])
            raise GradfuseError(
                f"intra-host allreduce ({phase}): rank {r} could not read or write rank {q}'s memory "
                f"(cross-memory attach): {_describe(e)}; the outputs of this call are incomplete on every rank "
                f"(GRADFUSE_CMA=0 uses the MPI library's allreduce instead)")

    def allreduce(self, groups, divisor=None):
        """Sum every group's tensors across the ranks (then divide by ``divisor`` when it
        is not None; float groups only).

        Args:
            groups: ``[(code, src, dst, counts), ...]``, one per dtype: the dtype code
                (``gradfuse.dtypes.CODE``, or ``BF16`` for bf16 words) and int64 arrays
                of this rank's source and destination addresses and element counts, row
                by row (the same rows and counts on every rank). ``src`` and ``dst`` may
                be the same rows (in place).

        A call with the same rows per group as a recent one reuses its address tables
        (no allocation of its own in a training loop's steady state).
        """
        MPI = self._MPI
        me = self.rank
        mine, tables, plans = self._buffers(groups)
        at = 0
        for code, src, dst, _ in groups:          # this rank's addresses: [src, dst] per group
            n = src.size
            mine[at:at + n] = src
            mine[at + n:at + 2 * n] = dst
            at += 2 * n
        self.comm.Allgather([mine, MPI.INT64_T], [tables, MPI.INT64_T])
        err, who = 0, -1
        divide, d = divisor is not None, 1.0 if divisor is None else float(divisor)
        for code, src_tab, dst_tab, counts, cuts in plans:
            for c in range(me, cuts.size - 1, self.size):          # this rank's stripes
                err, who = _core.peer_reduce(self.pids, me, src_tab, dst_tab, counts, code, int(cuts[c]),
                                             int(cuts[c + 1]), divide, d, self.scratch, self.push)
                if err:
                    break
            if err:
                break
        if self.push:            # every rank's sums are in every rank's outputs once all are here
            self._fence(err, who, "summing this rank's stripes into every rank's outputs")
            return
        self._fence(err, who, "summing this rank's stripes")
        for code, src_tab, dst_tab, counts, cuts in plans:
            err, who = _core.peer_gather(self.pids, me, dst_tab, counts, code, cuts)
            if err:
                break
        self._fence(err, who, "copying the other ranks' stripes")

    def _buffers(self, groups):
        """``(mine, tables, plans)`` for groups of these sizes: this rank's address row,
        every rank's (the allgather's receive buffer) and per group its code, views of
        the source and destination tables in it, its counts and its stripes' cuts; kept for
        the next call with the same layout (at most ``MAX_LAYOUTS``)."""
        key = tuple((int(code), int(src.size)) for code, src, _, _ in groups)
        got = self._layouts.get(key)
        if got is not None:
            self._layouts.move_to_end(key)
            if all(pl[3] is g[3] or np.array_equal(pl[3], g[3]) for pl, g in zip(got[2], groups)):
                return got            # (the caller's counts array itself, in a training loop)
        total = 2 * sum(n for _, n in key)
        mine = np.empty(total, np.int64)
        tables = np.empty((self.size, total), np.int64)
        plans, at = [], 0
        for code, src, _, counts in groups:
            n = src.size
            counts = np.ascontiguousarray(counts, dtype=np.int64)
            plans.append((code, tables[:, at:at + n], tables[:, at + n:at + 2 * n], counts,
                          self._cuts(int(counts.sum()), _itemsize(code))))
            at += 2 * n
        got = self._layouts[key] = (mine, tables, plans)
        while len(self._layouts) > self.MAX_LAYOUTS:
            self._layouts.popitem(last=False)
        return got


#: the kernels' code for bf16 words (the bf16 compressor's payload), beside gradfuse.dtypes.CODE
BF16 = 6


def _itemsize(code):
    return {1: 2, 2: 4, 3: 8, 4: 4, 5: 8, BF16: 2}[code]


__all__ = ["CMAReducer", "PIECE_BYTES", "MIN_BYTES"]
