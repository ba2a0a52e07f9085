"""Step time and bytes per step of DDP comm hooks: none, PyTorch's fp16 and PowerSGD, gradfuse's.

    torchrun --nproc_per_node 2 examples/torch_ddp_bench.py
    torchrun --nproc_per_node 2 examples/torch_ddp_bench.py --width 1024 --layers 4 --steps 20
    scripts/torch_slow_link.py --link 1gbit          # the same, one rank per emulated host

One process per rank, all methods in the same run (the machine is shared and noisy: read
the ratios to "ddp", not the absolute times). A step is forward, backward (with the hook's
exchange) and SGD; DDP's buckets hold 64 MB (``--bucket-cap-mb``: one bucket here; see
its help for why). Every method first runs ``--warmup`` steps; then ``--rounds`` rounds
run ``--steps`` steps of every method in turn (A B C .. A B C ..), so that a change of the
machine's load hits all methods alike; the median over all timed steps is reported, and
its quartiles (each the slowest rank's).

Bytes per step are what one rank puts on the wire, an allreduce of S bytes counted as a
bandwidth-optimal one's 2(p-1)/p x S: for gradfuse its pipelines' ``bytes_sent`` (allgather
payloads as sent), for PyTorch's hooks the tensors they hand to ``all_reduce`` (counted
by wrapping it), for DDP without a hook its buckets. With ``--tc-dev DEV`` (on the emulated
cluster: eth0) each rank also reads the bytes that left DEV's qdisc (``tc -s``) around its
timed steps: what really crossed the link, headers and TCP acks included; with
``--link-bps`` the table adds the time that link needs for them (the link-bound time).
"""
import argparse
import re
import statistics
import subprocess
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import gradfuse.torch as gt

METHODS = ["ddp", "pytorch-fp16", "pytorch-powersgd-r1", "pytorch-powersgd-r4", "gradfuse-none", "gradfuse-fp16",
           "gradfuse-1bit", "gradfuse-2bit", "gradfuse-topk", "gradfuse-randomk", "gradfuse-powersgd-r1",
           "gradfuse-powersgd-r4"]
_count = {"method": None}
_real_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor, *args, **kwargs):
    p = dist.get_world_size()
    m = _count["method"]
    _count[m] = _count.get(m, 0) + 2 * (p - 1) / p * tensor.numel() * tensor.element_size()
    return _real_all_reduce(tensor, *args, **kwargs)


def tc_sent(dev):
    """Bytes that left ``dev``'s root qdisc (``tc -s qdisc show``), or 0 without ``dev``."""
    if not dev:
        return 0
    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True).stdout
    m = re.search(r"qdisc \S+ \S+ root.*?\n\s*Sent (\d+) bytes", out, re.S)
    if not m:
        raise RuntimeError(f"--tc-dev {dev}: no root qdisc counters in:\n{out}")
    return int(m.group(1))


class Bench:
    """One method's DDP model, hook and optimizer, and what its timed steps measured."""

    def __init__(self, method, args, rank):
        self.method, self.args = method, args
        torch.manual_seed(0)
        dims = [args.width] * (args.layers + 1)
        layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers[:-1])
        self.ddp = DDP(self.model, bucket_cap_mb=args.bucket_cap_mb)
        self.state = None
        if method == "pytorch-fp16":
            self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method.startswith("pytorch-powersgd"):
            r = int(method.rsplit("r", 1)[1])
            self.ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                                                    start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
        elif method.startswith("gradfuse-powersgd"):
            # torch's hook's schedule: PowerSGD from DDP iteration 2 on, rank r
            self.state = gt.CompressionState("powersgd", rank=int(method.rsplit("r", 1)[1]), start_iter=2,
                                             module=self.model)
            self.ddp.register_comm_hook(self.state, gt.comm_hook)
        elif method.startswith("gradfuse-"):
            c = method.split("-", 1)[1]
            self.state = gt.CompressionState(None if c == "none" else c, module=self.model)
            self.ddp.register_comm_hook(self.state, gt.comm_hook)
        elif method != "ddp":
            raise ValueError(f"--methods: unknown method {method!r} (known: {', '.join(METHODS)})")
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-3)
        self.x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
        self.times, self.steps, self.sent, self.counted, self.wire = [], 0, 0, 0, 0
        self.nbytes = sum(p.numel() * 4 for p in self.model.parameters())

    def run(self, steps, timed):
        """``steps`` steps; when ``timed``, their times and bytes are added to the method's."""
        _count["method"] = self.method
        sent0 = self.state.stats["bytes_sent"] if self.state is not None else 0
        counted0, wire0 = _count.get(self.method, 0), tc_sent(self.args.tc_dev) if timed else 0
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=False)
            self.ddp(self.x).square().mean().backward()
            self.opt.step()
            if timed:
                self.times.append(time.perf_counter() - t0)
        if timed:
            dist.barrier()       # the last step's traffic is out before the counter is read
            self.wire += tc_sent(self.args.tc_dev) - wire0
            self.steps += steps
            self.counted += _count.get(self.method, 0) - counted0
            if self.state is not None:
                self.sent += self.state.stats["bytes_sent"] - sent0

    def per_step(self, size):
        """Bytes per step per rank by gradfuse's/the hook's own count (see the module's doc)."""
        if self.state is not None:
            return self.sent / self.steps
        if self.method == "ddp":
            return 2 * (size - 1) / size * self.nbytes
        return self.counted / self.steps


