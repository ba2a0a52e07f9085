"""Where a link-bound compressed step's time goes beyond its wire time, from the step's own
timeline. On the emulated cluster of docs/network.md, as root:

    scripts/emu_cluster.py --hosts 2 --link 300mbit -- $PWD/.venv/bin/python \\
        -m gradfuse.bench link-idle --link 300mbit --steps 8 1bit 2bit

ResNet-50's gradients, in-place ``allreduce_`` steps of a ``Pipeline`` at its defaults
(pipelined exchange groups), 5 untimed steps, then ``--steps`` timed ones with the
timeline on (``gradfuse.runtime.timeline``, the spans ``GRADFUSE_TIMELINE`` writes). Rank
0 splits each timed step, from its spans, into
* *before the first post*: the step's start until its first exchange group is posted
  (negotiation and the compression of the first group);
* *link idle*: the gaps between exchange spans (a group's exchange span runs from its post,
  or from the previous group's completion when it was posted earlier, to its completion:
  where one span ends before the next begins, no group of this rank was in flight);
* *exchanges*: the union of the exchange spans (some group in flight), beside the wire
  time of the step's bytes at the link rate (``Pipeline.stats.bytes_sent``, per rank and
  step) and their ratio, the rate the link reached while it had work;
* *after the last exchange*: decoding what arrived last, until the step returns;
* beside them, the two parts of the step's verdict (stage ``"verdict"``): the max |x| pass
  over the inputs (while the early groups are on the link) and the max-allreduce that
  agrees on it; and the share of the machine's CPU time spent in softirq during the timed
  steps (``/proc/stat``): on the emulated cluster, the packet processing of the hosts'
  links runs on the ranks' own cores and slows their kernels while data flows;

and prints the medians over the timed steps. The step is link-bound where the exchanges
cover most of it: then everything but their union is time the link had nothing to do.
"""
import argparse
import json
import os
import statistics
import tempfile
import time


def link_bps(text):
    """Bits per second of ``--link``, read as ``emu_cluster.py`` reads it
    (``gradfuse.bench.netns.parse_link``: ``300mbit``, a preset such as ``1gbit``)."""
    from .netns import parse_link
    try:
        return parse_link(text.replace("/", ":"))[2]
    except ValueError as exc:
        raise SystemExit(f"--link: {exc}") from None


def cpu_ticks():
    """(all, softirq) jiffies of the whole machine (/proc/stat): the share of the CPUs that
    the kernel's packet processing takes (on the emulated cluster the hosts' veths, bridge
    and qdiscs run on the ranks' own cores)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v[:8]), v[6]


def split_steps(events):
    """The complete spans of a trace, cut into steps at each negotiation span (one per
    ``allreduce_`` call): ``[[span, ...], ...]`` in time order, times in ms."""
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in spans if e.get("cat") == "negotiate"]
    steps = []
    for i, t0 in enumerate(starts):
        t1 = starts[i + 1] if i + 1 < len(starts) else float("inf")
        steps.append([e for e in spans if t0 <= e["ts"] < t1])
    return steps


def account(step):
    """``{"step", "before", "idle", "exchanges", "after"}`` of one step's spans (ms)."""
    t0 = step[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in step)
    ex = sorted({(e["ts"], e["ts"] + e["dur"]) for e in step if e.get("cat") == "exchange"})
    if not ex:
        raise SystemExit("no exchange spans in a step: is the pipeline compressed and pipelined?")
    union, idle, lo, hi = 0.0, 0.0, ex[0][0], ex[0][1]
    for a, b in ex[1:]:
        if a > hi:
            union, idle, lo = union + (hi - lo), idle + (a - hi), a
        hi = max(hi, b)
    union += hi - lo
    part = {p: sum(e["dur"] for e in step if e.get("cat") == "verdict" and e["args"].get("part") == p)
            for p in ("max |x|", "agree")}
    ms = 1e-3
    return {"step": (end - t0) * ms, "before": (ex[0][0] - t0) * ms, "idle": idle * ms,
            "exchanges": union * ms, "after": (end - hi) * ms,
            "pass": part["max |x|"] * ms, "agree": part["agree"] * ms}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench link-idle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("methods", nargs="+", help="compressors (Pipeline's compress=)")
    ap.add_argument("--link", required=True, help="the hosts' link rate, as given to emu_cluster.py")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per method (default 8)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be at least 1, got {a.steps}")
    bps = link_bps(a.link)

    from mpi4py import MPI

    from ..pipeline import Pipeline
    from ..runtime import context, timeline
    from .sets import make_set, resnet50_shapes

    context.init()
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    grads = make_set(resnet50_shapes(), 1 + me)
    tmp = tempfile.mkdtemp(prefix="gf-link-idle-") if me == 0 else None
    tmp = world.bcast(tmp, root=0)
    if me == 0:
        print(f"{world.Get_size()} ranks, link {a.link}, ResNet-50 gradients, {a.steps} timed steps "
              f"(ms, rank 0, medians over the steps)\n")
        print("| method | step | before the first post | link idle | exchanges | wire time | "
              "wire / exchanges | after the last exchange | verdict: max abs pass | verdict: agree | "
              "CPU in softirq |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for method in a.methods:
        pipe = Pipeline(compress=method)
        for _ in range(5):
            pipe.allreduce_(grads)
        path = os.path.join(tmp, f"{method}-{me}.json")
        sent0 = pipe.stats.bytes_sent
        timeline.start(path, rank=me)
        ticks0 = cpu_ticks()
        wall = []
        for _ in range(a.steps):
            world.Barrier()
            t = time.perf_counter()
            pipe.allreduce_(grads)
            wall.append(time.perf_counter() - t)
        ticks1 = cpu_ticks()
        timeline.stop()
        softirq = (ticks1[1] - ticks0[1]) / max(1, ticks1[0] - ticks0[0])
        sent = (pipe.stats.bytes_sent - sent0) / a.steps
        world.Barrier()
        if me == 0:
            with open(path) as f:
                trace = json.load(f)
            rows = [account(s) for s in split_steps(trace["traceEvents"])]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            wire = sent * 8 / bps * 1e3
            print(f"| {method} | {med['step']:.1f} | {med['before']:.1f} | {med['idle']:.1f} | "
                  f"{med['exchanges']:.1f} | {wire:.1f} | {wire / med['exchanges']:.2f} | "
                  f"{med['after']:.1f} | {med['pass']:.1f} | {med['agree']:.1f} | {softirq:.0%} |", flush=True)
        del pipe
    if me == 0:
        print("\nwire time: Pipeline.stats.bytes_sent per rank and step at the link rate (payload "
              "bytes, no TCP/IP headers); step: from the timeline (the wall time around "
              f"allreduce_, median: {statistics.median(wall) * 1e3:.1f} ms for the last method).")
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
