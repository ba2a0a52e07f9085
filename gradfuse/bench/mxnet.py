"""gradfuse.mxnet beside Horovod 0.28.1, gradfuse.Pipeline and per-tensor MPI.

    mpiexec -n 2 python -m gradfuse.bench mxnet --rounds 7 --sets resnet50,small
    python -m gradfuse.bench mxnet            # one rank: the per-tensor cost, no network

Per set (ResNet-50's 193 float32 gradients, 2000 small tensors), one run, every method
once per round, alternating, the median over rounds of the slowest rank:

* ``gradfuse.mxnet``: ``grouped_allreduce_(nds, op=Sum)`` on NDArrays, then the wait
  (``--wait all``: ``mx.nd.waitall()``, one call; ``--wait each``: ``wait_to_read()`` on
  every output, 2000 Python calls on the small set, on both sides alike);
* ``Pipeline (numpy)``: ``gradfuse.Pipeline(average=False).allreduce_`` on numpy arrays of
  the same shapes; with the ranks on one host its sums go through the ranks' own memory
  (``gradfuse.comm.cma``), as gradfuse.mxnet's do;
* ``Pipeline, MPI library``: the same on a communicator made with ``cma=False``
  (``GRADFUSE_CMA=0``): packed buckets and direct tensors through ``MPI_Allreduce``;
* ``Horovod <threshold>``: Horovod's ``grouped_allreduce_`` and the same wait, once per
  ``--horovod-thresholds`` entry (default: Horovod's own 128 MiB, and 4 MiB, the fastest
  of a sweep on this machine). Horovod reads ``HOROVOD_FUSION_THRESHOLD`` in ``init()``,
  so each Horovod method is ``init()`` with its threshold, one untimed warm-up call, the
  timed call, ``shutdown()``: its background thread does not run (and take a core) while
  the other methods are timed. MPI is initialised by mpi4py first, so Horovod's shutdown
  does not finalise it;
* ``MPI per-tensor``: ``comm.Allreduce(MPI.IN_PLACE, a)`` for each array;
* ``Pipeline.allreduce``: the README's out-of-place call (outputs dropped each round).

Then the per-tensor cost of gradfuse.mxnet, (t(2000 tensors) - t(one tensor of the same
bytes)) / 2000, on a one-rank process set of each rank (``ProcessSet(MPI.COMM_SELF)``),
so no network time is in it; Pipeline's beside it.

Every method is checked once against ``MPI.Allreduce`` before timing. Nothing here
asserts a target; the targets of docs/benchmarks.md are printed beside the ratios.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

from .sets import SETS, make_set, progress

HOROVOD_DEFAULT = 128 << 20          # Horovod 0.28.1's HOROVOD_FUSION_THRESHOLD default
HOROVOD_TUNED = 4 << 20              # the fastest of 256 KiB .. 128 MiB here (docs/benchmarks.md)


class Method:
    """One timed call (``run``), with untimed ``setup``/``teardown`` around it every round."""

    def __init__(self, run, setup=None, teardown=None):
        self.run, self.setup, self.teardown = run, setup, teardown


def _horovod():
    try:
        import horovod.mxnet as hvd
    except Exception:          # any import problem means: not available, say so in the table
        return None
    return hvd


def _label(threshold):
    if threshold == HOROVOD_DEFAULT:
        return "Horovod 128 MiB (default)"
    if threshold >= 1 << 20 and threshold % (1 << 20) == 0:
        return f"Horovod {threshold >> 20} MiB"
    return f"Horovod {threshold >> 10} KiB" if threshold % 1024 == 0 else f"Horovod {threshold} B"


def _horovod_method(hvd, mx, nds, name, threshold, wait):
    def setup():
        old = os.environ.get("HOROVOD_FUSION_THRESHOLD")
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(threshold)
        try:
            hvd.init()          # reads the variable here: put it back at once (gradfuse reads it too)
        finally:
            if old is None:
                os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
            else:
                os.environ["HOROVOD_FUSION_THRESHOLD"] = old
        run()                   # warm-up: negotiation and Horovod's response cache

    def run():
        hvd.grouped_allreduce_(nds, op=hvd.Sum, name=name)
        wait(nds)

    return Method(run, setup, hvd.shutdown)


def _timed(methods, rounds, sync, show=None):
    times = {k: [] for k in methods}
    for r in range(rounds):
        for k, m in methods.items():
            if m.setup:
                m.setup()
            sync()
            t0 = time.perf_counter()
            m.run()
            t = time.perf_counter() - t0
            sync()
            if m.teardown:
                m.teardown()
            times[k].append(t)
        if show:
            show(r + 1, rounds)
    return {k: statistics.median(v) for k, v in times.items()}


def _waiter(mx, how):
    if how == "each":
        def wait(nds):
            for nd in nds:
                nd.wait_to_read()
    else:
        def wait(nds):
            mx.nd.waitall()
    return wait


def _check(label, got, want, rank, exact=True):
    for g, w in zip(got, want):
        ok = np.array_equal(g, w) if exact else np.allclose(g, w, rtol=1e-5, atol=1e-4)
        if not ok:
            raise SystemExit(f"{label}: wrong allreduce result on rank {rank}")


def bench_set(set_name, rounds, world, gfm, hvd, thresholds, wait):
    """Median seconds per method (max over ranks) on one gradient set."""
    import mxnet as mx
    from mpi4py import MPI
    from ..comm.mpi import MPICommunicator
    from ..pipeline import Pipeline
    rank = world.rank
    arrays = make_set(SETS[set_name](), 100 + rank)
    expected = [a.copy() for a in arrays]
    for e in expected:
        world.Allreduce(MPI.IN_PLACE, e)
    nds = [mx.nd.array(a, dtype=np.float32) for a in arrays]
    work = {k: [a.copy() for a in arrays] for k in ("pipe", "lib", "per", "oop")}
    pipe, oop = Pipeline(average=False), Pipeline(average=False)
    lib = Pipeline(average=False, comm=MPICommunicator(world, cma=False))
    name = f"bench.{set_name}"

    def gf():
        gfm.grouped_allreduce_(nds, op=gfm.Sum, name=name)
        wait(nds)

    def per_tensor():
        for a in work["per"]:
            world.Allreduce(MPI.IN_PLACE, a)

    methods = {"gradfuse.mxnet": Method(gf),
               "Pipeline (numpy)": Method(lambda: pipe.allreduce_(work["pipe"])),
               "Pipeline, MPI library": Method(lambda: lib.allreduce_(work["lib"]))}
    hvd_nds = None
    if hvd is not None:
        hvd_nds = [mx.nd.array(a, dtype=np.float32) for a in arrays]
        for th in thresholds:
            methods[_label(th)] = _horovod_method(hvd, mx, hvd_nds, name, th, wait)
    methods["MPI per-tensor"] = Method(per_tensor)
    methods["Pipeline.allreduce"] = Method(lambda: oop.allreduce(work["oop"]))

    # one checked step of each (also the warm-up: plans, MPI connections)
    gf()
    _check("gradfuse.mxnet", [nd.asnumpy() for nd in nds], expected, rank)
    pipe.allreduce_(work["pipe"])
    _check("Pipeline", work["pipe"], expected, rank)
    lib.allreduce_(work["lib"])
    _check("Pipeline, MPI library", work["lib"], expected, rank)
    per_tensor()
    _check("MPI per-tensor", work["per"], expected, rank)
    _check("Pipeline.allreduce", oop.allreduce(work["oop"]), expected, rank)
    if hvd_nds is not None:
        m = methods[_label(thresholds[0])]
        m.setup()           # its warm-up call is the checked step
        m.teardown()
        _check("Horovod", [nd.asnumpy() for nd in hvd_nds], expected, rank, exact=False)

    def sync():
        mx.nd.waitall()
        world.Barrier()
    t = _timed(methods, rounds, sync, progress(f"mxnet {set_name}") if rank == 0 else None)
    t = {k: world.allreduce(v, op=MPI.MAX) for k, v in t.items()}
    return {"tensors": len(arrays), "bytes": sum(a.nbytes for a in arrays), "t": t}


def per_tensor_cost(rounds, world, gfm):
    """(t(2000 tensors) - t(one tensor of their bytes)) / 2000 on a one-rank set, in seconds."""
    import mxnet as mx
    from mpi4py import MPI
    from ..pipeline import Pipeline
    if world.size == 1:
        ps, comm = gfm.global_process_set, world
    else:
        ps = gfm.add_process_set(gfm.ProcessSet(MPI.COMM_SELF))
        comm = MPI.COMM_SELF
    arrays = make_set(SETS["small"](), 5)
    one = np.concatenate([a.ravel() for a in arrays])
    many_nd = [mx.nd.array(a) for a in arrays]
    one_nd = [mx.nd.array(one)]
    many_np, one_np = [a.copy() for a in arrays], [one.copy()]
    pipe = Pipeline(average=False, comm=comm)

    def gf(nds, name):
        def run():
            gfm.grouped_allreduce_(nds, op=gfm.Sum, name=name, process_set=ps)
            mx.nd.waitall()
        return Method(run)
    methods = {"mx 2000": gf(many_nd, "cost.many"), "mx 1": gf(one_nd, "cost.one"),
               "np 2000": Method(lambda: pipe.allreduce_(many_np)),
               "np 1": Method(lambda: pipe.allreduce_(one_np))}
    for m in methods.values():
        m.run()

    def sync():
        mx.nd.waitall()
        world.Barrier()
    t = _timed(methods, rounds, sync, progress("per-tensor cost") if world.rank == 0 else None)
    t = {k: world.allreduce(v, op=MPI.MAX) for k, v in t.items()}
    if ps is not gfm.global_process_set:
        gfm.remove_process_set(ps)
    return {"n": len(arrays), "bytes": one.nbytes, "t": t}


def _report(results, cost, size, rounds, thresholds, have_hvd, wait_how):
    print(f"\n### gradfuse.mxnet beside Horovod 0.28.1, {size} rank(s), sum of float32 gradients "
          f"({rounds} rounds, alternating, median of the slowest rank; wait: {wait_how})\n")
    if not have_hvd:
        print("Horovod is not installed here (or --no-horovod): its columns are left out.\n")
    if results:
        names = list(next(iter(results.values()))["t"])
        print("| set | tensors | MB | " + " | ".join(f"{n} ms" for n in names) + " |")
        print("|---|---:|---:|" + "---:|" * len(names))
        for s, r in results.items():
            print(f"| {s} | {r['tensors']} | {r['bytes'] / 1e6:.1f} | " +
                  " | ".join(f"{r['t'][n] * 1e3:.2f}" for n in names) + " |")
        hv = [_label(th) for th in thresholds] if have_hvd else []
        print("\n| set | gradfuse.mxnet / Pipeline (target <= 1.1) | " +
              " | ".join(f"{h} / gradfuse.mxnet (target >= 2)" for h in hv) +
              (" | " if hv else "") + "MPI per-tensor / Pipeline.allreduce (target >= 1.0 resnet50, "
              ">= 1.5 small) | Pipeline, MPI library / Pipeline |")
        print("|---|---:|" + "---:|" * len(hv) + "---:|---:|")
        for s, r in results.items():
            t = r["t"]
            g = t["gradfuse.mxnet"]
            row = f"| {s} | {g / t['Pipeline (numpy)']:.2f}x | "
            row += "".join(f"{t[h] / g:.2f}x | " for h in hv)
            row += f"{t['MPI per-tensor'] / t['Pipeline.allreduce']:.2f}x | "
            row += f"{t['Pipeline, MPI library'] / t['Pipeline (numpy)']:.2f}x |"
            print(row)
    if cost:
        t, n = cost["t"], cost["n"]
        print(f"\n### per-tensor cost on a one-rank process set ({n} tensors vs one tensor of "
              f"{cost['bytes'] / 1e6:.1f} MB; {size} rank(s) measuring at once, slowest)\n")
        print(f"| | {n} tensors ms | 1 tensor ms | (t({n}) - t(1)) / {n} |")
        print("|---|---:|---:|---:|")
        for label, k in (("gradfuse.mxnet grouped_allreduce_ + waitall (target < 5 us)", "mx"),
                         ("Pipeline.allreduce_ (numpy)", "np")):
            many, one = t[f"{k} 2000"], t[f"{k} 1"]
            print(f"| {label} | {many * 1e3:.2f} | {one * 1e3:.2f} | {(many - one) / n * 1e6:.2f} us |")
    print("\nEach ratio is the first-named method's time over the second's. Every method was checked "
          "once against MPI.Allreduce before timing.")
    sys.stdout.flush()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench mxnet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="rounds per method (default 7)")
    ap.add_argument("--sets", default="resnet50,small", help="comma-separated: resnet50, small")
    ap.add_argument("--horovod-thresholds", default=f"{HOROVOD_DEFAULT},{HOROVOD_TUNED}",
                    help="HOROVOD_FUSION_THRESHOLD values, one Horovod method each "
                         f"(default {HOROVOD_DEFAULT},{HOROVOD_TUNED})")
    ap.add_argument("--no-horovod", action="store_true", help="leave Horovod out even if installed")
    ap.add_argument("--no-cost", action="store_true", help="skip the per-tensor cost")
    ap.add_argument("--wait", choices=["all", "each"], default="all",
                    help="after each grouped_allreduce_: mx.nd.waitall() (default) or wait_to_read() "
                         "on every output")
    args = ap.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s]
    for s in sets:
        if s not in SETS:
            ap.error(f"unknown set {s!r}; choose from {', '.join(SETS)}")
    try:
        thresholds = [int(x) for x in args.horovod_thresholds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--horovod-thresholds: expected comma-separated byte counts, got {args.horovod_thresholds!r}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    from mpi4py import MPI      # MPI first: Horovod then leaves it initialised at shutdown
    import mxnet as mx
    import gradfuse.mxnet as gfm
    world = MPI.COMM_WORLD
    gfm.init()
    hvd = None if args.no_horovod else _horovod()
    wait = _waiter(mx, args.wait)
    results = {s: bench_set(s, args.rounds, world, gfm, hvd, thresholds, wait) for s in sets}
    cost = None if args.no_cost else per_tensor_cost(max(args.rounds, 9), world, gfm)
    if world.rank == 0:
        _report(results, cost, world.size, args.rounds, thresholds, hvd is not None, args.wait)
