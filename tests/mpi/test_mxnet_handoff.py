"""The engine hand-off of gradfuse.mxnet (issue 15, items 1 and 7), across ranks.

Every collective is one operation in MXNet's engine and returns at once; the data moves
when the other ranks arrive, and MXNet's dependency tracking makes ``wait_to_read()`` /
``asnumpy()`` wait for it. The tests below make the last rank arrive late (``DELAY``):
the other ranks' calls must return long before that rank has even called, and their
``wait_to_read()`` must then wait for it and give the right values. Errors of an
engine-pushed operation are rethrown by MXNet at the wait on its outputs, on every rank.
"""
import time

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
from mxnet import autograd, gluon  # noqa: E402
from mxnet.base import MXNetError  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402
from gradfuse.mxnet.errors import CollectiveMismatchError  # noqa: E402
from gradfuse.mxnet.optimizer import _Reducer  # noqa: E402

DELAY = 0.6          # seconds the last rank waits before it calls
QUICK = DELAY / 3    # a call that "returns at once" takes less than this (a shared, loaded machine)


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


def _late(world):
    """True on the rank that arrives late (the last one)."""
    return world.rank == world.size - 1


def _timed_call(world, fn):
    """Start every rank together, the last one DELAY late; returns (result, call seconds)."""
    mx.nd.waitall()
    world.Barrier()
    if _late(world):
        time.sleep(DELAY)
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _outputs(out):
    if isinstance(out, hvd.AsyncHandle):
        out = out._result
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _raised(arrays):
    """Wait on each array; the MXNetErrors raised. MXNet rethrows a failed operation's
    error once: all of its outputs share it, so the first wait on any of them raises it."""
    got = []
    for a in arrays:
        try:
            a.wait_to_read()
        except MXNetError as exc:
            got.append(exc)
    return got


def _rank_ones(world, shape, dtype="float32"):
    return mx.nd.ones(shape, dtype=dtype) * (world.rank + 1)


def _tri(world):
    return world.size * (world.size + 1) / 2


def _cases(world):
    n, s = world.size, _tri(world)
    r = world.rank
    return {
        "allreduce": (lambda: hvd.allreduce(_rank_ones(world, (5,)), op=hvd.Sum, name="h.ar"),
                      [np.full(5, s)]),
        "allreduce_": (lambda: hvd.allreduce_(_rank_ones(world, (5,)), op=hvd.Sum, name="h.ar_"),
                       [np.full(5, s)]),
        "allreduce average float64": (lambda: hvd.allreduce(_rank_ones(world, (3, 2), "float64"), name="h.avg"),
                                      [np.full((3, 2), s / n)]),
        "allreduce prescale (not fused)": (
            lambda: hvd.allreduce(_rank_ones(world, (4,)), op=hvd.Sum, prescale_factor=0.5, name="h.pre"),
            [np.full(4, s * 0.5)]),
        "allreduce Max": (lambda: hvd.allreduce(_rank_ones(world, (4,)), op=hvd.Max, name="h.max"),
                          [np.full(4, n)]),
        "grouped_allreduce": (lambda: hvd.grouped_allreduce([_rank_ones(world, (3,)), _rank_ones(world, (2, 2))],
                                                            op=hvd.Sum, name="h.g"),
                              [np.full(3, s), np.full((2, 2), s)]),
        "grouped_allreduce_": (lambda: hvd.grouped_allreduce_([_rank_ones(world, (3,)), _rank_ones(world, (7,))],
                                                              op=hvd.Sum, name="h.g_"),
                               [np.full(3, s), np.full(7, s)]),
        "allreduce_async": (lambda: hvd.allreduce_async(_rank_ones(world, (4,)), op=hvd.Sum, name="h.async"),
                            [np.full(4, s)]),
        "allreduce_async_": (lambda: hvd.allreduce_async_(_rank_ones(world, (4,)), op=hvd.Sum, name="h.async_"),
                             [np.full(4, s)]),
        "grouped_allreduce_async_": (
            lambda: hvd.grouped_allreduce_async_([_rank_ones(world, (2,)), _rank_ones(world, (3,))], op=hvd.Sum,
                                                 name="h.gasync_"),
            [np.full(2, s), np.full(3, s)]),
        "broadcast": (lambda: hvd.broadcast(_rank_ones(world, (4,)), root_rank=0, name="h.b"), [np.ones(4)]),
        "broadcast_": (lambda: hvd.broadcast_(_rank_ones(world, (4,)), root_rank=n - 1, name="h.b_"),
                       [np.full(4, n)]),
        "reducescatter": (lambda: hvd.reducescatter(_rank_ones(world, (2 * n, 3)), op=hvd.Sum, name="h.rs"),
                          [np.full((2, 3), s)]),
        "grouped_reducescatter": (
            lambda: hvd.grouped_reducescatter([_rank_ones(world, (n,)), _rank_ones(world, (n, 2))], op=hvd.Sum,
                                              name="h.grs"),
            [np.full(1, s), np.full((1, 2), s)]),
    }


