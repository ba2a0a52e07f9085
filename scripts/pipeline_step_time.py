"""Median time of a Pipeline step on ResNet-50's gradients (in place), under mpiexec.

    mpiexec -n 2 python scripts/pipeline_step_time.py --steps 15 1bit fp16
Prints one JSON line per compressor on rank 0: the median and min of ``--steps`` timed
steps after 3 untimed ones (the slowest rank's time per step, barrier before each).
"""
import argparse
import json
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("compressors", nargs="+")
    a = ap.parse_args()
    import gradfuse
    from gradfuse.bench.sets import resnet50_shapes
    from mpi4py import MPI
    gradfuse.init()
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.Get_rank())
    grads = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(resnet50_shapes())}
    for spec in a.compressors:
        name, _, rest = spec.partition(":")
        opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        pipe = gradfuse.Pipeline(compress=None if name == "none" else name, **opts)
        times = []
        for i in range(3 + a.steps):
            comm.Barrier()
            t0 = time.perf_counter()
            pipe.allreduce_(grads)
            t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= 3:
                times.append(t)
        if comm.Get_rank() == 0:
            print(json.dumps({"compressor": spec, "p": comm.Get_size(), "median_ms": 1e3 * float(np.median(times)),
                              "min_ms": 1e3 * min(times)}), flush=True)
        del pipe


if __name__ == "__main__":
    main()
