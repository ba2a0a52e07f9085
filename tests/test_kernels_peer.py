"""The intra-host kernels (``kernels/_peer.h``) in one process: every "rank" of a table
is this process (its own pid), so cross-memory attach reads this process's memory and the
kernels' walk over rows, pieces, iovec batches, sums and divisions is checked against
numpy without MPI. The MPI side (addresses published, phases fenced, errors raised on
every rank) is tests/mpi/test_cma.py."""
import os

import numpy as np
import pytest

from gradfuse import _core
from gradfuse import dtypes as _dt
from gradfuse.comm import cma

pytestmark = pytest.mark.skipif(not _core.PEER_SUPPORTED, reason="no cross-memory attach on this OS")

PID = os.getpid()


def _ref_sum(xs, dtype):
    """Rank-order sum, each add in the dtype's arithmetic (float16: float32 add rounded once)."""
    acc = xs[0].copy()
    for x in xs[1:]:
        if dtype == np.float16:
            acc = (acc.astype(np.float32) + x.astype(np.float32)).astype(np.float16)
        else:
            acc = acc + x
    return acc


def _ref_div(x, dtype, d):
    if dtype == np.float16:
        return (x.astype(np.float32) / np.float32(d)).astype(np.float16)
    return x / dtype(d)


def _run(ranks, code, divide, piece_bytes, inplace, stripe_bytes=None, push=False):
    """Phase 1 for every rank (each of its stripes), then phase 2 for every rank, as the
    fences order them; with ``push``, phase 1 alone (it writes the sums into every rank)."""
    p = len(ranks)
    dtype = np.dtype(np.uint16) if code == cma.BF16 else _dt.DTYPE[code]
    src_tab = np.array([[a.ctypes.data for a in src] for src, _ in ranks], np.int64)
    dst_tab = np.array([[a.ctypes.data for a in dst] for _, dst in ranks], np.int64)
    counts = np.array([a.size for a in ranks[0][0]], np.int64)
    red = cma.CMAReducer.__new__(cma.CMAReducer)
    red.size = p
    saved = cma.STRIPE_BYTES
    cma.STRIPE_BYTES = stripe_bytes or saved
    try:
        cuts = red._cuts(int(counts.sum()), dtype.itemsize)
    finally:
        cma.STRIPE_BYTES = saved
    pids = np.full(p, PID, np.int64)
    scratch = np.empty(piece_bytes * p, np.uint8)
    for me in range(p):
        for c in range(me, cuts.size - 1, p):
            err, who = _core.peer_reduce(pids, me, src_tab, dst_tab, counts, code, int(cuts[c]),
                                         int(cuts[c + 1]), divide, float(p), scratch, push)
            assert (err, who) == (0, -1)
    if push:
        return
    for me in range(p):
        assert _core.peer_gather(pids, me, dst_tab, counts, code, cuts) == (0, -1)


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("stripe_bytes", [None, 40_000])       # one stripe per rank, or many
@pytest.mark.parametrize("push", [True, False])
def test_every_rank_gets_the_rank_order_sum(p, dtype, inplace, stripe_bytes, push):
    rng = np.random.default_rng(p * 10 + inplace)
    sizes = [0, 1, 7, 64, 1000, 0, 33_333, 3, 70_001, 5]     # empty rows, rows across pieces
    code = _dt.CODE[np.dtype(dtype)]
    ranks, want_in = [], []
    for r in range(p):
        if np.dtype(dtype).kind == "f":
            src = [(rng.standard_normal(n) * 100).astype(dtype) for n in sizes]
        else:
            src = [rng.integers(-2**30, 2**30, n).astype(dtype) for n in sizes]
        want_in.append([s.copy() for s in src])
        dst = src if inplace else [np.full_like(s, 7) for s in src]
        ranks.append((src, dst))
    divide = np.dtype(dtype).kind == "f"
    _run(ranks, code, divide, piece_bytes=4096, inplace=inplace, stripe_bytes=stripe_bytes, push=push)
    for i in range(len(sizes)):
        want = _ref_sum([want_in[r][i] for r in range(p)], dtype)
        if divide:
            want = _ref_div(want, dtype, p)
        for r in range(p):
            got = ranks[r][1][i]
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (r, i)
            if not inplace:
                assert np.array_equal(ranks[r][0][i], want_in[r][i])      # sources untouched


