"""The ranks' half of ``python -m gradfuse.bench network --e2e``: a Gluon training step.

Model: an MLP with large layers, 1024 -> 4096 -> 4096 -> 10 (ReLU; 21.0 M parameters,
84 MB of float32 gradients), batch 16 of random inputs and labels, softmax
cross-entropy, SGD (learning rate 0.01, momentum 0.9), trained with
``gradfuse.mxnet.DistributedTrainer`` (``compress=None``, ``"fp16"``, ``"1bit"``; the
trainer's defaults otherwise). Its forward and backward (6 x 21 M x 16 = 2 GFLOP) take a
fraction of the 0.67 s that 84 MB take on a 1 Gbit/s link, so communication dominates
the fp32 step. Each rank runs MXNet with ``OMP_NUM_THREADS=1`` unless set (2 ranks on 2
cores: more threads only oversubscribe them).

Every compressor has its own copy of the net (the same initial weights) and trainer, and
``no-exchange``, a plain ``gluon.Trainer`` with the same optimizer that reduces nothing
(MXNet's own step: the floor of any compressor's step). Two warm-up rounds, then
``rounds`` timed rounds; each round runs one step of every method in turn (A B C A B C:
load that drifts hits them alike), each step between barriers: ``fb`` is forward +
backward (until ``mx.nd.waitall()``), ``ar`` from ``trainer.step(batch)`` until the
trainer's reductions are done (gradfuse's pipeline: compression, exchange, decompression;
momentum correction's velocity), ``upd`` the rest of the step (MXNet's optimizer update,
waited for), ``t`` the whole step, ``xchg`` the part of the step that gradfuse's timeline
(``gradfuse.runtime.timeline``, on during the timed rounds) records as ``exchange`` spans
(the MPI collectives, waits for the other rank included): the step's communication, and
``t - xchg`` its compute, both measured in the same run. Reported: medians of the slowest
rank, and the bytes the trainer's pipelines count as sent per step.
"""
import json
import sys

import numpy as np

from .sets import median_times

LAYERS = (1024, 4096, 4096, 10)
BATCH = 16


def build(mx, seed):
    from mxnet import gluon
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    for units in LAYERS[1:-1]:
        net.add(gluon.nn.Dense(units, activation="relu"))
    net.add(gluon.nn.Dense(LAYERS[-1]))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


NO_EXCHANGE = "no-exchange"


