#!/usr/bin/env python3
"""Where the time of the emulated cluster's links goes: raw TCP between two host
namespaces both ways at once, or an MPI allreduce/sendrecv, over variants of the
shaping, the links and the MPI environment. As root. Builds one 2-host cluster
(gradfuse/bench/netns.py, with its defaults for ``--link``) and measures every variant
in rounds that alternate them (A/B/A/B..., reversed every other round), so that a load
that drifts during the run hits them alike:

    scripts/net_ceiling.py --shape tbf,none --rounds 3                 # TCP through the tbfs and unshaped
    scripts/net_ceiling.py --shape tbf --mtu 1500,9000,65535 --streams 1,4
    scripts/net_ceiling.py --shape none --offload on,gro,nogso --tool iperf3
    scripts/net_ceiling.py --one-way --burst 65536,cluster               # the tbf's accuracy
    scripts/net_ceiling.py --mpi allreduce --env "(cluster);-MALLOC_MMAP_MAX_+-MALLOC_TRIM_THRESHOLD_"
    scripts/net_ceiling.py --variant "shape=none" --variant "shape=tbf cc=bbr"   # a list, not a product

Raw TCP: each trial runs one process per host that both sends and receives (as an MPI
rank does) over ``--streams`` TCP connections, each carrying data both ways (4 MiB
``sendall`` / ``recv_into``), for ``--seconds``; it counts what each side received in a
common window that leaves out the first 0.5 s (slow start). ``--one-way`` sends
h0 -> h1 only. ``--tool iperf3`` runs ``iperf3 --bidir`` (1 MiB writes, its maximum)
instead, where installed.
``--mpi allreduce|sendrecv``: each trial is one mpiexec run on the cluster timing
``--mpi-rounds`` calls of ``--mb`` MB (the median), with the page faults a call.

Per trial it prints: Gbit/s of payload each way; the machine's CPU split over the
window from /proc/stat (user, sys, softirq, idle, steal; 2 cores = 200 %); ``ours``,
the CPU the workers (or ranks) themselves used (getrusage; softirq work done in their
context counts there, work in ksoftirqd does not); ``pre``, how busy the machine was
just before the trial (``--quiet-wait`` waits up to that many seconds for it to be
under ``--quiet-busy`` %); the 1-min load; and what the first sender was limited by
(``ss -ti``: the share of its busy time spent rwnd- or sndbuf-limited, cwnd, RTT).
The summaries give the medians over all trials and over the quiet ones (user CPU under
``--quiet-user`` %: the workers spend almost none, so it is other users' work).

The variants (comma lists make a product; ``--variant`` lists them instead):

- ``--shape``: ``tbf`` (tbf at ``--link`` on all four veth ends, as the cluster
  shapes) or ``none`` (qdiscs removed: the veth and bridge path alone). (This
  machine's kernel has neither sch_fq nor sch_netem, so there is no pacing qdisc to
  compare.)
- ``--burst`` (``cluster``: the cluster's, 1 ms at the rate) and ``--latency`` (the
  tbf's queue as time; the cluster's is 100ms).
- ``--mtu``: of every veth end.
- ``--offload``: ``on`` (veth defaults: TSO/GSO on, GRO off), ``gro`` (GRO on: veth
  then runs NAPI on receive), ``nogso`` (TSO and GSO off: every MTU-sized packet
  crosses the qdiscs and the bridge alone), ``notso`` (TSO off, GSO on).
- ``--tcpmem``: the host namespaces' net.ipv4.tcp_wmem / tcp_rmem maximum in bytes
  (``default`` keeps the kernel's: 4 MiB send, 32 MiB receive here).
- ``--cc``: the hosts' congestion control (``default``: the cluster's).
- ``--brnf``: bridge-nf-call-iptables in the bridge's namespace (1: the kernel's).
- ``--streams``: TCP connections (raw TCP only).
- ``--env`` (with ``--mpi``): environment over the cluster's MPI environment.

All of it is torn down afterwards (the Cluster context manager), also on failure.
"""
import argparse
import itertools
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PORT = 5301
DIMS = ("shape", "burst", "latency", "mtu", "offload", "tcpmem", "cc", "brnf", "streams", "env")
CHUNK = 4 << 20


