"""NCCL communicator over ``cupy.cuda.nccl``, and the choice between it and the
host-staged MPI fallback (``gradfuse.comm.staged``).

Data plane: device buffers (cupy arrays, anything with ``__cuda_array_interface__``, or
``gradfuse.fusion.intake.DeviceArray``), contiguous. Every call is blocking, like the MPI
communicator's: the NCCL operation is enqueued on the communicator's stream after the
caller's current stream (an event makes it wait for the producer of the data), and the
call returns when it has completed. The control plane (small host messages of
``gradfuse.runtime.control``) is delegated to an ``MPICommunicator``; the NCCL unique id is
broadcast over that same MPI communicator.

``make_gpu_communicator()`` picks NCCL when it can, else ``HostStagedCommunicator``
(copy to pinned host memory, MPI, copy back) with a warning. NCCL refuses two ranks on
one GPU, so when ranks share a device (checked through MPI before NCCL starts, the same
decision on every rank) the fallback is used too.

Arithmetic: sums of float32/float64/ints use NCCL's reduction (its own order, like MPI's,
which is unspecified too). The 16-bit sum of the fp16/bf16 compressors (``allreduce16``)
defaults to ``sum16="exact"``: allgather, then the ``gf_sum16`` kernel folds the rows in
rank order with the CPU's rounding and NaN rules, so every rank gets the same bits and
they follow docs/compressors.md. ``sum16="nccl"`` (or a call with ``native=True``, which
``Pipeline(compress="fp16", sum16="nccl")`` makes) uses NCCL's native half/bfloat16 sum
(faster at large p: a ring over 2n bytes instead of an allgather of (p-1) 2n; NaN
payloads and rounding order not guaranteed; untested on hardware beyond one rank).
"""
import atexit
import weakref

import numpy as np

from .device import DeviceCommunicator, as_bytes, as_device, cupy, is_host
from .mpi import MPICommunicator
from .staged import HostStagedCommunicator

# NCCL's enums (nccl.h); cupy exposes them as NCCL_* too, used when present.
_NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}


def _nccl_module():
    from cupy.cuda import nccl
    if not getattr(nccl, "available", False):
        raise ImportError("cupy.cuda.nccl is not available (no NCCL library)")
    return nccl


def _const(nccl, name, table, key):
    return getattr(nccl, name, table[key])


def _close_at_exit(ref):
    comm = ref()
    if comm is not None:
        try:
            comm.close()
        except Exception:       # at exit: a broken device or NCCL must not hide the real error
            pass


