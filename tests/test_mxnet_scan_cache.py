"""gradfuse.mxnet's scan cache (``fence._ScanCache``): a call that passes the very same
NDArray objects as a recent one reuses their scan; anything else is scanned afresh, and
the cache never keeps arrays alive that nobody else holds beyond its next miss."""
import gc
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
pytest.importorskip("mpi4py")

import gradfuse.mxnet as hvd  # noqa: E402
from gradfuse.mxnet import fence  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    hvd.init()
    fence._scans.clear()
    yield
    fence._scans.clear()


def test_same_objects_reuse_the_scan_and_equal_ones_do_not():
    nds = [mx.nd.ones((3, 4)), mx.nd.zeros(7, dtype="float16")]
    a = fence.Tables(list(nds))
    b = fence.Tables(list(nds))                       # another list, the same objects
    assert b.handles is a.handles and b.sig == a.sig
    assert not b.ptrs.any() and b.ptrs is not a.ptrs  # the pointers are the call's own
    c = fence.Tables([nds[0], mx.nd.zeros(7, dtype="float16")])      # an equal array, not the same
    assert c.handles is not a.handles
    d = fence.Tables([nds[0], mx.nd.zeros(8, dtype="float16")])
    assert d.shape(1) == (8,) and d.nbytes[1] == 16


def test_outputs_are_scanned_every_time_and_inputs_still_reused():
    nds = [mx.nd.ones(5)]
    outs = [mx.nd.empty(5)]
    a = fence.Tables(nds, outs)
    b = fence.Tables(nds, [mx.nd.empty(5)])
    assert a.handles is not b.handles and a.handles[1] != b.handles[1]


def test_lists_nobody_holds_are_let_go_and_shutdown_clears():
    keep = [mx.nd.ones(4)]
    fence.Tables(keep)
    for i in range(5):
        fence.Tables([mx.nd.ones(i + 1)])             # temporaries: dropped after the call
    gc.collect()
    held = [t for t, _ in fence._scans._d.values()]
    assert any(t[0] is keep[0] for t in held)
    assert len(held) <= 2                             # keep's, and at most the last temporary
    fence.Tables([mx.nd.ones(9)])
    assert sys.getrefcount(keep[0]) >= 3
    hvd.shutdown()
    assert not fence._scans._d
    hvd.init()


def test_the_cache_is_bounded():
    arrays = [[mx.nd.ones(i + 1)] for i in range(fence._ScanCache.MAX + 10)]
    for a in arrays:
        fence.Tables(a)
    assert len(fence._scans._d) == fence._ScanCache.MAX


def test_results_stay_right_while_lists_change():
    """Reused and fresh scans in one loop: every allreduce (one rank: the identity) keeps
    the right values and shapes."""
    base = [mx.nd.array(np.arange(n, dtype=np.float32)) for n in (3, 70, 1)]
    for step in range(6):
        nds = base if step % 2 else [mx.nd.array(np.full(step + 2, step, np.float32))] + base[1:]
        want = [nd.asnumpy().copy() for nd in nds]
        hvd.grouped_allreduce_(nds, op=hvd.Sum, name=f"scan{step % 2}")
        for nd, w in zip(nds, want):
            np.testing.assert_array_equal(nd.asnumpy(), w)


def _mx_pointer(nd):
    import ctypes
    p = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(nd.handle, ctypes.byref(p)))
    return p.value or 0


def _start(tables):
    """One in-place engine operation over ``tables``, run to its start: the data pointers
    its callback read, then completed."""
    op = fence.new_op(tables, 0)
    fence.push(op, "test.direct")
    assert op.wait_ready() is None
    got = tables.ptrs.copy()
    op.complete(None)
    mx.nd.waitall()
    return got


@pytest.fixture
def direct_on():
    from gradfuse.mxnet import _engine
    if not fence.DEFERRED:
        pytest.skip("pointers are read at call time on this MXNet build")
    was = _engine.direct()
    _engine.set_direct(True)
    yield _engine
    _engine.set_direct(was)


def test_direct_pointers_are_the_ones_mxnet_gives(direct_on):
    """The start callback computes a known array's pointer from its storage's address and
    the offset it learned at an earlier call: the same pointers as MXNDArrayGetData, for
    fresh arrays, a lazily allocated one, views at an offset, a reshape and float16, call
    after call, and for a list whose first array is a new one at every call."""
    assert fence._layout_holds()            # MXNet 1.9.1's layout, as fence.py checks it
    base = mx.nd.array(np.arange(60, dtype=np.float32).reshape(6, 10))
    nds = [base, mx.nd.empty((4, 3)), mx.nd.ones(9, dtype="float16"), mx.nd.zeros(1)]
    views = [base[1:3], base[4:].reshape((2, 5, 2))]      # offsets 40 and 160 bytes into base
    for arrays in (nds, views):
        for call in range(3):
            tables = fence.Tables(arrays)
            assert (tables.memo is not None) and (call == 0 or tables.memo.any())
            got = _start(tables)
            assert got.tolist() == [_mx_pointer(nd) for nd in arrays], (arrays is views, call)
    assert direct_on.direct()
    # a list whose first array is another object at each call: scanned afresh, learned afresh
    for call in range(3):
        arrays = [mx.nd.ones(5 + call)] + nds[1:]
        assert _start(fence.Tables(arrays)).tolist() == [_mx_pointer(nd) for nd in arrays]


def test_a_pointer_that_disagrees_turns_direct_pointers_off(direct_on):
    """The callback reads the first known array both ways at every call: when they
    disagree (here: a corrupted offset, as a different MXNet layout would give), the call's
    pointers come from MXNDArrayGetData, all of them, and direct pointers stay off."""
    arrays = [mx.nd.ones(7), mx.nd.ones(300), mx.nd.ones(2)]
    tables = fence.Tables(arrays)
    _start(tables)
    assert tables.memo.any()
    tables = fence.Tables(arrays)
    tables.memo[len(arrays)] += 64             # array 0's offset
    got = _start(tables)
    assert got.tolist() == [_mx_pointer(nd) for nd in arrays]
    assert not direct_on.direct()
    got = _start(fence.Tables(arrays))
    assert got.tolist() == [_mx_pointer(nd) for nd in arrays]
