"""Steady state of gradfuse.mxnet's training paths (issue 15, item 6), across ranks.

DistributedOptimizer makes one collective per aggregated update (MXNet's optimizers
update ``aggregate_num`` parameters at a time), so a deep model has many distinct groups:
the plan cache must hold all of them (no rebuilding after warm-up), and a step after
warm-up must not allocate buffers (fusion buffers, outputs, wire buffers).
"""
import gc
import tracemalloc
from collections import Counter

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402

LAYERS = 24          # 48 parameters; 12 groups of aggregate_num=4 (more than the old cache of 8)


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


def _deep(prefix, width):
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        for _ in range(LAYERS):
            net.add(gluon.nn.Dense(width, in_units=width))
    net.initialize(mx.init.Constant(0.01))
    return net


def _setup(world, prefix, width, **kw):
    net = _deep(prefix, width)
    sgd = mx.optimizer.SGD(learning_rate=0.01)
    sgd.aggregate_num = 4                # MXNet's default (MXNET_OPTIMIZER_AGGREGATION_SIZE), fixed here
    opt = hvd.DistributedOptimizer(sgd, **kw)
    trainer = gluon.Trainer(net.collect_params(), opt, kvstore=None)
    x = mx.nd.ones((2, width)) * (world.rank + 1)

    def start():
        """backward and the update: returns with the collectives in flight"""
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(2)

    def finish():
        mx.nd.waitall()
        opt._reducer.synchronize()

    def step():
        start()
        finish()
    step.start, step.finish = start, finish
    return net, opt, step


def _groups(opt):
    return sum(p.stats.steps for p in opt._reducer.pipelines)


@pytest.mark.parametrize("kw", [{}, {"num_groups": 2}])
def test_distributed_optimizer_with_many_groups_builds_its_plans_once(world, kw):
    if world.size == 1:
        pytest.skip("DistributedOptimizer reduces nothing on one rank")
    net, opt, step = _setup(world, f"ss_plans{len(kw)}_", 8, **kw)
    step()
    built = opt._reducer.stats().plans_built
    calls = _groups(opt)
    assert calls >= 12, f"only {calls} collectives in a step: the test needs more than 8 groups"
    assert built >= 12
    for _ in range(4):
        step()
    assert opt._reducer.stats().plans_built == built, "plans were rebuilt after warm-up"
    assert _groups(opt) == 5 * calls
    # and the parameters agree on every rank
    w = np.concatenate([p.data().asnumpy().ravel() for p in net.collect_params().values()])
    np.testing.assert_array_equal(world.allgather(w)[0], w)


def _new_big_blocks(before, after, limit):
    """Single blocks of at least ``limit`` bytes alive in ``after`` and not in ``before``
    (matched by size and where they were allocated)."""
    def big(snap):
        return Counter((t.size, t.traceback) for t in snap.traces if t.size >= limit)
    return list((big(after) - big(before)).elements())


def _show(blocks):
    return "\n".join(f"{size} B at {tb.format()[-2:]}" for size, tb in blocks)


def test_a_step_after_warm_up_allocates_no_buffer_of_4_kib(world):
    """From step 3 on, a step allocates no block of 4 KiB or more (tracemalloc, which sees
    every thread: the caller's and gradfuse's communication thread; MXNet's C++ memory is
    not Python's and not seen). Checked block by block at two moments: while every group
    of the step is in flight (trainer.step() has returned, nothing waited for), and after
    the step; and over the whole step through the peak of traced memory: the weights are
    1 MiB each (biases 2 KiB), so a fusion buffer, output or staging copy made per step
    would be 1 MiB or more, and the peak stays under 256 KiB (what is allocated is MXNet's
    and gradfuse's small Python objects, a few KiB per group in flight, none as large as
    4 KiB)."""
    if world.size == 1:
        pytest.skip("DistributedOptimizer reduces nothing on one rank")
    width = 512                                    # weights of 512 x 512 float32: 1 MiB
    net, opt, step = _setup(world, "ss_alloc_", width)
    for _ in range(2):
        step()                                     # warm-up: plans, buffers, MXNet's own caches
    tracemalloc.start(8)
    try:
        peaks = []
        for _ in range(3):                         # steps 3 to 5
            gc.collect()
            before = tracemalloc.take_snapshot()
            cur0, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            step.start()
            in_flight = tracemalloc.take_snapshot()
            step.finish()
            _, peak = tracemalloc.get_traced_memory()
            after = tracemalloc.take_snapshot()
            peaks.append(peak - cur0)
            big = _new_big_blocks(before, in_flight, 4096)
            assert not big, "blocks of 4 KiB or more while the step is in flight:\n" + _show(big)
            big = _new_big_blocks(before, after, 4096)
            assert not big, "a step kept new blocks of 4 KiB or more:\n" + _show(big)
        assert max(peaks) < 256 << 10, f"a step's allocations peaked {peaks} bytes above its start"
    finally:
        tracemalloc.stop()
