#!/usr/bin/env python3
"""Run MPI ranks on an emulated cluster: hosts as network namespaces, each on its own
shaped full-duplex link to a bridge (gradfuse/bench/netns.py has the layout). As root.

    scripts/emu_cluster.py --hosts 2 --link 10gbit --check            # the link-rate check
    scripts/emu_cluster.py --hosts 4 --link 1gbit -- python -m gradfuse.bench network --worker ...
    scripts/emu_cluster.py --cleanup                                   # remove leftovers

With ``-- CMD...`` it runs ``mpiexec -hosts <host ips> -launcher ssh -launcher-exec
<netns wrapper> -iface eth0 -n <ranks> CMD...`` in the head namespace, with MPICH pushed
onto TCP, and prints the bytes that crossed each shaped link (``tc -s``) afterwards.

``--check``: a float32 ``MPI.Allreduce`` of ``--mb`` MB (median of ``--rounds``) against
the time the link rate allows, 2(p-1)/p x S / rate; exits 1 when the measured time is more
than ``--tolerance`` (15 %) away from it, or when the shaped links did not carry at least
the ring's bytes (traffic that bypassed them).

The namespaces are deleted afterwards, also on failure, Ctrl-C and kill (SIGTERM);
``--cleanup`` deletes the ones a killed run (SIGKILL) left behind.
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


def _cpu_ticks():
    """(all, idle + iowait) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v[:8]), v[3] + v[4]