# --- the worker: one per host --------------------------------------------------------
def worker(role, me, peer, streams, t_start, t_stop, out, one_way):
    """role 'server' accepts ``streams`` connections on ``me``; 'client' connects to
    ``peer``. Every connection sends (unless one-way and server) and receives
    (unless one-way and client) until t_stop (CLOCK_MONOTONIC, shared by the
    namespaces); the received bytes are counted between t_start and t_stop."""
    if role == "server":
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((me, PORT))
        ls.listen(streams)
        ls.settimeout(30)
        conns = [ls.accept()[0] for _ in range(streams)]
        ls.close()
    else:
        conns = []
        for _ in range(streams):
            for _ in range(100):
                try:
                    conns.append(socket.create_connection((peer, PORT), timeout=30))
                    break
                except ConnectionRefusedError:
                    time.sleep(0.05)
            else:
                raise SystemExit(f"could not connect to {peer}:{PORT}")
    for c in conns:
        c.settimeout(None)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send = not (one_way and role == "server")
    recv = not (one_way and role == "client")
    got = [None] * len(conns)

    def sender(c):
        buf = memoryview(bytearray(CHUNK))
        while time.monotonic() < t_stop:
            c.sendall(buf)
        c.shutdown(socket.SHUT_WR)

    def receiver(i, c):
        buf = memoryview(bytearray(CHUNK))
        total, a, b = 0, None, None     # (time, bytes) at the first read after t_start / last before t_stop
        while True:
            n = c.recv_into(buf)
            if not n:
                break
            total += n
            now = time.monotonic()
            if now < t_start:
                continue
            if a is None:
                a = (now, total)
            if now <= t_stop:
                b = (now, total)
        got[i] = (a, b)

    threads = []
    for i, c in enumerate(conns):
        if send:
            threads.append(threading.Thread(target=sender, args=(c,)))
        if recv:
            threads.append(threading.Thread(target=receiver, args=(i, c)))
    for t in threads:
        t.start()
    import resource
    time.sleep(max(0.0, t_start - time.monotonic()))
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(max(0.0, t_stop - time.monotonic()))
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    for t in threads:
        t.join()
    for c in conns:
        c.close()
    rate = 0.0
    if recv:
        for a, b in got:
            if a and b and b[0] > a[0]:
                rate += (b[1] - a[1]) * 8 / (b[0] - a[0])
    with open(out, "w") as f:
        json.dump({"bps": rate, "cpu_user": (ru1.ru_utime - ru0.ru_utime) / (t_stop - t_start),
                   "cpu_sys": (ru1.ru_stime - ru0.ru_stime) / (t_stop - t_start)}, f)


