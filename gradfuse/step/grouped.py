"""Exchange groups: a pipelined step's allgather and sparse-allreduce buckets exchanged by
non-blocking collectives that the communication thread posts while it compresses the
next buckets; and ``run_jobs``, where a step's compressed buckets go.

This is the one place that posts compressed exchanges from the communication thread.
``run_jobs`` sends a pipelined step's (``Pipeline(pipeline_buckets=True)``, host, MPI, 2
ranks or more, ``MPI_THREAD_MULTIPLE``: ``step.overlap.enabled``) buckets that go by
allgather (top-k, random-k, 1-bit and 2-bit on the allgather) or by random-k's sparse
allreduce here, when there are at least two of them; the others (two-phase 1-bit/2-bit,
fp16/bf16) to ``step.overlap.run_jobs``: the exchange thread, the 16-bit step between
2 hosts, or serially.

A collective per bucket costs more than its bytes when the bytes are few: on ResNet-50
(37 buckets, random-k's 1 MB of values in all) 37 polled allgathers between two emulated
hosts on 1 Gbit/s links took 15.5 ms, one allgather of the same bytes 8.5 ms
(docs/notes/benchmarks-history.md, "random-k at 20x"). So the buckets go in *exchange groups*: the
wire rows of a group's buckets lie side by side in one buffer (each bucket's row is the
one its own job would send: int64 header, payload; ``group_bufs`` are views into the
group's buffers, so nothing is copied), and one non-blocking collective moves the group
(``MPI_Iallgather``; for the sparse allreduce ``MPI_Ialltoall``, the sums of this rank's
chunks, then ``MPI_Iallgather``). The communication thread posts a group as soon as its
last bucket is compressed and tests the requests in flight between two compressions
(MPICH progresses a non-blocking collective only inside MPI calls; a compression of
ResNet-50's largest bucket takes about 1 ms, and the sockets' buffers hold more than the
link moves meanwhile), so no second thread competes for the cores (the exchange thread's
polling cost top-k about 13 ms of CPU a step per rank on 2 ranks per 2 cores,
docs/notes/benchmarks-history.md, "Pipelined buckets"). Groups are cut from the last bucket backwards,
``LAST_GROUP`` bytes of rows, then twice that, up to ``MAX_GROUP``: the exchange left
after the last compression is a small one.

Same bytes, same bits: every bucket's row is its job's, the allgather's rows arrive in
rank order, and a server adds the same chunks in the same order, so the results, the
residuals, the non-finite verdict (each bucket's header) and ``bytes_sent`` are those of
one collective per bucket. The collectives differ (fewer, larger), so all ranks must
group alike: the groups depend only on the jobs, which every rank has the same, and
what a rank posts, and when, depends only on them too (never on how far a request got:
collectives on one communicator match by the order they are posted in).
Errors: an error of a compression stops the posting (as serially); the groups already
posted are completed (every rank posted them) before it is raised, so nothing moves
afterwards. A failed collective, or an error in a bucket's part of its group's exchange
(``serve``, ``received``), does not stop the posting: every later group is still
compressed, posted and completed on this rank as on the others (a failed sparse
allreduce's allgather too), the bookkeeping of the buckets after it is skipped, and the
step raises the first error once nothing is in flight.
"""
import time

from . import overlap as _overlap
from ..comm.mpi import mpi
from ..runtime import timeline as _tl

#: bytes of wire rows (this rank's) in the last group; each group before it may hold
#: twice its successor's, up to MAX_GROUP (docs/notes/benchmarks-history.md, "Pipelined buckets":
#: measured against groups of one bucket)
LAST_GROUP = 16 * 1024
MAX_GROUP = 256 * 1024
ALGORITHMS = ("allgather", "sparse_allreduce")


def groupable(job, comm):
    """Whether ``job`` can run in an exchange group: an allgather or sparse-allreduce bucket
    on the host, on a communicator with an mpi4py data communicator (``comm.data``)."""
    return job.algorithm in ALGORITHMS and job.bk.device == "cpu" and hasattr(comm, "data")


