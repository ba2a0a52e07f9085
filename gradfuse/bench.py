"""Benchmarks: ratios measured side by side in one run (this machine is shared and noisy).

    python -m gradfuse.bench fusion                  # pack+unpack GB/s vs np.copyto
    python -m gradfuse.bench compress                # compressor kernels vs numpy and copy bandwidth
    mpiexec -n 2 python -m gradfuse.bench allreduce  # vs per-tensor mpi4py, naive fusion, Horovod
    mpiexec -n 2 python -m gradfuse.bench threshold  # gradfuse time per fusion threshold
    mpiexec -n 3 python -m gradfuse.bench collectives  # every compressor: time and bytes per rank

Every method runs once per round, methods alternate inside a round, and the table
reports the median over rounds, so drifting machine load hits all methods alike.
Nothing here asserts a target: the numbers are what they are. docs/benchmarks.md
holds the tables these commands printed.
"""
import argparse
import json
import statistics
import sys
import time
from importlib import resources

import numpy as np

GB = 1e9


def resnet50_shapes():
    """The 193 float32 gradient shapes of MXNet's resnet50_v1 (25.6 M parameters)."""
    text = resources.files("gradfuse.data").joinpath("resnet50_v1_grads.json").read_text()
    return [tuple(t["shape"]) for t in json.loads(text)["tensors"]]


def small_shapes(n=2000, seed=0):
    """2000 tensors of 100-5000 float32 elements each."""
    rng = np.random.default_rng(seed)
    return [(int(s),) for s in rng.integers(100, 5001, n)]


SETS = {"resnet50": resnet50_shapes, "small": small_shapes}


