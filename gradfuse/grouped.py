"""random-k's buckets exchanged in groups, on the communication thread, while the next
buckets compress (``Pipeline(pipeline_buckets=True)``, host, MPI, 2 ranks or more).

random-k sends about 1 % of a bucket's bytes, so a step's exchange is a few small
messages, and a polled collective per bucket costs more than its bytes: on ResNet-50 (37
buckets, 1 MB of values in all) 37 polled allgathers between two emulated hosts on
1 Gbit/s links took 15.5 ms, one allgather of the same bytes 8.5 ms
(docs/benchmarks.md, "random-k at 20x"). So the buckets go in *exchange groups*: the
wire rows of a group's buckets lie side by side in one buffer (each bucket's row is the
one its own job would send: int64 header, values; ``group_bufs`` are views into the
group's buffers, so nothing is copied), and one non-blocking collective moves the group
(``MPI_Iallgather``; for the sparse allreduce ``MPI_Ialltoall``, the sums of this rank's
chunks, then ``MPI_Iallgather``). The communication thread posts a group as soon as its
last bucket is compressed and tests the outstanding requests between two compressions
(MPICH progresses a non-blocking collective only inside MPI calls; a compression of
ResNet-50's largest bucket takes about 1 ms, and the sockets' buffers hold more than the
link moves meanwhile), so no second thread competes for the cores. Groups are cut from
the last bucket backwards, ``LAST_GROUP`` bytes of rows, then twice that, up to
``MAX_GROUP``: the exchange left after the last compression is a small one.

Same bytes, same bits: every bucket's row is its job's, the allgather's rows arrive in
rank order, and a server adds the same chunks in the same order, so the results, the
residuals, the non-finite verdict (each bucket's header) and ``bytes_sent`` are those of
one collective per bucket. The collectives differ (fewer, larger), so all ranks must
group alike: the groups depend only on the jobs, which every rank has the same.
Errors: an error of a compression stops the posting; groups already posted are
completed (every rank posted them) before it is raised, so nothing moves afterwards. An
error in a bucket's part of its group's exchange (``serve``, ``received``) ends that
group only: the other groups still run, because which groups a rank posts must not
depend on when it noticed the error; the step then raises it.
"""
import time

from .runtime import timeline as _tl

#: bytes of wire rows (this rank's) in the last group; each group before it may hold
#: twice its successor's, up to MAX_GROUP
LAST_GROUP = 16 * 1024
MAX_GROUP = 256 * 1024
ALGORITHMS = ("allgather", "sparse_allreduce")


def groupable(job, comm, ov):
    """Whether ``job`` runs in an exchange group: pipelined buckets (``ov``), a host
    random-k bucket with the allgather or the sparse allreduce, on an MPI communicator
    of at least 2 ranks."""
    return (ov is not None and job.algorithm in ALGORITHMS and job.comp.name == "randomk"
            and job.bk.device == "cpu" and comm.size >= 2 and getattr(comm, "kind", None) == "mpi"
            and hasattr(comm, "data"))


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
    request and state, and when it was posted and seen done."""

    __slots__ = ("jobs", "sparse", "bufs", "req", "state", "t_post", "t_done", "error")

    def __init__(self, jobs, bufs):
        self.jobs, self.bufs = jobs, bufs
        self.sparse = jobs[0].algorithm == "sparse_allreduce"
        self.req, self.state, self.t_post, self.t_done = None, "new", None, None
        self.error = None         # the first error of its jobs' part of the exchange (serve, received)


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
    the plan's scratch for the next steps while the layout stays (sparsity warm-up's next
    stage changes it)."""
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


def _byte():
    from .comm.mpi import mpi
    return mpi().BYTE


def _post(group, comm):
    """Post the group's (first) collective: the allgather, or the sparse allreduce's alltoall."""
    b = _byte()
    if group.sparse:
        group.req, group.state = comm.data.Ialltoall([group.bufs[0], b], [group.bufs[1], b]), "alltoall"
    else:
        group.req, group.state = comm.data.Iallgather([group.bufs[0], b], [group.bufs[1], b]), "allgather"
    group.t_post = _tl.clock()


