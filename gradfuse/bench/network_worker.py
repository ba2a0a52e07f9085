"""The ranks' half of ``python -m gradfuse.bench network``: runs under mpiexec, times every
method on every workload, and rank 0 writes the results as JSON for the driver
(gradfuse/bench/network.py), which prints the tables.

Per method: a fresh Pipeline (one at a time, so 8 ranks of ResNet-50 or BERT fit in
memory), ``WARMUP`` warm-up steps (plans, MPI connections, buffers touched for the
first time; the first one's result is checked where the method is exact), then
``rounds`` timed steps, each between two barriers. Reported: the
median over rounds of the slowest rank; the bytes ``Pipeline.stats.bytes_sent`` counts
per step; and, where ``GRADFUSE_NET_IFACE`` names this host's interface (the emulated
cluster sets it), the bytes that really left it per step (``tx_bytes`` of the interface,
headers included), as the mean over ranks.
"""
import gc
import json
import math
import os
import sys
from importlib import resources

import numpy as np

from .sets import make_set, median_times, resnet50_shapes

MB = 1e6
#: untimed steps before the rounds: at 1 warm-up step, 1-bit's first 5 timed steps on the
#: emulated 1 Gbit/s link ran 52 ms against 38-43 ms from 15 rounds (docs/benchmarks.md,
#: "Settled steps")
WARMUP = 3


def bert_base_shapes():
    """The 199 float32 gradient shapes of BERT-base's encoder (109.5 M parameters)."""
    text = resources.files("gradfuse.data").joinpath("bert_base_grads.json").read_text()
    return [tuple(t["shape"]) for t in json.loads(text)["tensors"]]