class NCCLCommunicator(DeviceCommunicator):
    """NCCL data plane on one GPU per rank, MPI control plane.

    Args:
        comm: an mpi4py intracommunicator or an ``MPICommunicator`` (default COMM_WORLD).
        device: CUDA device of this rank (default: ``local_rank % device count``).
        sum16: ``"exact"`` (default) or ``"nccl"``, see the module docstring.

    Raises RuntimeError (on every rank, before NCCL starts) when ranks share a GPU.
    """

    kind = "nccl"

    def __init__(self, comm=None, device=None, sum16="exact"):
        if sum16 not in ("exact", "nccl"):
            raise ValueError(f"sum16 must be 'exact' or 'nccl', got {sum16!r}")
        self._init_control(comm)
        cp = cupy()
        nccl = _nccl_module()
        self._nccl = nccl
        self.sum16_mode = sum16
        if device is None:
            device = self.local_rank % cp.cuda.runtime.getDeviceCount()
        self.device = int(device)
        cp.cuda.Device(self.device).use()
        shared = _shared_devices(self.mpi, self.device)
        if shared:
            raise RuntimeError(f"NCCL needs one GPU per rank, but ranks {shared} share a device")
        # rank 0 sends the id or its error: every rank raises instead of waiting for an id
        sent = None
        if self.rank == 0:
            try:
                sent = ("uid", nccl.get_unique_id())
            except Exception as e:
                sent = ("error", f"{type(e).__name__}: {e}")
        kind, uid = self.mpi.user_comm.bcast(sent, root=0)
        if kind == "error":
            raise RuntimeError(f"NCCL: rank 0 could not create the unique id: {uid}")
        # passed on exactly as get_unique_id() made it: bytes since cupy 14 (whose constructor
        # takes only bytes), a tuple of ints before; mpi4py's pickled bcast keeps the type
        self.nccl = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._ready = cp.cuda.Event(disable_timing=True)
        self._u8 = _const(nccl, "NCCL_UINT8", _NCCL_DTYPES, "uint8")
        self._scratch = {}
        # destroy the NCCL communicator at exit before MPI finalizes (atexit runs last-in
        # first-out, and mpi4py registered its finalizer when it was imported), not
        # whenever the garbage collector reaches it after CUDA or MPI is gone
        atexit.register(_close_at_exit, weakref.ref(self))

    def close(self):
        """Destroy the NCCL communicator now (also done at exit); later collectives raise.
        Idempotent."""
        comm, self.nccl = getattr(self, "nccl", None), None
        if comm is None:
            return
        try:
            self.stream.synchronize()
        finally:
            comm.destroy()

    def describe(self):
        return f"nccl communicator, rank {self.rank} of {self.size}, device {self.device}"

    # --- plumbing ----------------------------------------------------------------------
    def _dtype(self, dtype):
        name = np.dtype(dtype).name
        if name not in _NCCL_DTYPES:
            raise TypeError(f"NCCL communicator cannot reduce dtype {name}")
        return _const(self._nccl, "NCCL_" + name.upper(), _NCCL_DTYPES, name)

    def _op(self, op):
        if op not in _NCCL_OPS:
            raise ValueError(f"unknown reduction {op!r}; known: {sorted(_NCCL_OPS)}")
        return _const(self._nccl, "NCCL_" + op.upper(), _NCCL_OPS, op)

    def _begin(self):
        """Make our stream wait for the caller's current stream (the data's producer)."""
        if self.nccl is None:
            raise RuntimeError(f"{self.describe()}: the NCCL communicator was closed")
        cp = cupy()
        # one event, re-recorded: a stream's wait takes the event's state at the call, and a
        # timing-disabled event is the cheap kind (Stream.record() makes a timing one)
        self._ready.record(cp.cuda.get_current_stream())
        self.stream.wait_event(self._ready)
        return self.stream.ptr

    def _end(self):
        self.stream.synchronize()

    def _scratch_buf(self, nbytes):
        cp = cupy()
        buf = self._scratch.get(nbytes)
        if buf is None:
            self._scratch.clear()
            buf = cp.empty(nbytes, np.uint8)
            self._scratch[nbytes] = buf
        return buf

    # --- data plane ----------------------------------------------------------------------
    def allreduce_inplace(self, arr):
        if is_host(arr):                  # a step's small host message: the control plane's
            return self.mpi.allreduce_inplace(arr)
        a = as_device(arr)
        s = self._begin()
        self.nccl.allReduce(a.data.ptr, a.data.ptr, a.size, self._dtype(a.dtype), self._op("sum"), s)
        self._end()
        return arr

    def allreduce(self, src, dst):
        return self.allreduce_op(src, dst, "sum")

    def allreduce_op(self, src, dst, op):
        if is_host(src) and is_host(dst):
            return self.mpi.allreduce_op(src, dst, op)
        a, b = as_device(src), as_device(dst)
        if a.size != b.size or a.dtype != b.dtype:
            raise ValueError(f"allreduce: src {a.dtype}[{a.size}] and dst {b.dtype}[{b.size}] differ")
        s = self._begin()
        self.nccl.allReduce(a.data.ptr, b.data.ptr, a.size, self._dtype(a.dtype), self._op(op), s)
        self._end()
        return dst

    native_sum16 = True

    def allreduce16(self, buf, fmt, native=False):
        """The 16-bit sum: exact (allgather + the rank-order ``sum16`` fold), or with
        ``native=True`` or ``sum16="nccl"`` NCCL's own half/bfloat16 allreduce (untested on
        hardware with more than one rank: one GPU cannot run two NCCL ranks)."""
        from .. import gpu
        b = as_device(buf)
        if b.dtype != np.uint16:
            raise TypeError(f"allreduce16 needs uint16 words, got {b.dtype}")
        if self.size == 1 or b.size == 0:
            return buf
        if native or self.sum16_mode == "nccl":
            dt = _const(self._nccl, "NCCL_FLOAT16" if fmt == 1 else "NCCL_BFLOAT16", _NCCL_DTYPES,
                        "float16" if fmt == 1 else "bfloat16")
            s = self._begin()
            self.nccl.allReduce(b.data.ptr, b.data.ptr, b.size, dt, self._op("sum"), s)
            self._end()
            return buf
        # exact: gather every rank's words, fold them in rank order with the CPU's rule
        # (row 0 first: acc = row0; acc = sum16(row_r, acc)), identical bits on every rank
        rows = self._scratch_buf(2 * b.size * self.size).view(np.uint16).reshape(self.size, b.size)
        self.allgather(b, rows)
        with self.stream:
            b[...] = rows[0]
            for r in range(1, self.size):
                gpu.sum16(fmt, rows[r], b)
        self._end()
        return buf

    def bcast(self, arr, root):
        a = as_bytes(as_device(arr))
        s = self._begin()
        self.nccl.bcast(a.data.ptr, a.size, self._u8, int(root), s)
        self._end()
        return arr

    def allgather(self, src, dst):
        a, b = as_bytes(as_device(src)), as_bytes(as_device(dst))
        if b.size != a.size * self.size:
            raise ValueError(f"allgather: dst of {b.size} bytes, expected {self.size} x {a.size}")
        s = self._begin()
        self.nccl.allGather(a.data.ptr, b.data.ptr, a.size, self._u8, s)
        self._end()
        return dst

    def allgatherv(self, src, dst, counts):
        """One grouped broadcast per rank (NCCL has no allgatherv)."""
        a, d = as_device(src), as_device(dst)
        item = d.itemsize
        sizes = [int(c) * item for c in counts]
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
        a8, d8 = as_bytes(a), as_bytes(d)
        s = self._begin()
        self._nccl.groupStart()
        try:
            for r in range(self.size):
                if sizes[r]:
                    self.nccl.broadcast(a8.data.ptr, d8.data.ptr + displs[r], sizes[r], self._u8, r, s)
        finally:
            self._nccl.groupEnd()
        self._end()
        return dst

    def _alltoallv_bytes(self, a8, ss, sd, d8, rs, rd):
        s = self._begin()
        self._nccl.groupStart()
        try:
            for r in range(self.size):
                if ss[r]:
                    self.nccl.send(a8.data.ptr + sd[r], ss[r], self._u8, r, s)
                if rs[r]:
                    self.nccl.recv(d8.data.ptr + rd[r], rs[r], self._u8, r, s)
        finally:
            self._nccl.groupEnd()
        self._end()

    def alltoall(self, src, dst):
        """Grouped send/recv: block r of ``src`` goes to rank r."""
        a8, d8 = as_bytes(as_device(src)), as_bytes(as_device(dst))
        if a8.size % self.size or d8.size != a8.size:
            raise ValueError(f"alltoall: {a8.size} bytes do not split into {self.size} equal blocks")
        blk = a8.size // self.size
        offs = [r * blk for r in range(self.size)]
        self._alltoallv_bytes(a8, [blk] * self.size, offs, d8, [blk] * self.size, offs)
        return dst

    def alltoallv(self, src, send_counts, dst, recv_counts):
        a, d = as_device(src), as_device(dst)
        item = a.itemsize
        ss = [int(c) * item for c in send_counts]
        rs = [int(c) * item for c in recv_counts]
        sd = np.concatenate([[0], np.cumsum(ss)[:-1]]).astype(np.int64).tolist()
        rd = np.concatenate([[0], np.cumsum(rs)[:-1]]).astype(np.int64).tolist()
        self._alltoallv_bytes(as_bytes(a), ss, sd, as_bytes(d), rs, rd)
        return dst

    def reduce_scatter(self, src, dst, counts, op="sum"):
        a, d = as_device(src), as_device(dst)
        counts = [int(c) for c in counts]
        if len(set(counts)) == 1:
            s = self._begin()
            self.nccl.reduceScatter(a.data.ptr, d.data.ptr, counts[0], self._dtype(a.dtype), self._op(op), s)
            self._end()
            return dst
        # unequal blocks: reduce everything, keep my block
        cp = cupy()
        full = cp.empty_like(a)
        self.allreduce_op(a, full, op)
        start = sum(counts[:self.rank])
        d.reshape(-1)[...] = full.reshape(-1)[start:start + counts[self.rank]]
        cp.cuda.get_current_stream().synchronize()
        return dst

    def split(self, ranks):
        sub = self.mpi.split(ranks)
        if sub is None:
            return None
        return NCCLCommunicator(sub, device=self.device, sum16=self.sum16_mode)