def make_set(shapes, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _median_times(methods, rounds, sync=None, progress=None):
    times = {name: [] for name in methods}
    for r in range(rounds):
        for name, fn in methods.items():
            if sync:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            times[name].append(time.perf_counter() - t0)
        if progress:
            progress(r + 1, rounds)
    return {k: statistics.median(v) for k, v in times.items()}


def _progress(label):
    def show(done, total):
        if done == total or done % max(1, total // 5) == 0:
            sys.stderr.write(f"  {label}: round {done}/{total}\n")
            sys.stderr.flush()
    return show


# --- fusion ---------------------------------------------------------------------------
def bench_fusion(rounds):
    from . import _core
    from .plan import aligned_empty
    rows = []
    for set_name, shapes_fn in SETS.items():
        arrays = make_set(shapes_fn(), 1)
        outs = [np.empty_like(a) for a in arrays]
        nb = np.array([a.nbytes for a in arrays], np.int64)
        off = np.concatenate([[0], np.cumsum(nb)[:-1]]).astype(np.int64)
        src = np.array([a.ctypes.data for a in arrays], np.int64)
        dst = np.array([a.ctypes.data for a in outs], np.int64)
        total = int(nb.sum())
        buf = aligned_empty(total)
        n = len(arrays)
        a_src = aligned_empty(total)
        a_dst = aligned_empty(total)
        a_src[:] = 1

        def pack_unpack():
            _core.pack(buf, src, off, nb, 0, n)
            _core.unpack(buf, dst, off, nb, 0, n)

        def copyto():
            np.copyto(a_dst, a_src)

        def numpy_concat():
            flat = np.concatenate([a.ravel() for a in arrays])
            offs = 0
            for o in outs:
                o.ravel()[:] = flat[offs:offs + o.size]
                offs += o.size

        pack_unpack()
        t = _median_times({"pack+unpack": pack_unpack, "np.copyto": copyto, "numpy concat+split": numpy_concat},
                          rounds, progress=_progress(f"fusion {set_name}"))
        assert all(np.array_equal(a, o) for a, o in zip(arrays, outs)), "pack/unpack corrupted data"
        gbs = {"pack+unpack": 4 * total / t["pack+unpack"] / GB,       # read+write, twice
               "np.copyto": 2 * total / t["np.copyto"] / GB,           # read+write, once
               "numpy concat+split": 4 * total / t["numpy concat+split"] / GB}
        rows.append((set_name, n, total, gbs))
    print(f"\n### fusion kernels: pack+unpack vs np.copyto ({rounds} rounds, median)\n")
    print("| set | tensors | MB | pack+unpack GB/s | np.copyto GB/s | ratio to copy | numpy concat+split GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for set_name, n, total, g in rows:
        print(f"| {set_name} | {n} | {total / 1e6:.1f} | {g['pack+unpack']:.2f} | {g['np.copyto']:.2f} | "
              f"{g['pack+unpack'] / g['np.copyto']:.2f}x | {g['numpy concat+split']:.2f} |")
    print("\nGB/s count bytes read plus bytes written: pack+unpack moves 4x the set's bytes, a copy 2x.")


# --- compressors -----------------------------------------------------------------------
def _numpy_baselines(n, seed=0):
    """Straightforward numpy versions of each compressor's math (speed baselines only)."""
    def onebit(g, e, block=512):
        c = g + e
        s = np.abs(c[: n - n % block].reshape(-1, block)).mean(axis=1)
        packed = np.packbits(c >= 0, bitorder="little")
        s_full = np.repeat(s, block)
        v = np.where(c[: s_full.size] >= 0, s_full, -s_full)
        e[: s_full.size] = c[: s_full.size] - v
        return packed, s

    def twobit(g, e, t=0.5):
        c = g + e
        q = np.where(c >= t, t, np.where(c <= -t, -t, 0)).astype(np.float32)
        codes = (c >= t).astype(np.uint8) | ((c <= -t).astype(np.uint8) << 1)
        packed = codes.reshape(-1, 4)
        packed = packed[:, 0] | (packed[:, 1] << 2) | (packed[:, 2] << 4) | (packed[:, 3] << 6)
        e[:] = c - q
        return packed

    def topk(g, e, ratio=0.01):
        c = g + e
        k = max(1, int(np.ceil(ratio * n)))
        idx = np.sort(np.argpartition(-np.abs(c), k)[:k])
        vals = c[idx]
        e[:] = c
        e[idx] = 0
        return vals, idx

    def randomk(g, e, ratio=0.01):
        c = g + e
        k = max(1, int(np.ceil(ratio * n)))
        idx = np.sort(np.random.default_rng(seed).choice(n, k, replace=False))
        vals = c[idx]
        e[:] = c
        e[idx] = 0
        return vals

    def bf16(g):
        u = g.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    return {"1bit": onebit, "2bit": twobit, "topk": topk, "randomk": randomk,
            "fp16": lambda g: g.astype(np.float16), "bf16": bf16}


def bench_compress(rounds, n=1 << 24):
    from . import _core
    from .compressors import BucketContext, create
    from .plan import aligned_empty
    from .reduce import Wire
    rng = np.random.default_rng(0)
    g = rng.standard_normal(n).astype(np.float32)
    table = (np.array([g.ctypes.data], np.int64), np.zeros(1, np.int64), np.array([n], np.int64), 0, 1)
    copy_src, copy_dst = aligned_empty(4 * n), aligned_empty(4 * n)
    copy_src[:] = 1
    base = _numpy_baselines(n)
    ctx = BucketContext()
    rows = []
    for name, opts in [("fp16", {}), ("bf16", {}), ("1bit", {}), ("2bit", {}), ("topk", {}), ("randomk", {})]:
        comp = create(name, **opts)
        ef = comp.error_feedback
        e_in, e_out = (np.zeros(n, np.float32), np.zeros(n, np.float32)) if ef else (np.zeros(0, np.float32),) * 2
        wire = Wire(comp.payload_layout(n))
        row = aligned_empty(wire.nbytes)
        payloads = wire.views(row)
        out = np.empty(n, np.float32)
        dst_table = (np.array([out.ctypes.data], np.int64), np.zeros(1, np.int64), np.array([n], np.int64), 0, 1)
        rows2d = [pl.reshape(1, -1) for pl in payloads]
        if comp.collective == "allreduce":
            def compress():
                comp.pack(table, payloads[0])
            touched = 4 * n + 2 * n
            def numpy_ref():
                base[name](g)
        else:
            def compress():
                comp.compress_table(table, e_in, e_out, payloads, ctx)
            touched = 4 * n * (3 if ef else 1) + wire.nbytes
            e_np = np.zeros(n, np.float32)
            def numpy_ref():
                base[name](g, e_np)

        def decompress():
            comp.decompress_sum_table(rows2d, dst_table, 1.0, ctx)

        def copy():
            np.copyto(copy_dst, copy_src)

        compress()
        t = _median_times({"compress": compress, "decompress": decompress, "numpy": numpy_ref, "copy": copy},
                          rounds, progress=_progress(f"compress {name}"))
        copy_bw = 2 * 4 * n / t["copy"]
        rows.append({
            "name": name, "ef": ef,
            "c_gbs": 4 * n / t["compress"] / GB, "d_gbs": 4 * n / t["decompress"] / GB,
            "vs_numpy": t["numpy"] / t["compress"],
            "vs_bw": (touched / t["compress"]) / copy_bw,
            "wire": (4 * n) / (wire.nbytes - 8),
            "touched_per_elem": touched / n,
        })
    print(f"\n### compressor kernels, one {4 * n / 1e6:.0f} MB float32 bucket ({rounds} rounds, median)\n")
    print("| compressor | error feedback | compress GB/s | decompress GB/s | compress vs numpy | "
          "compress vs memory-bandwidth limit | fp32 bytes / wire bytes |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {'yes' if r['ef'] else 'no'} | {r['c_gbs']:.2f} | {r['d_gbs']:.2f} | "
              f"{r['vs_numpy']:.1f}x | {r['vs_bw']:.2f}x | {r['wire']:.1f}x |")
    print("\nGB/s are gradient bytes (4 per element) per second. The bandwidth limit is the bytes the "
          "kernel must touch (gradient, residual read and written, payload) at np.copyto's speed in the "
          "same run; 1.00x means memory speed. numpy: the straightforward numpy version of the same math.")


# --- allreduce ------------------------------------------------------------------------
def _horovod():
    try:
        import mxnet as mx
        import horovod.mxnet as hvd
    except Exception:          # any import problem means: not available, say so in the table
        return None, None
    hvd.init()
    return hvd, mx


def bench_allreduce(rounds, sets, with_horovod=True):
    from mpi4py import MPI
    import gradfuse
    world = MPI.COMM_WORLD
    gradfuse.init()
    hvd, mx = _horovod() if with_horovod else (None, None)
    rank, size = world.rank, world.size
    results = []
    for set_name in sets:
        shapes = SETS[set_name]()
        arrays = make_set(shapes, 100 + rank)
        total = sum(a.nbytes for a in arrays)
        pipe = gradfuse.Pipeline(average=False)
        expected = [a.copy() for a in arrays]
        for e in expected:
            world.Allreduce(MPI.IN_PLACE, e)

        work = {k: [a.copy() for a in arrays] for k in ("per", "naive", "gf")}

        def per_tensor():
            for a in work["per"]:
                world.Allreduce(MPI.IN_PLACE, a)

        def naive():
            flat = np.concatenate([a.ravel() for a in work["naive"]])
            world.Allreduce(MPI.IN_PLACE, flat)
            off = 0
            for a in work["naive"]:
                a.ravel()[:] = flat[off:off + a.size]
                off += a.size

        def gf():
            pipe.allreduce_(work["gf"])

        methods = {"mpi4py per-tensor": per_tensor, "naive fusion": naive, "gradfuse": gf}
        if hvd is not None:
            nds = [mx.nd.array(a, dtype=np.float32) for a in arrays]

            def horovod():
                hvd.grouped_allreduce_(nds, op=hvd.Sum, name=f"bench.{set_name}")
                mx.nd.waitall()
            methods["horovod grouped_allreduce_"] = horovod
        # warm-up (plans, MPI connections) and a correctness check of one step each
        for name, fn in methods.items():
            fn()
        for k in ("per", "naive", "gf"):
            for a, e in zip(work[k], expected):
                if not np.array_equal(a, e):
                    raise SystemExit(f"{k}: wrong allreduce result on rank {rank}")
        if hvd is not None:
            for nd, e in zip(nds, expected):
                if not np.allclose(nd.asnumpy(), e, rtol=1e-5, atol=1e-4):
                    raise SystemExit(f"horovod: wrong allreduce result on rank {rank}")
        t = _median_times(methods, rounds, sync=world.Barrier,
                          progress=_progress(f"allreduce {set_name}") if rank == 0 else None)
        t = {k: world.allreduce(v, op=MPI.MAX) for k, v in t.items()}
        results.append((set_name, len(arrays), total, t, pipe))
    if rank == 0:
        print(f"\n### allreduce, {size} ranks, sum of float32 gradients ({rounds} rounds, median of the "
              f"slowest rank)\n")
        if hvd is None and with_horovod:
            print("Horovod is not installed here: its column is left out.\n")
        names = list(results[0][3])
        print("| set | tensors | MB | " + " | ".join(f"{n} ms" for n in names) +
              " | gradfuse vs per-tensor | gradfuse vs naive | " +
              ("gradfuse vs Horovod |" if "horovod grouped_allreduce_" in names else ""))
        print("|---|---:|---:|" + "---:|" * len(names) + "---:|---:|" +
              ("---:|" if "horovod grouped_allreduce_" in names else ""))
        for set_name, n, total, t, pipe in results:
            g = t["gradfuse"]
            row = f"| {set_name} | {n} | {total / 1e6:.1f} | " + " | ".join(f"{t[k] * 1e3:.2f}" for k in names)
            row += f" | {t['mpi4py per-tensor'] / g:.2f}x | {t['naive fusion'] / g:.2f}x |"
            if "horovod grouped_allreduce_" in t:
                row += f" {t['horovod grouped_allreduce_'] / g:.2f}x |"
            print(row)
        print("\nRatios above 1 mean gradfuse is faster. gradfuse: default fusion threshold "
              f"{results[0][4].fusion_threshold} bytes, in-place allreduce_, control-plane agreement "
              "included in its time.")
    if hvd is not None:
        hvd.shutdown()


def bench_collectives(rounds, sets):
    from mpi4py import MPI
    import gradfuse
    world = MPI.COMM_WORLD
    gradfuse.init()
    configs = [("none", {}), ("fp16", {}), ("bf16", {}), ("1bit", {"algorithm": "allgather"}),
               ("1bit", {"algorithm": "twophase"}), ("2bit", {}), ("topk", {}), ("randomk", {})]
    table = {}
    for set_name in sets:
        arrays = make_set(SETS[set_name](), 11 + world.rank)
        total = sum(a.nbytes for a in arrays)
        methods, pipes = {}, {}
        for name, opts in configs:
            label = name + (f" ({opts['algorithm']})" if "algorithm" in opts else "")
            pipe = gradfuse.Pipeline(compress=name, **opts)
            work = [a.copy() for a in arrays]
            pipes[label] = pipe
            methods[label] = (lambda pipe=pipe, work=work: pipe.allreduce_(work))
        for fn in methods.values():
            fn()
        sent0 = {k: p.stats.bytes_sent for k, p in pipes.items()}
        t = _median_times(methods, rounds, sync=world.Barrier,
                          progress=_progress(f"collectives {set_name}") if world.rank == 0 else None)
        t = {k: world.allreduce(v, op=MPI.MAX) for k, v in t.items()}
        sent = {k: (pipes[k].stats.bytes_sent - sent0[k]) / rounds for k in pipes}
        table[set_name] = (total, t, sent)
    if world.rank == 0:
        p = world.size
        print(f"\n### compressed allreduce, {p} ranks ({rounds} rounds, median of the slowest rank)\n")
        print("| set | compressor | ms per step | speed vs none | bytes sent per rank per step | "
              "fp32 allreduce bytes / these |")
        print("|---|---|---:|---:|---:|---:|")
        for set_name, (total, t, sent) in table.items():
            ring = 2 * (p - 1) / p * total          # what a bandwidth-optimal fp32 allreduce sends
            for k in t:
                b = sent[k]
                print(f"| {set_name} | {k} | {t[k] * 1e3:.2f} | {t['none'] / t[k]:.2f}x | "
                      f"{b / 1e6:.3f} MB | {ring / b:.1f}x |")
        print("\nBytes: Pipeline.stats.bytes_sent per step. Compressed payloads as gradfuse sends them; "
              "uncompressed buckets ('none', non-float32) as a bandwidth-optimal allreduce's 2(p-1)/p x S "
              "(the MPI library decides the real traffic).")


def bench_threshold(rounds, sets):
    from mpi4py import MPI
    import gradfuse
    world = MPI.COMM_WORLD
    gradfuse.init()
    thresholds = [0, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    table = {}
    for set_name in sets:
        arrays = make_set(SETS[set_name](), 7 + world.rank)
        pipes = {th: gradfuse.Pipeline(fusion_threshold=th, average=False) for th in thresholds}
        work = [a.copy() for a in arrays]

        def per_tensor():
            for a in work:
                world.Allreduce(MPI.IN_PLACE, a)
        methods = {"per-tensor": per_tensor}
        for th, p in pipes.items():
            methods[th] = (lambda p=p: p.allreduce_(work))
        for fn in methods.values():
            fn()
        t = _median_times(methods, rounds, sync=world.Barrier,
                          progress=_progress(f"threshold {set_name}") if world.rank == 0 else None)
        table[set_name] = {k: world.allreduce(v, op=MPI.MAX) for k, v in t.items()}
    if world.rank == 0:
        print(f"\n### fusion threshold sweep, {world.size} ranks ({rounds} rounds, median, ms)\n")
        print("| set | per-tensor | " + " | ".join("off" if th == 0 else f"{th >> 10} KiB" for th in thresholds) + " |")
        print("|---|---:|" + "---:|" * len(thresholds))
        for set_name, t in table.items():
            print(f"| {set_name} | {t['per-tensor'] * 1e3:.2f} | " +
                  " | ".join(f"{t[th] * 1e3:.2f}" for th in thresholds) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fusion", "compress", "allreduce", "threshold", "collectives"])
    ap.add_argument("--rounds", type=int, default=None, help="rounds per method (default 20; fusion 15)")
    ap.add_argument("--sets", default="resnet50,small", help="comma-separated: resnet50, small")
    ap.add_argument("--no-horovod", action="store_true", help="leave Horovod out even if installed")
    args = ap.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s]
    for s in sets:
        if s not in SETS:
            ap.error(f"unknown set {s!r}; choose from {', '.join(SETS)}")
    if args.what == "fusion":
        bench_fusion(args.rounds or 15)
    elif args.what == "compress":
        bench_compress(args.rounds or 7)
    elif args.what == "allreduce":
        bench_allreduce(args.rounds or 20, sets, with_horovod=not args.no_horovod)
    elif args.what == "collectives":
        bench_collectives(args.rounds or 10, sets)
    else:
        bench_threshold(args.rounds or 10, sets)


if __name__ == "__main__":
    main()
