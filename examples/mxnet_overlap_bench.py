"""Does overlapping the allreduce with backward make a Gluon training step faster?

Times DistributedTrainer steps with ``overlap=False`` (one fused allreduce after
backward) and ``overlap=True`` (reverse-order buckets, each reduced as soon as backward
has written it), alternating the two in rounds so drift hits both alike, and prints
the median step time of each and their ratio. Also times the allreduce of the same
gradients alone (waited for), for scale.

Where the link is the bottleneck (see docs/mxnet.md for the network namespace with a
``tc``-limited loopback and ``MPIR_CVAR_NOLOCAL=1``):

    mpiexec -n 2 python examples/mxnet_overlap_bench.py --layers 6 --width 512 --batch 128
"""
import argparse
import os
import time

os.environ.setdefault("MXNET_CPU_WORKER_NTHREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket", type=int, default=1 << 20, help="fusion threshold (bytes)")
    args = p.parse_args()
    hvd.init()

    net = gluon.nn.HybridSequential()
    for _ in range(args.layers):
        net.add(gluon.nn.Dense(args.width, activation="relu", in_units=args.width))
    net.add(gluon.nn.Dense(10, in_units=args.width))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    hvd.broadcast_parameters(net.collect_params())
    nbytes = sum(int(np.prod(p.shape)) * 4 for p in net.collect_params().values())
    rng = np.random.default_rng(hvd.rank())
    x = mx.nd.array(rng.standard_normal((args.batch, args.width)))
    y = mx.nd.array(rng.integers(0, 10, args.batch))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    trainers = {mode: hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 1e-3},
                                             overlap=(mode == "overlap"), fusion_threshold=args.bucket)
                for mode in ("fused", "overlap")}

    def step(trainer):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(args.batch)
        mx.nd.waitall()

    times = {m: [] for m in trainers}
    for m in trainers:                       # warm up plans, caches, MXNet's graph
        for _ in range(3):
            step(trainers[m])
    for _ in range(args.rounds):
        for m, tr in trainers.items():
            hvd.allreduce(mx.nd.zeros((1,)), name="sync")   # start each run together
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(tr)
                times[m].append(time.perf_counter() - t0)

    # the allreduce alone, for scale
    grads = [p.grad() for p in net.collect_params().values()]
    comm = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        hvd.grouped_allreduce_(grads, op=hvd.Sum, name="alone")
        mx.nd.waitall()          # the call only hands the allreduce to MXNet's engine
        comm.append(time.perf_counter() - t0)
    med = {m: float(np.median(v)) for m, v in times.items()}
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {args.layers}x{args.width} MLP, batch {args.batch}, "
              f"{nbytes / 1e6:.1f} MB of gradients, buckets of {args.bucket} bytes")
        print(f"allreduce alone (grouped_allreduce_, waited for): median {np.median(comm) * 1e3:.1f} ms")
        for m in trainers:
            print(f"step with {m:8s}: median {med[m] * 1e3:.1f} ms "
                  f"(min {min(times[m]) * 1e3:.1f}, max {max(times[m]) * 1e3:.1f}) over {len(times[m])} steps")
        print(f"overlap / fused step time: {med['overlap'] / med['fused']:.3f}")


if __name__ == "__main__":
    main()
