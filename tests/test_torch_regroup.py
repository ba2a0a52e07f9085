"""gradfuse.torch.regroup on its own: a restarted DDP's buckets routed to the restored
layouts, in their order; every bucket's future completes once the steps holding its
tensors did, also when the iteration ends or a bucket no restored layout holds arrives
before a layout is complete (no future may wait forever)."""
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

from gradfuse.torch.regroup import Regroup  # noqa: E402


class IO:
    """What Regroup reads of a BucketIO: views, layout, buf, future(), finish()."""

    def __init__(self, idx, names, shapes):
        self.views = [f"view:{n}" for n in names]
        self.layout = (tuple(f"bucket{idx}.{n}" for n in names), tuple(shapes), "float32")
        self.buf = f"buf{idx}"
        self.finished = 0

    def future(self):
        return torch.futures.Future()

    def finish(self):
        self.finished += 1


class Handle:
    def __init__(self, fail=False):
        self.fail = fail

    def wait(self):
        if self.fail:
            raise RuntimeError("step failed")


def layout(idx, names, shapes):
    return (tuple(f"bucket{idx}.{n}" for n in names), tuple(shapes), "float32")


def make(fail=()):
    r0 = layout(0, ["c.w", "c.b", "b.w"], [(4, 3), (4,), (3, 3)])
    r1 = layout(1, ["b.b", "a.w"], [(3,), (3, 2)])
    keys = {(False, 0, r0): r0, (False, 1, r1): r1}
    runs, errors = [], []

    def submit(key, lay, views, src):
        runs.append((key[1], lay[0], list(views)))
        return Handle(fail=key[1] in fail)
    pool = ThreadPoolExecutor(1)
    return Regroup(keys, pool, errors.append), submit, runs, errors, pool


def test_one_initial_bucket_runs_every_restored_layout_in_its_order():
    rg, submit, runs, errors, pool = make()
    io = IO(0, ["a.w", "b.b", "b.w", "c.b", "c.w"], [(3, 2), (3,), (3, 3), (4,), (4, 3)])
    assert rg.covers(io)
    fut = rg.add(io, submit, last=True)
    pool.shutdown(wait=True)
    assert [r[0] for r in runs] == [0, 1] or [r[0] for r in runs] == [1, 0]
    by = {r[0]: r for r in runs}
    assert by[0][1] == ("bucket0.c.w", "bucket0.c.b", "bucket0.b.w")
    assert by[0][2] == ["view:c.w", "view:c.b", "view:b.w"]
    assert by[1][2] == ["view:b.b", "view:a.w"]
    assert fut.done() and fut.value() == "buf0" and io.finished == 1 and not errors and rg.done


def test_a_layout_split_over_two_buckets_waits_for_the_second():
    rg, submit, runs, errors, pool = make()
    first = IO(0, ["c.w", "c.b"], [(4, 3), (4,)])
    second = IO(1, ["b.w", "b.b", "a.w"], [(3, 3), (3,), (3, 2)])
    f1 = rg.add(first, submit, last=False)
    assert runs == [] and not f1.done()
    assert rg.covers(second)
    f2 = rg.add(second, submit, last=True)
    pool.shutdown(wait=True)
    assert sorted(r[0] for r in runs) == [0, 1]
    assert f1.done() and f2.done() and first.finished == second.finished == 1


def test_flush_runs_what_arrived_and_completes_every_future():
    rg, submit, runs, errors, pool = make()
    f1 = rg.add(IO(0, ["c.w"], [(4, 3)]), submit, last=False)
    stranger = IO(1, ["z.w"], [(2,)])
    assert not rg.covers(stranger)
    rg.flush(submit, stranger)
    pool.shutdown(wait=True)
    assert runs == [(0, ("bucket0.c.w",), ["view:c.w"])]         # a partial layout, on its own pipeline
    assert f1.done() and rg.done


def test_a_failed_step_fails_every_bucket_that_waits_for_it():
    rg, submit, runs, errors, pool = make(fail=(1,))
    io = IO(0, ["a.w", "b.b", "b.w", "c.b", "c.w"], [(3, 2), (3,), (3, 3), (4,), (4, 3)])
    fut = rg.add(io, submit, last=True)
    pool.shutdown(wait=True)
    assert fut.done() and len(errors) == 1
    with pytest.raises(RuntimeError, match="step failed"):
        fut.wait()
    assert io.finished == 0
