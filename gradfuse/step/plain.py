"""A step's uncompressed buckets (stage 4 of ``gradfuse.step``).

* ``pack(step, b)``, ``reduce(step, comm, b)`` (the MPI library's or NCCL's own
  allreduce, in place on the fusion buffer), ``unpack(step, b, ...)`` (dividing when
  averaging);
* ``reduce_direct``: a large tensor reduced where it lies, alone;
* ``reduce_rows``: between the ranks of one host (``comm.reduces_rows``), every plain
  bucket's tensors summed where they lie, in one call per step: no fusion buffer, no
  pack, no unpack (``gradfuse.comm.cma``);
* ``uncompressed``: a float32 bucket that ``uncompressed_if_faster`` runs uncompressed,
  with the residual it kept while compressed;
* ``plain_velocity``: an uncompressed bucket of a pipeline with DGC's momentum correction
  (its velocity is summed).
"""
import numpy as np

from .twophase import twophase_chunk
from ..compressors import momentum as _momentum
from ..fusion.staging import F16, staging
from ..runtime import timeline as _tl


def bucket_names(step, b):
    """The names of bucket ``b``'s tensors (built only while a timeline records)."""
    return [step.entry.names[int(i)] for i in step.entry.plan.order[b.lo:b.hi]]


def pack(step, b):
    """Copy bucket ``b``'s tensors into its fusion buffer (one kernel call)."""
    t = step.tables
    with _tl.stage("pack", "allreduce", lambda: bucket_names(step, b), bucket=b.index, bytes=b.nbytes):
        step.entry.bk.pack(b.buffer, step.src, t.offsets, t.nbytes, b.lo, b.hi)


def reduce(step, comm, b):
    """Sum bucket ``b``'s fusion buffer across ranks, in place."""
    with _tl.stage("exchange", "allreduce", lambda: bucket_names(step, b), bucket=b.index, bytes=b.nbytes):
        comm.allreduce_inplace(b.view())


def unpack(step, b, divide, size):
    """Copy the summed buffer back into the outputs, dividing by ``size`` when averaging."""
    t, bk = step.tables, step.entry.bk
    with _tl.stage("unpack", "allreduce", lambda: bucket_names(step, b), bucket=b.index, bytes=b.nbytes):
        if divide:
            outs = () if bk.device == "cpu" else [step.out_objs[int(i)] for i in step.entry.plan.order[b.lo:b.hi]]
            bk.unpack_div(b.buffer, step.dst, t.offsets, t.nbytes, b.lo, b.hi, b.code, size, outs)
        else:
            bk.unpack(b.buffer, step.dst, t.offsets, t.nbytes, b.lo, b.hi)


def reduce_bucket(step, comm, b, divide, size):
    """Sum plain bucket ``b``: its one tensor where it lies (direct), or packed, reduced
    and unpacked."""
    if b.direct:
        reduce_direct(step, comm, b, divide, size)
    else:
        pack(step, b)
        reduce(step, comm, b)
        unpack(step, b, divide, size)


def rows_buckets(step, comm, plain, jobs, vel):
    """{bucket index: bucket} of the plain buckets that ``comm`` sums where their tensors
    lie (``allreduce_rows``: between the ranks of one host, ``gradfuse.comm.cma``), or
    an empty dict: host memory only, no momentum correction, at least
    ``comm.rows_min_bytes`` in all."""
    if not comm.reduces_rows or vel or step.entry.bk.device != "cpu":
        return {}
    picked = {b.index: b for b in plain if b.index not in jobs and b.index not in step.unpaid}
    if sum(b.nbytes for b in picked.values()) < comm.rows_min_bytes:
        return {}
    return picked


def reduce_rows(step, comm, buckets, divide, size):
    """Sum the tensors of ``buckets`` where they lie, into the outputs, dividing by
    ``size`` when averaging: no fusion buffer, no pack and no unpack; one
    ``allreduce_rows`` call per step with one group of rows per dtype. The groups' rows,
    counts and address arrays are kept with the plan, so a step allocates nothing here."""
    entry = step.entry
    key = ("rows",) + tuple(buckets)
    groups = entry.wire.get(key)
    if groups is None:           # per dtype: the plan's rows, their counts, address buffers
        by_code = {}
        for b in buckets.values():
            by_code.setdefault(b.code, []).append(np.arange(b.lo, b.hi, dtype=np.int64))
        groups = entry.wire[key] = []
        for code, r in by_code.items():
            r = np.concatenate(r)
            groups.append((code, r, entry.plan.counts[r], np.empty(r.size, np.int64), np.empty(r.size, np.int64)))
    for _, r, _, src, dst in groups:
        np.take(step.src, r, out=src)
        np.take(step.dst, r, out=dst)
    names = lambda: [n for b in buckets.values() for n in bucket_names(step, b)]     # noqa: E731
    with _tl.stage("exchange", "allreduce", names, bytes=sum(b.nbytes for b in buckets.values())):
        comm.allreduce_rows([(code, src, dst, counts) for code, _, counts, src, dst in groups],
                            size if divide else None)


