"""``python -m gradfuse.bench network``: gradient allreduce where the network is the limit.

    python -m gradfuse.bench network                                  # local:2 and 1gbit:2, ResNet-50
    python -m gradfuse.bench network --where 1gbit:2,1gbit:4,1gbit:8 --workloads resnet50,bert,flat256
    python -m gradfuse.bench network --where local:2 --workloads tiny --rounds 2   # no root needed

``--where`` lists ``PLACE:RANKS`` entries: ``local:P`` runs ``mpiexec -n P`` on this
machine (shared memory: the compute-bound reference); ``cluster:P`` runs
``--launch`` (e.g. ``'mpiexec -hosts n1,n2,n3,n4'``) with ``-n P`` on real hosts, predicted
at ``--link-rate`` (docs/network.md); ``1gbit:P``, ``10gbit:P`` or
``RATE[/DELAY]:P`` (``2gbit/50us:4``) builds an emulated cluster of P hosts, one rank each,
every host on its own link shaped both ways (gradfuse/bench/netns.py; needs root), and
runs the ranks there with MPICH on TCP. Each entry is one mpiexec run of
gradfuse/bench/network_worker.py; this process drives them and prints the tables.

Methods: gradfuse with every compressor at its defaults (``none`` is fp32; ``1bit`` both
algorithms and its ``auto`` default), per-tensor mpi4py ``Allreduce``, and Horovod's MXNet
``grouped_allreduce_`` in fp32 and fp16 (cast, sum, cast back, as its
``Compression.fp16``) when Horovod is installed.

Figures, as nccl-tests defines them, with S the workload's float32 gradient bytes and t
the step time: algbw = S / t, busbw = algbw x 2(p - 1)/p. "sent" is what
``Pipeline.stats`` counts per rank per step (compressed payloads as sent; fp32 and the
baselines as a ring's 2(p - 1)/p x S); "wire" is what left the host's interface per step
(headers included; emulated cluster only). "predicted" sums
``gradfuse.compressors.cost.predict`` over the fusion buckets, each with the algorithm the
compressor picks for it, on the link's rate and a latency per message step taken from
an 8-byte allreduce measured in the same run (its time, less the same on shared memory
when the run has a ``local:P`` entry, / ceil(log2 p)). A second prediction replaces the
model's compute terms by the method's measured ``local:P`` time (wire + local). "bound" is
max(the same method's time in this run's ``local:P`` entry, sent / link rate): the
issue's target is t <= 1.25 x bound.

Timings on this project's machine are taken on 2 shared cores: 4 and 8 ranks oversubscribe
them, so there the local (compute) times grow and only the link-bound rows mean much.
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile

from .network_worker import BASELINES, COMPRESSORS, WORKLOADS, bucket_shapes, buckets

DEFAULT_METHODS = ("none", "fp16", "1bit-allgather", "1bit-twophase", "2bit", "topk", "randomk") + BASELINES
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_where(spec):
    """``'local:2,1gbit:4'`` -> [('local', 2), ('1gbit', 4)]; a link may carry a delay:
    ``2gbit/50us:4``."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        place, _, n = item.rpartition(":")
        if not place or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--where entry {item!r}: expected PLACE:RANKS, e.g. local:2 or 1gbit:4")
        if place not in ("local", "cluster"):
            from .netns import parse_link
            parse_link(place.replace("/", ":"))      # a bad rate fails here, before any run
        out.append((place, int(n)))
    return out


def _mpiexec():
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else "mpiexec"


