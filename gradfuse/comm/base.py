"""The communicator contract.

A communicator moves bytes; it knows nothing of tensors, plans or compression.

Data plane (called from gradfuse's communication thread only):
    ``allreduce_inplace(arr)`` sums a contiguous numpy array across ranks in place;
    ``allreduce(src, dst)`` sums ``src`` into ``dst``.

Control plane (used by ``gradfuse.control.Coordinator``): small non-blocking
point-to-point messages and a broadcast, each returning a request that ``test``
polls, so that the coordinator can time out and name the ranks that never arrived.
"""
from abc import ABC, abstractmethod


class Communicator(ABC):
    """Abstract communicator: rank/size queries, a sum-allreduce, a control channel."""

    kind = "abstract"

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

    def abort(self, code=1):
        """Terminate the whole job (all ranks)."""
        raise SystemExit(code)

    def describe(self):
        return f"{self.kind} communicator, rank {self.rank} of {self.size}"

    def __repr__(self):
        return f"<{type(self).__name__} rank={self.rank} size={self.size}>"
