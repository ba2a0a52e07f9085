"""Multi-rank benchmarks: fused allreduce against per-tensor mpi4py, naive fusion and
Horovod; every compressor's time and bytes per rank; the fusion-threshold sweep."""
import numpy as np

from .sets import SETS, make_set, median_times, progress


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
    from ..pipeline import Pipeline
    from ..runtime import context
    world = MPI.COMM_WORLD
    context.init()
    hvd, mx = _horovod() if with_horovod else (None, None)
    rank, size = world.rank, world.size
    results = []
    for set_name in sets:
        shapes = SETS[set_name]()
        arrays = make_set(shapes, 100 + rank)
        total = sum(a.nbytes for a in arrays)
        pipe = Pipeline(average=False)
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
        t = median_times(methods, rounds, sync=world.Barrier,
                          progress=progress(f"allreduce {set_name}") if rank == 0 else None)
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
    from ..pipeline import Pipeline
    from ..runtime import context
    world = MPI.COMM_WORLD
    context.init()
    configs = [("none", {}), ("fp16", {}), ("bf16", {}), ("1bit", {"algorithm": "allgather"}),
               ("1bit", {"algorithm": "twophase"}), ("2bit", {}), ("topk", {}), ("randomk", {})]
    table = {}
    for set_name in sets:
        arrays = make_set(SETS[set_name](), 11 + world.rank)
        total = sum(a.nbytes for a in arrays)
        methods, pipes = {}, {}
        for name, opts in configs:
            label = name + (f" ({opts['algorithm']})" if "algorithm" in opts else "")
            pipe = Pipeline(compress=name, **opts)
            work = [a.copy() for a in arrays]
            pipes[label] = pipe
            methods[label] = (lambda pipe=pipe, work=work: pipe.allreduce_(work))
        for fn in methods.values():
            fn()
        sent0 = {k: p.stats.bytes_sent for k, p in pipes.items()}
        t = median_times(methods, rounds, sync=world.Barrier,
                          progress=progress(f"collectives {set_name}") if world.rank == 0 else None)
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
    from ..pipeline import Pipeline
    from ..runtime import context
    world = MPI.COMM_WORLD
    context.init()
    thresholds = [0, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    table = {}
    for set_name in sets:
        arrays = make_set(SETS[set_name](), 7 + world.rank)
        pipes = {th: Pipeline(fusion_threshold=th, average=False) for th in thresholds}
        work = [a.copy() for a in arrays]

        def per_tensor():
            for a in work:
                world.Allreduce(MPI.IN_PLACE, a)
        methods = {"per-tensor": per_tensor}
        for th, p in pipes.items():
            methods[th] = (lambda p=p: p.allreduce_(work))
        for fn in methods.values():
            fn()
        t = median_times(methods, rounds, sync=world.Barrier,
                          progress=progress(f"threshold {set_name}") if world.rank == 0 else None)
        table[set_name] = {k: world.allreduce(v, op=MPI.MAX) for k, v in t.items()}
    if world.rank == 0:
        print(f"\n### fusion threshold sweep, {world.size} ranks ({rounds} rounds, median, ms)\n")
        print("| set | per-tensor | " + " | ".join("off" if th == 0 else f"{th >> 10} KiB" for th in thresholds) + " |")
        print("|---|---:|" + "---:|" * len(thresholds))
        for set_name, t in table.items():
            print(f"| {set_name} | {t['per-tensor'] * 1e3:.2f} | " +
                  " | ".join(f"{t[th] * 1e3:.2f}" for th in thresholds) + " |")


