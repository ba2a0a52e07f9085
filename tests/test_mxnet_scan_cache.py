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