def run_jobs(ov, comm, device, jobs, stream, compress, exchange, decode, verdict=None):
    """Compress and exchange the step's compressed ``jobs`` (a list, in bucket order; the
    stages are the step's). ``verdict(between)``: the step's agreement on its inputs,
    called once before the first bucket whose residual is updated in place is compressed;
    it returns whether the step is settled (cannot be refused). Pipelined (``ov``, the
    pipeline's ``Overlap``, where ``step.overlap.enabled``), the ``groupable`` jobs run
    in exchange groups (``run``) when there are at least two groups: the ``early`` groups
    first, compressed before the verdict into spare residuals and posted, so that the link
    has work while the verdict's pass reads the inputs; in a settled step each bucket is
    decoded as soon as its group's exchange completes. The others then go to
    ``step.overlap.run_jobs`` (``stream`` and ``decode``: the 16-bit buckets decoded as
    they arrive)."""
    grouped = []
    if ov is not None and _overlap.enabled(comm, device):
        grouped = [j for j in jobs if groupable(j, comm)]
    if len(grouped) < 2:
        if verdict is not None:
            verdict()
        return _overlap.run_jobs(ov, comm, device, jobs, stream, compress, exchange, decode)
    run(ov, comm, grouped, compress, decode, verdict)
    ids = {id(j) for j in grouped}
    rest = [j for j in jobs if id(j) not in ids]
    if rest:
        _overlap.run_jobs(ov, comm, device, rest, stream, compress, exchange, decode)


#: the early groups (``early``) hold at most this share of a step's grouped input bytes:
#: their residuals are double-buffered (docs/benchmarks.md, "Memory")
EARLY_SHARE = 0.125


def early(groups):
    """How many leading groups a pipelined step compresses before its verdict: whole
    groups, in bucket order, while their buckets hold at most ``EARLY_SHARE`` of the
    grouped input bytes; never every group (the verdict's pass must come before the
    first in-place residual update, and a step with none in place would not learn its
    bound)."""
    total = sum(job.bucket.nbytes for g in groups for job in g.jobs)
    n, acc = 0, 0
    for g in groups[:-1]:
        acc += sum(job.bucket.nbytes for job in g.jobs)
        if acc > EARLY_SHARE * total:
            break
        n += 1
    return n


def cut(sizes, last=None, most=None):
    """Groups of consecutive buckets, as ``[(first, stop), ...]`` in bucket order, for rows
    of ``sizes`` bytes: from the last bucket backwards, a group closes once it holds its
    cap (``last``, then doubling, at most ``most``; by default ``LAST_GROUP`` and
    ``MAX_GROUP``)."""
    last = LAST_GROUP if last is None else last
    most = MAX_GROUP if most is None else most
    groups, stop, cap, acc = [], len(sizes), last, 0
    for i in range(len(sizes) - 1, -1, -1):
        acc += sizes[i]
        if acc >= cap or i == 0:
            groups.append((i, stop))
            stop, acc, cap = i, 0, min(2 * cap, most)
    return groups[::-1]


class _Group:
    """One group: its jobs, its buffers (allgather: ``send`` ``[W]``, this rank's rows,
    and ``recv`` ``[p, W]``; sparse allreduce: ``[p, W]`` out and in for the alltoall,
    then ``ssend`` ``[W]`` and ``srecv`` ``[p, W]`` for the allgather of the sums), its
    request and state (new, alltoall, served, allgather, done), and when it was posted and
    seen done."""

    __slots__ = ("jobs", "sparse", "bufs", "req", "state", "t_post", "t_done")

    def __init__(self, jobs, bufs):
        self.jobs, self.bufs = jobs, bufs
        self.sparse = jobs[0].algorithm == "sparse_allreduce"
        self.req, self.state, self.t_post, self.t_done = None, "new", None, None


def _allocate(bk, sparse, p, width):
    """A group's buffers, zeroed once: the alignment padding between a bucket's arrays is
    never written."""
    if sparse:
        bufs = (bk.empty_bytes(p * width).reshape(p, width), bk.empty_bytes(p * width).reshape(p, width),
                bk.empty_bytes(width), bk.empty_bytes(p * width).reshape(p, width))
    else:
        bufs = (bk.empty_bytes(width), bk.empty_bytes(p * width).reshape(p, width))
    for b in bufs:
        b[...] = 0
    return bufs