def run_place(place, p, worker, mtu, timeout, launch=None, link_rate=None):
    """One mpiexec run of ``python -m <worker[0]> OUT <worker[1:]>``; returns its JSON plus
    the link's facts."""
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="gfnet-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, "-m", worker[0], out] + list(worker[1:])
        load0 = os.getloadavg()[0]
        sys.stderr.write(f"== {place}:{p} (load average {load0:.1f}) ==\n")
        sys.stderr.flush()
        if place == "local":
            rc = subprocess.run([_mpiexec(), "-n", str(p)] + argv, env=env, timeout=timeout).returncode
            link = None
        elif place == "cluster":       # a real one: the user's launcher, the link rate they name
            from .netns import parse_link
            rate, _, bps = parse_link(link_rate)
            rc = subprocess.run(shlex.split(launch) + ["-n", str(p)] + argv, env=env, timeout=timeout).returncode
            link = {"bps": bps, "rate": rate, "delay": None, "mtu": None, "tc_bytes": {}}
        else:
            from . import netns
            env["GRADFUSE_NET_IFACE"] = "eth0"
            with netns.Cluster(p, place.replace("/", ":"), mtu=mtu) as c:
                before = c.counters()
                rc = c.run(c.mpiexec(argv, mpiexec=_mpiexec()), env=env, timeout=timeout).returncode
                links = netns.counter_delta(before, c.counters())
                link = {"bps": c.bps, "rate": c.rate, "delay": c.delay if c.delay_applied else None,
                        "mtu": c.mtu, "tc_bytes": links}
        if rc:
            raise SystemExit(f"{place}:{p}: the ranks failed (exit status {rc})")
        with open(out) as f:
            r = json.load(f)
    r["place"], r["link"], r["load"] = place, link, (load0, os.getloadavg()[0])
    return r


