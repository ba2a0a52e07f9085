"""MPI communicator over mpi4py.

Data and control traffic each get their own duplicate of the user's communicator,
so gradfuse's messages never match a user's own sends or collectives. Sums use the
MPI library's own ``MPI_Allreduce``; float16, which MPI has no type for, travels as
16-bit words and is summed by a user-defined op backed by a Cython kernel (one
Python call per chunk the library reduces, each pairwise add in float32, rounded
once to float16).
"""
import numpy as np

from .. import _core, config
from .. import dtypes as _dt
from . import cma as _cma
from .base import Communicator

_MPI = None


def mpi():
    """Import mpi4py lazily, so that ``import gradfuse`` works without it."""
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError(f"gradfuse: the MPI communicator needs mpi4py ({exc}); install it with "
                              f"pip install 'gradfuse[mpi]' (keeps your cluster's MPI, which mpi4py builds "
                              f"against) or 'gradfuse[mpich]' (an MPI from PyPI too). gradfuse.torch needs "
                              f"no MPI: its hook runs on torch.distributed") from exc
        _MPI = MPI
    return _MPI


_SUM16 = {}
#: the smallest 16-bit buffer (words) that allreduce16 sums as a ring from 3 ranks on
RING16_MIN = 1 << 13
#: the smallest float32/float64 array (elements) that ``allreduce`` (out of place) sums on 2
#: ranks by two exchanges straight into the output, instead of MPI's out-of-place call
#: (which first copies the input into the output: one more pass over the memory)
OOP2_MIN = 1 << 16


_OOP2_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _sum16_op(fmt):
    """The MPI op that sums fp16 (fmt 1) or bf16 (fmt 2) words: float32 add, rounded once."""
    if fmt not in _SUM16:
        MPI = mpi()

        def _sum(inbuf, inoutbuf, datatype):
            _core.sum16(fmt, inbuf, inoutbuf)

        _SUM16[fmt] = MPI.Op.Create(_sum, commute=True)
    return _SUM16[fmt]


def _f16_sum_op():
    return _sum16_op(1)


_F16_OPS = {}
_KNOWN = tuple(np.dtype(d) for d in (np.float16, np.float32, np.float64, np.int32, np.int64))


def _bytes(arr):
    """A flat byte view of a contiguous array (the payload collectives move raw bytes)."""
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _f16_op(op):
    """min/max/prod for float16 words, computed in float32 (prod rounded once)."""
    if op not in _F16_OPS:
        MPI = mpi()
        fn = {"min": np.minimum, "max": np.maximum, "prod": np.multiply}[op]

        def _apply(inbuf, inoutbuf, datatype):
            a = np.frombuffer(inbuf, dtype=np.float16)
            b = np.frombuffer(inoutbuf, dtype=np.float16)
            b[...] = fn(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)

        _F16_OPS[op] = MPI.Op.Create(_apply, commute=True)
    return _F16_OPS[op]


def _type_and_op(dtype):
    MPI = mpi()
    if dtype == np.float32:
        return MPI.FLOAT, MPI.SUM
    if dtype == np.float64:
        return MPI.DOUBLE, MPI.SUM
    if dtype == np.float16:
        return MPI.UINT16_T, _f16_sum_op()
    if dtype == np.int32:
        return MPI.INT32_T, MPI.SUM
    if dtype == np.int64:
        return MPI.INT64_T, MPI.SUM
    raise TypeError(f"MPI communicator cannot reduce dtype {dtype}")


class _Gather:
    """A non-blocking allgather of variable-length bytes in two steps (sizes, then data)."""

    def __init__(self, comm, data):
        MPI = mpi()
        self.comm = comm
        self.data = np.frombuffer(bytes(data), dtype=np.uint8)
        self.sizes = np.zeros(comm.size, dtype=np.int64)
        self.mine = np.array([self.data.size], dtype=np.int64)
        self.req = comm.Iallgather([self.mine, MPI.INT64_T], [self.sizes, MPI.INT64_T])
        self.stage = 0
        self.out = None

    def test(self):
        MPI = mpi()
        if not self.req.Test():
            return False
        if self.stage == 0:
            self.stage = 1
            self.displs = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
            self.out = np.empty(int(self.sizes.sum()), dtype=np.uint8)
            self.req = self.comm.Iallgatherv(
                [self.data, MPI.BYTE],
                [self.out, (self.sizes.tolist(), self.displs.tolist()), MPI.BYTE])
            return self.test()
        return True

    def result(self):
        return [self.out[d:d + s].tobytes() for d, s in zip(self.displs, self.sizes)]


