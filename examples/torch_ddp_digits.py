"""Train an MLP on sklearn's digits with PyTorch DDP and gradfuse's comm hook.

    torchrun --nproc_per_node 2 examples/torch_ddp_digits.py --compress 1bit
    torchrun --nproc_per_node 2 examples/torch_ddp_digits.py --compress ddp,1bit,topk,randomk --seeds 0,1,2,3,4
    mpiexec -n 2 python examples/torch_ddp_digits.py --compress topk     # rank and size from PMI_*

``--compress ddp`` is DDP without a hook and SGD with momentum 0.9: the reference. Every
other method registers ``gradfuse.torch.comm_hook`` with
``CompressionState(method, momentum=0.9)`` (DGC's momentum correction: the velocity lives
in the hook state) and runs SGD with momentum 0 -- the same learning rate, batch size and
epochs for all. With several methods, the first is the reference: each seed runs every
method from the same initial weights and data order, and the paired gap to the reference
(mean and 95% confidence interval over the seeds) is printed at the end.

PowerSGD keeps the momentum in the optimizer (error feedback on the raw gradient, as
Vogels et al. and torch's hook do): ``powersgd-r1`` / ``powersgd-r2`` run gradfuse's hook
with ``CompressionState("powersgd", rank=r, start_iter=T)``, ``torch-powersgd-r1`` /
``torch-powersgd-r2`` torch's own ``powerSGD_hook`` with ``start_powerSGD_iter=T``, both
with SGD momentum 0.9; T is a tenth of the run (``--start-iter``).

The train/test split is fixed (random_state=0, 360 test images) apart from the seed.
"""
import argparse
import json
import math
import time

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP

import gradfuse.torch as gt
from gradfuse.errors import NonFiniteError

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compress", default="1bit",
                    help="comma-separated: ddp (no hook, SGD momentum) or a gradfuse compressor name (none, fp16, "
                         "bf16, 1bit, 2bit, topk, randomk)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--start-iter", type=int, default=None,
                    help="PowerSGD's uncompressed first iterations (default: a tenth of the run, at least 2)")
    ap.add_argument("--json", help="write the results here (rank 0)")
    return ap.parse_args()


def data():
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=360, random_state=0, stratify=d.target)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(), torch.from_numpy(xte), torch.from_numpy(yte).long())


def train(method, seed, args, ds, rank, size):
    xtr, ytr, xte, yte = ds
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10))
    ddp = DDP(model)
    state = None
    n = xtr.shape[0]
    steps_per_epoch = n // (args.batch * size)
    start = args.start_iter if args.start_iter is not None else max(2, steps_per_epoch * args.epochs // 10)
    if method == "ddp":
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    elif method.startswith("torch-powersgd-r"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=int(method.rsplit("r", 1)[1]),
                                 start_powerSGD_iter=start, random_seed=seed)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    elif method.startswith("powersgd-r"):
        state = gt.CompressionState("powersgd", rank=int(method.rsplit("r", 1)[1]), start_iter=start, seed=seed,
                                    module=model)
        ddp.register_comm_hook(state, gt.comm_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)   # PowerSGD: momentum here
    else:
        comp = None if method == "none" else method
        state = gt.CompressionState(comp, momentum=args.momentum, module=model)
        ddp.register_comm_hook(state, gt.comm_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.0)   # the momentum is in the hook state
        state.check_optimizer(opt)
    gen = torch.Generator().manual_seed(1000 + seed)      # the same order on every rank
    t0 = time.perf_counter()
    steps, diverged = 0, None
    try:
        for _ in range(args.epochs):
            perm = torch.randperm(n, generator=gen)
            for s in range(steps_per_epoch):
                idx = perm[(s * size + rank) * args.batch:(s * size + rank + 1) * args.batch]
                opt.zero_grad(set_to_none=False)
                loss = torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx])
                loss.backward()
                opt.step()
                steps += 1
    except RuntimeError:
        # DDP re-raises the hook's error as a RuntimeError; a NonFiniteError (raised on every rank
        # at the same step) means the run diverged
        if not isinstance(getattr(state, "last_error", None), NonFiniteError):
            raise
        diverged = f"step {steps}: {state.last_error}"
    wall = time.perf_counter() - t0
    with torch.no_grad():
        out = model(xte)
        acc = float((out.argmax(1) == yte).float().mean())
        finite = diverged is None and bool(torch.isfinite(out).all())
    # every rank must hold the same parameters
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    res = {"method": method, "seed": seed, "acc": acc if finite else float("nan"), "steps": steps,
           "step_ms": 1e3 * wall / max(1, steps), "identical_on_all_ranks": same}
    if not finite:
        res["diverged"] = diverged or "non-finite outputs"
    full = 2 * (size - 1) / size * sum(p.numel() * 4 for p in model.parameters())
    if isinstance(state, gt.CompressionState):
        st = state.stats
        res["bytes_per_step"] = st["bytes_sent"] / max(1, steps)
        res["hook_calls"] = state.calls
        if method.startswith("powersgd"):
            res["start_iter"] = start
    elif state is not None:        # torch's PowerSGD: its own element counts, over the compressed steps
        _, before, after = state.compression_stats()
        c = max(0, steps - start)
        res["bytes_per_step"] = (start * full + c * full * after / max(1, before)) / max(1, steps)
        res["start_iter"] = start
    else:
        res["bytes_per_step"] = full
    return res


def main():
    args = parse()
    rank, size = gt.init_process_group("gloo")
    methods = args.compress.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    ds = data()
    results = []
    for seed in seeds:
        for m in methods:
            r = train(m, seed, args, ds, rank, size)
            results.append(r)
            if rank == 0:
                print(json.dumps(r), flush=True)
    if rank == 0 and len(methods) > 1:
        ref = {r["seed"]: r["acc"] for r in results if r["method"] == methods[0]}
        print(f"\n{size} ranks, {args.epochs} epochs, lr {args.lr}, momentum {args.momentum}, batch {args.batch}/rank; "
              f"reference: {methods[0]}")
        print("| method | accuracy, seeds " + " / ".join(map(str, seeds)) + " | mean paired gap (points) | 95% CI | "
              "bytes/step | identical on all ranks |")
        print("|---|---|---:|---|---:|---|")
        for m in methods:
            rs = [r for r in results if r["method"] == m]
            # a diverged run counts at chance (10 %), not as a missing value
            gaps = np.array([100 * ((0.1 if r["acc"] != r["acc"] else r["acc"]) - ref[r["seed"]]) for r in rs])
            mean = float(gaps.mean())
            half = T95.get(len(gaps) - 1, 2.0) * float(gaps.std(ddof=1)) / math.sqrt(len(gaps)) if len(gaps) > 1 else 0.0
            accs = " / ".join(f"{r['acc']:.3f}" for r in rs)
            print(f"| {m} | {accs} | {mean:+.2f} | [{mean - half:+.2f}, {mean + half:+.2f}] | "
                  f"{np.mean([r['bytes_per_step'] for r in rs]):.0f} | {all(r['identical_on_all_ranks'] for r in rs)} |")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
