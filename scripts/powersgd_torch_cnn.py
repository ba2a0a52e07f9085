"""The digits CNN of gradfuse-experiments in torch DDP, 5 seeds: fp32, torch's PowerSGD hook, gradfuse's (docs/compressors.md, "PowerSGD").

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 scripts/powersgd_torch_cnn.py RANK
"""
import json, sys
import numpy as np, torch, torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
import gradfuse.torch as gt

def data():
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    y = d.target
    order = np.random.default_rng(0).permutation(len(x))
    te, tr = order[:len(x) // 5], order[len(x) // 5:]
    return torch.from_numpy(x[tr]), torch.from_numpy(y[tr]).long(), torch.from_numpy(x[te]), torch.from_numpy(y[te]).long()

def net():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Flatten(), torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

def run(method, seed, rank, size, ds, r):
    xtr, ytr, xte, yte = ds
    torch.manual_seed(seed)
    m = net()
    ddp = DDP(m)
    if method == "torch":
        ddp.register_comm_hook(ps.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=60, random_seed=seed), ps.powerSGD_hook)
    elif method == "gradfuse":
        ddp.register_comm_hook(gt.CompressionState("powersgd", rank=r, start_iter=60, seed=seed, module=m), gt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + seed)
    n = xtr.shape[0]; spe = n // (32 * size)
    for _ in range(30):
        perm = torch.randperm(n, generator=gen)
        for s in range(spe):
            idx = perm[(s * size + rank) * 32:(s * size + rank + 1) * 32]
            opt.zero_grad(); torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward(); opt.step()
    with torch.no_grad():
        return float((m(xte).argmax(1) == yte).float().mean())

rank, size = gt.init_process_group("gloo")
ds = data()
r = int(sys.argv[1])
res = {}
for seed in range(5):
    for meth in ("none", "torch", "gradfuse"):
        res.setdefault(meth, []).append(run(meth, seed, rank, size, ds, r))
if rank == 0:
    print(json.dumps({"rank": r, **{k: v for k, v in res.items()}, **{k + "_mean": float(np.mean(v)) for k, v in res.items()}}))
dist.destroy_process_group()
