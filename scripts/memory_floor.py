"""The memory floor of an allreduce of ResNet-50's gradients on one host's shared memory.

    mpiexec -n 2 python scripts/memory_floor.py [--mb 102.3] [--rounds 9]

Every rank copies its own float32 buffer of ``--mb`` MB into another at the same time
(``np.copyto``: one read and one write of each byte), so the ranks share the memory bus
as an allreduce's ranks do. From the aggregate rate it prints the least time any
2-rank allreduce of that size can take on this host: each rank reads its own half and the
peer's copy of it and writes the sum (2 half-reads, 1 half-write), then reads the peer's
summed half and writes it into its own buffer (1 half-read, 1 half-write), even with no
copy through a bounce buffer at all: 2.5 x S of traffic per rank against the copy's 2 x S
(docs/benchmarks.md, "gradfuse.mxnet against Horovod"). Time per round: the slowest
rank's, median.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=102.3)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    n = int(a.mb * 1e6 / 4)
    src = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)                               # first touch outside the timing
    times = []
    for _ in range(a.rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        times.append(t)
    t = float(np.median(times))
    nbytes = 4 * n
    agg = 2 * nbytes * comm.size / t                  # bytes read + written by all ranks per second
    floor = 2.5 * nbytes * comm.size / agg
    if comm.rank == 0:
        print(f"{comm.size} ranks, {nbytes / 1e6:.1f} MB each: copy {t * 1e3:.2f} ms (slowest rank, median of "
              f"{a.rounds}); aggregate {agg / 1e9:.1f} GB/s read+write; least allreduce time "
              f"{floor * 1e3:.1f} ms (2.5 x S of traffic per rank at that rate)")


if __name__ == "__main__":
    main()
