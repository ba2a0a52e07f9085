"""Small measurements the benchmark pages quote, each a subcommand of ``python -m gradfuse.bench``:

    mpiexec -n 2 python -m gradfuse.bench bytes [--compress 1bit,topk]   # bytes per step per compressor
    mpiexec -n 2 python -m gradfuse.bench memory --steps 30 topk          # extra resident memory
    mpiexec -n 2 python -m gradfuse.bench floor                           # the host's copy floor
    python -m gradfuse.bench cost [--links 1gbit,100mbit]                 # the cost model up to 256 ranks

Each uses gradfuse's public API only (``Pipeline``, its ``stats``, ``compressors.cost``).
"""
import argparse
import ast
import json
import math
import time

import numpy as np

from .network_worker import WORKLOADS, bucket_shapes, buckets
from .sets import make_set, resnet50_shapes

# examples/mxnet_gluon_digits.py's build_net(), in collect_params() order
DIGITS_SHAPES = [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 128), (64,), (10, 64), (10,)]
GRADIENT_SETS = {"resnet50": resnet50_shapes, "digits": lambda: list(DIGITS_SHAPES)}


def _names(text, option, valid=None):
    names = [n for n in text.split(",") if n]
    if not names:
        raise SystemExit(f"{option}: empty list")
    bad = [n for n in names if valid is not None and n not in valid]
    if bad:
        raise SystemExit(f"{option}: unknown {', '.join(bad)}; choose from {', '.join(valid)}")
    return names


def bytes_main(argv=None):
    """Bytes per step of each compressor: one ``Pipeline.allreduce`` per compressor at the
    default fusion threshold, rank 0's ``Pipeline.stats.bytes_sent`` beside the fp32 bytes a
    bandwidth-optimal allreduce of the same tensors sends, 2(p-1)/p x S."""
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench bytes", description=bytes_main.__doc__)
    ap.add_argument("--compress", default="none,fp16,bf16,1bit,2bit,topk,randomk,powersgd",
                    help="comma-separated compressor names (default: every built-in one)")
    ap.add_argument("--sets", default="resnet50,digits",
                    help="gradient sets: resnet50 (193 tensors), digits (the digits CNN's 8)")
    a = ap.parse_args(argv)
    from mpi4py import MPI

    from ..compressors import available
    from ..pipeline import Pipeline
    from ..runtime import context
    names = _names(a.compress, "--compress", available())
    sets = _names(a.sets, "--sets", GRADIENT_SETS)
    context.init()
    world = MPI.COMM_WORLD
    rows = []
    for set_name in sets:
        shapes = GRADIENT_SETS[set_name]()
        grads = make_set(shapes, 100 + world.rank)
        nbytes = sum(g.nbytes for g in grads)
        ring = 2 * nbytes * (world.size - 1) / world.size
        for name in names:
            pipe = Pipeline(compress=None if name == "none" else name)
            pipe.allreduce(grads)
            sent = pipe.stats.bytes_sent if name != "none" else ring
            ratio = f"{ring / sent:.1f}x" if sent else "-"
            rows.append(f"| {set_name} | {name} | {len(shapes)} | {nbytes} | {round(sent)} | {ratio} |")
    if world.rank == 0:
        print(f"\n### bytes sent per step by rank 0 ({world.size} ranks, default fusion threshold)\n")
        print("| gradients | compressor | tensors | fp32 bytes | bytes sent per step | fp32 allreduce / sent |")
        print("|---|---|---:|---:|---:|---:|")
        print("\n".join(rows))
        print("\nnone: a bandwidth-optimal allreduce's 2(p-1)/p x S (the MPI library decides the real "
              "traffic); the others: gradfuse's own count of the payload bytes rank 0 sent.")


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status: resident memory cannot be read here")


def memory_main(argv=None):
    """Extra resident memory of a compressed Pipeline, as a multiple of the gradient bytes:
    every rank allocates ResNet-50's float32 gradients (102 MB, touched), reads its resident
    set size (VmRSS), runs ``--steps`` in-place ``allreduce_`` steps of a fresh Pipeline and
    reads VmRSS again. Prints (after - before) / gradient bytes, the largest over the ranks,
    as one JSON line on rank 0. One compressor per process, so nothing of another pipeline
    is counted."""
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench memory", description=memory_main.__doc__)
    ap.add_argument("compressor", help="a compressor name, with options after a colon: 1bit:algorithm=twophase")
    ap.add_argument("--steps", type=int, default=200, help="in-place steps before the second reading (default 200)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be at least 1, got {a.steps}")
    name, _, rest = a.compressor.partition(":")
    opts = {}
    for kv in (kv for kv in rest.split(",") if kv):
        key, eq, value = kv.partition("=")
        if not eq:
            ap.error(f"compressor option {kv!r} in {a.compressor!r} is not NAME=VALUE")
        try:
            opts[key] = ast.literal_eval(value)      # numbers stay numbers: randomk:ratio=0.05
        except (ValueError, SyntaxError):
            opts[key] = value                         # names stay strings: 1bit:algorithm=twophase
    from mpi4py import MPI

    from ..pipeline import Pipeline
    from ..runtime import context
    context.init()
    world = MPI.COMM_WORLD
    grads = {f"t{i}": g for i, g in enumerate(make_set(resnet50_shapes(), world.rank))}
    nbytes = sum(g.nbytes for g in grads.values())
    pipe = Pipeline(compress=None if name == "none" else name, **opts)
    world.Barrier()
    before = _rss()
    for _ in range(a.steps):
        pipe.allreduce_(grads)               # in place: the next step reduces the last one's results
    extra = world.gather((_rss() - before) / nbytes, root=0)
    if world.rank == 0:
        print(json.dumps({"compressor": name, "options": opts, "p": world.size, "steps": a.steps,
                          "grad_mb": round(nbytes / 1e6, 3), "extra_x": max(extra), "per_rank": extra}), flush=True)