# --- the MPI worker: one rank per host ------------------------------------------------
def mpi_worker(op, mb, rounds, out):
    """Time ``op`` (allreduce: a float32 MPI.Allreduce of mb MB in place; sendrecv: an
    MPI.Sendrecv of mb/2 MB each way with the other rank) ``rounds`` times after a warm-up;
    rank 0 writes the median of the slowest rank, the CPU split of the machine over the
    timed loop, and the ranks' own CPU (getrusage, summed)."""
    import resource
    from mpi4py import MPI
    import numpy as np
    comm = MPI.COMM_WORLD
    n = int(mb * 1e6) // 4
    if op == "allreduce":
        a = np.full(n, comm.rank + 1, np.float32)
        call = lambda: comm.Allreduce(MPI.IN_PLACE, a)
        wire = 2 * (comm.size - 1) / comm.size * n * 4
    else:
        if comm.size != 2:
            raise SystemExit("sendrecv needs 2 ranks")
        a, b = np.full(n // 2, comm.rank + 1, np.float32), np.empty(n // 2, np.float32)
        call = lambda: comm.Sendrecv(a, 1 - comm.rank, 0, b, 1 - comm.rank, 0)
        wire = n // 2 * 4
    call()
    if op == "allreduce" and not (a[:8] == sum(range(1, comm.size + 1))).all():
        raise SystemExit(f"rank {comm.rank}: wrong allreduce result")
    comm.Barrier()
    ca, ru0, w0 = cpu_ticks(), resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    times = []
    for _ in range(rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    comm.Barrier()
    cb, ru1, w1 = cpu_ticks(), resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    mine = comm.allreduce(ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime)
    faults = comm.allreduce(ru1.ru_minflt - ru0.ru_minflt, op=MPI.MAX) / rounds
    t = comm.allreduce(statistics.median(times), op=MPI.MAX)
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump({"p": comm.size, "wire_bytes": wire, "median_s": t, "cpu": cpu_split(ca, cb),
                       "mine": 100 * mine / (w1 - w0), "faults_per_call": faults}, f)


# --- the driver -------------------------------------------------------------------------
def cpu_ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal
    return {"user": v[0] + v[1], "sys": v[2], "idle": v[3] + v[4], "irq": v[5], "softirq": v[6],
            "steal": v[7] if len(v) > 7 else 0}


def cpu_split(a, b):
    d = {k: b[k] - a[k] for k in a}
    tot = sum(d.values()) or 1
    ncpu = os.cpu_count() or 1
    return {k: 100.0 * ncpu * v / tot for k, v in d.items()}


def sh(ns, *argv, check=True):
    from gradfuse.bench.netns import _sh
    return _sh(*argv, ns=ns, check=check)


def ends(c):
    """(namespace, device) of the four veth ends of a 2-host cluster."""
    return [(c.ns[0], "eth0"), (c.br, "h0"), (c.ns[1], "eth0"), (c.br, "h1")]


def configure(c, v, a):
    for ns, dev in ends(c):
        sh(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        sh(ns, "ip", "link", "set", dev, "mtu", v["mtu"])
        k = {"on": dict(tso="on", gso="on", gro="off"), "gro": dict(tso="on", gso="on", gro="on"),
             "nogso": dict(tso="off", gso="off", gro="off"), "notso": dict(tso="off", gso="on", gro="off")}[v["offload"]]
        sh(ns, "ethtool", "-K", dev, *itertools.chain.from_iterable(k.items()))
        if v["shape"] == "tbf":
            sh(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", c.rate,
               "burst", c.burst if v["burst"] == "cluster" else v["burst"], "latency", v["latency"])
        elif v["shape"] != "none":
            raise SystemExit(f"--shape {v['shape']!r}: tbf or none")
    sh(c.br, "sysctl", "-q", f"net.bridge.bridge-nf-call-iptables={v['brnf']}",
       f"net.bridge.bridge-nf-call-ip6tables={v['brnf']}", f"net.bridge.bridge-nf-call-arptables={v['brnf']}",
       check=False)
    for ns in c.ns:
        if v["cc"] != "default":
            sh(ns, "sysctl", "-q", f"net.ipv4.tcp_congestion_control={v['cc']}")
        else:
            sh(ns, "sysctl", "-q", f"net.ipv4.tcp_congestion_control={a._default_cc}")
        mem = v["tcpmem"]
        if mem == "default":
            mem_w, mem_r = a._default_tcpmem
        else:
            mem_w = mem_r = int(float(mem))
        w = sh(ns, "sysctl", "-n", "net.ipv4.tcp_wmem").split()
        r = sh(ns, "sysctl", "-n", "net.ipv4.tcp_rmem").split()
        sh(ns, "sysctl", "-q", f"net.ipv4.tcp_wmem={w[0]} {w[1]} {mem_w}", f"net.ipv4.tcp_rmem={r[0]} {r[1]} {mem_r}")


def ss_limits(ns):
    """What the first established sender on port PORT (or iperf3's 5201) was limited by."""
    out = sh(ns, "ss", "-tin", "state", "established", check=False)
    blocks = re.split(r"\n(?=\S)", out)
    for blk in blocks:
        if f":{PORT}" not in blk and ":5201" not in blk:
            continue
        m = {k: re.search(p, blk) for k, p in (("busy", r"busy:(\d+)ms"), ("rwnd", r"rwnd_limited:(\d+)ms"),
                                                ("sndbuf", r"sndbuf_limited:(\d+)ms"), ("cwnd", r"cwnd:(\d+)"),
                                                ("rtt", r"\brtt:([\d.]+)"), ("mss", r"\bmss:(\d+)"))}
        if not m["busy"] or int(m["busy"].group(1)) == 0:
            continue
        busy = int(m["busy"].group(1))
        return {"rwnd%": 100 * int(m["rwnd"].group(1)) / busy if m["rwnd"] else 0.0,
                "sndbuf%": 100 * int(m["sndbuf"].group(1)) / busy if m["sndbuf"] else 0.0,
                "cwnd_kb": int(m["cwnd"].group(1)) * int(m["mss"].group(1)) / 1024 if m["cwnd"] and m["mss"] else 0,
                "rtt_ms": float(m["rtt"].group(1)) if m["rtt"] else 0.0}
    return None


def trial_python(c, v, a, tmp):
    t0 = time.monotonic() + 1.0          # connections and startup
    t_start, t_stop = t0 + 0.5, t0 + 0.5 + a.seconds
    procs = []
    for role, ns, me, peer in (("server", c.ns[1], c.ips[1], c.ips[0]), ("client", c.ns[0], c.ips[0], c.ips[1])):
        out = os.path.join(tmp, f"{role}.json")
        cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--worker", role, me, peer,
               str(v["streams"]), repr(t_start), repr(t_stop), out] + (["--one-way"] if a.one_way else [])
        procs.append(subprocess.Popen(cmd))
        if role == "server":
            time.sleep(0.2)
    def result():
        r = [json.load(open(os.path.join(tmp, f"{role}.json"))) for role in ("server", "client")]
        mine = 100 * sum(x["cpu_user"] + x["cpu_sys"] for x in r)
        return r[0]["bps"], None if a.one_way else r[1]["bps"], mine
    return t_start, t_stop, procs, result


def trial_iperf3(c, v, a, tmp):
    out = os.path.join(tmp, "iperf3.json")
    srv = subprocess.Popen(["ip", "netns", "exec", c.ns[1], "iperf3", "-s", "-1", "-B", c.ips[1]],
                           stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    t = a.seconds + 0.5
    cli = subprocess.Popen(["ip", "netns", "exec", c.ns[0], "iperf3", "-c", c.ips[1], "-t", f"{t:g}", "-O", "0.5",
                            "-P", str(v["streams"]), "-l", str(1 << 20), "-J"] + ([] if a.one_way else ["--bidir"]),
                           stdout=open(out, "w"))
    now = time.monotonic()

    def result():
        e = json.load(open(out))["end"]
        fwd = e["sum_received"]["bits_per_second"]
        return fwd, None if a.one_way else e["sum_received_bidir_reverse"]["bits_per_second"], None
    return now + 0.8, now + 0.5 + t - 0.1, [srv, cli], result


def run_mpi_trial(c, v, a, tmp):
    out = os.path.join(tmp, "mpi.json")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    argv = c.mpiexec([sys.executable, os.path.abspath(__file__), "--mpi-worker", a.mpi, str(a.mb), str(a.mpi_rounds), out],
                     mpiexec=mpiexec if os.path.exists(mpiexec) else "mpiexec")
    full = c.env(env)
    for kv in filter(None, v["env"].split("+")):      # the variant overrides the cluster's own MPI environment
        if kv == "(cluster)":
            continue
        if kv.startswith("-"):                          # -NAME: unset it
            full.pop(kv[1:], None)
            continue
        k, _, val = kv.partition("=")
        full[k] = val
    r = subprocess.run(["ip", "netns", "exec", c.head] + argv, env=full, timeout=300)
    if r.returncode:
        raise RuntimeError(f"mpiexec failed ({r.returncode}) for {fmt_variant(v)}")
    m = json.load(open(out))
    os.unlink(out)
    gbps = m["wire_bytes"] * 8 / m["median_s"] / 1e9
    return {"fwd": gbps, "rev": gbps, "ms": m["median_s"] * 1e3, "cpu": m["cpu"], "mine": m["mine"],
            "faults": m.get("faults_per_call"),
            "load": os.getloadavg()[0], "ss": None}


def wait_quiet(a):
    """Wait (at most ``a.quiet_wait`` s) until the machine's other users leave it nearly
    idle: busy under ``a.quiet_busy`` % (of 200 %) over 0.5 s. Returns the busy % seen last."""
    t_end = time.monotonic() + a.quiet_wait
    while True:
        c0 = cpu_ticks()
        time.sleep(0.5)
        busy = 200 - cpu_split(c0, cpu_ticks())["idle"]
        if busy <= a.quiet_busy or time.monotonic() >= t_end:
            return busy
        time.sleep(0.5)


def run_trial(c, v, a, tmp):
    configure(c, v, a)
    busy_before = wait_quiet(a) if a.quiet_wait > 0 else None
    if a.mpi:
        r = run_mpi_trial(c, v, a, tmp)
        r["busy_before"] = busy_before
        return r
    r = _run_trial(c, v, a, tmp)
    r["busy_before"] = busy_before
    return r


def _run_trial(c, v, a, tmp):
    t_start, t_stop, procs, result = (trial_iperf3 if a.tool == "iperf3" else trial_python)(c, v, a, tmp)
    try:
        time.sleep(max(0.0, t_start - time.monotonic()))
        ca = cpu_ticks()
        time.sleep(max(0.0, (t_start + t_stop) / 2 - time.monotonic()))
        lim = ss_limits(c.ns[0])
        time.sleep(max(0.0, t_stop - time.monotonic()))
        cb = cpu_ticks()
        for p in procs:
            if p.wait(timeout=60):
                raise RuntimeError(f"{p.args} failed ({p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    fwd, rev, mine = result()
    return {"fwd": fwd / 1e9, "rev": None if rev is None else rev / 1e9, "cpu": cpu_split(ca, cb), "mine": mine,
            "load": os.getloadavg()[0], "ss": lim}


VARYING = list(DIMS)


def fmt_variant(v):
    """The dimensions that differ between this run's variants (the rest are in the header)."""
    return " ".join(f"{k}={v[k] or '(cluster)'}" for k in VARYING) or "-"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="10gbit", help="the tbf's rate (a netns.py preset or RATE)")
    ap.add_argument("--shape", default="tbf,none", help="tbf, none (comma list)")
    ap.add_argument("--mtu", default="1500")
    ap.add_argument("--offload", default="on", help="on, gro, nogso, notso (comma list)")
    ap.add_argument("--tcpmem", default="default", help="default or bytes (comma list)")
    ap.add_argument("--streams", default="1")
    ap.add_argument("--cc", default="default", help="TCP congestion control in the hosts (default: the kernel's)")
    ap.add_argument("--brnf", default="1", help="the bridge namespace's bridge-nf-call-iptables (1: the kernel's)")
    ap.add_argument("--burst", default="cluster", help="tbf burst, e.g. 64kb,1250000 (cluster: the cluster's, 1 ms at "
                                                       "the rate)")
    ap.add_argument("--latency", default="100ms", help="tbf queue length as time (the cluster's: 100ms)")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one-way", action="store_true")
    ap.add_argument("--tool", choices=("python", "iperf3"), default="python")
    ap.add_argument("--mpi", choices=("allreduce", "sendrecv"),
                    help="instead of raw TCP: time an MPI operation (one rank per host, the cluster's MPI environment)")
    ap.add_argument("--mb", type=float, default=102.2, help="--mpi: MB (allreduce: the buffer; sendrecv: both ways together)")
    ap.add_argument("--mpi-rounds", type=int, default=5, help="--mpi: timed calls per trial (median)")
    ap.add_argument("--env", default="", help="--mpi: environment variants over the cluster's MPI environment, "
                                                "';' between variants, '+' between K=V in one, -K unsets K "
                                                "(e.g. ';MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=tree;-MALLOC_MMAP_MAX_')")
    ap.add_argument("--variant", action="append",
                    help="instead of the product of the options: one variant as 'DIM=VALUE ...' over the options' "
                         "first values (repeat it), e.g. --variant 'cc=reno' --variant 'mtu=9000 env=K=V+K2=V2'")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="before each trial, wait up to this many seconds for the machine to be nearly idle")
    ap.add_argument("--quiet-busy", type=float, default=25.0,
                    help="--quiet-wait: 'nearly idle' is under this CPU %% busy (of 100 %% per core)")
    ap.add_argument("--quiet-user", type=float, default=30.0,
                    help="the second summary keeps the trials whose user CPU (the workers here spend almost "
                         "none: it is other users' work) stayed under this %%")
    ap.add_argument("--json", help="write every trial here")
    ap.add_argument("--mpi-worker", nargs=4, metavar=("OP", "MB", "ROUNDS", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=7, metavar=("ROLE", "ME", "PEER", "STREAMS", "T_START", "T_STOP", "OUT"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        role, me, peer, streams, t_start, t_stop, out = a.worker
        return worker(role, me, peer, int(streams), float(t_start), float(t_stop), out, a.one_way)
    from gradfuse.bench import netns
    if a.mpi_worker:
        op, mb, rounds, out = a.mpi_worker
        return mpi_worker(op, float(mb), int(rounds), out)
    lists = {k: getattr(a, k).split(";" if k == "env" else ",") for k in DIMS}
    variants = [dict(zip(DIMS, combo)) for combo in itertools.product(*(lists[k] for k in DIMS))]
    if a.variant:       # an explicit list instead of the product: each overrides the options' first values
        variants = []
        for spec in a.variant:
            v = {k: lists[k][0] for k in DIMS}
            for kv in spec.split():
                k, _, val = kv.partition("=")
                if k not in DIMS:
                    ap.error(f"--variant {spec!r}: {k!r} is not one of {', '.join(DIMS)}")
                v[k] = val
            variants.append(v)
        for k in DIMS:
            lists[k] = sorted({str(v[k]) for v in variants})
    for v in variants:
        v["mtu"], v["streams"] = int(v["mtu"]), int(v["streams"])
    VARYING[:] = [k for k in DIMS if len(lists[k]) > 1]
    fixed = " ".join(f"{k}={lists[k][0]}" for k in DIMS if len(lists[k]) == 1 and (k != "env" or lists[k][0]))
    if a.tool == "iperf3" and not __import__("shutil").which("iperf3"):
        sys.exit("--tool iperf3: iperf3 is not installed (Debian: apt-get install iperf3)")
    trials = []
    with netns.Cluster(2, a.link) as c, tempfile.TemporaryDirectory() as tmp:
        w = sh(c.ns[0], "sysctl", "-n", "net.ipv4.tcp_wmem").split()
        r = sh(c.ns[0], "sysctl", "-n", "net.ipv4.tcp_rmem").split()
        a._default_tcpmem = (int(w[2]), int(r[2]))
        a._default_cc = sh(c.ns[0], "sysctl", "-n", "net.ipv4.tcp_congestion_control").strip()
        print(f"2 hosts, link {c.rate} (both ends shaped where shape=tbf; the cluster's burst {c.burst} B, queue "
              f"100ms), {a.tool}, {'one way' if a.one_way else 'both ways'}, "
              f"{a.seconds:g} s per trial; kernel tcp_wmem/rmem max {a._default_tcpmem}; "
              f"{os.cpu_count()} CPUs; congestion control {a._default_cc}" + (f"; MPI: {a.mpi} of {a.mb:g} MB, median of "
              f"{a.mpi_rounds} calls per trial" if a.mpi else "") + f"\nfixed: {fixed}", flush=True)
        W = max(len(fmt_variant(v)) for v in variants)
        print(f"{'variant':<{W}} {'h0->h1':>7} {'h1->h0':>7} {'sum':>6}  {'user':>5} {'sys':>5} {'sirq':>5} {'idle':>5} "
              f"{'steal':>5} {'ours':>5} {'pre':>4}  {'load':>5}  h0's first sender (ss -ti)", flush=True)
        for rnd in range(a.rounds):
            for v in (variants if rnd % 2 == 0 else variants[::-1]):
                r = run_trial(c, v, a, tmp)
                r.update(variant=v, round=rnd)
                trials.append(r)
                cpu, s = r["cpu"], r["ss"]
                rev = r["rev"] if r["rev"] is not None else 0.0
                print(f"{fmt_variant(v):<{W}} {r['fwd']:7.2f} {rev:7.2f} {r['fwd'] + rev:6.2f}  {cpu['user']:5.0f} "
                      f"{cpu['sys']:5.0f} {cpu['softirq']:5.0f} {cpu['idle']:5.0f} {cpu['steal']:5.0f} {r['mine'] if r['mine'] is not None else -1:5.0f} {r['busy_before'] if r['busy_before'] is not None else -1:4.0f}  {r['load']:5.2f}  "
                      + (f"rwnd-limited {s['rwnd%']:.0f}% sndbuf-limited {s['sndbuf%']:.0f}% cwnd {s['cwnd_kb']:.0f} KiB "
                         f"rtt {s['rtt_ms']:.2f} ms" if s else f"{a.mpi} {r['ms']:.1f} ms, {r['faults']:.0f} page faults a call" if a.mpi else "-"), flush=True)
    W = max(len(fmt_variant(v)) for v in variants)
    for title, keep in (("all trials", lambda t: True),
                        (f"quiet trials only (others' user CPU under {a.quiet_user:g} % during the trial)",
                         lambda t: t["cpu"]["user"] < a.quiet_user)):
        summary(title, trials, variants, keep, a, W)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(trials, f, indent=1)
    return 0


def summary(title, trials, variants, keep, a, W):
    print(f"\nmedians over the rounds, {title} (Gbit/s of payload; CPU % of 2 cores):")
    for v in variants:
        rs = [t for t in trials if t["variant"] == v and keep(t)]
        if not rs:
            print(f"{fmt_variant(v):<{W}} (none)")
            continue
        med = lambda f: statistics.median(f(t) for t in rs)
        print(f"{fmt_variant(v):<{W}} h0->h1 {med(lambda t: t['fwd']):5.2f}  h1->h0 "
              f"{med(lambda t: t['rev'] or 0.0):5.2f}  idle {med(lambda t: t['cpu']['idle']):4.0f}%  "
              f"load {min(t['load'] for t in rs):.2f}-{max(t['load'] for t in rs):.2f}"
              + (f"  {a.mpi} {med(lambda t: t['ms']):.1f} ms (best {min(t['ms'] for t in rs):.1f})" if a.mpi else "")
              + f"  [{len(rs)} trials]")


if __name__ == "__main__":
    sys.exit(main())
