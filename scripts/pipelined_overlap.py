#!/usr/bin/env python
"""Pipelined buckets against serial ones (issue 16, item 4), on an emulated cluster.

    sudo python scripts/pipelined_overlap.py --hosts 2 --link 1gbit          # the table
    python scripts/pipelined_overlap.py --place local --hosts 2              # shared memory, no root

Per compressor (ResNet-50's gradients, ``--fusion-threshold``, every other option at its
default): the step time with ``pipeline_buckets=False`` and ``True`` (and with
``--blocking``, pipelined with blocking waits on the exchange thread), alternated A B C,
C B A round by round in the same run; the compute time: the same step alone on one rank
(``COMM_SELF``: no network, one payload to decode; every rank at once, since the emulated
hosts share the machine's memory bus; the median of at least 7 steps, the largest over
the ranks) and the kernels alone (the communication thread's pack, compress, decompress
and unpack spans and the verdict's max |x| pass in gradfuse's timeline, in serial steps of
their own: the multi-rank step's own local work, which decodes p payloads where the step
alone decodes one); with ``--thread``, also pipelined with a step's
allgather and sparse-allreduce buckets run one at a time on the exchange thread (the design
before they were posted from the communication thread in exchange groups,
``gradfuse.step.grouped``); with ``--per-bucket``, also pipelined with exchange groups of one
bucket each (one collective per bucket, posted from the communication thread, as the posted
allgathers of commit 93dbc81 did before the groups took them); with ``--whole``, also pipelined with every 16-bit
bucket moved whole between 2 hosts (parts as large as the largest bucket: the design
before ``AllreduceJob.PART_WORDS`` bounded them, ``step.overlap._run16``); the bytes that left and entered this host's
``eth0`` per step (``/sys/class/net/eth0/statistics``; the tbf queues shape both), so
wire = max(sent, received) / link rate; and the ratios pipelined / max(compute, wire),
issue 16's target <= 1.2, and pipelined / max(kernels, wire), the same against the step's
own local work. The tc counters of the whole run are printed as a check that the traffic crossed
the shaped links.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _net(name):
    try:
        with open(f"/sys/class/net/eth0/statistics/{name}") as f:
            return int(f.read())
    except OSError:
        return 0


def worker(out, methods, rounds, threshold, blocking=False, whole=False, thread=False, per_bucket=False):
    from mpi4py import MPI

    import gradfuse
    from gradfuse.bench.sets import make_set, resnet50_shapes
    from gradfuse.step import grouped
    from gradfuse.step import overlap
    from gradfuse.runtime import timeline
    from gradfuse.step.exchange import AllreduceJob
    polling, part_words = overlap.PollingComm, AllreduceJob.PART_WORDS
    groupable, caps = grouped.groupable, (grouped.LAST_GROUP, grouped.MAX_GROUP)

    gradfuse.init()
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    grads = make_set(resnet50_shapes(), seed=me)
    names = [f"g{i}" for i in range(len(grads))]
    results = {}
    tmp = tempfile.mkdtemp(prefix="gf-pipe-")
    for method in methods:
        pipes = {flag: gradfuse.Pipeline(compress=method, fusion_threshold=threshold, pipeline_buckets=flag)
                 for flag in (False, True)}
        bufs = {flag: [g.copy() for g in grads] for flag in pipes}

        def step(flag):
            for b, g in zip(bufs[flag], grads):
                b[...] = g
            world.Barrier()
            tx, rx, t0, c0 = _net("tx_bytes"), _net("rx_bytes"), time.perf_counter(), time.process_time()
            pipes[flag].allreduce_(dict(zip(names, bufs[flag])))
            t = time.perf_counter() - t0
            cpu.append(time.process_time() - c0)        # this rank's CPU, every thread
            return t, _net("tx_bytes") - tx, _net("rx_bytes") - rx

        cpu = []
        for flag in (False, True, False, True):
            step(flag)                                   # warm-up: plans, buffers
        times = {False: [], True: [], "blocking": [], "whole": [], "thread": [], "per-bucket": []}
        cpus = {k: [] for k in times}
        wire = []
        variants = ([False, True] + (["blocking"] if blocking else []) + (["whole"] if whole else [])
                    + (["thread"] if thread else []) + (["per-bucket"] if per_bucket else []))
        for r in range(rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                if v == "blocking":        # the design measured against: blocking waits on the thread
                    overlap.PollingComm = lambda comm: comm
                if v == "whole":           # 16-bit buckets moved whole, not in parts of the threshold
                    AllreduceJob.PART_WORDS = 1 << 62
                if v == "thread":          # allgathers on the exchange thread, not in groups
                    grouped.groupable = lambda job, comm: False
                if v == "per-bucket":      # exchange groups of one bucket: a collective per bucket
                    grouped.LAST_GROUP = grouped.MAX_GROUP = 1
                cpu = cpus[v]
                t, tx, rx = step(v is not False)
                overlap.PollingComm, AllreduceJob.PART_WORDS = polling, part_words
                grouped.groupable, (grouped.LAST_GROUP, grouped.MAX_GROUP) = groupable, caps
                times[v].append(t)
                wire.append(max(tx, rx))
        cpu = []               # the steps below are not the variants'
        # compute: the serial step's kernel stages, from the timeline (steps of their own)
        path = os.path.join(tmp, f"{method}.rank{me}.json")
        sink = timeline.start(path, rank=me)
        n_tl = 3
        for _ in range(n_tl):
            step(False)
        timeline.stop(sink)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        per_stage = {}
        for e in events:
            if e["ph"] == "X":
                k = tracks[e["tid"]].split(" ")[0]
                if k == "verdict" and e["args"].get("part") != "max |x|":
                    continue        # the verdict's allreduce is communication, its pass is local work
                per_stage[k] = per_stage.get(k, 0.0) + e["dur"] / n_tl / 1e6
        compute = sum(per_stage.get(k, 0.0) for k in ("pack", "compress", "decompress", "unpack", "verdict"))
        # and the step on this rank alone (COMM_SELF: no network, one payload to decode), every
        # rank at once as in the steps above (the emulated hosts share this machine's memory
        # bus), one untimed step, then at least 7 (a median of 3 moved by a third run to run)
        solo = gradfuse.Pipeline(compress=method, fusion_threshold=threshold, comm=MPI.COMM_SELF)
        sb = [g.copy() for g in grads]
        solo_t = []
        for i in range(1 + max(7, rounds)):
            for b, g in zip(sb, grads):
                b[...] = g
            world.Barrier()
            t0 = time.perf_counter()
            solo.allreduce_(dict(zip(names, sb)))
            if i:
                solo_t.append(time.perf_counter() - t0)
        del solo, sb
        st = pipes[True].stats
        plan = next(iter(pipes[True]._plans.values())).plan
        results[method] = {"serial": statistics.median(times[False]), "pipelined": statistics.median(times[True]),
                           "blocking": statistics.median(times["blocking"]) if times["blocking"] else None,
                           "whole": statistics.median(times["whole"]) if times["whole"] else None,
                           "whole_all": times["whole"],
                           "thread": statistics.median(times["thread"]) if times["thread"] else None,
                           "thread_all": times["thread"],
                           "per_bucket": statistics.median(times["per-bucket"]) if times["per-bucket"] else None,
                           "per_bucket_all": times["per-bucket"],
                           "cpu": {str(k): statistics.median(v) for k, v in cpus.items() if v},
                           "serial_all": times[False], "pipelined_all": times[True],
                           "wire_bytes": statistics.median(wire), "compute": compute,
                           "stages": per_stage, "solo": statistics.median(solo_t),
                           "sent_estimate": st.bytes_sent / max(st.steps, 1), "buckets": len(plan.buckets),
                           "pipelined_runs": pipes[True]._cfg.overlap.runs}
        if me == 0:
            r = results[method]
            sys.stderr.write(f"  {method}: serial {r['serial'] * 1e3:.1f} ms, pipelined {r['pipelined'] * 1e3:.1f} ms, "
                             + (f"blocking waits {r['blocking'] * 1e3:.1f} ms, " if blocking else "")
                             + (f"16-bit buckets whole {r['whole'] * 1e3:.1f} ms, " if whole else "")
                             + (f"allgathers on the exchange thread {r['thread'] * 1e3:.1f} ms, " if thread else "")
                             + (f"groups of one bucket {r['per_bucket'] * 1e3:.1f} ms, " if per_bucket else "") +
                             f"compute {compute * 1e3:.1f} ms, alone {r['solo'] * 1e3:.1f} ms, "
                             f"wire {r['wire_bytes'] / 1e6:.2f} MB/step; serial stages (ms): "
                             + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(per_stage.items())) + "\n")
            sys.stderr.flush()
        del pipes, bufs
    gathered = world.gather(results, root=0)
    if me == 0:
        with open(out, "w") as f:
            json.dump({"ranks": gathered, "p": world.Get_size(),
                       "thread_multiple": MPI.Query_thread() == MPI.THREAD_MULTIPLE}, f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--place", choices=("netns", "local"), default="netns")
    ap.add_argument("--methods", default="1bit,topk,fp16")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--fusion-threshold", type=int, default=None, help="bytes (default: gradfuse's)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--blocking", action="store_true",
                    help="also time the pipelined step with blocking waits on the exchange thread")
    ap.add_argument("--thread", action="store_true",
                    help="also time the pipelined step with a step's allgather and sparse-allreduce buckets on the "
                         "exchange thread, not in exchange groups")
    ap.add_argument("--per-bucket", action="store_true",
                    help="also time the pipelined step with exchange groups of one bucket (a collective per bucket)")
    ap.add_argument("--whole", action="store_true",
                    help="also time the pipelined step with 16-bit buckets moved whole between 2 hosts")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.methods.split(","), a.rounds, a.fusion_threshold, a.blocking, a.whole, a.thread,
                      a.per_bucket)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="gf-pipe-") as tmp:
        out = os.path.join(tmp, "out.json")
        argv_w = [sys.executable, os.path.abspath(__file__), "--worker", out, "--methods", a.methods,
                  "--rounds", str(a.rounds)]
        if a.fusion_threshold is not None:
            argv_w += ["--fusion-threshold", str(a.fusion_threshold)]
        if a.blocking:
            argv_w.append("--blocking")
        if a.whole:
            argv_w.append("--whole")
        if a.thread:
            argv_w.append("--thread")
        if a.per_bucket:
            argv_w.append("--per-bucket")
        load0 = os.getloadavg()
        if a.place == "local":
            rc = subprocess.run([mpiexec, "-n", str(a.hosts)] + argv_w, env=env).returncode
            bps, tc = None, None
        else:
            from gradfuse.bench import netns
            with netns.Cluster(a.hosts, a.link) as c:
                before = c.counters()
                rc = c.run(c.mpiexec(argv_w, mpiexec=mpiexec), env=env).returncode
                tc = netns.counter_delta(before, c.counters())
                bps = c.bps
        load1 = os.getloadavg()
        if rc:
            raise SystemExit(f"the ranks failed (exit status {rc})")
        with open(out) as f:
            res = json.load(f)
    print(f"# {a.place} {a.hosts} ranks{'' if bps is None else ' ' + a.link}, ResNet-50, fusion threshold "
          f"{a.fusion_threshold or 'default'}, {a.rounds} rounds, THREAD_MULTIPLE={res['thread_multiple']}; "
          f"load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    if tc:
        print("# tc bytes this run (sent by host, received by host): "
              + ", ".join(f"{h}: {s / 1e6:.1f} / {r / 1e6:.1f} MB" for h, (s, r) in tc.items()))
    blk = ((" pipelined, blocking waits |" if a.blocking else "") + (" pipelined, 16-bit whole |" if a.whole else "")
           + (" pipelined, allgathers on the thread |" if a.thread else "")
           + (" pipelined, groups of one bucket |" if a.per_bucket else ""))
    print("| compressor | buckets | kernels | compute (1 rank) | wire MB/step | wire time | bound | serial |" + blk +
          " pipelined | pipelined / bound | pipelined / max(kernels, wire) | serial / pipelined |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (a.blocking + a.whole + a.thread + a.per_bucket)
          + "---:|---:|---:|---:|")
    rows = {}
    for m in a.methods.split(","):
        per = [r[m] for r in res["ranks"]]
        kernels = max(r["compute"] for r in per)
        compute = max(r["solo"] for r in per)         # the step alone on one rank: no network
        wb = max(r["wire_bytes"] for r in per)
        wire = wb * 8 / bps if bps else 0.0
        serial = max(r["serial"] for r in per)
        piped = max(r["pipelined"] for r in per)
        bound = max(compute, wire)
        rows[m] = dict(kernels=kernels, compute=compute, wire_bytes=wb, wire=wire, bound=bound, serial=serial,
                       pipelined=piped, buckets=per[0]["buckets"], runs=per[0]["pipelined_runs"])
        bcol = f" {max(r['blocking'] for r in per) * 1e3:.1f} ms |" if a.blocking else ""
        rows[m]["blocking"] = max(r["blocking"] for r in per) if a.blocking else None
        rows[m]["whole"] = max(r["whole"] for r in per) if a.whole else None
        bcol += f" {rows[m]['whole'] * 1e3:.1f} ms |" if a.whole else ""
        rows[m]["thread"] = max(r["thread"] for r in per) if a.thread else None
        bcol += f" {rows[m]['thread'] * 1e3:.1f} ms |" if a.thread else ""
        rows[m]["per_bucket"] = max(r["per_bucket"] for r in per) if a.per_bucket else None
        bcol += f" {rows[m]['per_bucket'] * 1e3:.1f} ms |" if a.per_bucket else ""
        print(f"| {m} | {per[0]['buckets']} | {kernels * 1e3:.1f} ms | {compute * 1e3:.1f} ms | {wb / 1e6:.2f} | "
              f"{wire * 1e3:.1f} ms | "
              f"{bound * 1e3:.1f} ms | {serial * 1e3:.1f} ms |{bcol} {piped * 1e3:.1f} ms | {piped / bound:.2f} | "
              f"{piped / max(kernels, wire):.2f} | {serial / piped:.2f} |")
    print("\nCPU per step (median, the busier rank, every thread of the process):")
    names = {"False": "serial", "True": "pipelined", "blocking": "blocking waits", "whole": "16-bit whole",
             "thread": "allgathers on the thread", "per-bucket": "groups of one bucket"}
    for m in a.methods.split(","):
        per = [r[m]["cpu"] for r in res["ranks"]]
        print(f"  {m}: " + ", ".join(f"{names[k]} {max(c[k] for c in per) * 1e3:.1f} ms" for k in per[0]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "raw": res, "load": [load0, load1], "link": a.link, "place": a.place}, f)


if __name__ == "__main__":
    main()
