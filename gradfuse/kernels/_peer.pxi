# Kernels: intra-host sums over the peers' own memory (Linux cross-memory attach).
# Included by _core.pyx; the C and its contract are in _peer.h; the Python side, which
# publishes the addresses and fences the phases, is gradfuse/comm/cma.py.

cdef extern from "_peer.h" nogil:
    int GF_PEER_OK
    int gf_peer_copy(int64_t pid, int64_t addr, uint8_t* buf, int64_t n, int write)
    int gf_peer_reduce(int p, int me, const int64_t* pids, const int64_t* src_tab, const int64_t* dst_tab,
                       int64_t stride, const int64_t* counts, int64_t nseg, int code, int64_t lo,
                       int64_t hi, int divide, double divisor, uint8_t* scratch, int64_t piece, int push,
                       int* who)
    int gf_peer_gather(int p, int me, const int64_t* pids, const int64_t* dst_tab, int64_t stride,
                       const int64_t* counts, int64_t nseg, int code, const int64_t* bounds, int64_t nchunks,
                       int* who)

#: whether this build has cross-memory attach (Linux)
PEER_SUPPORTED = bool(GF_PEER_OK)


cdef int64_t _peer_check(str who, const int64_t[::1] pids, int me, const int64_t[:, :] tab,
                         const int64_t[::1] counts, int code) except -1:
    """Validate a table; return its element count N."""
    cdef Py_ssize_t p = pids.shape[0], nseg = counts.shape[0], i, r
    cdef int64_t total = 0
    if p < 2 or p > 64:
        raise ValueError(f"{who}: {p} ranks (2 to 64 supported)")
    if me < 0 or me >= p:
        raise IndexError(f"{who}: rank {me} of {p}")
    if tab.strides[1] != 8 or tab.strides[0] % 8:
        raise ValueError(f"{who}: each rank's row of the address table must be contiguous int64")
    if tab.shape[0] != p or tab.shape[1] != nseg:
        raise ValueError(f"{who}: address table of shape ({tab.shape[0]}, {tab.shape[1]}) for {p} ranks "
                         f"and {nseg} rows")
    if code < 1 or code > 6:
        raise ValueError(f"{who}: unknown dtype code {code}")
    for i in range(nseg):
        if counts[i] < 0:
            raise ValueError(f"{who}: row {i} has a negative count ({counts[i]})")
        if counts[i] > 0:
            for r in range(p):
                if tab[r, i] == 0:
                    raise ValueError(f"{who}: row {i} of rank {r} has a null address")
        total += counts[i]
    return total


def peer_read(int64_t pid, int64_t addr, uint8_t[::1] out):
    """Copy ``len(out)`` bytes at ``addr`` in process ``pid`` into ``out``; 0 or an errno."""
    cdef int err
    if out.shape[0] == 0:
        return 0
    with nogil:
        err = gf_peer_copy(pid, addr, &out[0], out.shape[0], 0)
    return err


def peer_write(int64_t pid, int64_t addr, const uint8_t[::1] data):
    """Copy ``data`` to ``addr`` in process ``pid``; 0 or an errno."""
    cdef int err
    if data.shape[0] == 0:
        return 0
    with nogil:
        err = gf_peer_copy(pid, addr, <uint8_t*> &data[0], data.shape[0], 1)
    return err


def peer_reduce(const int64_t[::1] pids, int me, const int64_t[:, :] src_tab, const int64_t[:, :] dst_tab,
                const int64_t[::1] counts, int code, int64_t lo, int64_t hi, bint divide, double divisor,
                uint8_t[::1] scratch, bint push=False):
    """Phase 1 (``_peer.h``): elements ``lo:hi`` of the table, summed over the ranks'
    source rows ``src_tab`` (ranks x rows; a slice of a wider table is fine) into this
    rank's destination rows (row ``me`` of ``dst_tab``, laid out like ``src_tab``),
    divided by ``divisor`` when ``divide``; with ``push``, also written into every other
    rank's destination rows. ``scratch``: one slot per rank, each of
    ``len(scratch) // ranks`` bytes rounded down to 64. Returns ``(errno, rank)``,
    ``(0, -1)`` when every copy succeeded."""
    cdef int64_t total = _peer_check("peer_reduce", pids, me, src_tab, counts, code)
    cdef Py_ssize_t p = pids.shape[0]
    cdef int64_t piece = (scratch.shape[0] // p) // 64 * 64
    cdef int err = 0, who = -1
    _peer_check("peer_reduce", pids, me, dst_tab, counts, code)
    if dst_tab.strides[0] != src_tab.strides[0]:
        raise ValueError("peer_reduce: the source and destination tables must have the same row stride")
    if lo < 0 or lo > hi or hi > total:
        raise IndexError(f"peer_reduce: range {lo}:{hi} outside a table of {total} elements")
    if divide and code != 1 and code != 2 and code != 3:       # (bf16 words, code 6, are never divided)
        raise TypeError(f"peer_reduce: division needs a float dtype code, got {code}")
    if piece < 64:
        raise ValueError(f"peer_reduce: scratch of {scratch.shape[0]} bytes is too small for {p} ranks")
    if hi == lo:
        return 0, -1
    with nogil:
        err = gf_peer_reduce(<int> p, me, &pids[0], &src_tab[0, 0], &dst_tab[0, 0], src_tab.strides[0] // 8,
                             &counts[0], counts.shape[0], code, lo, hi, divide, divisor, &scratch[0], piece,
                             push, &who)
    return err, who


def peer_gather(const int64_t[::1] pids, int me, const int64_t[:, :] dst_tab, const int64_t[::1] counts,
                int code, const int64_t[::1] bounds):
    """Phase 2 (``_peer.h``): every stripe of another rank (``bounds``: the cut points of
    the table's elements, a multiple of ranks stripes; stripe c is rank c % ranks') copied
    from its owner's destination rows (row ``c % ranks`` of ``dst_tab``) into this rank's
    (row ``me``). Returns ``(errno, rank)``, ``(0, -1)`` when every read succeeded."""
    cdef int64_t total = _peer_check("peer_gather", pids, me, dst_tab, counts, code)
    cdef Py_ssize_t p = pids.shape[0], i, nchunks = bounds.shape[0] - 1
    cdef int err = 0, who = -1
    if nchunks < p or nchunks % p or bounds[0] != 0 or bounds[nchunks] != total:
        raise ValueError(f"peer_gather: bounds must be k x {p} + 1 cut points from 0 to {total}")
    for i in range(nchunks):
        if bounds[i] > bounds[i + 1]:
            raise ValueError(f"peer_gather: bounds are not increasing at {i}")
    if total == 0:
        return 0, -1
    with nogil:
        err = gf_peer_gather(<int> p, me, &pids[0], &dst_tab[0, 0], dst_tab.strides[0] // 8, &counts[0],
                             counts.shape[0], code, &bounds[0], nchunks, &who)
    return err, who