CASES = list(_cases(type("W", (), {"size": 2, "rank": 0})()))


@pytest.mark.parametrize("case", CASES)
def test_the_call_returns_before_the_late_rank_has_called(world, case):
    """The call returns at once on the ranks that are on time; wait_to_read() waits for the
    late rank and gives the right result."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    fn, want = _cases(world)[case]
    out, t_call = _timed_call(world, fn)
    t0 = time.perf_counter()
    outs = _outputs(out)
    for o in outs:
        o.wait_to_read()
    t_wait = time.perf_counter() - t0
    for o, w in zip(outs, want):
        np.testing.assert_array_equal(o.asnumpy(), w)
    if not _late(world):
        assert t_call < QUICK, f"{case}: the call took {t_call:.3f} s while a rank was {DELAY} s late"
        assert t_wait > DELAY / 2, f"{case}: wait_to_read returned after {t_wait:.3f} s, before the late rank"
    if isinstance(out, hvd.AsyncHandle):
        assert out.wait() is out._result
    world.Barrier()


@pytest.mark.parametrize("which", ["allgather", "alltoall"])
def test_allgather_and_alltoall_block_for_the_shape_round_only(world, which):
    """allgather and alltoall size their outputs from the other ranks' first dimensions: a
    blocking round at call time (docs/mxnet.md); the data then moves through the engine."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    n, r = world.size, world.rank
    if which == "allgather":
        out, t_call = _timed_call(world, lambda: hvd.allgather(_rank_ones(world, (r + 1, 2)), name="h.ag"))
        want = np.concatenate([np.full((k + 1, 2), k + 1) for k in range(n)])
    else:
        out, t_call = _timed_call(world, lambda: hvd.alltoall(_rank_ones(world, (2 * n,)), name="h.a2a"))
        want = np.repeat(np.arange(1, n + 1), 2)
    np.testing.assert_array_equal(out.asnumpy(), want)
    if not _late(world):
        assert t_call > DELAY / 2, f"{which}: the call returned after {t_call:.3f} s, before the shape round"
    world.Barrier()


def _mlp(prefix):
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Dense(16, in_units=8, activation="relu"), gluon.nn.Dense(4, in_units=16))
    net.initialize(mx.init.Constant(0.1))
    return net


@pytest.mark.parametrize("kind", ["trainer", "trainer num_groups=2", "trainer overlap", "optimizer"])
def test_training_step_returns_before_the_late_rank_has_called(world, kind):
    """DistributedTrainer / DistributedOptimizer use the same hand-off: step() returns while
    the gradients are still being averaged, the update waits for them in MXNet's engine,
    and every rank ends with the parameters of the averaged gradient."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    net = _mlp(f"hand_{kind.replace(' ', '_').replace('=', '')}_")
    params = net.collect_params()
    if kind == "optimizer":
        opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1))
        trainer = gluon.Trainer(params, opt, kvstore=None)
    else:
        kw = {"num_groups": 2} if "num_groups" in kind else {"overlap": True, "fusion_threshold": 256} \
            if "overlap" in kind else {}
        trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.1}, **kw)
    x = mx.nd.ones((2, 8)) * (world.rank + 1)
    for step in range(2):           # the first step also builds the plans
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        _, t_call = _timed_call(world, lambda: trainer.step(2))
        ws = [p.data().asnumpy() for p in params.values()]
        if step and not _late(world):
            assert t_call < QUICK, f"{kind}: step() took {t_call:.3f} s while a rank was {DELAY} s late"
    _same_on_every_rank_as_one_process(world, ws, f"ref_{kind.replace(' ', '_').replace('=', '')}_", 2)


def _same_on_every_rank_as_one_process(world, ws, prefix, steps):
    """Every rank holds the same parameters ``ws``, and they are those of one process that
    ran ``steps`` SGD steps (lr 0.1) of ``_mlp`` on all ranks' batches."""
    got = np.concatenate([w.ravel() for w in ws])
    np.testing.assert_array_equal(world.allgather(got)[0], got)
    ref = _mlp(prefix)
    tr = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=None)
    xs = mx.nd.concat(*[mx.nd.ones((2, 8)) * (k + 1) for k in range(world.size)], dim=0)
    for _ in range(steps):
        with autograd.record():
            loss = ref(xs).sum()
        loss.backward()
        tr.step(2 * world.size)
    want = np.concatenate([p.data().asnumpy().ravel() for p in ref.collect_params().values()])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    world.Barrier()