def worker_allreduce(mb, rounds, out):
    """One rank of --check: time a float32 Allreduce of mb MB; rank 0 also notes how busy
    the machine was during the timed calls, and how much of that the ranks were."""
    import resource
    from mpi4py import MPI
    import numpy as np
    comm = MPI.COMM_WORLD
    n = int(mb * 1e6) // 4
    a = np.full(n, comm.rank + 1, np.float32)
    comm.Allreduce(MPI.IN_PLACE, a)                   # warm-up: connections
    if not (a[:8] == sum(range(1, comm.size + 1))).all():
        raise SystemExit(f"rank {comm.rank}: wrong allreduce result")
    times = []
    comm.Barrier()
    cpu0, ru0, w0 = _cpu_ticks(), resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    for _ in range(rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, a)
        times.append(time.perf_counter() - t0)
    comm.Barrier()
    cpu1, ru1, w1 = _cpu_ticks(), resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    t = comm.allreduce(statistics.median(times), op=MPI.MAX)
    ranks_cpu = comm.allreduce(ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime) / (w1 - w0)
    if comm.rank == 0:
        busy = 1 - (cpu1[1] - cpu0[1]) / max(1, cpu1[0] - cpu0[0])     # the whole machine
        ncpu = os.cpu_count() or 1
        with open(out, "w") as f:
            json.dump({"p": comm.size, "bytes": n * 4, "median_s": t, "calls": rounds + 1,
                       "machine_busy": busy * ncpu, "ranks_cpu": ranks_cpu, "ncpu": ncpu}, f)
        print(f"fp32 MPI.Allreduce of {n * 4 / 1e6:.1f} MB on {comm.size} ranks: {t * 1e3:.1f} ms "
              f"(median of {rounds}, slowest rank); a ring sends 2(p-1)/p x S = "
              f"{2 * (comm.size - 1) / comm.size * n * 4 / 1e6:.1f} MB per rank", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--link", default="1gbit", help="1gbit, 10gbit, or RATE:DELAY (e.g. 2gbit:50us)")
    ap.add_argument("--mtu", type=int, default=1500, help="link MTU (9000: jumbo frames)")
    ap.add_argument("--ranks", type=int, default=None, help="MPI ranks (default: one per host)")
    ap.add_argument("--keep-heap", action=argparse.BooleanOptionalAction, default=None,
                    help="the ranks' malloc keeps freed memory (no mmap, no trim: netns.HEAP_ENV), so that "
                         "MPICH's per-call temporary buffer does not page-fault afresh on every call "
                         "(default: on for links of 5 Gbit/s and up, where the 2 cores are the limit)")
    ap.add_argument("--loss-based-cc", action=argparse.BooleanOptionalAction, default=None,
                    help="the hosts' TCP uses cubic or reno (netns.LOSS_BASED_CC) instead of the machine's "
                         "default (default: on for links of 5 Gbit/s and up)")
    ap.add_argument("--check", action="store_true", help="measure an fp32 allreduce against the link rate")
    ap.add_argument("--mb", type=float, default=102.2, help="--check: MB per allreduce (default: ResNet-50's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--cleanup", action="store_true", help="delete leftover namespaces of dead runs")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker-allreduce", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.worker_allreduce:
        return worker_allreduce(a.mb, a.rounds, a.worker_allreduce)
    from gradfuse.bench import netns
    if a.cleanup:
        gone = netns.cleanup(only_dead=True)
        print(f"deleted {len(gone)} namespaces" + (": " + " ".join(gone) if gone else ""))
        return 0
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not a.check and not cmd:
        ap.error("give --check, --cleanup or -- CMD...")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else "mpiexec"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with netns.Cluster(a.hosts, a.link, mtu=a.mtu, keep_heap=a.keep_heap,
                       loss_based_cc=a.loss_based_cc) as c, tempfile.TemporaryDirectory() as tmp:
        print(f"cluster: {a.hosts} hosts {', '.join(c.ips)}, link {c.rate} each way, one-way delay "
              f"{c.delay if c.delay_applied else 'none (no netem)'}, tbf burst {c.burst} B, MTU {c.mtu}; head "
              f"{netns.HEAD_IP}; hosts' TCP congestion control {c.cc}; ranks' heap kept: "
              + (f"yes ({' '.join(f'{k}={v}' for k, v in netns.HEAP_ENV.items())})" if c.keep_heap else "no"), flush=True)
        out = os.path.join(tmp, "check.json")
        if a.check:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker-allreduce", out,
                   "--mb", str(a.mb), "--rounds", str(a.rounds)]
        before = c.counters()
        rc = c.run(c.mpiexec(cmd, ranks=a.ranks, mpiexec=mpiexec), env=env, timeout=a.timeout).returncode
        delta = netns.counter_delta(before, c.counters())
        print(c.tc_show())
        print("bytes that crossed each shaped link (tc -s, this run):")
        for h, (sent, recv) in delta.items():
            print(f"  {h}: sent {sent / 1e6:10.2f} MB   received {recv / 1e6:10.2f} MB")
        if rc or not a.check:
            return rc
        r = json.load(open(out))
        p, S = r["p"], r["bytes"]
        ring = 2 * (p - 1) / p * S
        want = ring * 8 / c.bps
        dev = r["median_s"] / want - 1
        print(f"\nfp32 MPI.Allreduce of {S / 1e6:.1f} MB on {p} ranks: {r['median_s'] * 1e3:.1f} ms (median of "
              f"{a.rounds}); link-rate time 2(p-1)/p x S / rate = {want * 1e3:.1f} ms; "
              f"measured/expected = {1 + dev:.3f} (tolerance {a.tolerance:.0%})")
        if "machine_busy" in r:
            print(f"CPU during the timed calls: the machine {100 * r['machine_busy']:.0f} % busy of "
                  f"{100 * r['ncpu']} %, the ranks themselves {100 * r['ranks_cpu']:.0f} % (their kernel work "
                  f"included); the rest, about {100 * max(0.0, r['machine_busy'] - r['ranks_cpu']):.0f} %, is "
                  f"softirq work outside the ranks and other users of the machine; 1-min load "
                  f"{os.getloadavg()[0]:.2f}")
        ok = abs(dev) <= a.tolerance
        crossed = min(min(s, rv) for s, rv in delta.values())
        need = ring * r["calls"]
        print(f"smallest per-link count {crossed / 1e6:.1f} MB vs the ring's {need / 1e6:.1f} MB "
              f"({r['calls']} calls x 2(p-1)/p x S): " + ("ok" if crossed >= need else "TOO FEW: traffic bypassed the links"))
        ok = ok and crossed >= need
        print("check:", "PASS" if ok else "FAIL")
        return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.TimeoutExpired as e:
        sys.exit(f"timed out: {e}")