def predict_step(label, w, p, link, latency):
    """Predicted seconds of one step of ``label`` on workload ``w``: (the cost model with
    its kernel rates, its wire and latency terms alone); (None, None) if it has no formula."""
    from ..compressors import cost
    L, free = cost.Link(link["bps"] / 8, latency), cost.Link(1e30, 0.0)
    m = w["methods"][label]
    if label in COMPRESSORS:
        cname, opts = COMPRESSORS[label]
        sh = bucket_shapes([tuple(s) for s in w.get("shapes", [(c,) for c in w["counts"]])], m["threshold"])
        parts = [(cname, a, n, opts, tuple(map(tuple, s)))
                 for n, a, s in zip(buckets(w["counts"], m["threshold"]), m["algorithms"], sh)]
    elif label == "mpi4py":
        parts = [("none", "ring", n, {}, None) for n in w["counts"]]
    else:      # Horovod fuses into 64 MB buckets: about one allreduce of everything
        parts = [("fp16", "allreduce", w["bytes"] // 4, {}, None) if label == "horovod-fp16" else
                 ("none", "ring", w["bytes"] // 4, {}, None)]
    try:
        full = sum(cost.predict(c, a, n, p, L, options=o, shapes=s) for c, a, n, o, s in parts)
        compute = sum(cost.predict(c, a, n, p, free, options=o, shapes=s) for c, a, n, o, s in parts)
    except (ValueError, KeyError):
        return None, None
    return full, full - compute


MODEL_ROWS = (("none", "ring"), ("fp16", "allreduce"), ("1bit", "allgather"), ("1bit", "twophase"),
              ("2bit", "allgather"), ("2bit", "twophase"), ("topk", "allgather"), ("randomk", "allgather"),
              ("randomk", "sparse_allreduce"), ("powersgd", "powersgd"))
MODEL_P = (2, 4, 8, 16, 32, 64, 128, 256)


def model_table(workload, links, threshold=1 << 20):
    """Markdown: the cost model's seconds per step of every (compressor, algorithm) at
    p = 2..256 on each link (its preset latency, the model's kernel rates), and the p from
    which each stops beating the fp32 ring (the crossover)."""
    from ..compressors import cost
    counts = [int(math.prod(s)) for s in WORKLOADS[workload]()]
    bs = buckets(counts, threshold)
    shs = bucket_shapes(WORKLOADS[workload](), threshold)

    def step(c, a, p, link):
        return sum(cost.predict(c, a, n, p, link, shapes=s) for n, s in zip(bs, shs))

    def crossover(c, a, link, p_max=4096):
        def loses(p):
            return step(c, a, p, link) >= step("none", "ring", p, link)
        if loses(2):
            return "2"
        lo, hi = 2, 4
        while hi <= p_max and not loses(hi):
            lo, hi = hi, hi * 2
        if hi > p_max:
            return f"> {p_max}"
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if loses(mid) else (mid, hi)
        return str(hi)

    lines = []
    for spec in links:
        link = cost.link_from(spec)
        lines.append(f"\n#### cost model: {workload} ({sum(counts) * 4 / 1e6:.1f} MB, {len(bs)} buckets of at most "
                     f"{threshold >> 10} KiB), {link!r}, ms per step\n")
        lines.append("| compressor | algorithm | " + " | ".join(f"p={p}" for p in MODEL_P) +
                     " | slower than fp32 from p = |")
        lines.append("|---|---|" + "---:|" * len(MODEL_P) + "---:|")
        for c, a in MODEL_ROWS:
            lines.append(f"| {c} | {a} | " + " | ".join(f"{step(c, a, p, link) * 1e3:.0f}" for p in MODEL_P) +
                         f" | {'-' if c == 'none' else crossover(c, a, link)} |")
    return "\n".join(lines)


def report(results):
    """Markdown tables of the runs (one per place and workload)."""
    lines = []
    local = {(r["p"], wn): w for r in results if r["place"] == "local" for wn, w in r["workloads"].items()}
    for r in results:
        p, link = r["p"], r["link"]
        # the link's latency per message step: the 8-byte allreduce here, less the same on
        # shared memory (what remains of it is scheduling, already in the local times)
        lsmall = next((x["small_allreduce_s"] for x in results if x["place"] == "local" and x["p"] == p), 0.0)
        lat = max(0.0, r["small_allreduce_s"] - lsmall) / max(1, math.ceil(math.log2(p))) if p > 1 else 0.0
        where = "local (shared memory)" if link is None else (
            f"emulated {link['rate']} links, one-way delay {link['delay'] or 'none (no netem)'}, MTU {link['mtu']}")
        for wn, w in r["workloads"].items():
            S, ms = w["bytes"], w["methods"]
            ref = ms.get("none", {}).get("t")
            lines.append(f"\n#### {wn} ({w['tensors']} tensors, {S / 1e6:.1f} MB), {p} ranks, {where}\n")
            load = r.get("load")
            lines.append(f"8-byte allreduce: {r['small_allreduce_s'] * 1e6:.0f} us" +
                         (f" (model latency per step: {lat * 1e6:.0f} us)" if link else "") + f"; {r['rounds']} rounds, median of the "
                         "slowest rank" + (f"; 1-min load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
                                           f"(of {os.cpu_count()} cores)" if load else "") + ".\n")
            head = "| method | algorithms | ms/step | algbw GB/s | busbw GB/s | speedup vs fp32 | MB sent/rank |"
            sep = "|---|---|---:|---:|---:|---:|---:|"
            if link:
                head += (" MB wire/rank | model ms (kernel rates) | model ms (measured compute) | "
                         "measured/model | bound ms | t/bound |")
                sep += "---:|---:|---:|---:|---:|---:|"
            lines += [head, sep]
            for label, m in ms.items():
                t = m["t"]
                algbw = S / t / 1e9
                algos = sorted(set(m["algorithms"] or [])) if m["algorithms"] else ["MPI"]
                row = (f"| {label} | {'+'.join(algos)} | {t * 1e3:.1f} | {algbw:.3f} | {algbw * 2 * (p - 1) / p:.3f} | "
                       f"{(ref / t if ref else float('nan')):.2f}x | {m['sent'] / 1e6:.3f} |")
                if link:
                    pred, wire_part = predict_step(label, w, p, link, lat)
                    lt = local.get((p, wn), {}).get("methods", {}).get(label, {}).get("t")
                    bound = max(lt or 0.0, m["sent"] * 8 / link["bps"])
                    row += (f" {m['wire'] / 1e6:.3f} |" if m["wire"] is not None else " - |")
                    row += f" {pred * 1e3:.1f} |" if pred else " - |"
                    # measured compute: this method's local:P time in place of the kernel-rate terms
                    mc = (wire_part + lt) if (pred and lt) else None
                    row += f" {mc * 1e3:.1f} | {t / mc:.2f} |" if mc else " - | - |"
                    row += f" {bound * 1e3:.1f} | {t / bound:.2f} |" if lt else f" - | - (no local:{p} run) |"
                lines.append(row)
            if r["horovod"] is False:
                lines.append("\nHorovod is not installed here (or failed to import): its rows are left out.")
        if link and link["tc_bytes"]:
            lines.append(f"\nBytes that crossed each shaped link during the {p}-host run (tc -s tbf counters, "
                         "whole run incl. warm-up and launch):\n")
            lines.append("| host | sent MB | received MB |\n|---|---:|---:|")
            for h, (s, rv) in link["tc_bytes"].items():
                lines.append(f"| {h} | {s / 1e6:.1f} | {rv / 1e6:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench network", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--where", default="local:2,1gbit:2", help="PLACE:RANKS list (default local:2,1gbit:2)")
    ap.add_argument("--workloads", default="resnet50", help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated: {', '.join(list(COMPRESSORS) + list(BASELINES))}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-horovod", action="store_true", help="leave Horovod out even if installed")
    ap.add_argument("--mtu", type=int, default=1500, help="emulated links' MTU")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per place before it is stopped")
    ap.add_argument("--json", help="also write every measurement to this file")
    ap.add_argument("--launch", help="cluster:P entries: the launcher, e.g. 'mpiexec -hosts n1,n2' (-n P is added)")
    ap.add_argument("--link-rate", help="cluster:P entries: the hosts' link rate for the model, e.g. 10gbit")
    ap.add_argument("--model", metavar="LINKS", help="print the cost model's extrapolation to 256 ranks for "
                    "these links (e.g. 1gbit,10gbit) and the first --workloads entry, run nothing")
    ap.add_argument("--from-json", metavar="FILE", help="print the tables of an earlier --json file, run nothing")
    ap.add_argument("--e2e", action="store_true",
                    help="the end-to-end Gluon training step instead (gradfuse/bench/network_e2e.py): "
                         "--methods then lists compressors (default none,fp16,1bit)")
    a = ap.parse_args(argv)
    import signal
    from .netns import _raise_exit
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _raise_exit)      # a kill stops the ranks and tears the cluster down
    if a.model:
        print(model_table(a.workloads.split(",")[0], a.model.split(",")))
        return 0
    if a.from_json:
        with open(a.from_json) as f:
            results = json.load(f)
        from .network_e2e import report as e2e_report
        print((e2e_report if results and "rows" in results[0] else report)(results))
        return 0
    try:
        where = parse_where(a.where)
    except ValueError as e:
        ap.error(str(e))
    if any(pl == "cluster" for pl, _ in where) and not (a.launch and a.link_rate):
        ap.error("--where cluster:P needs --launch 'mpiexec -hosts ...' and --link-rate (e.g. 10gbit)")
    if any(pl not in ("local", "cluster") for pl, _ in where):
        from .netns import check_root
        try:
            check_root()
        except (PermissionError, FileNotFoundError) as e:
            ap.error(f"{e}: run the emulated entries as root, or use --where local:P")
    where.sort(key=lambda e: e[0] != "local")   # local first: the emulated rows use its times as the bound
    if a.e2e:
        from .network_e2e import report as e2e_report
        comps = a.methods if a.methods != ap.get_default("methods") else "none,fp16,1bit"
        worker = ["gradfuse.bench.network_e2e", "--compressors", comps, "--rounds", str(a.rounds)]
        return _finish(a, [run_place(pl, p, worker, a.mtu, a.timeout, a.launch, a.link_rate) for pl, p in where], e2e_report)
    workloads = [s for s in a.workloads.split(",") if s]
    methods = [s for s in a.methods.split(",") if s]
    for name, valid in ((w, WORKLOADS) for w in workloads):
        if name not in valid:
            ap.error(f"unknown workload {name!r}; choose from {', '.join(valid)}")
    for m in methods:
        if m not in COMPRESSORS and m not in BASELINES:
            ap.error(f"unknown method {m!r}; choose from {', '.join(list(COMPRESSORS) + list(BASELINES))}")
    if "none" not in methods:
        methods.insert(0, "none")     # every speedup is against gradfuse fp32
    worker = ["gradfuse.bench.network_worker", "--workloads", ",".join(workloads), "--methods", ",".join(methods),
              "--rounds", str(a.rounds)] + (["--no-horovod"] if a.no_horovod else [])
    return _finish(a, [run_place(pl, p, worker, a.mtu, a.timeout, a.launch, a.link_rate) for pl, p in where], report)


def _finish(a, results, fmt):
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print(fmt(results))
    return 0