def _kv_cases(world):
    """KVStore calls: (call, [(output, expected)])."""
    n, s, r = world.size, _tri(world), world.rank
    ctxs = [mx.cpu(0), mx.cpu(1)]

    def one_key():
        a = _rank_ones(world, (5,))
        hvd.KVStore().pushpull("hk.a", a)
        return [(a, np.full(5, s))]

    def keys():
        a, b, out = _rank_ones(world, (3,)), _rank_ones(world, (2, 2)) * 10, mx.nd.zeros((2, 2))
        hvd.KVStore().pushpull(["hk.b", "hk.c"], [a, b], out=[a, out])
        return [(a, np.full(3, s)), (out, np.full((2, 2), 10 * s))]

    def devices():
        vals = [mx.nd.ones((4,), ctx=c) * (r + d) for d, c in enumerate(ctxs)]
        hvd.KVStore().pushpull("hk.d", vals)
        return [(v, np.full(4, 2 * (s - n) + n)) for v in vals]

    def update_on_store():
        kv = hvd.KVStore(update_on_kvstore=True)
        kv.init("hk.w", mx.nd.ones((3,)))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0, wd=0.0))
        out = mx.nd.zeros((3,))
        kv.pushpull("hk.w", _rank_ones(world, (3,)), out=out)
        return [(out, np.full(3, 1.0 - 0.5 * s))]
    return {"one key": one_key, "keys": keys, "two devices": devices, "update on the store": update_on_store}


@pytest.mark.parametrize("case", ["one key", "keys", "two devices", "update on the store"])
def test_kvstore_pushpull_returns_before_the_late_rank_has_called(world, case):
    """The dist_gradfuse KVStore's pushpull goes through the same hand-off: it returns at
    once; the device sum, the store's update and the copies out wait in MXNet's engine."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    fn = _kv_cases(world)[case]
    mx.nd.waitall()
    world.Barrier()
    if _late(world):
        time.sleep(DELAY)
    t0 = time.perf_counter()
    pairs = fn()
    t_call = time.perf_counter() - t0
    t0 = time.perf_counter()
    for o, _ in pairs:
        o.wait_to_read()
    t_wait = time.perf_counter() - t0
    for o, want in pairs:
        np.testing.assert_array_equal(o.asnumpy(), want)
    if not _late(world):
        assert t_call < QUICK, f"{case}: pushpull took {t_call:.3f} s while a rank was {DELAY} s late"
        assert t_wait > DELAY / 2, f"{case}: the output was ready after {t_wait:.3f} s, before the late rank"
    world.Barrier()


def test_trainer_step_through_the_kvstore_returns_before_the_late_rank_has_called(world):
    """gluon.Trainer(kvstore='dist_gradfuse'): after the first step (the store learns the
    key sequence), step() returns at once; the parameters are those of the summed gradients."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    net = _mlp("hand_kv_")
    params = net.collect_params()
    trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.1}, kvstore="dist_gradfuse")
    x = mx.nd.ones((2, 8)) * (world.rank + 1)
    for step in range(3):
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        _, t_call = _timed_call(world, lambda: trainer.step(2 * world.size))
        ws = [p.data().asnumpy() for p in params.values()]
        if step and not _late(world):
            assert t_call < QUICK, f"step() took {t_call:.3f} s while a rank was {DELAY} s late"
    _same_on_every_rank_as_one_process(world, ws, "ref_kv_", 3)


