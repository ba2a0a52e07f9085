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

from ..compressors import adam as _adam
from ..compressors import momentum as _momentum
from ..compressors.error_feedback import EMPTY, compress_with_feedback


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
        self.adam = None              # the Adam correction's AdamSpec: the compressor reads the moment (step.adam)
        self.stream = False           # decoded right after its exchange, in shared buffers (the step cannot fail)
        self.slot = 0                 # streamed and pipelined (step.overlap): which of two shared buffers
        self.group_bufs = None        # an exchange group's views for this bucket's wire rows (grouped.py)

    def apply_velocity(self, velocity):
        """DGC's momentum correction (``gradfuse.compressors.momentum``): update this rank's
        velocity from the bucket's gradients, and make the compressor read the velocity (or
        the Nesterov values) instead of them. ``velocity``: ``(m, nesterov)``."""
        if self.state.vel_cur.size:
            self.src, x = _momentum.feed(self.bk, self.state, self.src, velocity)
            self.velocity = (x, self.state.vel_nxt)

    def scratch_f32(self, n):
        """A float32 work array of ``n`` elements shared by the plan's buckets, for the
        exchange stage (``shared("f32", ...)``)."""
        return self.shared("f32", n, np.float32)

    def shared(self, name, n, dtype):
        """A work array ``name`` of ``n`` elements of ``dtype`` shared by the plan's buckets
        (64-byte aligned): valid until the next job asks for the same name, so a plan keeps
        one, the size of its largest request, instead of one per bucket. A name belongs to
        one stage kind: those of ``exchange`` run one at a time on the exchange thread (or
        serially), those of ``compress`` and ``decode`` one at a time on the communication
        thread, so a name used by one kind only is never used twice at once, also pipelined
        (``gradfuse.step.overlap``)."""
        buf = self.scratch.get(name)
        if buf is None or buf.size < n:
            size = max(int(n), 1)
            buf = self.scratch[name] = self.bk.empty_bytes(size * np.dtype(dtype).itemsize).view(dtype)[:size]
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
        """Fused kernel if the compressor has one, else the reference path. With the Adam
        correction the compressor takes the moment ``b1 m + (c1 g) r`` instead of the gradients:
        in its own pass fused with the compression where the compressor has one
        (``compress_moment_table``), else from a moment pass into a shared work array."""
        e_in, e_out = self.residuals()
        bad = None
        if self.adam is not None:
            spec = self.adam
            if self.fused():
                arrays = self.state.arrays
                bad = self.comp.compress_moment_table(self.src, (arrays[_adam.M], arrays[_adam.R], spec.b1, spec.c1),
                                                      e_in, e_out, payloads, self.ctx)
            if bad is None:
                self.moment_pass()
        if bad is None and self.fused():
            bad = self.comp.compress_table(self.src, e_in, e_out, payloads, self.ctx)
        if bad is None:
            bad = self.reference_compress(self.bk.gather_f32(self.src, self.n), payloads)
        if self.velocity is not None and self.comp.momentum_masking:
            _momentum.mask(self.bk, e_in, self.velocity[0], e_out, self.velocity[1])
        return int(bad)

    def moment_pass(self):
        """The Adam correction's moment ``b1 m + (c1 g) r`` into a work array shared by the plan's
        buckets (its compress stage reads it at once), which the compressor then reads."""
        self.src = _adam.moment_table(self.bk, self.state, self.src, self.adam,
                                      self.shared("adam.x", self.n, np.float32))

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

    def wire_layout(self):
        """The bytes of this rank's payload row (an exchange group lays the rows of its
        buckets side by side: ``gradfuse.step.grouped``)."""
        return Wire(self.comp.bucket_layout(self.ctx))

    def compress(self):
        p = self.comm.size
        wire = self.wire_layout()
        if self.group_bufs is not None:        # views into the exchange group's buffers
            send, recv = self.group_bufs
        else:
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
        """The allgather, then the bookkeeping (``received``; in an exchange group,
        ``gradfuse.step.grouped`` runs only that, once the group's allgather completed)."""
        self.comm.allgather(self.send, self.recv)
        self.received()

    def received(self):
        """After the allgather (this bucket's, or its exchange group's): the bytes sent, and
        which ranks reported non-finite values."""
        p, wire, recv = self.comm.size, self.wire, self.recv
        self.stats.bytes_sent += wire.nbytes * (p - 1)
        flags = self.bk.host(Wire.header(recv)[:, 0])
        self.nonfinite_ranks = [r for r in range(p) if flags[r]]

    def decode(self):
        self.write_sum(self.wire.rows(self.recv), self.divisor)
        self.commit()