def plan(jobs, comm):
    """The step's exchange groups, in the order they are posted (by their last bucket), each
    job given its views into its group's buffers (``group_bufs``). The buffers are kept in
    the plan's scratch for the next steps while the layout stays (top-k's and random-k's
    sparsity warm-up changes it at each stage)."""
    p = comm.size
    sizes = {id(job): job.wire_layout().nbytes for job in jobs}
    order = {id(job): i for i, job in enumerate(jobs)}
    members = []
    for algorithm in ALGORITHMS:           # one collective per group: a group has one algorithm
        mine = [job for job in jobs if job.algorithm == algorithm]
        members += [mine[a:b] for a, b in cut([sizes[id(job)] for job in mine])]
    members.sort(key=lambda m: order[id(m[-1])])
    layout = (p, tuple((m[0].algorithm, tuple(sizes[id(job)] for job in m)) for m in members))
    scratch = jobs[0].scratch
    kept = scratch.get("exchange-groups")
    if kept is None or kept[0] != layout:
        kept = scratch["exchange-groups"] = (layout, [
            _allocate(jobs[0].bk, m[0].algorithm == "sparse_allreduce", p, sum(sizes[id(job)] for job in m))
            for m in members])
    groups = []
    for m, bufs in zip(members, kept[1]):
        o0 = 0
        for job in m:
            o1 = o0 + sizes[id(job)]
            if m[0].algorithm == "sparse_allreduce":
                job.group_bufs = (bufs[0][:, o0:o1], bufs[1][:, o0:o1], bufs[2][o0:o1], bufs[3][:, o0:o1])
            else:
                job.group_bufs = (bufs[0][o0:o1], bufs[1][:, o0:o1])
            o0 = o1
        groups.append(_Group(m, bufs))
    return groups


class _Posted:
    """One step's groups in flight, in the order they were posted, and the first error of
    their exchange (a failed collective, or a job's ``serve`` or ``received``)."""

    def __init__(self, comm, decode=None):
        self.comm, self.groups, self.error, self.decode = comm, [], None, decode
        self.ready = []          # a settled step's groups received and not yet decoded

    def _part(self, group, name):
        """The jobs' ``name`` part of the group's exchange; skipped once the step has an
        error (the collectives still run)."""
        if self.error is None:
            try:
                for job in group.jobs:
                    getattr(job, name)()
            except BaseException as exc:
                self.error = exc

    def _test(self, group):
        """Whether the group's request completed (a failed one did: it is over)."""
        try:
            return group.req.Test()
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            return True

    def _wait(self, group):
        """Wait for the group's request by testing it every ``POLL_S`` seconds, sleeping in
        between: MPI's own wait spins in its progress loop, and with two ranks on two cores
        the spinning rank takes the core from the rank it waits for."""
        while not self._test(group):
            time.sleep(_overlap.POLL_S)

    def _ended(self, group):
        """The group's request completed: an alltoall's chunks are summed (``serve``), an
        allgather's rows received."""
        group.req = None
        if group.state == "alltoall":
            self._part(group, "serve")
            group.state = "served"
        else:
            group.state, group.t_done = "done", _tl.clock()
            self._part(group, "received")
            self.ready.append(group)         # decoded here only in a settled step (``decode``)

    def _in_flight(self):
        return any(g.state in ("alltoall", "served", "allgather") for g in self.groups)

    def decode_ready(self):
        """A settled step: the received groups' buckets decoded into the outputs now
        (``stream``: the step does not decode them again). A bucket that reports non-finite
        values anyway, or an error, stops it (the step then raises; its verdict names what
        was written)."""
        while self.ready and self.decode is not None and self.error is None:
            for job in self.ready.pop(0).jobs:
                if job.nonfinite_ranks:
                    self.decode = None
                    return
                try:
                    self.decode(job)
                except BaseException as exc:
                    self.error = exc
                    return
                job.stream = True

    def post(self, group):
        """Post the group's (first) collective, after every earlier sparse allreduce's
        second one (``_promote``)."""
        for g in self.groups:
            self._promote(g)
        b, data = mpi().BYTE, self.comm.data
        if group.sparse:
            group.req = data.Ialltoall([group.bufs[0], b], [group.bufs[1], b])
            group.state = "alltoall"
        else:
            group.req = data.Iallgather([group.bufs[0], b], [group.bufs[1], b])
            group.state = "allgather"
        group.t_post = _tl.clock()
        self.groups.append(group)

    def _promote(self, group):
        """A sparse allreduce's second collective, posted at a point every rank reaches in
        the same order (before the next group's collective, or at the end): waits for its
        alltoall if it is still running, sums, and posts the allgather of the sums.
        Posting it whenever a rank saw the alltoall finish would pair different
        collectives on the ranks."""
        if group.state == "alltoall":
            self._wait(group)
            self._ended(group)
        if group.state == "served":
            b = mpi().BYTE
            group.req = self.comm.data.Iallgather([group.bufs[2], b], [group.bufs[3], b])
            group.state = "allgather"

    def progress(self):
        """Test the requests in flight, oldest first, up to the first that is still
        running (each test progresses them all); posts nothing: what a rank posts and when
        must not depend on how far its requests got."""
        for g in self.groups:
            if g.state in ("alltoall", "allgather") and self._test(g):
                self._ended(g)
            if g.state != "done":
                break
        if self.ready and self._in_flight():
            # a settled step decodes while later groups are on the wire; with nothing in
            # flight the next compression comes first, so that the link has work
            self.decode_ready()

    def finish(self):
        """Complete every group posted, in order (a settled step decoding the groups
        received while it waits for the next)."""
        for g in self.groups:
            self._promote(g)
            if g.state == "allgather":
                self.decode_ready()
                self._wait(g)
                self._ended(g)
        self.decode_ready()