def test_an_engine_error_reaches_every_rank_at_wait_to_read_and_the_next_call_matches(world):
    """A mismatch only the negotiation finds (every rank's own checks pass): each rank's
    call returns, and the error is rethrown by MXNet at wait_to_read() on every rank, as
    the binding's class (an MXNetError); the next collective matches."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    out, t_call = _timed_call(world, lambda: hvd.allreduce(mx.nd.ones((3 + world.rank,)), name="h.mismatch"))
    if not _late(world):
        assert t_call < QUICK
    with pytest.raises(CollectiveMismatchError) as info:
        out.wait_to_read()
    assert isinstance(info.value, MXNetError)
    assert "h.mismatch" in str(info.value) and "shape" in str(info.value)
    assert all(world.allgather(True))
    out = hvd.allreduce(_rank_ones(world, (3,)), op=hvd.Sum, name="h.after.mismatch")
    np.testing.assert_array_equal(out.asnumpy(), np.full(3, _tri(world)))


def test_an_error_nobody_waited_for_is_raised_by_waitall(world):
    """Errors are never lost: an output nobody waits on keeps its error for mx.nd.waitall()."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    hvd.allreduce(mx.nd.ones((2 + world.rank,)), name="h.lost")       # the output is dropped
    with pytest.raises(CollectiveMismatchError):
        mx.nd.waitall()
    mx.nd.waitall()          # raised once
    out = hvd.allreduce(_rank_ones(world, (3,)), op=hvd.Sum, name="h.after.lost")
    np.testing.assert_array_equal(out.asnumpy(), np.full(3, _tri(world)))


# --- item 7: one group fails, the others finish or stay fenced ---------------------------
def _grads(world, bad_group):
    """Three groups of two gradients; on the last rank, group ``bad_group``'s first gradient
    has the transposed shape (same bytes, so every rank cuts the same groups)."""
    shapes = [(2, 3), (4,), (3, 5), (6,), (2, 7), (5,)]
    gs = []
    for i, s in enumerate(shapes):
        if i == 2 * bad_group and _late(world):
            s = s[::-1]
        gs.append(mx.nd.ones(s) * (world.rank + 1) * (i + 1))
    return gs


@pytest.mark.parametrize("mode", ["num_groups", "overlap"])
def test_one_failed_group_the_other_groups_writes_are_fenced(world, mode):
    """One group fails (a mismatch found in its negotiation); the call has returned on every
    rank with the other groups still in flight. Their writes are fenced by MXNet's
    dependency tracking: a read right after sees the averaged values, a write right after
    (the next backward) lands after the reduction and is not overwritten; the failed
    group's error is raised at the wait on its gradients, on every rank; the next
    collective matches."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    red = _Reducer(hvd.global_process_set, None, {}, fusion_threshold=64)
    bad = 1
    gs = _grads(world, bad)
    names = [f"h.grp.{mode}.{i}" for i in range(len(gs))]
    kw = {"num_groups": 3} if mode == "num_groups" else {"overlap": True}
    groups = red._groups(gs, kw.get("num_groups", 0), kw.get("overlap", False))
    assert len(groups) >= 3
    failed = next(g for g in groups if 2 * bad in g)
    _, t_call = _timed_call(world, lambda: red.reduce_(gs, names, **kw))
    if not _late(world):
        assert t_call < QUICK, f"reduce_ took {t_call:.3f} s"
    snaps = [g * 1 for g in gs]                  # reads, pushed at once (before the data is there)
    for g in gs:
        g[:] = -7                                # writes of the next backward, pushed at once
    avg = (world.size + 1) / 2
    got = _raised([snaps[i] for i in failed])
    assert len(got) == 1 and isinstance(got[0], CollectiveMismatchError), got
    assert "shape" in str(got[0]) and names[2 * bad] in str(got[0]), str(got[0])
    for i, (g, s) in enumerate(zip(gs, snaps)):
        if i in failed:
            continue
        np.testing.assert_array_equal(s.asnumpy(), np.full(g.shape, avg * (i + 1)), err_msg=names[i])
        np.testing.assert_array_equal(g.asnumpy(), np.full(g.shape, -7.0), err_msg=names[i])
    mx.nd.waitall()                              # the failed group's error was raised once
    red.synchronize()
    assert all(world.allgather(True))
    out = hvd.allreduce(_rank_ones(world, (3,)), op=hvd.Sum, name=f"h.after.grp.{mode}")
    np.testing.assert_array_equal(out.asnumpy(), np.full(3, _tri(world)))


def test_a_group_refused_on_one_rank_the_later_groups_still_match(world):
    """A group that fails its local check on one rank (a sparse gradient there): that rank
    raises at the call, after its earlier groups finished; the later groups are refused
    too, so no rank is left paired with the next call; the other ranks see the error at
    the wait on the failed groups, and their other groups are averaged."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    red = _Reducer(hvd.global_process_set, None, {})
    gs = [mx.nd.ones((4,)) * (world.rank + 1) * (i + 1) for i in range(6)]
    if _late(world):
        gs[2] = gs[2].tostype("row_sparse")
    names = [f"h.ref.{i}" for i in range(6)]
    if _late(world):
        with pytest.raises(TypeError, match="h.ref.2"):
            red.reduce_(gs, names, num_groups=3)
        np.testing.assert_array_equal(gs[0].asnumpy(), np.full(4, (world.size + 1) / 2))
    else:
        red.reduce_(gs, names, num_groups=3)
        for i in range(2):
            np.testing.assert_array_equal(gs[i].asnumpy(), np.full(4, (world.size + 1) / 2 * (i + 1)))
        for group in ([2, 3], [4, 5]):           # each failed group raises, naming the rank
            got = _raised([gs[i] for i in group])
            assert len(got) == 1 and f"rank {world.size - 1}" in str(got[0]), got
            assert names[group[0]] in str(got[0]) or "h.ref.2" in str(got[0]), str(got[0])
    mx.nd.waitall()
    red.synchronize()
    assert all(world.allgather(True))
    out = hvd.allreduce(_rank_ones(world, (3,)), op=hvd.Sum, name="h.after.refused")
    np.testing.assert_array_equal(out.asnumpy(), np.full(3, _tri(world)))


