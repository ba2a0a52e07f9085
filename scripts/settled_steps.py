#!/usr/bin/env python
"""Settled steps against decoding after the verdict (issue 16, "close to the bound"), on
the emulated cluster of docs/network.md.

    sudo python scripts/settled_steps.py --hosts 2 --link 1gbit --rounds 15
    python scripts/settled_steps.py --place local --hosts 2            # shared memory, no root

ResNet-50's gradients, in-place ``allreduce_`` steps of a pipelined ``Pipeline`` at its
defaults, per compressor. Three variants of the same pipeline, alternated round by round
(A B C, C B A), two steps each, the slowest rank's time per step:

* *settled*: as shipped (``gradfuse.step.grouped``): the early groups compressed into pinned
  residuals and posted before the verdict's pass, every bucket decoded as soon as its
  group has arrived;
* *no early groups*: the same with ``grouped.EARLY_SHARE = 0`` (the verdict's pass before
  the first compression);
* *after the verdict*: the verdict first and every bucket decoded after the last exchange
  (the design before settled steps).

Prints the medians, the ratio settled / after the verdict, the bytes each rank sent and
their time on the emulated link. With ``--place local`` the same steps run on shared memory:
that is the bound's compute term of ``python -m gradfuse.bench network``, so the step's ratio
to max(compute, wire) can be read off two runs (issue 16's target: at most 1.25).
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = ("settled", "no early groups", "after the verdict")


def worker(methods, rounds):
    from mpi4py import MPI

    import gradfuse
    from gradfuse.step import grouped
    from gradfuse.bench.sets import make_set, resnet50_shapes

    gradfuse.init()
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    grads = make_set(resnet50_shapes(), 1 + me)
    run, share = grouped.run, grouped.EARLY_SHARE

    def after_verdict(ov, comm, jobs, compress, decode=None, verdict=None):
        if verdict is not None:
            verdict()
        return run(ov, comm, jobs, compress, None, None)
    setups = {"settled": (run, share), "no early groups": (run, 0.0), "after the verdict": (after_verdict, share)}
    for method in methods:
        pipe = gradfuse.Pipeline(compress=method)
        for _ in range(3):
            pipe.allreduce_(grads)
        times = {v: [] for v in VARIANTS}
        sent0 = pipe.stats.bytes_sent
        for r in range(rounds):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                grouped.run, grouped.EARLY_SHARE = setups[v]
                for _ in range(2):
                    world.Barrier()
                    t = time.perf_counter()
                    pipe.allreduce_(grads)
                    times[v].append(world.allreduce(time.perf_counter() - t, op=MPI.MAX))
        grouped.run, grouped.EARLY_SHARE = run, share
        sent = (pipe.stats.bytes_sent - sent0) / (2 * rounds * len(VARIANTS))
        if me == 0:
            med = {v: statistics.median(times[v]) for v in VARIANTS}
            print(f"RESULT {method} " + " ".join(f"{1e3 * med[v]:.2f}" for v in VARIANTS) + f" {sent:.0f}",
                  flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--link", default="1gbit", help="1gbit or 10gbit (emulated cluster)")
    ap.add_argument("--place", choices=("cluster", "local"), default="cluster",
                    help="cluster: emulated hosts (root); local: ranks on this host (shared memory)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--methods", default="1bit,2bit,topk,randomk")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if args.worker:
        worker(methods, args.rounds)
        return 0
    inner = [sys.executable, os.path.abspath(__file__), "--worker", "--rounds", str(args.rounds),
             "--methods", ",".join(methods)]
    if args.place == "local":
        from gradfuse.bench.network import _mpiexec
        cmd = [_mpiexec(), "-n", str(args.hosts)] + inner
    else:
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "emu_cluster.py"), "--hosts", str(args.hosts),
               "--link", args.link, "--"] + inner
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    rows = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or len(rows) != len(methods):
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        return out.returncode or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    where = f"{args.hosts} ranks, {'shared memory' if args.place == 'local' else args.link + ' links'}"
    rate = {"1gbit": 1e9, "10gbit": 1e10}.get(args.link)
    print(f"ResNet-50, {where}, {args.rounds} rounds, ms per step (slowest rank, median); load {load:.1f} at the end\n")
    print("| compressor | " + " | ".join(VARIANTS) + " | settled / after | MB sent/rank | wire ms |")
    print("|---|" + "---:|" * (len(VARIANTS) + 3))
    for m, *vals in rows:
        t = [float(x) for x in vals[:3]]
        sent = float(vals[3])
        wire = f"{sent * 8 / rate * 1e3:.1f}" if rate and args.place == "cluster" else "-"
        print(f"| {m} | " + " | ".join(f"{x:.1f}" for x in t) + f" | {t[0] / t[2]:.3f} | {sent / 1e6:.3f} | {wire} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
