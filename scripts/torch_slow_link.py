#!/usr/bin/env python3
"""The torch DDP step bench (examples/torch_ddp_bench.py) on an emulated cluster. As root.

    scripts/torch_slow_link.py --link 1gbit                       # 2 hosts, every method
    scripts/torch_slow_link.py --link 1gbit,10gbit -- --rounds 4 --steps 5
    scripts/torch_slow_link.py --link 1gbit -- --methods ddp,gradfuse-1bit

For each link: ``gradfuse.bench.netns.Cluster(hosts, link)`` (hosts as network namespaces,
each on its own shaped full-duplex link; docs/network.md), then one bench process per host
namespace (``ip netns exec``), torch.distributed over gloo on the veths: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` = host 0's address, ``MASTER_PORT``,
``GLOO_SOCKET_IFNAME=eth0``. Arguments after ``--`` go to the bench; this script adds
``--tc-dev eth0 --link-bps <rate>``, so every rank counts what left its shaped queue per
method. Afterwards it prints ``tc -s`` of both ends of every link and the bytes that crossed
each during the run, and checks that every host's link carried at least what its rank
counted on eth0 in its timed steps (exit status 1 otherwise).

No MPI: the processes are started directly. The namespaces are deleted afterwards, also on
failure, Ctrl-C and SIGTERM (``scripts/emu_cluster.py --cleanup`` after a SIGKILL).
"""
import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BENCH = os.path.join(ROOT, "examples", "torch_ddp_bench.py")


def run_link(link, hosts, bench_args, python, timeout, port):
    """One cluster, one bench run; returns its exit status."""
    from gradfuse.bench import netns
    with netns.Cluster(hosts, link) as c:
        print(f"## link {link}: {hosts} hosts {', '.join(c.ips)}, {c.rate} each way, one-way delay "
              f"{c.delay if c.delay_applied else 'none (no netem on this kernel)'}, tbf burst {c.burst} B", flush=True)
        print("load average before:", open("/proc/loadavg").read().strip(), flush=True)
        before = c.counters()
        procs = []
        for i, ns in enumerate(c.ns):
            env = dict(os.environ, RANK=str(i), WORLD_SIZE=str(hosts), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=c.ips[0], MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            cmd = ["ip", "netns", "exec", ns, python, BENCH, "--tc-dev", "eth0", "--link-bps", str(c.bps)] + bench_args
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        t0 = time.monotonic()
        outs, rcs = [], []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
                outs.append(out)
                rcs.append(p.returncode)
        except subprocess.TimeoutExpired:
            print(f"timed out after {timeout} s", flush=True)
            return 124                                 # Cluster.down() kills what still runs
        print(f"wall {time.monotonic() - t0:.0f} s; load average after:", open("/proc/loadavg").read().strip())
        for i, (out, rc) in enumerate(zip(outs, rcs)):
            if i == 0 or rc:
                print(f"# rank {i} (exit {rc}):\n{out}", flush=True)
        delta = netns.counter_delta(before, c.counters())
        print(c.tc_show())
        print("bytes that crossed each shaped link during the run (tc -s):")
        for h, (sent, recv) in delta.items():
            print(f"  {h}: sent {sent / 1e6:10.2f} MB   received {recv / 1e6:10.2f} MB")
        if any(rcs):
            return max(rcs)
        # what each rank counted on its eth0 in its timed steps is a part of what its
        # link carried during the run
        ok = True
        for i, out in enumerate(outs):
            m = re.search(rf"^rank {i}: (\d+) bytes left eth0", out, re.M)
            if not m:
                print(f"rank {i}: no byte count in its output")
                return 1
            sent = delta[f"h{i}"][0]
            good = sent >= int(m.group(1)) > 0
            ok = ok and good
            print(f"h{i}: sent {sent / 1e6:.1f} MB in the run, of which the rank counted {int(m.group(1)) / 1e6:.1f} MB "
                  f"in its timed steps: " + ("ok" if good else "INCONSISTENT"))
        return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="1gbit", help="comma-separated: 1gbit, 10gbit, RATE:DELAY (one cluster each)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--python", default=sys.executable, help="the python with torch (default: this one)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per link")
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the bench's arguments")
    a = ap.parse_args(argv)
    bench_args = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    rc = 0
    for link in a.link.split(","):
        rc = max(rc, run_link(link, a.hosts, bench_args, a.python, a.timeout, a.port))
    return rc


if __name__ == "__main__":
    sys.exit(main())