# --- arrays that share storage: one engine variable ---------------------------------------
def test_the_same_array_twice_in_one_call(world):
    """MXNet's engine, given one variable twice, would wait for itself (a hang): each
    storage is one dependency. The same array twice is reduced into both entries (what
    Horovod's fusion buffer gives); reads of one array twice, and reshaped views, too."""
    a = _rank_ones(world, (3,))
    hvd.grouped_allreduce_([a, a], op=hvd.Sum, name="h.dup.inplace")
    np.testing.assert_array_equal(a.asnumpy(), np.full(3, _tri(world)))
    b = _rank_ones(world, (4,))
    got = hvd.grouped_allreduce([b, b, b.reshape((2, 2))], op=hvd.Sum, name="h.dup.oop")
    for g in got:
        np.testing.assert_array_equal(g.asnumpy().ravel(), np.full(4, _tri(world)))
    c = _rank_ones(world, (2,))
    hvd.broadcast_parameters({"x": c, "y": c}, root_rank=0, prefix="h.dup.")
    np.testing.assert_array_equal(c.asnumpy(), np.ones(2))


def test_partly_overlapping_in_place_arrays_are_refused_by_name(world):
    """Overlapping parts of one array would write each other's elements: ValueError
    naming both tensors, on every rank; the next call matches."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    b = mx.nd.ones((6,))
    hvd.grouped_allreduce_([b, b[2:5]], op=hvd.Sum, name="h.part")
    with pytest.raises(ValueError, match="tensor 'h.part.0' and tensor 'h.part.1' partly overlap"):
        b.wait_to_read()
    out = hvd.allreduce(_rank_ones(world, (3,)), op=hvd.Sum, name="h.after.part")
    np.testing.assert_array_equal(out.asnumpy(), np.full(3, _tri(world)))


def test_a_collective_on_an_array_that_carries_an_error_does_not_hang(world):
    """MXNet skips an operation whose arrays carry an earlier operation's error (it never
    starts it): the collective is refused on every rank instead of waiting for a start
    that never comes; the first error is raised at the wait; later collectives match."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    a = mx.nd.ones((3 + world.rank,))
    hvd.allreduce_(a, name="h.carry.bad")              # a mismatch: a now carries its error
    hvd.allreduce_(a, op=hvd.Sum, name="h.carry.next")  # skipped by MXNet on every rank
    out = hvd.allreduce(_rank_ones(world, (2,)), op=hvd.Sum, name="h.carry.other")
    np.testing.assert_array_equal(out.asnumpy(), np.full(2, _tri(world)))
    with pytest.raises(CollectiveMismatchError, match="h.carry.bad"):
        a.wait_to_read()
    mx.nd.waitall()
    out = hvd.allreduce(_rank_ones(world, (3,)), op=hvd.Sum, name="h.after.carry")
    np.testing.assert_array_equal(out.asnumpy(), np.full(3, _tri(world)))