def floor_main(argv=None):
    """The memory floor of a 2-rank allreduce on one host: every rank copies its own float32
    buffer of ``--mb`` MB into another at the same time (``np.copyto``: one read and one write
    of each byte), so the ranks share the memory bus as an allreduce's ranks do. Prints the
    copy time (slowest rank, median of ``--rounds``) and the aggregate rate. An allreduce
    whose ranks push their sums into the peers' outputs moves one copy's traffic per rank;
    one whose ranks read the summed halves back moves 2.5x the bytes of a copy."""
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench floor", description=floor_main.__doc__)
    ap.add_argument("--mb", type=float, default=102.3, help="MB per rank (default 102.3, ResNet-50's gradients)")
    ap.add_argument("--rounds", type=int, default=9, help="timed copies (default 9)")
    a = ap.parse_args(argv)
    if a.mb <= 0 or a.rounds < 1:
        ap.error(f"--mb must be positive and --rounds at least 1, got {a.mb} and {a.rounds}")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    n = int(a.mb * 1e6 / 4)
    src = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)                               # first touch outside the timing
    times = []
    for _ in range(a.rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    t = float(np.median(times))
    agg = 2 * 4 * n * comm.size / t                  # bytes read + written by all ranks per second
    if comm.rank == 0:
        print(f"{comm.size} ranks, {4 * n / 1e6:.1f} MB each: copy {t * 1e3:.2f} ms (slowest rank, median of "
              f"{a.rounds}); {agg / 1e9:.1f} GB/s read+write together; an allreduce reading the sums "
              f"back (2.5 copies of traffic): {2.5 * t * 1e3:.1f} ms at least")


COST_ROWS = {"fp32 ring": ("none", "ring", {}), "1bit allgather": ("1bit", "allgather", {}),
             "1bit twophase": ("1bit", "twophase", {}),
             "powersgd r1": ("powersgd", "powersgd", {"rank": 1}),
             "powersgd r4": ("powersgd", "powersgd", {"rank": 4})}


def cost_main(argv=None):
    """The cost model (``gradfuse.compressors.cost.predict``, summed over the fusion buckets)
    of one step on a workload's gradients, ms, for rank counts up to 256: fp32 ring, 1-bit
    allgather and two-phase, PowerSGD at rank 1 and 4, with 1 MiB buckets and with the whole
    set as one bucket. Prints the fastest method per rank count and the rank count from which
    each compressed method is slower than the fp32 ring."""
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench cost", description=cost_main.__doc__)
    ap.add_argument("--workload", default="resnet50", choices=sorted(WORKLOADS))
    ap.add_argument("--links", default="1gbit,100mbit", help="comma-separated link rates (default 1gbit,100mbit)")
    ap.add_argument("--latency-us", type=float, default=50.0, help="per-message latency (default 50 us)")
    ap.add_argument("--ranks", default="2,4,8,16,32,64,128,256", help="comma-separated rank counts")
    a = ap.parse_args(argv)
    from ..compressors import cost
    try:
        ranks = [int(p) for p in _names(a.ranks, "--ranks")]
    except ValueError:
        ap.error(f"--ranks: {a.ranks!r} is not a comma-separated list of integers")
    if min(ranks) < 2:
        ap.error(f"--ranks: every rank count must be at least 2, got {a.ranks}")
    shapes = WORKLOADS[a.workload]()
    counts = [math.prod(s) for s in shapes]
    for spec in _names(a.links, "--links"):
        try:
            link = cost.link_from(spec, a.latency_us * 1e-6)
        except ValueError as exc:
            raise SystemExit(f"--links: {exc}") from None
        for threshold, label in ((1 << 20, "1 MiB buckets"), (1 << 40, "one bucket")):
            bs, shs = buckets(counts, threshold), bucket_shapes(shapes, threshold)

            def step(row, p):
                c, alg, o = COST_ROWS[row]
                return sum(cost.predict(c, alg, n, p, link, options=o, shapes=s) for n, s in zip(bs, shs))
            print(f"\n{a.workload}, {label} ({len(bs)}), {link}: ms per step\n")
            print("| method | " + " | ".join(f"p={p}" for p in ranks) + " |")
            print("|---|" + "---:|" * len(ranks))
            for row in COST_ROWS:
                print(f"| {row} | " + " | ".join(f"{step(row, p) * 1e3:.0f}" for p in ranks) + " |")
            print("| fastest | " + " | ".join(min(COST_ROWS, key=lambda r: step(r, p)) for p in ranks) + " |")
            for row in list(COST_ROWS)[1:]:
                lose = next((p for p in range(2, max(ranks) + 1) if step(row, p) >= step("fp32 ring", p)), None)
                print(f"\n{row}: " + (f"slower than the fp32 ring from p = {lose}" if lose else
                                        f"faster than the fp32 ring up to p = {max(ranks)}"), end="")
            print()

