"""Hugging Face accelerate with gradfuse's DDP comm hook (digits MLP, CPU or GPU).

    accelerate launch --multi_gpu --num_processes 2 --mixed_precision no --dynamo_backend no \
        examples/torch_accelerate_digits.py --compress 1bit
    torchrun --nproc_per_node 2 examples/torch_accelerate_digits.py     # the same processes, started by torchrun

accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` offers only PyTorch's own
hooks, so the hook is registered by hand on the model ``accelerator.prepare`` returned,
which is a ``DistributedDataParallel`` module when more than one process runs. The
momentum lives in the hook state (``momentum=0.9``), so the optimizer runs with momentum
0. On a machine without a GPU, accelerate's ``--multi_gpu`` launcher (torchrun) still
starts the processes, and ``Accelerator(cpu=True)`` runs them on the CPU over gloo
(``accelerate launch --cpu`` starts one process unless it is given an MPI hostfile). ``--save DIR``
writes accelerate's checkpoint and each rank's hook state beside it (accelerate's own
``register_for_checkpointing`` saves the main process's object only, and the hook state
is per rank); ``--resume DIR`` continues from it. At the end every rank prints the hook's
counters and checks that all ranks hold the same parameters.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import gradfuse.torch as gt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compress", default="1bit")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="write accelerate's checkpoint and each rank's hook state here at the end")
    ap.add_argument("--resume", help="continue from a --save directory")
    args = ap.parse_args()
    # without a GPU, Accelerator(cpu=True) makes the launcher's processes one gloo group (MULTI_CPU)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(args.seed)
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=360, random_state=0, stratify=d.target)
    loader = DataLoader(TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr).long()), batch_size=32,
                        shuffle=True)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.0)      # the momentum is in the hook state
    model, opt, loader = accelerator.prepare(net, opt, loader)

    # the recipe: gradfuse's hook on the DDP module accelerate made
    compress = None if args.compress == "none" else args.compress
    state = None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        state = gt.CompressionState(compress, momentum=args.momentum, module=accelerator.unwrap_model(model))
        model.register_comm_hook(state, gt.comm_hook)
        state.check_optimizer(opt.optimizer)
    if args.resume:
        accelerator.load_state(args.resume)
        if state is not None:
            state.load_state_dict(torch.load(os.path.join(args.resume, f"gradfuse-rank{accelerator.process_index}.pt")))

    for _ in range(args.epochs):
        for xb, yb in loader:
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.cross_entropy(model(xb), yb))
            opt.step()

    if args.save:
        accelerator.save_state(args.save)
        if state is not None:
            torch.save(state.state_dict(), os.path.join(args.save, f"gradfuse-rank{accelerator.process_index}.pt"))
    net = accelerator.unwrap_model(model)
    with torch.no_grad():
        acc = float((net(torch.from_numpy(xte).to(accelerator.device)).argmax(1).cpu()
                     == torch.from_numpy(yte)).float().mean())
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    same = True
    if dist.is_initialized():
        out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(out, flat)
        same = all(torch.equal(o, out[0]) for o in out)
    st = state.stats if state is not None else {"steps": 0, "bytes_sent": 0, "bytes_reduced": 0}
    line = "GRADFUSE-ACCELERATE " + json.dumps({
        "rank": accelerator.process_index, "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type), "device": str(accelerator.device),
        "is_ddp": state is not None, "compress": args.compress, "hook_calls": state.calls if state else 0,
        "iterations": state.iteration if state else 0, "steps": st["steps"], "bytes_sent": st["bytes_sent"],
        "bytes_reduced": st["bytes_reduced"], "test_acc": acc, "identical_on_all_ranks": same,
        "param_sum": float(flat.double().sum())}) + "\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())     # one write: the ranks share the pipe
    accelerator.end_training()


if __name__ == "__main__":
    main()
