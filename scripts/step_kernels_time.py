"""The per-step kernels of random-k and fp16 on ResNet-50's gradients, in ms (min of
--rounds): what a step's local compute is made of, without communication; one process,
or with --mpi every rank of an mpiexec at once (the ranks of one host share its memory).

    python scripts/step_kernels_time.py --rounds 7
    mpiexec -n 2 python scripts/step_kernels_time.py --rounds 7 --mpi   # both ranks at once
Rows: the finiteness verdict (max |x| over the step's tensors, ``table_absmax``: the
step's bound, ``input_bound``, and ``halves_cannot_fail``), random-k's draw, compress
(c = g + e, gather, residual in place) and decode (p = 2 rows, averaged: the rows' shared
positions repeated per row, and as the step passes them, one row of positions and the
rows where they lie in the receive buffer; and the same on the general path, taken when
the rows' positions differ, as the former decode did for all), fp16's fused pack + cast,
inf/NaN count of the summed payload (C, and the former numpy expression) and unpack +
divide; and one float32 copy of the gradients (read + write) as the machine's memory
reference.
"""
import argparse
import json
import os
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mpi", action="store_true",
                    help="under mpiexec: every rank runs each kernel at the same time (a barrier before "
                         "each round), as the ranks of one host share its memory bus in a step; the slowest "
                         "rank's time per round")
    a = ap.parse_args()
    comm = None
    if a.mpi:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    from gradfuse import _core
    from gradfuse.bench.sets import resnet50_shapes
    from gradfuse.compressors.topk import ks_for
    rng = np.random.default_rng(0 if comm is None else comm.rank)
    xs = [rng.standard_normal(s).astype(np.float32).reshape(-1) for s in resnet50_shapes()]
    ptrs = np.array([x.ctypes.data for x in xs], np.int64)
    cnt = np.array([x.size for x in xs], np.int64)
    off = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.int64)
    n, rows = int(cnt.sum()), len(xs)
    ks = ks_for(0.01, cnt).astype(np.int64)
    k = int(ks.sum())
    e = np.zeros(n, np.float32)
    vals, idx = np.empty(k, np.float32), np.empty(k, np.uint32)
    copy = np.empty(n, np.float32)
    buf = np.empty(n, np.uint16)

    _core.randomk_compress(ptrs, off, cnt, 0, rows, e, e, 7, ks, vals, idx)
    v2, i2 = np.ascontiguousarray(np.stack([vals, vals])), np.ascontiguousarray(np.stack([idx, idx]))
    recv = np.zeros((2, k + 2), np.float32)       # the allgather's receive rows: header, values
    recv[:, 2:] = vals
    i2g = i2.copy()
    i2g[1, -1] = 0           # rows that differ: the general path (clear, adds, a divide pass over all n)
    cases = {
        "finite: max|x| (C)": lambda: _core.table_absmax(ptrs, cnt, 0, rows),
        "randomk: draw": lambda: _core.randomk_indices(7, cnt, ks, idx),
        "randomk: compress": lambda: _core.randomk_compress(ptrs, off, cnt, 0, rows, e, e, 7, ks, vals, idx),
        "randomk: decode p=2 /2": lambda: _core.sparse_decompress_sum(v2, i2, ptrs, off, cnt, 0, rows, 2.0),
        "randomk: decode p=2 /2, one row of positions (the step's)": lambda: _core.sparse_decompress_shared(
            recv[:, 2:], idx, ptrs, off, cnt, 0, rows, 2.0),
        "randomk: decode p=2 /2, general path": lambda: _core.sparse_decompress_sum(v2, i2g, ptrs, off, cnt, 0,
                                                                                   rows, 2.0),
        "fp16: pack+cast": lambda: _core.pack_cast(1, buf, ptrs, off, cnt, 0, rows, 1.0),
        "fp16: inf/NaN count (C)": lambda: _core.count_masked16(buf, 0x7C00),
        "fp16: inf/NaN count (numpy)": lambda: np.count_nonzero((buf & 0x7C00) == 0x7C00),
        "fp16: unpack /2": lambda: _core.unpack_cast(1, buf, ptrs, off, cnt, 0, rows, 2.0),
        "float32 copy (memory reference)": lambda: np.copyto(copy, e),
    }
    out = {"n": n, "k": k, "ranks": 1 if comm is None else comm.size, "load": os.getloadavg()[0]}
    for name, f in cases.items():
        ts = []
        for _ in range(a.rounds):
            if comm is not None:
                comm.Barrier()
            t0 = time.perf_counter()
            f()
            t = time.perf_counter() - t0
            ts.append(t if comm is None else comm.allreduce(t, op=MPI.MAX))
        out[name] = round(1e3 * min(ts), 2)
    out["load_end"] = os.getloadavg()[0]
    if comm is None or comm.rank == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