def test_two_ranks_give_mpi_bits_with_nan_and_inf():
    """p = 2: a + b, so the bits of MPI_Allreduce's sum; fp16 follows gf_sum16's NaN rule."""
    a = np.array([1.5, np.inf, -np.inf, np.nan, 65504, 3e-8], np.float16)
    b = np.array([2.25, -np.inf, -np.inf, 1.0, 65504, 3e-8], np.float16)
    ranks = [([a.copy()], [a.copy()]), ([b.copy()], [b.copy()])]
    _run(ranks, 1, False, 4096, True)
    want = np.empty_like(a)
    want[...] = b
    _core.sum16(1, a, want)
    for _, dst in ranks:
        assert np.array_equal(dst[0].view(np.uint16), want.view(np.uint16))


def test_more_rows_than_one_call_takes():
    """3000 rows: phase 1 pieces and phase 2 batches both split at IOV_MAX (1024)."""
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 40, 3000)
    xs = [[rng.standard_normal(n).astype(np.float32) for n in sizes] for _ in range(2)]
    want = [x + y for x, y in zip(*xs)]
    ranks = [(x, x) for x in xs]
    _run(ranks, 2, False, 1 << 20, True)
    for r in range(2):
        for got, w in zip(ranks[r][1], want):
            assert np.array_equal(got, w)


def test_errors_name_the_rank_and_refuse_bad_tables():
    x = np.ones(100, np.float32)
    pids = np.array([PID, PID], np.int64)
    counts = np.array([100], np.int64)
    scratch = np.empty(8192, np.uint8)
    bad = np.array([[x.ctypes.data], [4096]], np.int64)             # rank 1's row: an unmapped page
    err, who = _core.peer_reduce(pids, 0, bad, bad, counts, 2, 0, 50, False, 1.0, scratch)
    assert who == 1 and err != 0
    assert np.array_equal(x, np.ones(100, np.float32))                # nothing written on a failed read
    with pytest.raises(ValueError, match="null address"):
        _core.peer_reduce(pids, 0, np.array([[x.ctypes.data], [0]], np.int64), bad, counts, 2, 0, 50, False,
                          1.0, scratch)
    with pytest.raises(IndexError, match="outside a table of 100"):
        _core.peer_reduce(pids, 0, bad, bad, counts, 2, 0, 101, False, 1.0, scratch)
    with pytest.raises(TypeError, match="float dtype"):
        _core.peer_reduce(pids, 0, bad, bad, counts, 4, 0, 50, True, 2.0, scratch)
    with pytest.raises(ValueError, match="shape"):
        _core.peer_gather(pids, 0, bad[:1], counts, 2, np.array([0, 50, 100], np.int64))
    with pytest.raises(ValueError, match="cut points"):
        _core.peer_gather(pids, 0, bad, counts, 2, np.array([0, 50, 99], np.int64))
    with pytest.raises(ValueError, match="k x 2 \\+ 1 cut points"):
        _core.peer_gather(pids, 0, bad, counts, 2, np.array([0, 30, 60, 100], np.int64))
    assert _core.peer_read(PID, 4096, np.empty(8, np.uint8)) != 0
    assert _core.peer_write(PID, 4096, np.ones(8, np.uint8)) != 0
    y = np.zeros(8, np.uint8)
    assert _core.peer_write(PID, y.ctypes.data, np.arange(8, dtype=np.uint8)) == 0 and (y == np.arange(8)).all()
    # a failed write names the rank written to: rank 1's destination row is unmapped
    dst = np.array([[x.ctypes.data], [4096]], np.int64)
    err, who = _core.peer_reduce(pids, 0, np.array([[x.ctypes.data], [x.ctypes.data]], np.int64), dst, counts, 2,
                                 0, 50, False, 1.0, scratch, True)
    assert who == 1 and err != 0


