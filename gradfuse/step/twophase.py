"""The two-phase compressed allreduce (DeepSpeed's scheme): alltoall of worker chunks, a
server-side residual per chunk, allgather of the recompressed result.

It runs any block format of two payloads (code words, one float32 per block) whose blocks
restart at every tensor: 1-bit (32 elements per word) and scaled 2-bit (16 per word). A
compressor tells the job its format through ``block``, ``elems_per_word`` (32 when absent)
and ``block_compress`` / ``block_decompress_sum`` (1-bit's kernels when absent).
"""
import numpy as np

from .exchange import BucketJob, Wire
from ..compressors.onebit import BlockLayout


class CodeLayout(BlockLayout):
    """``BlockLayout`` for code words of ``per_word`` elements (32: 1-bit, 16: 2-bit): the
    blocks and elements are the same, ``word[b]`` and ``nwords`` count these words."""

    def __init__(self, counts, block, per_word=32):
        super().__init__(counts, block)
        self.per_word = per_word
        if per_word != 32:
            nb = -(-self.counts // block)
            nw = -(-self.counts // per_word)
            t = np.repeat(np.arange(len(self.counts)), nb)
            kb = np.arange(self.nblocks, dtype=np.int64) - (np.cumsum(nb) - nb)[t]
            self.word = np.append((np.cumsum(nw) - nw)[t] + kb * (block // per_word), nw.sum()).astype(np.int64)
            self.nwords = int(nw.sum())


def _per_word(comp):
    return getattr(comp, "elems_per_word", 32)


def _compress(comp, K, table, e_in, e_out, payloads):
    if hasattr(comp, "block_compress"):
        return comp.block_compress(K, table, e_in, e_out, payloads)
    ptrs, off, cnt, lo, hi = table
    return K.onebit_compress(ptrs, off, cnt, lo, hi, e_in, e_out, comp.block, payloads[0], payloads[1])


def _decompress_sum(comp, K, rows, table, divisor):
    if hasattr(comp, "block_decompress_sum"):
        return comp.block_decompress_sum(K, rows, table, divisor)
    ptrs, off, cnt, lo, hi = table
    K.onebit_decompress_sum(rows[0], rows[1], comp.block, ptrs, off, cnt, lo, hi, divisor)


class TwoPhaseJob(BucketJob):
    """Block-format (1-bit, scaled 2-bit) compressed allreduce in two phases (DeepSpeed's
    scheme, on any p).

    The bucket's blocks (per tensor: a tensor's last block may be short) are cut
    into p chunks of ``cb = ceil(nblocks / p)`` blocks, so chunk edges fall on block
    boundaries of the tensors, and so on word boundaries of the payload (the last chunks
    may be short or empty and are padded). 1) alltoall: rank r receives every rank's chunk
    r. 2) rank r decodes and sums them in rank order, divides (averaging), adds its server
    residual for chunk r and compresses again, with the chunk's parts of the tensors as
    the tensors (the same blocks, so the same payload layout). 3) allgather of the server
    payloads; every rank decodes the same bits, so every rank ends with identical results.
    """

    algorithm = "twophase"
    #: the most elements the server sums and compresses at once (``_server_pieces``): a
    #: 1 MiB float32 work array, the default fusion bucket's, instead of the largest chunk
    SERVER_PIECE = 1 << 18

    @classmethod
    def residual_sizes(cls, comp, n, comm, counts=None):
        if not comp.error_feedback:
            return 0, 0
        e0, e1 = twophase_chunk(counts if counts else (n,), comm.size, comp.block, comm.rank)
        return n, e1 - e0

    def geometry(self):
        """The bucket's block layout and chunk size (cached with the job's buffers)."""
        B, p, pw = self.comp.block, self.comm.size, _per_word(self.comp)
        lay = self.cache.get("twophase-layout")
        if (lay is None or lay.n != self.n or lay.block != B or lay.per_word != pw
                or tuple(lay.counts) != tuple(self.ctx.counts or (self.n,))):
            lay = self.cache["twophase-layout"] = CodeLayout(self.ctx.counts or (self.n,), B, pw)
        return B, p, lay, max(1, -(-lay.nblocks // p))

    def chunk(self, lay, r):
        """(elements e0, e1, words w0, w1, scales s0, s1) of chunk r."""
        b0, b1 = lay.chunk_blocks(self.comm.size, r)
        return int(lay.elem[b0]), int(lay.elem[b1]), int(lay.word[b0]), int(lay.word[b1]), b0, b1

    def compress(self):
        B, p, lay, cb = self.geometry()
        n = self.n
        wire = Wire([(np.dtype(np.uint32), cb * B // lay.per_word), (np.dtype(np.float32), cb)])
        key = ("twophase", wire.nbytes, p, n)
        bufs = self.cache.get(key)
        bk = self.bk
        if bufs is None:
            # this bucket's own: the worker chunks (compress to exchange) and the server
            # payloads (exchange to decode, after the step's verdict); the rest is shared
            mk = lambda: bk.empty_bytes(wire.nbytes * p).reshape(p, wire.nbytes)   # noqa: E731
            bufs = (mk(), mk())
            self.cache.clear()
            self.cache["twophase-layout"] = lay
            self.cache[key] = bufs
        send = bufs[0]
        bits, scales = self.payload(lay)
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

    def payload(self, lay):
        """The bucket's whole 1-bit/2-bit payload (words, scales): work arrays shared by the
        plan's buckets, used by ``compress`` and ``decode`` only (the communication thread's
        stages), each filling and reading them within the stage."""
        return self.shared("twophase-bits", lay.nwords, np.uint32), self.shared("twophase-scales", lay.nblocks,
                                                                                 np.float32)

    def _server_pieces(self, lay, b0, b1):
        """The server's chunk (blocks b0..b1-1) in pieces of whole blocks of at most
        ``SERVER_PIECE`` elements each (one block when a block is longer), summed and
        compressed one after the other in one shared float32 work array (``scratch_f32``):
        per piece, a table of the chunk's parts of the tensors over that array, and the
        piece's word, scale and element ranges counted from the chunk's start. Blocks are
        independent (a scale per block, restarting at every tensor), so the pieces give the
        whole chunk's bits. Kept with the job's buffers while the array stays where it is
        (resident on a GPU)."""
        elem = lay.elem[b0:b1 + 1]
        e0, limit = int(elem[0]), self.SERVER_PIECE
        cuts = [0]
        while cuts[-1] < b1 - b0:      # the most whole blocks from the last cut within limit
            nxt = int(np.searchsorted(elem, int(elem[cuts[-1]]) + limit, side="right")) - 1
            cuts.append(max(nxt, cuts[-1] + 1))
        acc = self.scratch_f32(max(int(elem[b] - elem[a]) for a, b in zip(cuts[:-1], cuts[1:])))
        base = acc.ctypes.data if isinstance(acc, np.ndarray) else acc.data.ptr
        key = (base, b0, b1, limit)
        got = self.cache.get("twophase-server")
        if got is not None and got[0] == key:
            return got[1]
        bk, pieces = self.bk, []
        for a, b in zip(cuts[:-1], cuts[1:]):
            ea, eb = int(elem[a]), int(elem[b])
            cnt = np.array(lay.pieces(ea, eb), np.int64)
            off = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.int64) if cnt.size else cnt
            table = (bk.pointers((base + 4 * off).astype(np.int64)), bk.pointers(off), bk.pointers(cnt), 0, cnt.size)
            pieces.append((table, int(lay.word[b0 + a] - lay.word[b0]), int(lay.word[b0 + b] - lay.word[b0]), a, b,
                           ea - e0, eb - e0))
        self.cache["twophase-server"] = (key, pieces)
        return pieces

    def exchange(self):
        B, p, lay, cb = self.geometry()
        wire, bk, K = self.wire, self.bk, self.bk.kernels
        send, srecv = self.bufs
        # the exchange stage's own work arrays, shared by the plan's buckets
        recv = self.shared("twophase-recv", p * wire.nbytes, np.uint8).reshape(p, wire.nbytes)
        ssend = self.shared("twophase-ssend", wire.nbytes, np.uint8)
        self.comm.alltoall(send, recv)
        # server side: my chunk from every rank, decoded, summed, compressed again (in pieces)
        me = self.comm.rank
        e0, e1, w0, w1, s0, s1 = self.chunk(lay, me)
        rows = wire.rows(recv)
        ssend[:] = 0
        sb, ss = wire.views(ssend)
        server_bad = 0
        if e1 > e0:
            res_in, res_out = self.state.server_cur, self.state.server_nxt
            for table, wa, wb, sa, sz, ra, rz in self._server_pieces(lay, s0, s1):
                _decompress_sum(self.comp, K, [rows[0][:, wa:wb], rows[1][:, sa:sz]], table, self.divisor)
                server_bad += _compress(self.comp, K, table, res_in[ra:rz], res_out[ra:rz], [sb[wa:wb], ss[sa:sz]])
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
        srecv = self.bufs[1]
        bits, scales = self.payload(lay)
        for r in range(p):
            e0, e1, w0, w1, s0, s1 = self.chunk(lay, r)
            if e1 == e0:
                continue
            sb, ss = wire.views(srecv[r])
            bits[w0:w1] = sb[:w1 - w0]
            scales[s0:s1] = ss[:s1 - s0]
        dst, off, cnt, lo, hi = self.dst
        _decompress_sum(self.comp, self.bk.kernels, [bits.reshape(1, -1), scales.reshape(1, -1)],
                        (dst, off, cnt, lo, hi), 1.0)
        self.commit()


def twophase_chunk(counts, p, block, r):
    """Element range [e0, e1) of chunk r of a bucket whose tensors have these element
    counts (see TwoPhaseJob: chunks of whole per-tensor blocks)."""
    lay = BlockLayout(counts, block)
    b0, b1 = lay.chunk_blocks(p, r)
    return int(lay.elem[b0]), int(lay.elem[b1])
