"""Benchmarks: ratios measured side by side in one run (this machine is shared and noisy).

    python -m gradfuse.bench fusion                  # pack+unpack GB/s vs np.copyto
    python -m gradfuse.bench compress                # compressor kernels (and the Adam correction's passes) vs numpy and copy bandwidth
    mpiexec -n 2 python -m gradfuse.bench allreduce  # vs per-tensor mpi4py, naive fusion, Horovod
    mpiexec -n 2 python -m gradfuse.bench threshold  # gradfuse time per fusion threshold
    mpiexec -n 3 python -m gradfuse.bench collectives  # every compressor: time and bytes per rank
    python -m gradfuse.bench gpu [--pipeline]        # CUDA kernels vs a D2D copy (gradfuse.bench.gpu)
    mpiexec -n 2 python -m gradfuse.bench fixed      # fixed-gradient time-averages (gradfuse.bench.fixed)
    mpiexec -n 2 python -m gradfuse.bench mxnet      # gradfuse.mxnet vs Horovod, Pipeline, MPI (gradfuse.bench.mxnet)
    python -m gradfuse.bench network [--where 1gbit:2,1gbit:4]  # on emulated links (gradfuse.bench.network; root)
    python -m gradfuse.bench powersgd [--ranks 1,4]  # PowerSGD's compute stage by stage (gradfuse.bench.powersgd)
    mpiexec -n 2 python -m gradfuse.bench bytes      # bytes per step of every compressor (gradfuse.bench.probes)
    mpiexec -n 2 python -m gradfuse.bench memory topk  # extra resident memory of a compressed Pipeline
    mpiexec -n 2 python -m gradfuse.bench floor      # this host's copy floor for a 2-rank allreduce
    python -m gradfuse.bench cost                    # the cost model to 256 ranks, PowerSGD included
    python -m gradfuse.bench link-idle --link 300mbit 1bit  # where a link-bound step idles (under emu_cluster.py)
    torchrun --nproc_per_node 2 -m gradfuse.bench powersgd-ddp  # PowerSGD in torch DDP: gradfuse's hook vs torch's

Every method runs once per round, methods alternate inside a round, and the table
reports the median over rounds, so drifting machine load hits all methods alike.
Nothing here asserts a target: the numbers are what they are. docs/benchmarks.md
holds the tables these commands printed.
"""
import argparse
import sys

from .sets import SETS


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fusion", "compress", "allreduce", "threshold", "collectives", "gpu", "fixed",
                                           "mxnet", "network", "powersgd", "bytes", "memory", "floor", "cost",
                                           "link-idle", "powersgd-ddp"])
    ap.add_argument("--rounds", type=int, default=None, help="rounds per method (default 20; fusion 15)")
    ap.add_argument("--sets", default="resnet50,small", help="comma-separated: resnet50, small")
    ap.add_argument("--no-horovod", action="store_true", help="leave Horovod out even if installed")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gpu"]:
        from .gpu import main as gpu_main      # its own options: python -m gradfuse.bench gpu --help
        return gpu_main(argv[1:])
    if argv[:1] == ["fixed"]:
        from .fixed import main as fixed_main  # its own options: python -m gradfuse.bench fixed --help
        return fixed_main(argv[1:])
    if argv[:1] == ["mxnet"]:
        from .mxnet import main as mxnet_main  # its own options: python -m gradfuse.bench mxnet --help
        return mxnet_main(argv[1:])
    if argv[:1] == ["powersgd"]:
        from .powersgd import main as powersgd_main  # its own options: python -m gradfuse.bench powersgd --help
        return powersgd_main(argv[1:])
    if argv[:1] and argv[0] in ("bytes", "memory", "floor", "cost"):
        from . import probes                   # each with its own options: python -m gradfuse.bench bytes --help
        return getattr(probes, f"{argv[0]}_main")(argv[1:])
    if argv[:1] == ["link-idle"]:
        from .link_idle import main as link_idle_main  # under scripts/emu_cluster.py, as root
        return link_idle_main(argv[1:])
    if argv[:1] == ["powersgd-ddp"]:
        from .powersgd_ddp import main as powersgd_ddp_main  # under torchrun; needs torch and scikit-learn
        return powersgd_ddp_main(argv[1:])
    if argv[:1] == ["network"]:
        from .network import main as network_main  # launches its own mpiexec runs: not under mpiexec
        return network_main(argv[1:])
    args = ap.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s]
    for s in sets:
        if s not in SETS:
            ap.error(f"unknown set {s!r}; choose from {', '.join(SETS)}")
    from .allreduce import bench_allreduce, bench_collectives, bench_threshold
    from .kernels import bench_adam, bench_compress, bench_fusion
    if args.what == "fusion":
        bench_fusion(args.rounds or 15)
    elif args.what == "compress":
        bench_compress(args.rounds or 7)
        bench_adam(args.rounds or 7)
    elif args.what == "allreduce":
        bench_allreduce(args.rounds or 20, sets, with_horovod=not args.no_horovod)
    elif args.what == "collectives":
        bench_collectives(args.rounds or 10, sets)
    else:
        bench_threshold(args.rounds or 10, sets)


if __name__ == "__main__":
    main()
