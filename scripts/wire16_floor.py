"""The floor of a 2-host 16-bit sum: ResNet-50's fp16 bytes (37 buckets of 1.38 MB) summed
by every way gradfuse could move them, with nothing else in the step (docs/benchmarks.md,
"A quiet machine"). Run on the emulated cluster, as root:

    scripts/emu_cluster.py --hosts 2 --link 1gbit -- python scripts/wire16_floor.py

Prints the median of 5 rounds (rank 0) for: MPI's user-op allreduce per bucket (what the
serial step runs), polled Isend/Irecv + the sum16 kernel (the pipelined step's transfer),
the same spinning, Sendrecv + sum16, the next bucket posted before the current one is
summed, and one allreduce of all 51 MB.
"""
import time
import numpy as np
from mpi4py import MPI
from gradfuse import _core
from gradfuse.comm.mpi import _sum16_op
comm = MPI.COMM_WORLD.Dup()
r, peer = comm.rank, 1 - comm.rank
NB, N = 37, 691000            # ~ResNet-50's fp16 bytes in 37 buckets
bufs = [np.random.default_rng([r, i]).integers(0, 30000, N).astype(np.uint16) for i in range(NB)]
tmp = np.empty(N, np.uint16)
op = _sum16_op(1)
def serial():
    for b in bufs:
        comm.Allreduce(MPI.IN_PLACE, [b, MPI.UINT16_T], op=op)
def polled(poll):
    for b in bufs:
        reqs = [comm.Irecv([tmp, MPI.UINT16_T], source=peer, tag=5), comm.Isend([b, MPI.UINT16_T], dest=peer, tag=5)]
        while not MPI.Request.Testall(reqs):
            if poll: time.sleep(poll)
        _core.sum16(1, tmp, b)
def sendrecv():
    for b in bufs:
        comm.Sendrecv([b, MPI.UINT16_T], dest=peer, sendtag=6, recvbuf=[tmp, MPI.UINT16_T], source=peer, recvtag=6)
        _core.sum16(1, tmp, b)
def overlapped(poll):
    # post bucket i+1 before summing bucket i
    tmps = [np.empty(N, np.uint16) for _ in range(2)]
    reqs = None
    for i, b in enumerate(bufs + [None]):
        nxt = None
        if b is not None:
            t = tmps[i % 2]
            nxt = [comm.Irecv([t, MPI.UINT16_T], source=peer, tag=7), comm.Isend([b, MPI.UINT16_T], dest=peer, tag=7)]
        if reqs is not None:
            while not MPI.Request.Testall(reqs[0]):
                if poll: time.sleep(poll)
            _core.sum16(1, reqs[1], reqs[2])
        reqs = (nxt, tmps[i % 2], b) if b is not None else None
whole = [np.concatenate(bufs)]
def serial_whole():
    comm.Allreduce(MPI.IN_PLACE, [whole[0], MPI.UINT16_T], op=op)
fns = {"serial": serial, "polled50us": lambda: polled(50e-6), "spin": lambda: polled(0), "sendrecv": sendrecv,
       "overlap50us": lambda: overlapped(50e-6), "one_allreduce": serial_whole}
res = {k: [] for k in fns}
for rnd in range(5):
    for k, f in fns.items():
        comm.Barrier(); t = time.perf_counter(); f(); comm.Barrier(); res[k].append(time.perf_counter() - t)
if r == 0:
    for k, v in res.items():
        print(f"{k:14s} {1e3*np.median(v):8.1f} ms")
