"""PowerSGD in torch DDP against torch's own hook: the digits CNN of ``gradfuse-experiments``
trained with no hook (fp32), with torch's ``powerSGD_hook`` and with gradfuse's
``comm_hook`` at the same approximation rank, on the same seeds; test accuracy per seed.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m gradfuse.bench powersgd-ddp --rank 1

Data: ``sklearn.datasets.load_digits``, pixels / 16, a fifth held out for the test (split
seed 0). Per run: SGD with lr 0.1 and momentum 0.9, batch 32 per rank, ``--epochs`` epochs,
PowerSGD from iteration ``--start-iter`` (both hooks run plain allreduce before it). Rank 0
prints one JSON line: every method's accuracies by seed and their means. Needs torch and
scikit-learn.
"""
import argparse
import json

import numpy as np

METHODS = ("none", "torch", "gradfuse")


def _data(torch):
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    y = d.target
    order = np.random.default_rng(0).permutation(len(x))
    te, tr = order[:len(x) // 5], order[len(x) // 5:]
    return (torch.from_numpy(x[tr]), torch.from_numpy(y[tr]).long(),
            torch.from_numpy(x[te]), torch.from_numpy(y[te]).long())


def _net(torch):
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def _run(method, seed, rank, size, ds, args):
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .. import torch as gt
    xtr, ytr, xte, yte = ds
    torch.manual_seed(seed)
    model = _net(torch)
    ddp = DDP(model)
    if method == "torch":
        ddp.register_comm_hook(ps.PowerSGDState(None, matrix_approximation_rank=args.rank,
                                                start_powerSGD_iter=args.start_iter, random_seed=seed),
                               ps.powerSGD_hook)
    elif method == "gradfuse":
        ddp.register_comm_hook(gt.CompressionState("powersgd", rank=args.rank, start_iter=args.start_iter,
                                                   seed=seed, module=model), gt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + seed)
    n = xtr.shape[0]
    steps = n // (32 * size)
    for _ in range(args.epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(steps):
            idx = perm[(s * size + rank) * 32:(s * size + rank + 1) * 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
            opt.step()
    with torch.no_grad():
        return float((model(xte).argmax(1) == yte).float().mean())


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench powersgd-ddp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=1, help="PowerSGD's approximation rank (default 1)")
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 (default 5)")
    ap.add_argument("--epochs", type=int, default=30, help="epochs per run (default 30)")
    ap.add_argument("--start-iter", type=int, default=60, help="plain allreduce before this iteration (default 60)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated: none, torch, gradfuse")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        ap.error(f"--methods: {', '.join(bad) or 'empty'} is not one of {', '.join(METHODS)}")
    for name in ("rank", "seeds", "epochs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.start_iter < 0:
        ap.error(f"--start-iter must be at least 0, got {args.start_iter}")
    import torch
    import torch.distributed as dist

    from .. import torch as gt
    rank, size = gt.init_process_group("gloo")
    ds = _data(torch)
    acc = {m: [] for m in methods}
    for seed in range(args.seeds):
        for m in methods:
            acc[m].append(_run(m, seed, rank, size, ds, args))
    if rank == 0:
        print(json.dumps({"rank": args.rank, "epochs": args.epochs, **acc,
                          **{f"{m}_mean": float(np.mean(v)) for m, v in acc.items()}}), flush=True)
    dist.destroy_process_group()
