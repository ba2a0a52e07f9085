"""2-rank check of the GPU communicators' data plane (run under mpiexec by
tests/test_gpu_comm.py). Both ranks may share one GPU: that forces the host-staged
fallback, which is what a single-GPU machine can test across ranks."""
import sys

import numpy as np
from mpi4py import MPI

import cupy as cp
from gradfuse.comm.nccl import make_gpu_communicator

comm = make_gpu_communicator(MPI.COMM_WORLD, device=0)
r, p = comm.rank, comm.size
# launched with -n 2: a world of one means mpiexec and mpi4py's MPI library do not match
assert p == 2, f"a world of {p} rank(s) under mpiexec -n 2 ({MPI.Get_library_version().splitlines()[0]})"
print(f"rank {r}: {comm.describe()}", flush=True)
if cp.cuda.runtime.getDeviceCount() == 1 and p > 1:
    assert comm.kind == "host-staged", comm.kind          # ranks share the GPU

x = cp.arange(1000, dtype=cp.float32) * (r + 1)
comm.allreduce_inplace(x)
assert cp.array_equal(x, cp.arange(1000, dtype=cp.float32) * sum(range(1, p + 1)))

src = cp.full(7, r, dtype=cp.int64)
dst = cp.empty(7 * p, dtype=cp.int64)
comm.allgather(src, dst)
assert cp.array_equal(dst, cp.repeat(cp.arange(p, dtype=cp.int64), 7))

a = cp.arange(4 * p, dtype=cp.int32) + 100 * r
b = cp.empty_like(a)
comm.alltoall(a, b)
want = np.concatenate([np.arange(4 * r, 4 * r + 4) + 100 * q for q in range(p)]).astype(np.int32)
assert np.array_equal(b.get(), want)

m = cp.full(5, float(r), dtype=cp.float32)
out = cp.empty_like(m)
comm.allreduce_op(m, out, "max")
assert float(out[0]) == p - 1

c = cp.full(3, 42.0 if r == 0 else 0.0, dtype=cp.float64)
comm.bcast(c, 0)
assert float(c.sum()) == 126.0

# 16-bit sums: the same bits as the CPU rule (float32 add, rounded once, rank order)
h = cp.asarray(np.array([1.0, 65504.0, -2.5, np.nan], np.float16).view(np.uint16))
comm.allreduce16(h, 1)
w = np.array([1.0, 65504.0, -2.5, np.nan], np.float32)
acc = w.astype(np.float16)
for _ in range(1, p):
    acc = (acc.astype(np.float32) + w.astype(np.float16).astype(np.float32)).astype(np.float16)
got = h.get().view(np.float16)
assert np.array_equal(got[:3], acc[:3]) and np.isnan(got[3]), (got, acc)

print(f"rank {r}: gpu communicator OK", flush=True)
sys.exit(0)
