"""The communicator contract.

A communicator moves bytes; it knows nothing of tensors, plans or compression.

Data plane (called from gradfuse's communication thread only):
    ``allreduce_inplace(arr)`` sums a contiguous numpy array across ranks in place;
    ``allreduce(src, dst)`` sums ``src`` into ``dst``.

Devices: ``devices`` names the memory the data plane takes (``"cpu"``: numpy arrays,
``"cuda"``: device buffers); a GPU communicator serves one GPU, ``device``.

Control plane (used by ``gradfuse.runtime.control.Coordinator``): small non-blocking
point-to-point messages and a broadcast, each returning a request that ``test``
polls, so that the coordinator can time out and name the ranks that never arrived.
"""
from abc import ABC, abstractmethod


class Communicator(ABC):
    """Abstract communicator: rank/size queries, a sum-allreduce, a control channel."""

    kind = "abstract"
    devices = ("cpu",)      # the memory its data plane carries: "cpu" and/or "cuda"
    device = None           # the one GPU a device communicator serves

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    @abstractmethod
    def allreduce_inplace(self, arr):
        """Sum ``arr`` (contiguous numpy) across all ranks, in place."""

    @abstractmethod
    def allreduce(self, src, dst):
        """Sum ``src`` across all ranks into ``dst`` (same shape and dtype)."""

    # Further data-plane collectives (numpy arrays, contiguous; called from the
    # communication thread). A communicator that lacks one raises NotImplementedError.
    def allreduce_op(self, src, dst, op):
        """Reduce with ``op`` in ("sum", "min", "max", "prod") from ``src`` into ``dst``."""
        raise NotImplementedError(f"{self.kind} communicator has no allreduce_op")

    #: whether ``allreduce16(..., native=True)`` has a sum of the network's own (NCCL's
    #: half-precision sum); the others always run the exact one
    native_sum16 = False

    #: whether ``allreduce_rows`` sums tensors where they lie (the MPI communicator between
    #: the ranks of one host: ``gradfuse.comm.cma``)
    reduces_rows = False
    #: the least bytes of a call worth ``allreduce_rows``
    rows_min_bytes = 0

    def allreduce_rows(self, groups, divisor=None):
        """Sum tensors where they lie, with no fusion buffer: ``groups`` is
        ``[(code, src, dst, counts), ...]``, one per dtype code, each an int64 array of
        this rank's source addresses, destination addresses (the same for in place) and
        element counts, row by row, the same rows on every rank. Divides by ``divisor``
        when it is not None (float groups only)."""
        raise NotImplementedError(f"{self.kind} communicator has no allreduce_rows")

    def allreduce16(self, buf, fmt, native=False):
        """Sum a uint16 buffer of fp16 (fmt 1) or bf16 (fmt 2) values in place, each
        pairwise add in float32 rounded once (the ``sum16`` kernel as an MPI user op).
        ``native=True``: the network's own 16-bit sum where the communicator has one
        (``native_sum16``; its order and rounding are the library's), else the exact one."""
        raise NotImplementedError(f"{self.kind} communicator has no allreduce16")

    def bcast(self, arr, root):
        """Broadcast ``arr`` in place from ``root``."""
        raise NotImplementedError(f"{self.kind} communicator has no bcast")

    def allgather(self, src, dst):
        """Gather equal-size ``src`` from every rank into ``dst`` (rank-major)."""
        raise NotImplementedError(f"{self.kind} communicator has no allgather")

    def allgatherv(self, src, dst, counts):
        """Gather ``counts[r]`` elements from rank r into ``dst``, in rank order."""
        raise NotImplementedError(f"{self.kind} communicator has no allgatherv")

    def alltoall(self, src, dst):
        """Send block r of ``src`` (equal blocks) to rank r; block r of ``dst`` comes from rank r."""
        raise NotImplementedError(f"{self.kind} communicator has no alltoall")

    def alltoallv(self, src, send_counts, dst, recv_counts):
        """Variable-size all-to-all; counts are in elements, blocks are in rank order."""
        raise NotImplementedError(f"{self.kind} communicator has no alltoallv")

    def reduce_scatter(self, src, dst, counts, op="sum"):
        """Reduce ``src`` with ``op`` and leave block r (``counts[r]`` elements) on rank r."""
        raise NotImplementedError(f"{self.kind} communicator has no reduce_scatter")

    def split(self, ranks):
        """A new communicator of the given ranks of this one (called by all ranks here;
        ranks not listed get None)."""
        raise NotImplementedError(f"{self.kind} communicator has no split")

    # --- control plane -------------------------------------------------------------
    @abstractmethod
    def ctl_isend(self, data: bytes, dest: int):
        """Post a small send to ``dest`` on the control channel; returns a request."""

    @abstractmethod
    def ctl_irecv(self, buf, source: int):
        """Post a receive into ``buf`` (a writable bytearray) from ``source``."""

    @abstractmethod
    def ctl_ibcast(self, buf, root: int):
        """Post a broadcast of ``buf`` from ``root`` on the control channel."""

    @abstractmethod
    def ctl_iallgather_bytes(self, data: bytes):
        """Start gathering variable-length bytes from all ranks; returns a request
        whose ``result()`` (after ``test`` says done) is the list of bytes by rank."""

    @staticmethod
    @abstractmethod
    def test(request) -> bool:
        """True when ``request`` has completed (never blocks)."""

    def device_communicator(self, device):
        """The communicator for this one's GPU buffers on CUDA ``device``, made collectively
        on the communication thread at the first GPU step (the ranks have agreed on it), or
        None: the runtime then picks one (NCCL or host-staged MPI for an MPI communicator).
        Its control plane must be this communicator's."""
        return None

    def carries(self, device):
        """Whether the data plane takes buffers in ``device`` memory ("cpu" or "cuda")."""
        return device in self.devices

    def abort(self, code=1):
        """Terminate the whole job (all ranks)."""
        raise SystemExit(code)

    def describe(self):
        """A one-line description for error messages: the kind, this rank and the size."""
        return f"{self.kind} communicator, rank {self.rank} of {self.size}"

    def __repr__(self):
        return f"<{type(self).__name__} rank={self.rank} size={self.size}>"
