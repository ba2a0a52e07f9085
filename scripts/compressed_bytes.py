"""Bytes per step of each compressor on ResNet-50's gradients and on the digits CNN.

    mpiexec -n 2 .venv/bin/python scripts/compressed_bytes.py [--compress 1bit,topk]

One Pipeline step per compressor (default fusion threshold), ``Pipeline.stats.bytes_sent``
of rank 0 beside the fp32 bytes of a bandwidth-optimal allreduce of the same tensors.
The digits CNN is examples/mxnet_gluon_digits.py's net (its parameter shapes, in the order
``collect_params()`` gives them, are built with MXNet when it is installed).
"""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# examples/mxnet_gluon_digits.py's build_net(), in collect_params() order (used without MXNet)
DIGITS_SHAPES = [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 128), (64,), (10, 64), (10,)]


def digits_shapes():
    try:
        import mxnet as mx
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        from mxnet_gluon_digits import build_net
    except Exception:
        return DIGITS_SHAPES
    net = build_net()
    net.initialize()
    net(mx.nd.zeros((1, 1, 8, 8)))
    return [tuple(p.shape) for p in net.collect_params().values()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compress", default="none,fp16,1bit,2bit,topk,randomk")
    args = ap.parse_args(argv)
    from mpi4py import MPI
    import gradfuse
    from gradfuse.bench.sets import make_set, resnet50_shapes
    gradfuse.init()
    world = MPI.COMM_WORLD
    sets = {"resnet50": resnet50_shapes(), "digits CNN": digits_shapes()}
    rows = []
    for set_name, shapes in sets.items():
        grads = make_set(shapes, 100 + world.rank)
        nbytes = sum(g.nbytes for g in grads)
        for name in [c for c in args.compress.split(",") if c]:
            pipe = gradfuse.Pipeline(compress=name)
            pipe.allreduce(grads)
            sent = pipe.stats.bytes_sent
            rows.append(f"| {set_name} | {name} | {len(shapes)} | {nbytes} | {sent} | "
                        f"{2 * nbytes * (world.size - 1) / world.size / max(sent, 1):.1f}x |")
    if world.rank == 0:
        print(f"\n### bytes sent per step by rank 0 ({world.size} ranks, default fusion threshold)\n")
        print("| gradients | compressor | tensors | fp32 bytes | bytes sent per step | fp32 allreduce / sent |")
        print("|---|---|---:|---:|---:|---:|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
