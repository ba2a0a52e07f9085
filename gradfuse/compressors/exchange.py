"""Compressed collectives for one fusion bucket: the exchange jobs.

A job is made from one ``BucketTask`` (everything the bucket's exchange needs) and runs
in three stages, so that the non-finite policy can hold for the whole step:
``compress()`` runs the fused kernel (reading the tensors through the plan's pointer
table, adding the residual, writing the new one into the spare buffer),
``exchange()`` moves the payloads (its collective) and learns which ranks saw
non-finite values, and ``decode()`` writes the results into the outputs and commits the
new residuals. The step runs ``compress`` and ``exchange`` on every compressed bucket,
then checks ``nonfinite_ranks`` (identical on every rank, because it travels with the
payloads), and only then runs ``decode``. So a step with NaN/Inf anywhere raises on
every rank before any result is written, and no residual changes.

Each job class states its own buffer needs (``residual_sizes``: the worker residual and,
for two-phase, the server's share), so the step needs no special case per algorithm.

Wire format of one rank's allgather payload: an int64 header (the number of non-finite
values this rank saw) followed by the compressor's payload arrays, each starting on an
8-byte boundary.
"""
import numpy as np

from . import momentum as _momentum
from .error_feedback import EMPTY, compress_with_feedback


def ring_bytes(nbytes, p):
    """What a bandwidth-optimal allreduce of ``nbytes`` sends per rank: 2(p-1)/p of it."""
    return 2 * nbytes * (p - 1) // max(p, 1)


def _align8(n):
    return (n + 7) & ~7


class Wire:
    """Byte layout of one payload (header + arrays), with views into a buffer row."""

    def __init__(self, layout):
        self.layout = layout
        self.offsets = []
        off = 8
        for dtype, count in layout:
            self.offsets.append(off)
            off = _align8(off + dtype.itemsize * count)
        self.nbytes = off

    def views(self, row):
        """Payload arrays inside ``row`` (a 1-D uint8 buffer of ``nbytes``)."""
        return [row[o:o + d.itemsize * c].view(d) for o, (d, c) in zip(self.offsets, self.layout)]

    def rows(self, table):
        """Per payload, a ``[p, count]`` view of a ``[p, nbytes]`` uint8 table."""
        return [table[:, o:o + d.itemsize * c].view(d) for o, (d, c) in zip(self.offsets, self.layout)]

    @staticmethod
    def header(row_or_table):
        return row_or_table[..., :8].view(np.int64)


class BucketTask:
    """Everything one compressed bucket's exchange needs, handed to its job as one object.

    Args (keyword only):
        comm: the data-plane communicator.
        compressor: the pipeline's compressor.
        bucket: the fusion bucket (``gradfuse.fusion.plan.Bucket``).
        src, dst: ``(pointers, element offsets, counts, lo, hi)``: the bucket's tensors,
            read from and written to.
        residual: the bucket's ``BucketState`` (worker and server residuals).
        ctx: the ``BucketContext`` (bucket index, step, device).
        divisor: what the sum is divided by (the world size when averaging, else 1).
        cache: a dict the job keeps its buffers in, across steps of the same plan.
        stats: the pipeline's counters (``bytes_sent``, cast overflow counts).
        backend: where the buffers live and which kernels run (host or a GPU).
        scratch: a dict shared by the plan's buckets, for work arrays that one job's stage
            needs only while it runs (``BucketJob.scratch_f32``).
    """

    __slots__ = ("comm", "compressor", "bucket", "src", "dst", "residual", "ctx", "divisor", "cache",
                 "stats", "backend", "scratch")

    def __init__(self, *, comm, compressor, bucket, src, dst, residual, ctx, divisor, cache, stats, backend,
                 scratch=None):
        self.comm, self.compressor, self.bucket = comm, compressor, bucket
        self.src, self.dst, self.residual, self.ctx = src, dst, residual, ctx
        self.divisor, self.cache, self.stats, self.backend = divisor, cache, stats, backend
        self.scratch = {} if scratch is None else scratch


