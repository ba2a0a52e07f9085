"""The main job on a default that needs nothing else:

    mpiexec -n 2 python -m gradfuse.demo

Allreduces the 193 gradients of ResNet-50 (25.6 M float32 parameters) for a few steps,
checks every step against a per-tensor MPI.Allreduce of the same arrays, and prints
what it did and how fast. Options: --steps, --compress, --set small, --threshold.
"""
import argparse
import sys
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradfuse.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", choices=["resnet50", "small"], default="resnet50")
    ap.add_argument("--compress", default="none", help="compressor name (see gradfuse.compressors.available())")
    ap.add_argument("--threshold", type=int, default=None, help="fusion threshold in bytes")
    args = ap.parse_args(argv)

    from mpi4py import MPI
    from ._version import __version__
    from .bench.sets import SETS, make_set
    from .pipeline import Pipeline
    from .runtime import context

    world = MPI.COMM_WORLD
    context.init()
    rank, size = context.rank(), context.size()
    shapes = SETS[args.set]()
    names = [f"grad{i}" for i in range(len(shapes))]
    pipe = Pipeline(compress=args.compress, fusion_threshold=args.threshold, average=True)
    if rank == 0:
        total = sum(int(np.prod(s)) for s in shapes)
        print(f"gradfuse {__version__}: {size} rank(s), {len(shapes)} tensors "
              f"({args.set}, {total / 1e6:.1f} M float32 = {total * 4 / 1e6:.1f} MB), {pipe!r}")
    worst = 0.0
    times = []
    # gradient buffers live across steps, as in a framework; each step refills them
    grads = dict(zip(names, make_set(shapes, rank)))
    ref = {k: np.empty_like(g) for k, g in grads.items()}
    rng = np.random.default_rng(1000 + rank)
    for step in range(args.steps):
        for k, g in grads.items():
            rng.standard_normal(g.shape, dtype=np.float32, out=g)
            # reference: per-tensor MPI.Allreduce, then divide (gradfuse's documented order)
            world.Allreduce(g, ref[k])
            ref[k] /= np.float32(size)
        world.Barrier()
        t0 = time.perf_counter()
        out = pipe.allreduce_(grads)             # in place: the results replace the gradients
        dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        times.append(dt)
        err = max(float(np.max(np.abs(out[k] - ref[k]), initial=0.0)) for k in grads)
        exact = all(np.array_equal(out[k], ref[k]) for k in grads)
        worst = max(worst, world.allreduce(err, op=MPI.MAX))
        all_exact = world.allreduce(int(exact), op=MPI.MIN)
        if rank == 0:
            print(f"  step {step + 1}/{args.steps}: {dt * 1e3:7.2f} ms, "
                  f"{'bit-identical to' if all_exact else f'max |diff| {err:.3g} vs'} per-tensor MPI.Allreduce",
                  flush=True)
        if args.compress == "none" and size == 2 and not all_exact:
            print(f"rank {rank}: result differs from per-tensor MPI.Allreduce", file=sys.stderr)
            return 1
    if rank == 0:
        med = float(np.median(times))
        nbytes = sum(int(np.prod(s)) for s in shapes) * 4
        print(f"done: median {med * 1e3:.2f} ms per step, {nbytes / med / 1e9:.2f} GB/s of gradients "
              f"(algbw), {pipe.stats.buckets // max(pipe.stats.steps, 1)} buckets per step, "
              f"max |diff| {worst:.3g}; stats {pipe.stats.as_dict()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