def _guard(group, fn):
    """Run a job's part of the exchange; an error is kept in ``group.error`` and ends the
    group (the other groups still run on every rank, so every rank posts the same
    collectives)."""
    try:
        fn()
    except Exception as exc:
        group.error = exc
        group.req, group.state = None, "done"
        return False
    return True


def _progress(group):
    """Test the group's request, without posting anything (what a rank posts and when
    must not depend on how far its requests got); a finished alltoall is summed
    (``serve``), a finished allgather received. Returns whether the group is done."""
    if group.state in ("alltoall", "allgather") and group.req.Test():
        group.req = None
        if group.state == "alltoall":
            if _guard(group, lambda: [job.serve() for job in group.jobs]):
                group.state = "served"
        else:
            group.state, group.t_done = "done", _tl.clock()
            _guard(group, lambda: [job.received() for job in group.jobs])
    return group.state == "done"


def _wait(req):
    """Wait for ``req`` by testing it every ``POLL_S`` seconds, sleeping in between: MPI's
    own wait spins in its progress loop, and with two ranks on two cores the spinning
    rank takes the core from the rank it waits for (``gradfuse.runtime.overlap``)."""
    from .runtime.overlap import POLL_S
    while not req.Test():
        time.sleep(POLL_S)


def _promote(group, comm):
    """A sparse allreduce's second collective, posted at a point every rank reaches in the
    same order (before the next group's collective, or at the end): waits for its
    alltoall if it is still running, sums, and posts the allgather of the sums.
    Collectives on one communicator match by the order they are posted in, so posting
    it whenever a rank saw the alltoall finish would pair different collectives."""
    if group.state == "alltoall":
        _wait(group.req)
        group.req = None
        if not _guard(group, lambda: [job.serve() for job in group.jobs]):
            return
        group.state = "served"
    if group.state == "served":
        group.req, group.state = comm.data.Iallgather([group.bufs[2], _byte()], [group.bufs[3], _byte()]), \
            "allgather"


def _finish(group, comm):
    """Complete the group (blocking)."""
    _promote(group, comm)
    if group.state == "allgather":
        _wait(group.req)
        _progress(group)


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
        t1 = g.t_done if prev is None else max(g.t_done, prev)     # seen done before the one before it: 0 long
        t0 = min(g.t_post if prev is None else max(g.t_post, prev), t1)
        for job in g.jobs:
            rec("exchange", "allreduce", getattr(job, "names", ()), t0, t1, bucket=job.bucket.index,
                bytes=job.bucket.nbytes, algorithm=job.algorithm, group=len(g.jobs))
        prev = t1


def run(ov, comm, jobs, compress):
    """Compress and exchange the groupable ``jobs`` (in bucket order) in exchange groups;
    returns once every group's exchange is complete (each job's ``received`` has run).
    ``compress(job)``: the step's compress stage. ``ov``: the pipeline's ``Overlap``, whose
    ``runs`` counts the step as pipelined."""
    if not jobs:
        return
    groups = plan(jobs, comm)
    last = {id(g.jobs[-1]): [] for g in groups}
    for g in groups:
        last[id(g.jobs[-1])].append(g)
    posted, error = [], None
    try:
        for job in jobs:
            compress(job)
            for g in last.get(id(job), ()):
                for q in posted:            # the second phases before the next collective, in order
                    _promote(q, comm)
                _post(g, comm)
                posted.append(g)
            for g in posted:                # progress on what is in flight (each test progresses them all)
                _progress(g)
        for g in posted:
            _finish(g, comm)
    except BaseException as exc:            # a compression (or MPI itself) failed
        error = exc
        for g in posted:                    # every rank posted these: complete them first
            try:
                _finish(g, comm)
            except BaseException:
                pass
    _record(groups)
    ov.runs += 1
    if error is None:
        error = next((g.error for g in posted if g.error is not None), None)
    if error is not None:
        raise error