def _record(groups):
    """One "exchange" span per bucket: its group's, from when the group was posted (or the
    group before it was done: the link carries them in order) to when it was seen done, so
    the spans on the track nest."""
    rec = _tl.recorder()
    if rec is None:
        return
    prev = None
    for g in groups:
        if g.t_post is None or g.t_done is None:
            continue
        t1 = g.t_done if prev is None else max(g.t_done, prev)
        t0 = min(g.t_post if prev is None else max(g.t_post, prev), t1)
        for job in g.jobs:
            rec("exchange", "allreduce", getattr(job, "names", ()), t0, t1, bucket=job.bucket.index,
                bytes=job.bucket.nbytes, algorithm=job.algorithm, group=len(g.jobs))
        prev = t1


def run(ov, comm, jobs, compress, decode=None, verdict=None):
    """Compress and exchange the ``groupable`` ``jobs`` (in bucket order) in exchange
    groups; returns once every group's exchange is complete (each job's ``received`` has
    run). ``compress(job)``: the step's compress stage; ``verdict(between)``: the step's
    agreement on its inputs (``run_jobs``), called after the ``early`` groups are
    compressed and posted (their residuals pinned: written into spares), or None;
    ``decode(job)``: the step's decode stage, run on each bucket as soon as its group
    completed when the verdict says the step is settled. ``ov``: the pipeline's
    ``Overlap``, whose ``runs`` counts the pipelined hand-overs."""
    if not jobs:
        return
    groups = plan(jobs, comm)
    n_early = early(groups) if verdict is not None else 0
    for i, g in enumerate(groups):
        for job in g.jobs:
            job.state.pin(i < n_early)
    early_ids = {id(job) for g in groups[:n_early] for job in g.jobs}
    last = {}
    for g in groups:
        last.setdefault(id(g.jobs[-1]), []).append(g)
    posted, error = _Posted(comm), None
    ov.runs += 1
    try:
        for job in jobs:
            if verdict is not None and id(job) not in early_ids:
                sure, verdict = verdict(posted.progress), None
                if sure and decode is not None:
                    posted.decode = decode
            compress(job)
            for g in last.get(id(job), ()):
                posted.post(g)
            posted.progress()
    except BaseException as exc:            # a compression, a post or the verdict failed:
        error = exc                         # no more posting (nor decoding)
        posted.decode = None
    try:
        posted.finish()                     # every rank posted these: complete them first
    except BaseException as exc:
        error = error or exc
    _record(groups)
    error = error or posted.error
    if error is not None:
        raise error