def flat256_shapes():
    """One flat 256 MB float32 tensor."""
    return [(256 * 1000 * 1000 // 4,)]


def tiny_shapes():
    """A few small tensors (the smoke test's workload)."""
    return [(1000, 10), (10,), (5000,), (300, 30)]


WORKLOADS = {"resnet50": resnet50_shapes, "bert": bert_base_shapes, "flat256": flat256_shapes, "tiny": tiny_shapes}

#: method label -> (Pipeline compressor, options); "none" is gradfuse fp32
COMPRESSORS = {
    "none": ("none", {}), "fp16": ("fp16", {}),
    "1bit-allgather": ("1bit", {"algorithm": "allgather"}), "1bit-twophase": ("1bit", {"algorithm": "twophase"}),
    "1bit": ("1bit", {}), "2bit": ("2bit", {}), "topk": ("topk", {}), "randomk": ("randomk", {}),
    "powersgd-r1": ("powersgd", {"rank": 1}), "powersgd-r4": ("powersgd", {"rank": 4}),
}
BASELINES = ("mpi4py", "horovod", "horovod-fp16")


def buckets(counts, threshold):
    """Element counts of the fusion buckets a greedy fusion at ``threshold`` bytes makes
    (tensors of at least ``threshold`` bytes alone): the cost model's input."""
    out, cur = [], 0
    for c in counts:
        if threshold == 0 or 4 * c >= threshold:
            if cur:
                out.append(cur)
                cur = 0
            out.append(c)
            continue
        if cur and 4 * (cur + c) > threshold:
            out.append(cur)
            cur = 0
        cur += c
    if cur:
        out.append(cur)
    return out


def bucket_shapes(shapes, threshold):
    """The tensor shapes of each fusion bucket ``buckets`` makes (the same greedy fusion)."""
    out, cur, acc = [], [], 0
    for s in shapes:
        c = int(math.prod(s))
        if threshold == 0 or 4 * c >= threshold:
            if cur:
                out.append(cur)
                cur, acc = [], 0
            out.append([s])
            continue
        if cur and 4 * (acc + c) > threshold:
            out.append(cur)
            cur, acc = [], 0
        cur.append(s)
        acc += c
    if cur:
        out.append(cur)
    return out


def _algorithms(comp, bucket_counts, p):
    """The collective each bucket runs (the compressor's own choice), by bucket."""
    if comp is None or comp.name == "none":
        return ["ring"] * len(bucket_counts)
    pick = getattr(comp, "algorithm_for", None)
    return [pick(n, p) if pick else comp.collective for n in bucket_counts]


def _tx(iface):
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def rank_order_sum(world, a):
    """``((a_0 + a_1) + a_2) + ...`` in ``a``'s dtype, the same array on every rank: the
    order in which gradfuse sums between the ranks of one host (``gradfuse/comm/cma.py``),
    where MPI's own allreduce may add in another order from 4 ranks on (MPICH: pairs
    first). A chain of sends, then a broadcast: two arrays of memory, however many ranks."""
    rank, p = world.rank, world.size
    if rank == 0:
        acc = np.array(a, copy=True, order="C")
    else:
        acc = np.empty(a.shape, a.dtype)
        world.Recv(acc, source=rank - 1, tag=7301)
        acc += a
    if rank < p - 1:
        world.Send(acc, dest=rank + 1, tag=7301)
    world.Bcast(acc, root=p - 1)
    return acc


def sums_match(world, arrays, work, expected):
    """Whether every rank's ``work`` holds the sum of ``arrays`` over the ranks, bit for bit:
    MPI's (``expected``, ``MPI.Allreduce``'s results), or, where any rank's differ, the
    rank-order sum (``rank_order_sum``). The same answer on every rank."""
    from mpi4py import MPI
    same = all(np.array_equal(w, e) for w, e in zip(work, expected))
    if world.allreduce(same, op=MPI.LAND):
        return True
    ok = True
    for a, w in zip(arrays, work):           # every tensor on every rank: collectives inside
        ok = np.array_equal(w, rank_order_sum(world, a)) and ok
    return world.allreduce(ok, op=MPI.LAND)


def _horovod():
    try:
        import mxnet as mx
        import horovod.mxnet as hvd
    except Exception:      # not installed or broken: the table says so
        return None, None
    hvd.init()
    return hvd, mx


def run(workloads, methods, rounds, out, with_horovod=True):
    from mpi4py import MPI
    from ..pipeline import Pipeline
    from ..runtime import context
    world = MPI.COMM_WORLD
    context.init()
    rank, p = world.rank, world.size
    iface = os.environ.get("GRADFUSE_NET_IFACE")
    hvd = mx = None
    if with_horovod and any(m.startswith("horovod") for m in methods):
        hvd, mx = _horovod()

    def say(msg):
        if rank == 0:
            sys.stderr.write(f"  [{p} ranks] {msg}\n")
            sys.stderr.flush()

    # the latency of one small message step: an 8-byte allreduce (median of 50)
    small = np.zeros(2, np.float32)
    lat = median_times({"a": lambda: world.Allreduce(MPI.IN_PLACE, small)}, 50)["a"]
    lat = world.allreduce(lat, op=MPI.MAX)
    result = {"p": p, "rounds": rounds, "small_allreduce_s": lat, "iface": iface,
              "workloads": {},
              # None: not asked for; False: asked for, but not importable here
              "horovod": (hvd is not None) if with_horovod and any(m.startswith("horovod") for m in methods) else None}
    for wname in workloads:
        shapes = WORKLOADS[wname]()
        arrays = make_set(shapes, 100 + rank)
        counts = [int(math.prod(s)) for s in shapes]
        S = sum(a.nbytes for a in arrays)
        expected = [a.copy() for a in arrays]
        for e in expected:
            world.Allreduce(MPI.IN_PLACE, e)
        rows = {}
        for label in methods:
            if label.startswith("horovod") and hvd is None:
                continue
            work = [a.copy() for a in arrays]
            pipe, exact, algos, threshold = None, None, None, None
            if label == "mpi4py":
                def fn(work=work):
                    for a in work:
                        world.Allreduce(MPI.IN_PLACE, a)
                exact = "sum"
            elif label.startswith("horovod"):
                nds = [mx.nd.array(a, dtype=np.float32) for a in work]
                half = label == "horovod-fp16"

                def fn(nds=nds, half=half):
                    # as DistributedTrainer's Compression.fp16 does: cast, sum, cast back
                    ts = [nd.astype("float16") for nd in nds] if half else nds
                    hvd.grouped_allreduce_(ts, op=hvd.Sum, name=f"net.{wname}.{label}")
                    if half:
                        for nd, t in zip(nds, ts):
                            t.astype("float32").copyto(nd)
                    mx.nd.waitall()
                exact = "hvd32" if not half else None
            else:
                cname, opts = COMPRESSORS[label]
                pipe = Pipeline(compress=cname, average=cname != "none", **opts)
                threshold = pipe.fusion_threshold
                algos = _algorithms(pipe.compressor, buckets(counts, threshold), p)

                def fn(pipe=pipe, work=work):
                    pipe.allreduce_(work)
                # MPI's bits across hosts; between the ranks of one host gradfuse adds in rank
                # order (its own intra-host sums), which from 4 ranks on need not be MPI's order
                exact = "ordered" if cname == "none" else None
            fn()     # warm-up, then check what must be exact (the first step's result)
            if exact == "sum" and not all(np.array_equal(a, e) for a, e in zip(work, expected)):
                raise SystemExit(f"{wname} {label}: wrong allreduce result on rank {rank}")
            if exact == "ordered" and not sums_match(world, arrays, work, expected):
                raise SystemExit(f"{wname} {label}: wrong allreduce result on rank {rank} (neither "
                                 f"MPI's sum nor the rank-order sum)")
            if exact == "hvd32" and not all(np.allclose(nd.asnumpy(), e, rtol=1e-5, atol=1e-4)
                                            for nd, e in zip(nds, expected)):
                raise SystemExit(f"{wname} {label}: wrong Horovod allreduce result on rank {rank}")
            for _ in range(WARMUP - 1):
                fn()
            sent0 = pipe.stats.bytes_sent if pipe else None
            tx0 = _tx(iface)
            t = median_times({label: fn}, rounds, sync=world.Barrier)[label]
            tx1 = _tx(iface)
            t = world.allreduce(t, op=MPI.MAX)
            sent = (pipe.stats.bytes_sent - sent0) / rounds if pipe else \
                2 * (p - 1) / p * S / (2 if label == "horovod-fp16" else 1)
            wire = None
            if tx0 is not None and tx1 is not None:
                wire = world.allreduce((tx1 - tx0) / rounds, op=MPI.SUM) / p
            rows[label] = {"t": t, "sent": sent, "wire": wire, "algorithms": algos, "threshold": threshold}
            say(f"{wname} {label}: {t * 1e3:.1f} ms per step, {sent / MB:.2f} MB sent per rank" +
                (f", {wire / MB:.2f} MB on the wire" if wire is not None else ""))
            del fn, work, pipe
            gc.collect()
        result["workloads"][wname] = {"bytes": S, "tensors": len(arrays), "counts": counts,
                                      "shapes": [list(s) for s in shapes], "methods": rows}
        del arrays, expected
        gc.collect()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if hvd is not None:
        hvd.shutdown()
    world.Barrier()        # leave together (gradfuse warns about a rank that exits while others run)


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench.network_worker")
    ap.add_argument("out")
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--methods", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-horovod", action="store_true")
    a = ap.parse_args(argv)
    run(a.workloads.split(","), a.methods.split(","), a.rounds, a.out, with_horovod=not a.no_horovod)


if __name__ == "__main__":
    main(sys.argv[1:])
