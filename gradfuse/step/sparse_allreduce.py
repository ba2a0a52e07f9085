"""random-k as an allreduce: every rank draws the same k positions, so only the k values
are summed, by a reduce-scatter (alltoall) and an allgather of k float32 values.

Why not the MPI library's own allreduce: its summation order depends on the algorithm it
picks (message size, p), so its bits could differ from the allgather's and are not
specified. Here rank r sums chunk r of every rank's values in rank order,
``((v_0 + v_1) + v_2) + ...`` in float32, as the allgather's decode does, so the result is
the allgather's bit for bit, and identical on every rank by construction; the bytes are
a ring allreduce's, 2(p-1)/p x 4k per rank (plus a header per chunk), against (p-1) x 4k
for the allgather, and every rank decodes one payload instead of p.
"""
import numpy as np

from .exchange import BucketJob, Wire


MASK_RANKS = 62       # up to this many ranks, a server's header names the ranks with non-finite values


def rank_mask(flags):
    """A server's header: bit r set if rank r reported non-finite values (p <= MASK_RANKS),
    else 1 if any did."""
    if len(flags) > MASK_RANKS:
        return int(bool(flags.any()))
    return sum(1 << r for r, f in enumerate(flags.tolist()) if f)


class SparseAllreduceJob(BucketJob):
    """random-k's K = sum of k_i values, summed across ranks without their indices.

    The K values (the compressor's payload, tensor after tensor) are cut into p chunks of
    ``cb = ceil(K / p)`` (the last may be short or empty, padded with zeros). Wire row: an
    int64 header, then ``cb`` float32 values. 1) alltoall: rank r receives every rank's
    chunk r, with its non-finite count (the whole bucket's, not only the drawn
    positions'). 2) rank r adds them in rank order; its header marks the ranks whose count
    was non-zero (``rank_mask``), so every rank can name them. 3) allgather of the summed chunks; every rank decodes the one summed payload
    at the shared positions (cleared destinations, scatter, divide).
    """

    algorithm = "sparse_allreduce"

    def wire_layout(self):
        """The bytes of one wire row (p rows go out, one to each rank): an int64 header and
        ``cb = ceil(K / p)`` float32 values."""
        (dtype, k), = self.comp.bucket_layout(self.ctx)
        return Wire([(np.dtype(np.float32), max(1, -(-k // self.comm.size)))])

    def compress(self):
        p, bk = self.comm.size, self.bk
        (dtype, k), = self.comp.bucket_layout(self.ctx)
        cb = max(1, -(-k // p))
        wire = Wire([(np.dtype(np.float32), cb)])
        key = ("sparse_allreduce", wire.nbytes, p, k, self.group_bufs is not None)
        bufs = self.cache.get(key)
        if bufs is None:
            mk = lambda: bk.empty_bytes(wire.nbytes * p).reshape(p, wire.nbytes)   # noqa: E731
            if self.group_bufs is not None:   # the wire rows live in the exchange group's buffers
                bufs = (None, None, None, None, bk.zeros(p * cb, np.float32))
            else:
                bufs = (mk(), mk(), bk.empty_bytes(wire.nbytes), mk(), bk.zeros(p * cb, np.float32))
                bufs[0][:] = 0
            self.cache.clear()
            self.cache[key] = bufs
        if self.group_bufs is not None:
            bufs = tuple(self.group_bufs) + (bufs[4],)
        send, recv, ssend, srecv, values = bufs
        bad = self.compress_into([values[:k]])
        rows = wire.rows(send)[0]
        rows[...] = values.reshape(p, cb)          # the tail past k stays 0
        Wire.header(send)[:, 0] = bad
        self.wire, self.bufs, self.k, self.cb = wire, bufs, k, cb

    def exchange(self):
        send, recv, ssend, srecv, values = self.bufs
        self.comm.alltoall(send, recv)
        self.serve()
        self.comm.allgather(ssend, srecv)
        self.received()

    def serve(self):
        """Between the alltoall and the allgather: this rank's chunk of every rank, summed
        in rank order, and the header naming the ranks that reported non-finite values."""
        p, wire, bk = self.comm.size, self.wire, self.bk
        send, recv, ssend, srecv, values = self.bufs
        rows = wire.rows(recv)[0]
        (acc,) = wire.views(ssend)
        acc[...] = rows[0]
        for r in range(1, p):                      # rank order: the allgather's sum, bit for bit
            bk.xp.add(acc, rows[r], out=acc)
        worker_flags = bk.host(Wire.header(recv)[:, 0])
        Wire.header(ssend)[0] = rank_mask(worker_flags)

    def received(self):
        """After the allgather of the summed chunks: the bytes sent, and the ranks that
        reported non-finite values (the servers' masks)."""
        p, wire, bk = self.comm.size, self.wire, self.bk
        send, recv, ssend, srecv, values = self.bufs
        self.stats.bytes_sent += 2 * wire.nbytes * (p - 1)
        mask = 0
        for m in bk.host(Wire.header(srecv)[:, 0]).tolist():
            mask |= int(m)
        if mask:
            self.nonfinite_ranks = [r for r in range(p) if mask >> r & 1] if p <= MASK_RANKS else ["?"]

    def decode(self):
        p, k, cb = self.comm.size, self.k, self.cb
        send, recv, ssend, srecv, values = self.bufs
        values.reshape(p, cb)[...] = self.wire.rows(srecv)[0]
        self.write_sum([values[:k].reshape(1, k)], self.divisor)
        self.commit()