def _slowest(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    _real_all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per method and round")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of all methods in turn (default 1)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--bucket-cap-mb", type=float, default=64,
                    help="DDP's bucket size (default 64: one bucket; PowerSGD's hook on gloo with several buckets "
                         "issues its collectives from callbacks in an order that differs between ranks, and "
                         "gloo aborts on the mismatched sizes)")
    ap.add_argument("--tc-dev", default=None, help="also count the bytes that left this device (tc -s; needs tc "
                                                   "and a qdisc on it, e.g. eth0 of the emulated cluster)")
    ap.add_argument("--link-bps", type=float, default=None, help="the link's rate in bit/s, for the link-bound "
                                                                 "time column (with --tc-dev)")
    args = ap.parse_args()
    rank, size = gt.init_process_group("gloo")
    dist.all_reduce = _counting_all_reduce        # PyTorch's Python hooks call it through the module
    benches = [Bench(m, args, rank) for m in args.methods.split(",")]
    for b in benches:
        b.run(args.warmup, timed=False)
    for _ in range(args.rounds):
        for b in benches:
            b.run(args.steps, timed=True)
    rows = [(b.method, _slowest(statistics.median(b.times)) * 1e3, b.per_step(size), _slowest(b.wire / b.steps),
             [_slowest(q) * 1e3 for q in statistics.quantiles(b.times, n=4)[::2]]) for b in benches]
    if args.tc_dev:
        print(f"rank {rank}: {sum(b.wire for b in benches)} bytes left {args.tc_dev} in the timed steps", flush=True)
    if rank == 0:
        base = dict((m, r[0]) for m, *r in rows).get("ddp")
        nbytes = benches[0].nbytes
        print(f"{size} ranks, gloo, MLP {args.layers} x Linear({args.width}, {args.width}): {nbytes / 1e6:.1f} MB of "
              f"fp32 gradients; batch {args.batch}; DDP buckets of {args.bucket_cap_mb} MB; {args.warmup} warm-up "
              f"steps, then median of {args.rounds} rounds x {args.steps} steps (methods alternated), slowest rank")
        wire = args.tc_dev is not None
        head = "| method | step time (ms) | quartiles (ms) | vs ddp | bytes/step/rank | vs ddp |"
        if wire:
            head += f" on {args.tc_dev} (tc), bytes/step/rank |" + (" link-bound time (ms) |" if args.link_bps else "")
        print(head)
        print("|---|---:|---:|---:|---:|---:|" + ("---:|" if wire else "") + ("---:|" if wire and args.link_bps else ""))
        ddp_bytes = 2 * (size - 1) / size * nbytes
        for m, t, b, w, (q1, q3) in rows:
            rel = f"{t / base:.2f}x" if base else "-"
            line = f"| {m} | {t:.1f} | {q1:.0f}-{q3:.0f} | {rel} | {b:,.0f} | {ddp_bytes / b:.1f}x less |"
            if wire:
                line += f" {w:,.0f} |" + (f" {w * 8 / args.link_bps * 1e3:.1f} |" if args.link_bps else "")
            print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
