"""Step time and bytes per step of DDP comm hooks: none, PyTorch's fp16 and PowerSGD, gradfuse's.

    torchrun --nproc_per_node 2 examples/torch_ddp_bench.py
    torchrun --nproc_per_node 2 examples/torch_ddp_bench.py --width 1024 --layers 4 --steps 20

One process per rank, all methods in the same run (the machine is shared and noisy: read
the ratios to "ddp", not the absolute times). A step is forward, backward (with the hook's
exchange) and SGD; DDP's buckets hold 64 MB (``--bucket-cap-mb``: one bucket here; see
its help for why); the median over ``--steps`` steps after ``--warmup`` is reported.
Bytes per step are what one rank puts on the wire, an allreduce of S bytes counted as a
bandwidth-optimal one's 2(p-1)/p x S: for gradfuse its pipelines' ``bytes_sent`` (allgather
payloads as sent), for PyTorch's hooks the tensors they hand to ``all_reduce`` (counted
by wrapping it), for DDP without a hook its buckets.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import gradfuse.torch as gt

METHODS = ["ddp", "pytorch-fp16", "pytorch-powersgd-r1", "pytorch-powersgd-r4", "gradfuse-none", "gradfuse-fp16",
           "gradfuse-1bit", "gradfuse-2bit", "gradfuse-topk", "gradfuse-randomk"]
_count = {"bytes": 0}
_real_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor, *args, **kwargs):
    p = dist.get_world_size()
    _count["bytes"] += 2 * (p - 1) / p * tensor.numel() * tensor.element_size()
    return _real_all_reduce(tensor, *args, **kwargs)


def run(method, args, rank, size):
    torch.manual_seed(0)
    dims = [args.width] * (args.layers + 1)
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if method == "pytorch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method.startswith("pytorch-powersgd"):
        r = int(method.rsplit("r", 1)[1])
        ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                                           start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
    elif method.startswith("gradfuse-"):
        c = method.split("-", 1)[1]
        state = gt.CompressionState(None if c == "none" else c, module=model)
        ddp.register_comm_hook(state, gt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    times = []
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            _count["bytes"] = 0
            sent0 = state.stats["bytes_sent"] if state is not None else 0
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        ddp(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    if state is not None:
        per_step = (state.stats["bytes_sent"] - sent0) / args.steps
    elif method == "ddp":
        per_step = 2 * (size - 1) / size * nbytes
    else:
        per_step = _count["bytes"] / args.steps
    return statistics.median(times[args.warmup:]) * 1e3, per_step, nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--bucket-cap-mb", type=float, default=64,
                    help="DDP's bucket size (default 64: one bucket; PowerSGD's hook on gloo with several buckets "
                         "issues its collectives from callbacks in an order that differs between ranks, and "
                         "gloo aborts on the mismatched sizes)")
    args = ap.parse_args()
    rank, size = gt.init_process_group("gloo")
    dist.all_reduce = _counting_all_reduce        # PyTorch's Python hooks call it through the module
    rows = [(m, *run(m, args, rank, size)) for m in args.methods.split(",")]
    if rank == 0:
        base = dict((m, t) for m, t, _, _ in rows).get("ddp")
        nbytes = rows[0][3]
        print(f"{size} ranks, gloo, MLP {args.layers} x Linear({args.width}, {args.width}): {nbytes / 1e6:.1f} MB of "
              f"fp32 gradients; batch {args.batch}; DDP buckets of {args.bucket_cap_mb} MB; median of {args.steps} steps after {args.warmup}")
        print("| method | step time (ms) | vs ddp | bytes/step/rank | vs ddp |")
        print("|---|---:|---:|---:|---:|")
        ddp_bytes = 2 * (size - 1) / size * nbytes
        for m, t, b, _ in rows:
            rel = f"{t / base:.2f}x" if base else "-"
            print(f"| {m} | {t:.1f} | {rel} | {b:,.0f} | {ddp_bytes / b:.1f}x less |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