def reduce_direct(step, comm, b, divide, size):
    """Sum the one large tensor of a ``direct`` bucket where it lies (no packing)."""
    i = int(step.entry.plan.order[b.lo])
    with _tl.stage("exchange", "allreduce", (step.entry.names[i],), bucket=b.index, bytes=b.nbytes):
        if step.src[b.lo] == step.dst[b.lo]:
            comm.allreduce_inplace(step.out_objs[i])
        else:
            comm.allreduce(step.in_objs[i], step.out_objs[i])
    if divide:
        with _tl.stage("unpack", "allreduce", (step.entry.names[i],), bucket=b.index, bytes=b.nbytes):
            step.entry.bk.div_inplace(step.out_objs[i], step.dst[b.lo], step.entry.plan.counts[b.lo], b.code, size)


def uncompressed(step, comm, b, divide, size):
    """A float32 bucket that ``uncompressed_if_faster`` runs uncompressed. A residual it kept
    while compressed (or restored from a checkpoint) joins this rank's addend and is
    dropped, so nothing of it is lost: the sum is that of ``g + e`` over the ranks. A
    two-phase server residual (in averaged units) joins as ``divisor x e_s`` on the rank
    that served that chunk. Runs after ``check_finite``, so a skipped step keeps them."""
    cfg, entry, bk = step.cfg, step.entry, step.entry.bk
    taken = cfg.state.take_residual((entry.state_key, b.index), bk)
    if taken is None:
        reduce_bucket(step, comm, b, divide, size)
        return
    e, es = taken

    def add_residuals(flat):           # (g + e), then + divisor x e_s on the server's chunk
        flat += e
        if es.size:
            counts = tuple(step.tables.counts[b.lo:b.hi].tolist())
            e0, e1 = twophase_chunk(counts, comm.size, cfg.compressor.compressors[b.group].block, comm.rank)
            flat[e0:e1] += es * bk.xp.float32(size if divide else 1.0)

    if b.direct:
        i = int(entry.plan.order[b.lo])
        out = step.out_objs[i]
        if step.src[b.lo] != step.dst[b.lo]:
            out[...] = step.in_objs[i]
        add_residuals(out.reshape(-1))
        comm.allreduce_inplace(out)
        if divide:
            bk.div_inplace(out, step.dst[b.lo], entry.plan.counts[b.lo], b.code, size)
        return
    pack(step, b)
    add_residuals(bk.xp.asarray(b.buffer).view(np.float32))
    reduce(step, comm, b)
    unpack(step, b, divide, size)


def plain_velocity(step, comm, b, vel, divide, size):
    """An uncompressed bucket of a momentum pipeline: its velocity ``u = m * u + g`` is
    written where the reduction reads (the fusion buffer, or a direct tensor itself), so the
    bucket's sum is the sum of the velocities (float16: through the float32 staging array,
    rounded once to float16 before the sum)."""
    cfg, entry, t, bk = step.cfg, step.entry, step.tables, step.entry.bk
    st = cfg.state.bucket((entry.state_key, b.index), 0, 0, None, bk, velocity=b.count)
    src, rows = step.src, len(entry.plan.order)
    if b.code == F16:
        sg = staging(entry.wire, bk, b, entry.plan)
        sg.load(step.src, t)
        src = out = sg.ptrs                   # u written over the staged gradients
    elif b.direct:
        out = step.dst
    else:
        out = _momentum.table(st, bk, _momentum.address(b.buffer), t.offsets, rows, b.lo, b.hi)
    _momentum.update(bk, st, (src, t.elem_offsets, t.counts, b.lo, b.hi), out, vel)
    if b.code == F16 and b.direct:
        sg.store(step.dst, t)
    elif b.code == F16:
        bk.kernels.cast_to16(1, sg.f32, b.buffer.view(np.uint16))
    if b.direct:
        i = int(entry.plan.order[b.lo])
        comm.allreduce_inplace(step.out_objs[i])
        if divide:
            bk.div_inplace(step.out_objs[i], step.dst[b.lo], entry.plan.counts[b.lo], b.code, size)
    else:
        reduce(step, comm, b)
        unpack(step, b, divide, size)
    st.commit_velocity()
    cfg.state.claim_done(entry.state_key)
