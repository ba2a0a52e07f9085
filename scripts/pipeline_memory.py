"""Extra resident memory of a compressed Pipeline, as a multiple of the gradient bytes.

Run under mpiexec, one compressor per run (a fresh process each, so nothing of another
pipeline is counted), e.g.
    for c in fp16 bf16 1bit 2bit topk randomk; do
        mpiexec -n 2 python scripts/pipeline_memory.py --steps 200 $c; done
Each rank allocates ResNet-50's float32 gradients (gradfuse/data/resnet50_v1_grads.json,
102 MB, random values, touched), reads its resident set size (VmRSS of /proc/self/status),
builds a Pipeline, runs ``--steps`` in-place allreduce_ steps, and reads VmRSS again. The
figure is (after - before) / gradient bytes, the largest over the ranks (one JSON line on
rank 0).
"""
import argparse
import json

import numpy as np


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def one(name, opts, steps):
    import gradfuse
    from gradfuse.bench.sets import resnet50_shapes
    from mpi4py import MPI
    gradfuse.init()
    rank, p = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    rng = np.random.default_rng(rank)
    grads = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(resnet50_shapes())}
    nbytes = sum(g.nbytes for g in grads.values())
    pipe = gradfuse.Pipeline(compress=None if name == "none" else name, **opts)
    MPI.COMM_WORLD.Barrier()
    before = rss()
    for _ in range(steps):
        pipe.allreduce_(grads)               # in place: the next step reduces the last one's results
    after = rss()
    extra = MPI.COMM_WORLD.gather((after - before) / nbytes, root=0)
    if rank == 0:
        print(json.dumps({"compressor": name, "options": opts, "p": p, "steps": steps,
                          "grad_mb": nbytes / 1e6, "extra_x": max(extra), "per_rank": extra}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("compressor", help="a compressor name, optionally with options: 1bit:algorithm=twophase")
    a = ap.parse_args()
    name, _, rest = a.compressor.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    one(name, opts, a.steps)


if __name__ == "__main__":
    main()