def _shared_devices(mpi_comm, device):
    """Ranks that share a GPU with another rank (same host and PCI bus id); [] if none.
    Collective over ``mpi_comm``: every rank gets the same answer."""
    cp = cupy()
    try:
        bus = cp.cuda.Device(device).pci_bus_id
    except Exception:
        bus = f"device{device}"
    import socket
    me = f"{socket.gethostname()}|{bus}"
    everyone = mpi_comm.user_comm.allgather(me)
    seen, shared = {}, []
    for r, key in enumerate(everyone):
        if key in seen:
            shared.extend([seen[key], r])
        seen.setdefault(key, r)
    return sorted(set(shared))


def make_gpu_communicator(comm=None, device=None, sum16="exact", prefer="nccl"):
    """NCCL when it can run, else the host-staged MPI fallback (with a warning).

    The choice is collective: NCCL needs a loadable NCCL library and one GPU per rank, on
    every rank (agreed through MPI before NCCL starts, so no rank waits in NCCL alone).
    ``prefer="host-staged"`` forces the fallback (no warning).
    """
    mpi_comm = comm if isinstance(comm, MPICommunicator) else MPICommunicator(comm)
    if prefer == "host-staged":
        return HostStagedCommunicator(mpi_comm, device, warn=False)
    if prefer != "nccl":
        raise ValueError(f"prefer must be 'nccl' or 'host-staged', got {prefer!r}")
    cp = cupy()
    reason = None
    try:
        _nccl_module()
    except Exception as e:
        reason = f"{type(e).__name__}: {e}"
    dev = int(device) if device is not None else mpi_comm.local_rank % max(1, cp.cuda.runtime.getDeviceCount())
    reasons = mpi_comm.user_comm.allgather(reason)
    bad = [f"rank {r}: {x}" for r, x in enumerate(reasons) if x]
    if not bad:
        shared = _shared_devices(mpi_comm, dev)
        if shared:
            bad = [f"ranks {shared} share a GPU"]
    if bad:
        return HostStagedCommunicator(mpi_comm, dev, reason="; ".join(bad))
    return NCCLCommunicator(mpi_comm, dev, sum16=sum16)