class BucketJob:
    """What every exchange job shares: the task's parts, residuals, reference paths."""

    algorithm = "abstract"

    @classmethod
    def residual_sizes(cls, comp, n, comm, counts=None):
        """(worker residual, server residual) elements this job keeps for a bucket of n
        (``counts``: its tensors' element counts, for layouts that depend on them)."""
        return (n if comp.error_feedback else 0), 0

    def __init__(self, task):
        self.comm, self.comp, self.bucket, self.bk = task.comm, task.compressor, task.bucket, task.backend
        self.src, self.dst = task.src, task.dst
        self.state, self.ctx, self.divisor = task.residual, task.ctx, task.divisor
        self.cache, self.stats, self.scratch = task.cache, task.stats, task.scratch
        self.n = task.bucket.count
        self.nonfinite_ranks = []     # ranks that reported non-finite values (same everywhere)
        self.nonfinite_detail = ""
        self.velocity = None          # (x, u) once apply_velocity ran: what the compressor read, u
        self.stream = False           # decoded right after its exchange, in shared buffers (the step cannot fail)
        self.slot = 0                 # streamed and pipelined (runtime.overlap): which of two shared buffers
        self.split = False            # 2-rank pipelined 16-bit sum: the transfer alone in exchange()

    def apply_velocity(self, velocity):
        """DGC's momentum correction (``gradfuse.compressors.momentum``): update this rank's
        velocity from the bucket's gradients, and make the compressor read the velocity (or
        the Nesterov values) instead of them. ``velocity``: ``(m, nesterov)``."""
        if self.state.vel_cur.size:
            self.src, x = _momentum.feed(self.bk, self.state, self.src, velocity)
            self.velocity = (x, self.state.vel_nxt)

    def scratch_f32(self, n):
        """A float32 work array of ``n`` elements shared by the plan's buckets: valid until
        the next job asks for one (the buckets' stages run one at a time), so a plan keeps
        one, the size of its largest request, instead of one per bucket."""
        buf = self.scratch.get("f32")
        if buf is None or buf.size < n:
            buf = self.scratch["f32"] = self.bk.empty(max(int(n), 1), np.float32)
        return buf[:n]

    def fused(self):
        """Whether the compressor's fused methods may run here (host, or a compressor
        whose fused methods take device memory)."""
        return self.bk.device == "cpu" or self.comp.supports_cuda

    def residuals(self):
        if self.comp.error_feedback:
            return self.state.cur, self.state.nxt
        return EMPTY, EMPTY

    def compress_into(self, payloads):
        """Fused kernel if the compressor has one, else the reference path."""
        e_in, e_out = self.residuals()
        bad = self.comp.compress_table(self.src, e_in, e_out, payloads, self.ctx) if self.fused() else None
        if bad is None:
            bad = self.reference_compress(self.bk.gather_f32(self.src, self.n), payloads)
        if self.velocity is not None and self.comp.momentum_masking:
            _momentum.mask(self.bk, e_in, self.velocity[0], e_out, self.velocity[1])
        return int(bad)

    def reference_compress(self, g, payloads):
        """``compress_with_feedback`` on host values ``g`` (the compressor's plain methods:
        for compressors without fused kernels, on the host whatever the device)."""
        bk = self.bk
        e_in, e_out = self.residuals()
        if bk.device == "cpu":
            return compress_with_feedback(self.comp, g, e_in, e_out, payloads, self.ctx)
        h_in = bk.host(e_in)
        h_out = np.empty(e_out.size, np.float32)
        h_pay = [np.zeros(p.shape, p.dtype) for p in payloads]
        bad = compress_with_feedback(self.comp, g, h_in, h_out, h_pay, self.ctx)
        for d, h in zip(payloads, h_pay):
            if d.size:
                bk.upload(d, h)
        if e_out.size:
            bk.upload(e_out, h_out)
        return bad

    def write_sum(self, rows, divisor):
        """Decode-sum-divide ``rows`` into the outputs (fused kernel or reference path)."""
        if not (self.fused() and self.comp.decompress_sum_table(rows, self.dst, divisor, self.ctx)):
            acc = self.comp.decompress_sum([self.bk.host(r) for r in rows], self.n, self.ctx)
            if divisor != 1.0:
                acc = np.divide(acc, np.float32(divisor), dtype=np.float32)
            self.bk.scatter_f32(acc, self.dst)

    def commit(self):
        if self.comp.error_feedback or self.state.server_cur.size or self.state.vel_cur.size:
            self.state.commit()


class AllgatherJob(BucketJob):
    """Every rank sends its payload to every rank; every rank decodes and sums all of them."""

    algorithm = "allgather"

    def compress(self):
        p = self.comm.size
        wire = Wire(self.comp.bucket_layout(self.ctx))
        key = ("allgather", wire.nbytes, p)
        bufs = self.cache.get(key)
        if bufs is None:
            bk = self.bk
            bufs = (bk.empty_bytes(wire.nbytes), bk.empty_bytes(wire.nbytes * p).reshape(p, wire.nbytes))
            bufs[0][:] = 0
            self.cache.clear()
            self.cache[key] = bufs
        send, recv = bufs
        Wire.header(send)[0] = self.compress_into(wire.views(send))
        self.wire, self.send, self.recv = wire, send, recv

    def exchange(self):
        p, wire, recv = self.comm.size, self.wire, self.recv
        self.comm.allgather(self.send, recv)
        self.stats.bytes_sent += wire.nbytes * (p - 1)
        flags = self.bk.host(Wire.header(recv)[:, 0])
        self.nonfinite_ranks = [r for r in range(p) if flags[r]]

    def decode(self):
        self.write_sum(self.wire.rows(self.recv), self.divisor)
        self.commit()