class AllreduceJob(BucketJob):
    """fp16/bf16: the network sums the 16-bit payloads (MPI user op, float32 add rounded once).

    Between 2 hosts (``step.overlap``) the words cross as a swap with the peer instead
    (``comm.swap16``), at most ``PART_WORDS`` words at a time, each added at once; a pipelined
    step of 16-bit buckets alone moves ``parts`` (``Part16``) instead of whole buckets."""

    algorithm = "allreduce"
    #: the most 16-bit words one swap (one part) moves between 2 hosts: 1 MiB, so the
    #: pipelined step's four shared buffers hold at most 4 MiB whatever the largest tensor
    #: (ResNet-50's: 2.36 M elements). Measured on 2 emulated hosts (docs/benchmarks.md,
    #: "Memory"): ResNet-50's fp16 step holds 0.055x / 0.091x / 0.20x of S with parts of
    #: 512 KiB / 1 MiB / 2 MiB (0.32x whole: the allocator keeps MPI's freed buffers of the
    #: larger messages), and each part costs a hand-over between the threads and the
    #: ranks: on loaded cores 512 KiB parts were up to 1.14x slower than whole buckets,
    #: 1 MiB parts no slower
    PART_WORDS = 1 << 19

    def __init__(self, task):
        super().__init__(task)
        self.native = self.comp.native_sum(self.comm)
        predivide = self.comp.options.get("predivide") or self.native
        self.prescale = float(self.comm.size) if predivide and self.divisor != 1.0 else 1.0
        self.divisor_after = 1.0 if self.prescale != 1.0 else self.divisor
        self.buf = None
        self.bad16 = 0             # inf/NaN words in the sum (summed over its parts)

    def compress(self):
        bk = self.bk
        if self.stream:            # one bucket at a time: the plan's shared buffer (two, pipelined)
            buf = self.slot_buffer("u16", lambda n: bk.empty_bytes(2 * n).view(np.uint16))
        elif bk.device == "cpu":   # held until the step's verdict: this step's only (host)
            buf = self.own16()
        else:
            buf = self.cache.get("buf16")
            if buf is None or buf.size != self.n:
                buf = bk.empty_bytes(2 * self.n).view(np.uint16)
                self.cache["buf16"] = buf
        e_in, e_out = self.residuals()
        if self.adam is not None:
            self.moment_pass()
        if e_in.size or not self.fused():
            g = bk.gather_f32(self.src, self.n)
            if self.prescale != 1.0:
                g = np.divide(g, np.float32(self.prescale), dtype=np.float32)
            self.reference_compress(g, [buf])
        else:
            self.cast(self.src, buf)
        self.buf = buf

    def cast(self, src, buf):
        """The fused pack + cast of table ``src`` into ``buf``, its overflow counted."""
        ovf, unf = self.comp.pack(src, buf, self.prescale, self.ctx)
        self.stats.cast_overflow += ovf
        self.stats.cast_underflow += unf

    def own16(self):
        """This step's own 16-bit buffer of the whole bucket (host; held until the verdict)."""
        if self.buf is None or self.buf.size != self.n:
            self.buf = self.bk.empty_bytes(2 * self.n).view(np.uint16)
        return self.buf

    def slot_buffer(self, name, alloc, n=None, slot=None):
        """The plan's shared 16-bit buffer ``name`` of slot ``slot`` (default: this job's;
        0 or 1: two of each serve a double-buffered step), grown to ``n`` words (default:
        the bucket's); ``alloc(n)`` makes one."""
        n = self.n if n is None else n
        slot = self.slot if slot is None else slot
        key = name if slot == 0 else name + "b" if slot == 1 else f"{name}.{slot}"
        buf = self.scratch.get(key)
        if buf is None or buf.size < n:
            buf = self.scratch[key] = alloc(max(n, 1))
        return buf[:n]

    def recv16(self, n, slot=None):
        """The shared receive buffer of ``n`` words for a swap."""
        return self.slot_buffer("r16", lambda m: np.empty(m, np.uint16), n, slot)

    def exchange(self):
        if getattr(self.comm, "swaps16", False) and not self.native:
            # step.overlap, 2 hosts: the words cross on the exchange thread, polled, at
            # most ``PART_WORDS`` at a time (the receive buffer is that long), each added at once
            step = max(1, min(self.PART_WORDS, self.n))
            for a in range(0, self.n, step):
                b = min(a + step, self.n)
                self.comp.add16(self.comm.swap16(self.buf[a:b], self.recv16(b - a)), self.buf[a:b])
            self.summed(self.buf)
            return
        self.comm.allreduce16(self.buf, self.comp.fmt, native=self.native)
        self.summed(self.buf)

    def summed(self, buf):
        """After a 16-bit sum of ``buf`` (the bucket's, or a part's words): count the bytes
        and check the sum for inf/NaN."""
        self.stats.bytes_sent += ring_bytes(2 * buf.size, self.comm.size)
        bad = self.comp.count_nonfinite(buf, self.bk)
        if bad:
            self.bad16 += bad
            self.nonfinite_ranks = ["?"]
            self.nonfinite_detail = (f"the {self.comp.name} sum holds {self.bad16} inf/NaN value(s): an input was "
                                     f"non-finite or the sum overflowed {self.comp.name}"
                                     + (" (largest 65504; try predivide=True or bf16)" if self.comp.fmt == 1 else ""))

    def decode(self):
        self.write_sum([self.buf.reshape(1, -1)], self.divisor_after)
        self.commit()

    def parts(self):
        """The bucket as ``Part16``s of at most ``PART_WORDS`` words each (equal but for one
        word; one part when it is no longer), in order. Host, fused, no residual."""
        k = max(1, -(-self.n // self.PART_WORDS))
        cuts = [i * self.n // k for i in range(k + 1)]
        srcs, dsts = sub_tables(self.src, cuts), sub_tables(self.dst, cuts)
        return [Part16(self, cuts[i], cuts[i + 1], srcs[i], dsts[i], i == k - 1) for i in range(k)]


def sub_tables(table, cuts):
    """A bucket's float32 table ``(pointers, element offsets, counts, lo, hi)`` cut at the
    element offsets ``cuts`` (ascending, from 0 to the bucket's count): one table per
    piece, its element offsets counted from the piece's start. One piece: the table."""
    if len(cuts) == 2:
        return [table]
    ptrs, off, cnt, lo, hi = table
    rows = [(int(ptrs[i]), int(off[i]), int(cnt[i])) for i in range(lo, hi) if cnt[i] > 0]
    out, r = [], 0
    for e0, e1 in zip(cuts[:-1], cuts[1:]):
        while r < len(rows) and rows[r][1] + rows[r][2] <= e0:
            r += 1
        piece, j = [], r
        while j < len(rows) and rows[j][1] < e1:
            p, o, c = rows[j]
            s, e = max(o, e0), min(o + c, e1)
            piece.append((p + 4 * (s - o), s - e0, e - s))
            j += 1
        t = np.array(piece, np.int64).reshape(-1, 3).T.copy()
        out.append((t[0], t[1], t[2], 0, len(piece)))
    return out


class Part16:
    """Words ``e0 .. e1-1`` of a 16-bit ``AllreduceJob``'s bucket: what the pipelined
    16-bit step on 2 hosts moves (``step.overlap._run16``), so that its shared buffers
    (two to cast into, two to receive into) hold a part, at most ``PART_WORDS``, not the
    largest bucket. Streamed, it is cast into the shared buffer of its
    ``slot``, crosses on the exchange thread, and ``decode`` adds the peer's words (one
    float32 add rounded once per element: the serial sum's bits, element by element) and
    writes its outputs; the last part commits the job. Not streamed, it is cast into the
    job's own buffer (``own16``), added on the exchange thread, and the job is decoded
    whole after the step's verdict. Stages and timeline spans as a job's (``bucket``,
    ``algorithm``, ``names``: the job's)."""

    algorithm = "allreduce"

    def __init__(self, job, e0, e1, src, dst, last):
        self.job, self.e0, self.e1, self.n = job, e0, e1, e1 - e0
        self.src, self.dst, self.last = src, dst, last
        self.bucket = job.bucket
        self.names = getattr(job, "names", ())
        self.stream, self.slot = True, 0
        self.buf = self.peer = None

    def compress(self):
        job = self.job
        if self.stream:
            self.buf = job.slot_buffer("u16", lambda n: job.bk.empty_bytes(2 * n).view(np.uint16), self.n, self.slot)
        else:
            self.buf = job.own16()[self.e0:self.e1]
        job.cast(self.src, self.buf)

    def exchange(self):
        self.peer = self.job.comm.swap16(self.buf, self.job.recv16(self.n, self.slot))
        if not self.stream:
            self.add()

    def add(self):
        """The peer's words into this part's: the 16-bit sum."""
        job = self.job
        job.comp.add16(self.peer, self.buf)
        self.peer = None
        job.summed(self.buf)

    def decode(self):
        job = self.job
        self.add()
        job.comp.decompress_sum_table([self.buf.reshape(1, -1)], self.dst, job.divisor_after, job.ctx)
        if self.last:
            job.commit()