class MPICommunicator(Communicator):
    """Communicator over an mpi4py communicator (``MPI.COMM_WORLD`` by default).

    Args:
        comm: any mpi4py intracommunicator. It is duplicated twice (data, control).
        cma: sum between the ranks of one host through their memory (``gradfuse.comm.cma``):
            None (default) reads ``GRADFUSE_CMA`` (unset: yes, where it works), False
            never. All ranks must pass the same.

    ``local_rank``/``local_size`` come from splitting by shared memory (same host);
    ``cross_rank``/``cross_size`` from splitting by local rank, as Horovod defines them.

    When all its ranks are on one host, sums of at least ``rows_min_bytes`` go through
    the ranks' own memory instead of the MPI library (``gradfuse.comm.cma``; the same
    bits on 2 ranks); ``cma_status`` says whether that is on, and if not, why.
    """

    kind = "mpi"

    def __init__(self, comm=None, cma=None):
        MPI = mpi()
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"MPICommunicator needs an mpi4py Intracomm, got {type(comm).__name__}")
        self.user_comm = comm
        self.data = comm.Dup()
        self.ctl = comm.Dup()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        cross = comm.Split(color=self.local_rank, key=self.rank)
        self.cross_rank, self.cross_size = cross.Get_rank(), cross.Get_size()
        local.Free()
        cross.Free()
        self._in_place = MPI.IN_PLACE
        self.cma, self._cma_arg = None, cma
        if self.size == 1:
            self.cma_status = "off: one rank"
        elif self.local_size != self.size:
            self.cma_status = "off: the ranks are not all on one host"
        else:
            want = np.array([int(config.cma() if cma is None else bool(cma))], np.int32)     # agreed
            self.data.Allreduce(MPI.IN_PLACE, [want, MPI.INT32_T], op=MPI.MIN)
            if not want[0]:
                self.cma_status = "off: GRADFUSE_CMA=0" if cma is None else "off: cma=False"
            else:
                self.cma, self.cma_status = _cma.CMAReducer.probe(self.data)

    # --- intra-host sums (gradfuse.comm.cma) ----------------------------------------
    @property
    def reduces_rows(self):
        return self.cma is not None

    rows_min_bytes = _cma.MIN_BYTES

    def allreduce_rows(self, groups, divisor=None):
        if self.cma is None:
            raise NotImplementedError(f"allreduce_rows: {self.cma_status}")
        self.cma.allreduce(groups, divisor)

    def _cma_one(self, src, dst, code=None):
        """Sum one contiguous array through the peers' memory, or return False."""
        code = _dt.CODE.get(src.dtype) if code is None else code
        if (self.cma is None or code is None or src.nbytes < _cma.MIN_BYTES or dst.dtype != src.dtype
                or dst.size != src.size or not (src.flags.c_contiguous and dst.flags.c_contiguous)):
            return False
        count = np.array([src.size], np.int64)
        self.cma.allreduce([(code, np.array([src.ctypes.data], np.int64), np.array([dst.ctypes.data], np.int64),
                             count)])
        return True

    # --- data plane ----------------------------------------------------------------
    def allreduce_inplace(self, arr):
        if self._cma_one(arr, arr):
            return arr
        if arr.dtype == np.float16:
            return self._sum16_inplace(arr, _f16_sum_op())
        mtype, op = _type_and_op(arr.dtype)
        self.data.Allreduce(self._in_place, [arr, mtype], op=op)
        return arr

    def allreduce(self, src, dst):
        if self._cma_one(src, dst):
            return dst
        if src.dtype == np.float16 and src.flags.c_contiguous and dst.flags.c_contiguous:
            np.copyto(dst, src)
            return self._sum16_inplace(dst, _f16_sum_op())
        if (self.size == 2 and src.dtype in _OOP2_DTYPES and src.size >= OOP2_MIN
                and src.flags.c_contiguous and dst.flags.c_contiguous and dst.dtype == src.dtype):
            return self._allreduce2(src, dst)
        mtype, op = _type_and_op(src.dtype)
        self.data.Allreduce([src, mtype], [dst, mtype], op=op)
        return dst

    def _allreduce2(self, src, dst):
        """``dst = src + the peer's src`` on 2 ranks, with no copy of ``src`` into ``dst``
        first: rank r owns half r; it sends the other half of ``src`` and receives the
        peer's half r straight into ``dst``, adds its own half there, then the two ranks
        swap their summed halves. Every element is one IEEE add of the same two values, so
        both ranks get the bits of ``MPI_Allreduce`` (a + b == b + a). The measured gain
        over MPI's out-of-place call is in docs/benchmarks.md."""
        x, y = src.reshape(-1), dst.reshape(-1)
        half = (x.size + 1) // 2
        me, peer = self.rank, 1 - self.rank
        cut = [slice(0, half), slice(half, x.size)]
        mine, theirs = cut[me], cut[peer]
        self.data.Sendrecv(x[theirs], dest=peer, sendtag=11, recvbuf=y[mine], source=peer, recvtag=11)
        np.add(y[mine], x[mine], out=y[mine])
        self.data.Sendrecv(y[mine], dest=peer, sendtag=12, recvbuf=y[theirs], source=peer, recvtag=12)
        return dst

    def allreduce16(self, buf, fmt, native=False):
        if self._cma_one(buf, buf, 1 if fmt == 1 else _cma.BF16):
            return buf
        return self._sum16_inplace(buf, _sum16_op(fmt))

    def _sum16_inplace(self, buf, op):
        """A 16-bit sum (user-defined ``op``) in place. MPICH sums a user-defined op by
        recursive doubling, which sends log2(p) x the buffer per rank (measured on the
        emulated links: 153.7 MB for ResNet-50's fp16 gradients at p = 8, against the ring's
        89.5). From 3 ranks on, a buffer of at least ``RING16_MIN`` words is summed as a ring
        is: a reduce-scatter in place, then an allgather, 2(p-1)/p x the buffer; each chunk
        is summed by one rank and then copied, so every rank still holds the same bits."""
        MPI = mpi()
        p, n = self.size, buf.size
        flat = buf.reshape(-1).view(np.uint16)
        if p < 3 or n < RING16_MIN:
            self.data.Allreduce(self._in_place, [flat, MPI.UINT16_T], op=op)
            return buf
        counts = [n // p + (1 if r < n % p else 0) for r in range(p)]
        displs = [0] * p
        for r in range(1, p):
            displs[r] = displs[r - 1] + counts[r - 1]
        self.data.Reduce_scatter(MPI.IN_PLACE, [flat, MPI.UINT16_T], counts, op=op)
        me = self.rank
        if displs[me]:              # in place, rank r's reduced chunk lands at the buffer's start
            flat[displs[me]:displs[me] + counts[me]] = flat[:counts[me]].copy()
        self.data.Allgatherv(MPI.IN_PLACE, [flat, (counts, displs), MPI.UINT16_T])
        return buf

    def allreduce_op(self, src, dst, op):
        MPI = mpi()
        mtype, sum_op = _type_and_op(src.dtype)
        if op == "sum":
            mop = sum_op
        elif src.dtype == np.float16:
            mop = _f16_op(op)
        else:
            mop = {"min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}[op]
        send = self._in_place if src is dst else [src, mtype]
        self.data.Allreduce(send, [dst, mtype], op=mop)
        return dst

    def bcast(self, arr, root):
        mtype, _ = _type_and_op(arr.dtype) if arr.dtype in _KNOWN else (mpi().BYTE, None)
        buf = arr if mtype is not mpi().BYTE else arr.reshape(-1).view(np.uint8)
        self.data.Bcast([buf, mtype], root=root)
        return arr

    def allgather(self, src, dst):
        self.data.Allgather([_bytes(src), mpi().BYTE], [_bytes(dst), mpi().BYTE])
        return dst

    def allgatherv(self, src, dst, counts):
        item = dst.dtype.itemsize
        sizes = [int(c) * item for c in counts]
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
        self.data.Allgatherv([_bytes(src), mpi().BYTE], [_bytes(dst), (sizes, displs), mpi().BYTE])
        return dst

    def alltoall(self, src, dst):
        self.data.Alltoall([_bytes(src), mpi().BYTE], [_bytes(dst), mpi().BYTE])
        return dst

    def alltoallv(self, src, send_counts, dst, recv_counts):
        item = src.dtype.itemsize
        ss = [int(c) * item for c in send_counts]
        rs = [int(c) * item for c in recv_counts]
        sd = np.concatenate([[0], np.cumsum(ss)[:-1]]).astype(np.int64).tolist()
        rd = np.concatenate([[0], np.cumsum(rs)[:-1]]).astype(np.int64).tolist()
        self.data.Alltoallv([_bytes(src), (ss, sd), mpi().BYTE], [_bytes(dst), (rs, rd), mpi().BYTE])
        return dst

    def reduce_scatter(self, src, dst, counts, op="sum"):
        MPI = mpi()
        mtype, sum_op = _type_and_op(src.dtype)
        mop = sum_op if op == "sum" else (_f16_op(op) if src.dtype == np.float16 else
                                          {"min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}[op])
        self.data.Reduce_scatter([src, mtype], [dst, mtype], recvcounts=[int(c) for c in counts], op=mop)
        return dst

    def split(self, ranks):
        ranks = sorted(int(r) for r in ranks)
        color = 0 if self.rank in ranks else mpi().UNDEFINED
        sub = self.user_comm.Split(color=color, key=self.rank)
        if sub == mpi().COMM_NULL:
            return None
        return MPICommunicator(sub, cma=self._cma_arg)

    # --- control plane -------------------------------------------------------------
    def ctl_isend(self, data, dest):
        return self.ctl.Isend([data, mpi().BYTE], dest=dest, tag=7)

    def ctl_irecv(self, buf, source):
        return self.ctl.Irecv([buf, mpi().BYTE], source=source, tag=7)

    def ctl_ibcast(self, buf, root):
        return self.ctl.Ibcast([buf, mpi().BYTE], root=root)

    def ctl_iallgather_bytes(self, data):
        return _Gather(self.ctl, data)

    @staticmethod
    def test(request):
        if isinstance(request, _Gather):
            return request.test()
        return request.Test()

    def abort(self, code=1):
        self.user_comm.Abort(code)