class AllreduceJob(BucketJob):
    """fp16/bf16: the network sums the 16-bit payloads (MPI user op, float32 add rounded once)."""

    algorithm = "allreduce"

    def __init__(self, task):
        super().__init__(task)
        self.native = self.comp.native_sum(self.comm)
        self.peer16 = None         # split (runtime.overlap): the peer's words, until decode() adds them

    def compress(self):
        bk = self.bk
        if self.stream:            # one bucket at a time: the plan's shared buffer (two, pipelined)
            buf = self.slot_buffer("u16", lambda n: bk.empty_bytes(2 * n).view(np.uint16))
        elif bk.device == "cpu":   # held until the step's verdict: this step's only (host)
            buf = bk.empty_bytes(2 * self.n).view(np.uint16)
        else:
            buf = self.cache.get("buf16")
            if buf is None or buf.size != self.n:
                buf = bk.empty_bytes(2 * self.n).view(np.uint16)
                self.cache["buf16"] = buf
        predivide = self.comp.options.get("predivide") or self.native
        prescale = float(self.comm.size) if predivide and self.divisor != 1.0 else 1.0
        e_in, e_out = self.residuals()
        if e_in.size or not self.fused():
            g = bk.gather_f32(self.src, self.n)
            if prescale != 1.0:
                g = np.divide(g, np.float32(prescale), dtype=np.float32)
            self.reference_compress(g, [buf])
            ovf = unf = 0
        else:
            ovf, unf = self.comp.pack(self.src, buf, prescale, self.ctx)
        self.stats.cast_overflow += ovf
        self.stats.cast_underflow += unf
        self.divisor_after = 1.0 if prescale != 1.0 else self.divisor
        self.buf = buf

    def slot_buffer(self, name, alloc):
        """The plan's shared 16-bit buffer ``name`` of this job's slot (``slot`` 0 or 1: two
        of each serve a double-buffered step), grown to ``n`` words, ``alloc(n)`` makes one."""
        key = name if self.slot == 0 else name + "b"
        buf = self.scratch.get(key)
        if buf is None or buf.size < self.n:
            buf = self.scratch[key] = alloc(max(self.n, 1))
        return buf[:self.n]

    def exchange(self):
        if (self.split or getattr(self.comm, "swaps16", False)) and not self.native:
            # runtime.overlap, 2 hosts: the words cross on the exchange thread, polled;
            # split, decode() adds them on the communication thread, else they are added here
            tmp = self.slot_buffer("r16", lambda n: np.empty(n, np.uint16))
            self.peer16 = self.comm.swap16(self.buf, tmp)
            if self.split:
                return
            self.add_peer()
            return
        self.comm.allreduce16(self.buf, self.comp.fmt, native=self.native)
        self.summed()

    def add_peer(self):
        """The peer's words (``peer16``, from ``comm.swap16``) into ``buf``: one float32 add
        rounded once per element, the bits of MPI's user-op allreduce on 2 ranks; then as
        after any 16-bit sum (``summed``)."""
        self.comp.add16(self.peer16, self.buf)
        self.peer16 = None
        self.summed()

    def summed(self):
        """Count the bytes and check the 16-bit sum for inf/NaN (``buf`` holds the sum)."""
        bk, buf = self.bk, self.buf
        p = self.comm.size
        self.stats.bytes_sent += ring_bytes(2 * self.n, p)
        bad = self.comp.count_nonfinite(buf, bk)
        if bad:
            self.nonfinite_ranks = ["?"]
            self.nonfinite_detail = (f"the {self.comp.name} sum holds {bad} inf/NaN value(s): an input was "
                                     f"non-finite or the sum overflowed {self.comp.name}"
                                     + (" (largest 65504; try predivide=True or bf16)" if self.comp.fmt == 1 else ""))

    def decode(self):
        if self.split:      # the peer's words, received by exchange()
            self.add_peer()
        self.write_sum([self.buf.reshape(1, -1)], self.divisor_after)
        self.commit()
