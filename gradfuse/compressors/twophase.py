"""The two-phase compressed allreduce (DeepSpeed's scheme): alltoall of worker chunks, a
server-side residual per chunk, allgather of the recompressed result."""
import numpy as np

from .exchange import BucketJob, Wire
from .onebit import BlockLayout


class TwoPhaseJob(BucketJob):
    """1-bit compressed allreduce in two phases (DeepSpeed's scheme, on any p).

    The bucket's 1-bit blocks (per tensor: a tensor's last block may be short) are cut
    into p chunks of ``cb = ceil(nblocks / p)`` blocks, so chunk edges fall on block
    boundaries of the tensors, and so on word boundaries of the payload (the last chunks
    may be short or empty and are padded). 1) alltoall: rank r receives every rank's chunk
    r. 2) rank r decodes and sums them in rank order, divides (averaging), adds its server
    residual for chunk r and compresses again, with the chunk's parts of the tensors as
    the tensors (the same blocks, so the same payload layout). 3) allgather of the server
    payloads; every rank decodes the same bits, so every rank ends with identical results.
    """

    algorithm = "twophase"

    @classmethod
    def residual_sizes(cls, comp, n, comm, counts=None):
        if not comp.error_feedback:
            return 0, 0
        e0, e1 = twophase_chunk(counts if counts else (n,), comm.size, comp.block, comm.rank)
        return n, e1 - e0

    def geometry(self):
        """The bucket's block layout and chunk size (cached with the job's buffers)."""
        B, p = self.comp.block, self.comm.size
        lay = self.cache.get("twophase-layout")
        if lay is None or lay.n != self.n or tuple(lay.counts) != tuple(self.ctx.counts or (self.n,)):
            lay = self.cache["twophase-layout"] = BlockLayout(self.ctx.counts or (self.n,), B)
        return B, p, lay, max(1, -(-lay.nblocks // p))

    def chunk(self, lay, r):
        """(elements e0, e1, words w0, w1, scales s0, s1) of chunk r."""
        b0, b1 = lay.chunk_blocks(self.comm.size, r)
        return int(lay.elem[b0]), int(lay.elem[b1]), int(lay.word[b0]), int(lay.word[b1]), b0, b1

    def compress(self):
        B, p, lay, cb = self.geometry()
        n = self.n
        wire = Wire([(np.dtype(np.uint32), cb * B // 32), (np.dtype(np.float32), cb)])
        key = ("twophase", wire.nbytes, p, n)
        bufs = self.cache.get(key)
        bk = self.bk
        if bufs is None:
            mk = lambda: bk.empty_bytes(wire.nbytes * p).reshape(p, wire.nbytes)   # noqa: E731
            e0, e1 = self.chunk(lay, self.comm.rank)[:2]
            bufs = (mk(), mk(), bk.empty_bytes(wire.nbytes), mk(),
                    bk.empty(lay.nwords, np.uint32), bk.empty(lay.nblocks, np.float32), e1 - e0)
            self.cache.clear()
            self.cache["twophase-layout"] = lay
            self.cache[key] = bufs
        send, recv, ssend, srecv, bits, scales, _ = bufs
        send[:] = 0
        bad = self.compress_into([bits, scales])
        # worker payload, cut into chunks
        for r in range(p):
            e0, e1, w0, w1, s0, s1 = self.chunk(lay, r)
            Wire.header(send[r])[0] = bad
            if e1 == e0:
                continue        # an empty chunk (fewer blocks than ranks): only the header travels
            w_bits, w_scales = wire.views(send[r])
            w_bits[:w1 - w0] = bits[w0:w1]
            w_scales[:s1 - s0] = scales[s0:s1]
        self.wire, self.bufs = wire, bufs

    def _server_table(self, acc, lay, e0, e1):
        """The chunk's parts of the tensors, as a table over ``acc`` (the server's values, in
        the plan's shared scratch); made once per plan and scratch address and kept with the
        job's buffers (resident on a GPU)."""
        base = acc.ctypes.data if isinstance(acc, np.ndarray) else acc.data.ptr
        tab = self.cache.get("twophase-server")
        if tab is None or tab[-1] != base:
            cnt = np.array(lay.pieces(e0, e1), np.int64)
            off = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.int64) if cnt.size else cnt
            bk = self.bk
            tab = self.cache["twophase-server"] = (bk.pointers((base + 4 * off).astype(np.int64)),
                                                   bk.pointers(off), bk.pointers(cnt), 0, cnt.size, base)
        return tab[:5]

    def exchange(self):
        B, p, lay, cb = self.geometry()
        wire, bk, K = self.wire, self.bk, self.bk.kernels
        send, recv, ssend, srecv, bits, scales, n_acc = self.bufs
        acc = self.scratch_f32(n_acc)        # the server's sum: needed only in this stage, shared
        self.comm.alltoall(send, recv)
        # server side: my chunk from every rank, decoded, summed, compressed again
        me = self.comm.rank
        e0, e1, w0, w1, s0, s1 = self.chunk(lay, me)
        rows = wire.rows(recv)
        ssend[:] = 0
        sb, ss = wire.views(ssend)
        server_bad = 0
        if e1 > e0:
            ptrs, off, cnt, lo, hi = self._server_table(acc, lay, e0, e1)
            K.onebit_decompress_sum(rows[0][:, :w1 - w0], rows[1][:, :s1 - s0], B, ptrs, off, cnt, lo, hi,
                                    self.divisor)
            server_bad = K.onebit_compress(ptrs, off, cnt, lo, hi, self.state.server_cur, self.state.server_nxt,
                                           B, sb[:w1 - w0], ss[:s1 - s0])
        worker_flags = bk.host(Wire.header(recv)[:, 0])
        Wire.header(ssend)[0] = int(worker_flags.any()) * (1 << 32) + int(server_bad)
        self.comm.allgather(ssend, srecv)
        self.stats.bytes_sent += 2 * wire.nbytes * (p - 1)
        # every rank learns, from the server headers, which ranks had non-finite values
        flags = bk.host(Wire.header(srecv)[:, 0])
        if flags.any():
            self.nonfinite_ranks = ["?"]
            self.nonfinite_detail = "a rank's gradients or a server average were non-finite"

    def decode(self):
        B, p, lay, cb = self.geometry()
        wire = self.wire
        _, _, _, srecv, bits, scales, _ = self.bufs
        for r in range(p):
            e0, e1, w0, w1, s0, s1 = self.chunk(lay, r)
            if e1 == e0:
                continue
            sb, ss = wire.views(srecv[r])
            bits[w0:w1] = sb[:w1 - w0]
            scales[s0:s1] = ss[:s1 - s0]
        dst, off, cnt, lo, hi = self.dst
        self.bk.kernels.onebit_decompress_sum(bits.reshape(1, -1), scales.reshape(1, -1), B, dst, off, cnt, lo, hi, 1.0)
        self.commit()


def twophase_chunk(counts, p, block, r):
    """Element range [e0, e1) of chunk r of a bucket whose tensors have these element
    counts (see TwoPhaseJob: chunks of whole per-tensor blocks)."""
    lay = BlockLayout(counts, block)
    b0, b1 = lay.chunk_blocks(p, r)
    return int(lay.elem[b0]), int(lay.elem[b1])
