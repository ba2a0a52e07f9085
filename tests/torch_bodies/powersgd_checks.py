"""gradfuse's PowerSGD through the DDP hook against torch's own ``powerSGD_hook``
(tests/test_torch_ddp.py runs it under torchrun on 2 ranks).

Both start from the same model, data and initial Q (torch's Q memory is filled with the Q
gradfuse draws, so neither draws its own) and train 20 steps of SGD with momentum 0.9 in
the optimizer, PowerSGD from DDP iteration 2 on; then max|w_gradfuse - w_torch| / max|w|
must be at most 1e-5 at rank 1 and at rank 2. Prints ``POWERSGD rank=<r> rel=<x>`` and
``ALL OK rank <r> of <p>``.
"""
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
from torch.nn.parallel import DistributedDataParallel as DDP

import gradfuse.torch as gt
from gradfuse.compressors.base import BucketContext
from gradfuse.compressors.powersgd import PowerSGD

STEPS, START = 20, 2


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(),
                               torch.nn.Linear(40, 10))


def batches(rank, n, seed=1):
    g = torch.Generator().manual_seed(seed + 100 * rank)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def train(ddp, opt, data):
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def check_matches_torch(rank, r):
    data = batches(rank, STEPS)
    # gradfuse: one DDP bucket (a large cap), PowerSGD from DDP iteration START on
    mg = model()
    dg = DDP(mg, bucket_cap_mb=64)
    state = gt.CompressionState("powersgd", module=mg, start_iter=START, rank=r)
    dg.register_comm_hook(state, gt.comm_hook)
    train(dg, torch.optim.SGD(mg.parameters(), lr=0.1, momentum=0.9), data)
    # torch: the same bucket, its Q memory set to the Q gradfuse drew for its first compressed step
    mt = model()
    dt = DDP(mt, bucket_cap_mb=64)
    pst = ps.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=START)
    grads = [p for p in mt.parameters()][::-1]        # DDP's bucket order: the parameters reversed
    shapes = tuple(tuple(p.shape) for p in grads)
    counts = tuple(p.numel() for p in grads)
    comp = PowerSGD(rank=r)
    lay = comp.layout(BucketContext(counts=counts, shapes=shapes), sum(counts))
    q0 = comp.initial_q(lay, 0, 0)
    pst.q_memory_dict[0] = torch.from_numpy(q0.copy())
    pst.p_memory_dict[0] = torch.zeros(lay.np_)
    dt.register_comm_hook(pst, ps.powerSGD_hook)
    train(dt, torch.optim.SGD(mt.parameters(), lr=0.1, momentum=0.9), data)
    wg, wt = params(mg), params(mt)
    rel = float((wg - wt).abs().max() / wt.abs().max())
    assert state.stats["steps"] == STEPS and state.iteration == STEPS, state.stats
    assert len(lay.mats) == 3 and lay.nu == 48 + 40 + 10, lay.route    # the order torch compresses in
    print(f"POWERSGD rank={r} rel={rel:.3e} compressed={lay.compressed_share:.3f}", flush=True)
    assert rel <= 1e-5, rel


def main():
    rank, size = gt.init_process_group("gloo")
    for r in (1, 2):
        check_matches_torch(rank, r)
        dist.barrier()
    print(f"ALL OK rank {rank} of {size}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