def test_stripes_are_cache_line_multiples_a_multiple_of_the_ranks_and_cover_everything():
    red = cma.CMAReducer.__new__(cma.CMAReducer)
    for p in (2, 3, 7):
        red.size = p
        for n, item in ((0, 4), (1, 4), (17, 2), (1000003, 4), (12345, 8), (25_557_032, 4)):
            c = red._cuts(n, item)
            assert c[0] == 0 and c[-1] == n and (np.diff(c) >= 0).all() and (len(c) - 1) % p == 0
            assert all(int(v) % (64 // item) == 0 for v in c[1:-1] if v < n)
            if n * item >= 2 * p * cma.STRIPE_BYTES:          # large calls: stripes near STRIPE_BYTES
                assert 0.5 * cma.STRIPE_BYTES <= np.diff(c)[0] * item <= 1.5 * cma.STRIPE_BYTES


@pytest.mark.parametrize("p", [2, 3])
def test_bf16_words_follow_the_16_bit_sum(p):
    """Code 6 (the bf16 compressor's payload words): rank-order adds by ``_core.sum16``'s
    bf16 rule, a float32 add rounded once per add."""
    rng = np.random.default_rng(p)
    words = [rng.integers(0, 1 << 16, 50_001).astype(np.uint16) for _ in range(p)]
    want = words[0].copy()
    for w in words[1:]:
        nxt = w.copy()
        _core.sum16(2, want, nxt)            # nxt = want + w
        want = nxt
    ranks = [([w.copy()], [w.copy()]) for w in words]
    _run(ranks, cma.BF16, False, 4096, True)
    for _, dst in ranks:
        assert np.array_equal(dst[0], want)


def test_tables_may_be_slices_of_a_wider_table():
    """The address tables are views into the allgather's buffer ([src, dst] per group):
    rows `stride` apart; a row that is not contiguous int64 is refused."""
    rng = np.random.default_rng(11)
    xs = [[rng.standard_normal(n).astype(np.float32) for n in (5, 9000, 3)] for _ in range(2)]
    want = [x + y for x, y in zip(*xs)]
    wide = np.zeros((2, 10), np.int64)
    wide[:, 2:5] = [[a.ctypes.data for a in x] for x in xs]
    tab = wide[:, 2:5]
    counts = np.array([5, 9000, 3], np.int64)
    pids = np.full(2, PID, np.int64)
    cuts = np.array([0, 4512, 9008], np.int64)
    scratch = np.empty(8192, np.uint8)
    for me in range(2):
        assert _core.peer_reduce(pids, me, tab, tab, counts, 2, int(cuts[me]), int(cuts[me + 1]), False, 1.0,
                                 scratch) == (0, -1)
    for me in range(2):
        assert _core.peer_gather(pids, me, tab, counts, 2, cuts) == (0, -1)
    for x in xs:
        for got, w in zip(x, want):
            assert np.array_equal(got, w)
    with pytest.raises(ValueError, match="contiguous int64"):
        _core.peer_gather(pids, 0, wide[:, 2:8:2], counts, 2, cuts)


def test_pieces_are_an_eighth_of_the_l2_cache_within_bounds(tmp_path):
    """``cma.PIECE_BYTES``: an eighth of the level-2 cache (sysfs), 64 KiB to 1 MiB, on
    64-byte multiples; 256 KiB where the cache size is unknown."""
    assert cma._piece_bytes(0) == 256 << 10
    assert cma._piece_bytes(2 << 20) == 256 << 10
    assert cma._piece_bytes(1280 << 10) == 160 << 10
    assert cma._piece_bytes(256 << 10) == 64 << 10
    assert cma._piece_bytes(64 << 20) == 1 << 20
    assert cma.PIECE_BYTES % 64 == 0 and (64 << 10) <= cma.PIECE_BYTES <= (1 << 20)
    # the sysfs layout: index0..3, each with its level and size
    for i, (level, size) in enumerate((("1", "48K"), ("1", "32K"), ("2", "2048K"), ("3", "300M"))):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(level + "\n")
        (d / "size").write_text(size + "\n")
    assert cma._l2_bytes(str(tmp_path)) == 2 << 20
    assert cma._l2_bytes(str(tmp_path / "nothing")) == 0