def exchange_spans(path, t0):
    """The ``exchange`` spans of a gradfuse timeline file as (start, end) on the
    ``perf_counter`` clock (``t0``: the sink's start)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((t0 + e["ts"] / 1e6, t0 + (e["ts"] + e["dur"]) / 1e6) for e in events
                  if e.get("ph") == "X" and str(e.get("name", "")).startswith("exchange"))


def overlap(spans, lo, hi):
    """Seconds of ``spans`` (sorted, possibly nested) inside ``[lo, hi]``, each instant once."""
    total, end = 0.0, lo
    for a, b in spans:
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def run(compressors, rounds, out):
    import os
    import time
    os.environ.setdefault("OMP_NUM_THREADS", "1")     # read when MXNet is imported
    import mxnet as mx
    from mxnet import autograd, gluon
    import gradfuse.mxnet as hvd
    from mpi4py import MPI
    hvd.init()
    world = MPI.COMM_WORLD
    rank, p = hvd.rank(), hvd.size()
    rng = np.random.default_rng(rank)
    x = mx.nd.array(rng.standard_normal((BATCH, LAYERS[0])).astype(np.float32))
    y = mx.nd.array(rng.integers(0, LAYERS[-1], BATCH).astype(np.float32))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    result = {"p": p, "rounds": rounds, "layers": LAYERS, "batch": BATCH, "rows": {}}
    sgd = {"learning_rate": 0.01, "momentum": 0.9}
    methods = {}
    for name in list(compressors) + [NO_EXCHANGE]:
        net = build(mx, 0)
        net(x)
        params = net.collect_params()
        if name == NO_EXCHANGE:
            trainer = gluon.Trainer(params, "sgd", dict(sgd), kvstore=None)
        else:
            trainer = hvd.DistributedTrainer(params, "sgd", dict(sgd), compress=None if name == "none" else name)
        methods[name] = (net, trainer, params, {"fb": [], "ar": [], "upd": [], "win": []})

    def make_step(name):
        net, trainer, _, times = methods[name]
        reducer = getattr(trainer, "_reducer", None)

        def whole():
            t0 = time.perf_counter()
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            mx.nd.waitall()
            t1 = time.perf_counter()
            trainer.step(BATCH)
            if reducer is not None:
                reducer.synchronize()         # the reductions are done: the update runs now
            t2 = time.perf_counter()
            mx.nd.waitall()
            t3 = time.perf_counter()
            times["fb"].append(t1 - t0)
            times["ar"].append(t2 - t1)
            times["upd"].append(t3 - t2)
            times["win"].append((t1, t2))
        return whole

    steps = {name: make_step(name) for name in methods}
    median_times(steps, 2, sync=world.Barrier)           # warm-up
    sent0 = {}
    for name, (_, trainer, _, times) in methods.items():
        for k in times:
            times[k].clear()
        pipe = getattr(trainer, "pipeline", None)
        sent0[name] = pipe.stats.bytes_sent if pipe is not None else 0
    import tempfile
    from ..runtime import timeline
    trace = os.path.join(tempfile.mkdtemp(prefix="gradfuse-e2e-"), f"rank{rank}.json")
    sink = timeline.start(trace, rank=rank)       # the exchange spans: the step's communication
    t = median_times(steps, rounds, sync=world.Barrier)
    timeline.stop(sink)
    exchange = exchange_spans(trace, sink.t0)
    for name, (net, trainer, params, times) in methods.items():
        pipe = getattr(trainer, "pipeline", None)
        sent = ((pipe.stats.bytes_sent - sent0[name]) / rounds) if pipe is not None else 0.0
        row = {"t": world.allreduce(t[name], op=MPI.MAX), "sent": sent,
               "grad_bytes": sum(q.data().size * 4 for q in params.values())}
        for k in ("fb", "ar", "upd"):
            row[k] = world.allreduce(float(np.median(times[k])), op=MPI.MAX)
        row["step"] = row["ar"] + row["upd"]
        xs = [overlap(exchange, w0, w1) for w0, w1 in times["win"]]
        row["xchg"] = world.allreduce(float(np.median(xs)) if xs else 0.0, op=MPI.MAX)
        result["rows"][name] = row
        if rank == 0:
            sys.stderr.write(f"  [{p} ranks] e2e {name}: {row['t'] * 1e3:.1f} ms per step (forward+backward "
                             f"{row['fb'] * 1e3:.1f}, reduction {row['ar'] * 1e3:.1f}, update "
                             f"{row['upd'] * 1e3:.1f})\n")
            sys.stderr.flush()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    world.Barrier()


def _ms(m, key):
    return f"{m[key] * 1e3:.1f}" if key in m else "-"


def report(results):
    """Markdown: per place, the step split into forward+backward, reduction and update,
    the speedup over fp32, and on a link Amdahl's bound from the method's own compute
    (its step less its measured exchange spans, in the same run) and communication (its
    bytes at the link rate)."""
    lines = []
    local = {r["p"]: r for r in results if r["place"] == "local"}
    for r in results:
        p, link, rows = r["p"], r["link"], r["rows"]
        where = "local (shared memory)" if link is None else f"emulated {link['rate']} links"
        g = next(iter(rows.values()))["grad_bytes"]
        lines.append(f"\n#### Gluon step, MLP {'-'.join(map(str, r['layers']))} ({g / 1e6:.1f} MB of gradients), "
                     f"batch {r['batch']}, {p} ranks, {where}; {r['rounds']} rounds" +
                     (f"; 1-min load average {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end"
                      if r.get("load") else "") + "\n")
        head = ("| compressor | ms/step | forward+backward ms | reduction ms | update ms | speedup vs fp32 "
                "| MB sent/rank |")
        sep = "|---|---:|---:|---:|---:|---:|---:|"
        if link:
            head += (" exchange ms (measured) | wire ms (sent / rate) | compute ms (step - exchange) "
                     "| allowed speedup (Amdahl) | measured / allowed |")
            sep += "---:|---:|---:|---:|---:|"
        lines += [head, sep]
        t32 = rows["none"]["t"] if "none" in rows else None
        for name, m in rows.items():
            sent = m["sent"] if m["sent"] is not None else 2 * (p - 1) / p * m["grad_bytes"]
            if "ar" not in m:          # a file from before the split: trainer.step as one figure
                m = dict(m, ar=m["step"])
            row = (f"| {name} | {m['t'] * 1e3:.1f} | {m['fb'] * 1e3:.1f} | {_ms(m, 'ar')} | {_ms(m, 'upd')} | "
                   f"{(t32 / m['t'] if t32 else float('nan')):.2f}x | {sent / 1e6:.2f} |")
            if link:
                wire = sent * 8 / link["bps"]
                if "xchg" in m:          # this run's own split: compute = the step less its exchange spans
                    xchg, compute = f"{m['xchg'] * 1e3:.1f}", m["t"] - m["xchg"]
                else:                    # an older file: the same method's local:P step as its compute
                    xchg, compute = "-", local.get(p, {}).get("rows", {}).get(name, {}).get("t")
                if compute and t32:
                    allowed = t32 / (compute + wire)     # Amdahl: its own compute, plus its bytes at the link rate
                    row += (f" {xchg} | {wire * 1e3:.1f} | {compute * 1e3:.1f} | {allowed:.2f}x | "
                            f"{t32 / m['t'] / allowed:.2f} |")
                else:
                    row += f" {xchg} | {wire * 1e3:.1f} | - | - | - |"
            lines.append(row)
    return "\n".join(lines)


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench.network_e2e")
    ap.add_argument("out")
    ap.add_argument("--compressors", default="none,fp16,1bit")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    run(a.compressors.split(","), a.rounds, a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
