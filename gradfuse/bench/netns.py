"""An emulated cluster on one machine: hosts as network namespaces on a shaped bridge.

Layout (all names start with ``gfnet<pid>-``, so ``cleanup()`` finds leftovers)::

    gfnet<pid>-br    a namespace holding the bridge br0 and the bridge-side veth ends
    gfnet<pid>-head  mpiexec runs here: eth0 10.213.0.254/24, unshaped (control traffic only)
    gfnet<pid>-h<i>  host i: eth0 10.213.0.<i+1>/24, lo; nothing else (no route out)

Every host has its own veth pair ``eth0`` (host side) <-> ``h<i>`` (bridge side), so its
link is full duplex and its own. Both ends are shaped with ``tc``: the host side's egress
(the host's sending) with tbf at the rate and a netem delay below it (the one-way
latency), the bridge side's egress (the host's receiving) with tbf at the rate. Presets:
``1gbit`` (100 us one way) and ``10gbit`` (25 us one way); ``rate:delay`` for others,
e.g. ``2.5gbit:50us``.

MPI ranks reach the hosts through hydra: ``mpiexec -hosts 10.213.0.1,... -launcher ssh
-launcher-exec <wrapper>``, where the wrapper maps a host address to ``ip netns exec
<host namespace> sh -c CMD`` (the ssh it replaces also runs CMD with a shell). mpiexec
itself runs in the head namespace, so the proxies connect back over the bridge. MPICH is
pushed onto TCP (``MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp
FI_TCP_IFACE=eth0``); NOLOCAL must stay because the namespaces share /dev/shm.

On links of 5 Gbit/s and up (the ``10gbit`` preset), where the 2 cores rather than the
link would otherwise set the pace, the ranks' malloc keeps freed memory (HEAP_ENV) and
the hosts' TCP uses a loss-based congestion control (LOSS_BASED_CC): with both, an fp32
allreduce of 102 MB on 2 hosts comes within 15 % of the 10 Gbit/s link rate here.

Needs root (ip netns, tc). ``Cluster`` is a context manager; ``down()`` runs on exit,
on an exception and on Ctrl-C, kills what still runs in the namespaces, and deletes them
(the veths and the bridge go with them).
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

PREFIX = "gfnet"
SUBNET = "10.213.0"
HEAD_IP = f"{SUBNET}.254"
PRESETS = {"1gbit": ("1gbit", "100us"), "10gbit": ("10gbit", "25us")}
MPI_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
           "FI_TCP_IFACE": "eth0"}
# glibc serves every malloc over 32 MiB with a fresh mmap and unmaps it on free. MPICH's
# allreduce mallocs a temporary buffer of the message's size on every call, so each call
# of a 102 MB allreduce page-faults fresh, zeroed pages into its receive buffer
# (measured: 12,478-12,876 faults a call per rank). At 10 Gbit/s that work lands on the
# same 2 cores that run both hosts' TCP: it took an fp32 allreduce of ResNet-50's 102 MB
# from 91-93 ms to 99-121 ms. With mmap off and no trimming, a freed block stays in the
# heap and the next call reuses its pages (docs/notes/benchmarks-history.md, "The link check"). Memory
# freed by the ranks is then never given back to the kernel, so resident-set figures
# read as peaks: only fast links, where the CPU is the limit, get it by default
# (``Cluster(keep_heap=...)`` / ``emu_cluster.py --keep-heap/--no-keep-heap``).
HEAP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4000000000"}
# Links from this rate up get the two settings that keep the 2 cores from being the limit
# (HEAP_ENV and a loss-based congestion control) unless the caller says otherwise.
FAST_LINK_BPS = 5e9
# A new namespace inherits the machine's TCP congestion control: BBR on this project's
# machine. BBR paces every flow with a timer and now and then cuts its window to probe the
# path's RTT (PROBE_RTT); measured at 10 Gbit/s with the heap kept, 3 of 9 quiet 102 MB
# allreduces took 106-107 ms under BBR (the others 91.5-94.4), while under reno 17 of 17
# took 90.6-92.8 (docs/benchmarks.md).
# A loss-based control without pacing is also what a stock Linux host runs (cubic).
# Namespaces other than the machine's own may only pick one from
# net.ipv4.tcp_allowed_congestion_control (here "reno bbr"), so the hosts get the first
# of these that they are allowed.
LOSS_BASED_CC = ("cubic", "reno")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_link(spec):
    """``'1gbit'`` / ``'10gbit'`` / ``'RATE:DELAY'`` -> (tc rate, tc delay, bits per second)."""
    rate, delay = PRESETS.get(spec, (None, None))
    if rate is None:
        rate, _, delay = spec.partition(":")
        delay = delay or "0us"
    m = re.fullmatch(r"([0-9.]+)([a-z]+)", rate)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"link {spec!r}: rate must look like 1gbit or 500mbit (or a preset: "
                         f"{', '.join(PRESETS)}), got {rate!r}")
    if not re.fullmatch(r"[0-9.]+(us|ms|s)", delay):
        raise ValueError(f"link {spec!r}: delay must look like 100us or 1ms, got {delay!r}")
    return rate, delay, float(m.group(1)) * _UNITS[m.group(2)]


def check_root():
    if os.geteuid() != 0:
        raise PermissionError("the emulated cluster needs root (ip netns, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"the emulated cluster needs {tool!r} (iproute2)")


def _sh(*argv, ns=None, check=True):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + [str(a) for a in argv]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids(ns):
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _signal_all(namespaces, sig):
    n = 0
    for ns in namespaces:
        for pid in _pids(ns):
            try:
                os.kill(pid, sig)
                n += 1
            except ProcessLookupError:
                pass
    return n


def _kill_and_delete(*namespaces):
    """Stop everything in ``namespaces`` (in the order given: launchers first, so that no
    new process starts behind the scan), then delete them."""
    import time
    if _signal_all(namespaces, signal.SIGTERM):
        time.sleep(0.3)
    for _ in range(5):         # a proxy may still have been spawning: scan until quiet
        if not _signal_all(namespaces, signal.SIGKILL):
            break
        time.sleep(0.1)
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def cleanup(only_dead=True):
    """Delete leftover cluster namespaces (of processes that are gone, or all with
    ``only_dead=False``); returns the names deleted."""
    gone = []
    for ns in _namespaces():
        m = re.fullmatch(PREFIX + r"(\d+)-\w+", ns)
        if not m:
            continue
        if only_dead and os.path.exists(f"/proc/{m.group(1)}"):
            continue
        gone.append(ns)
    gone.sort(key=lambda n: not n.endswith("-head"))   # launchers first
    _kill_and_delete(*gone)
    # the hydra wrappers' folders of dead runs
    tmp = tempfile.gettempdir()
    for d in os.listdir(tmp):
        m = re.fullmatch(PREFIX + r"(\d+)-\w+", d)
        if m and not os.path.exists(f"/proc/{m.group(1)}") and os.path.isdir(os.path.join(tmp, d)):
            shutil.rmtree(os.path.join(tmp, d), ignore_errors=True)
    return gone


class Cluster:
    """``hosts`` network namespaces on a bridge, each link shaped to ``link`` both ways.

    Example::

        with Cluster(2, "10gbit") as c:
            c.run(c.mpiexec(["python", "-c", "..."]))
            print(c.format_counters(c.counters()))
    """

    def __init__(self, hosts, link="1gbit", burst=None, mtu=1500, keep_heap=None, loss_based_cc=None):
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be 1..250, got {hosts}")
        self.hosts = hosts
        self.link = link
        self.rate, self.delay, self.bps = parse_link(link)
        # a burst of ~1 ms at the rate (at least 64 KiB, one GSO segment) keeps tbf exact
        self.burst = burst or max(64 << 10, int(self.bps / 8 / 1000))
        self.mtu = int(mtu)
        # by default on links of 5 Gbit/s and up: the ranks' malloc keeps freed blocks
        # (HEAP_ENV), and the hosts' TCP uses a loss-based congestion control (LOSS_BASED_CC)
        fast = self.bps >= FAST_LINK_BPS
        self.keep_heap = fast if keep_heap is None else bool(keep_heap)
        self.loss_based_cc = fast if loss_based_cc is None else bool(loss_based_cc)
        self.cc = None               # the hosts' congestion control, once up
        self.tag = f"{PREFIX}{os.getpid()}"
        self.br, self.head = f"{self.tag}-br", f"{self.tag}-head"
        self.ns = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.ips = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.tmp = None
        self.wrapper = None
        self.delay_applied = None    # False where the kernel has no netem
        self._made = []

    # --- up / down -----------------------------------------------------------------
    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()
        return False

    def _add_ns(self, ns):
        _sh("ip", "netns", "add", ns)
        self._made.append(ns)
        _sh("ip", "link", "set", "lo", "up", ns=ns)

    def up(self):
        check_root()
        old = signal.getsignal(signal.SIGTERM)
        if old in (signal.SIG_DFL, None):   # a kill must still tear down: make it an exception
            signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self._add_ns(self.br)
            _sh("ip", "link", "add", "br0", "type", "bridge", ns=self.br)
            _sh("ip", "link", "set", "br0", "up", ns=self.br)
            for name, ns, ip, shaped in ([("head", self.head, HEAD_IP, False)] +
                                         [(f"h{i}", n, a, True) for i, (n, a) in enumerate(zip(self.ns, self.ips))]):
                self._add_ns(ns)
                _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", name,
                    "netns", self.br)
                _sh("ip", "link", "set", "eth0", "mtu", self.mtu, ns=ns)
                _sh("ip", "link", "set", name, "mtu", self.mtu, ns=self.br)
                _sh("ip", "link", "set", name, "master", "br0", ns=self.br)
                _sh("ip", "link", "set", name, "up", ns=self.br)
                _sh("ip", "addr", "add", f"{ip}/24", "dev", "eth0", ns=ns)
                _sh("ip", "link", "set", "eth0", "up", ns=ns)
                if shaped:
                    self._shape(ns, "eth0", delay=True)       # the host's sending
                    self._shape(self.br, name, delay=False)   # the host's receiving
                    self.cc = self._set_cc(ns)
            self.tmp = tempfile.mkdtemp(prefix=f"{self.tag}-")
            self.wrapper = os.path.join(self.tmp, "netns-ssh")
            cases = "\n".join(f"    {ip}) ns={ns} ;;" for ip, ns in zip(self.ips, self.ns))
            with open(self.wrapper, "w") as f:
                f.write("#!/bin/sh\n# hydra's ssh launcher: [ssh options] HOST CMD... -> "
                        "ip netns exec NS sh -c CMD\n"
                        "while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done\n"
                        "host=$1; shift\ncase $host in\n" + cases +
                        "\n    *) echo \"netns-ssh: unknown host $host\" >&2; exit 255 ;;\nesac\n"
                        "exec ip netns exec \"$ns\" sh -c \"$*\"\n")
            os.chmod(self.wrapper, 0o755)
        except BaseException:
            self.down()
            raise

    def _shape(self, ns, dev, delay):
        # tbf at the root gives the rate; netem below it adds the one-way delay
        _sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", self.rate,
            "burst", self.burst, "latency", "100ms", ns=ns)
        if delay and self.delay not in ("0us", "0ms", "0s") and self.delay_applied is not False:
            r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1",
                                "handle", "10:", "netem", "delay", self.delay, "limit", "100000"],
                               capture_output=True, text=True)
            # kernels without sch_netem (this machine's) get the rate only; say so, and
            # let the benchmarks measure the latency the links really have
            self.delay_applied = r.returncode == 0
            if r.returncode:
                sys.stderr.write(f"netns: no netem delay ({r.stderr.strip()}); the links get the rate "
                                 f"only, their latency is the veth path's own\n")

    def _set_cc(self, ns):
        """The host's TCP congestion control: the first allowed of LOSS_BASED_CC where
        ``loss_based_cc``, else the one the namespace inherited."""
        if self.loss_based_cc:
            for cc in LOSS_BASED_CC:
                _sh("sysctl", "-q", f"net.ipv4.tcp_congestion_control={cc}", ns=ns, check=False)
                if _sh("sysctl", "-n", "net.ipv4.tcp_congestion_control", ns=ns).strip() == cc:
                    return cc
        return _sh("sysctl", "-n", "net.ipv4.tcp_congestion_control", ns=ns).strip()

    def down(self):
        # the head (mpiexec) first, then the hosts, the bridge last
        order = [n for n in (self.head, *self.ns, self.br) if n in self._made]
        _kill_and_delete(*order)
        self._made = []
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    # --- running -------------------------------------------------------------------
    def mpiexec(self, argv, ranks=None, mpiexec="mpiexec"):
        """The mpiexec command line that starts ``argv`` on ``ranks`` ranks (default one
        per host), round-robin over the hosts."""
        ranks = ranks or self.hosts
        return [mpiexec, "-hosts", ",".join(self.ips), "-launcher", "ssh", "-launcher-exec",
                self.wrapper, "-iface", "eth0", "-n", str(ranks)] + list(argv)

    def env(self, base=None):
        """``base`` (default: this process's environment) with MPICH pushed onto the links
        (MPI_ENV), and HEAP_ENV where ``keep_heap``; a HEAP_ENV variable already in
        ``base`` wins."""
        env = dict(os.environ if base is None else base)
        env.update(MPI_ENV)
        if self.keep_heap:
            for k, v in HEAP_ENV.items():
                env.setdefault(k, v)
        return env

    def run(self, argv, timeout=None, **kw):
        """Run ``argv`` in the head namespace with MPICH's network environment."""
        return subprocess.run(["ip", "netns", "exec", self.head] + list(argv), env=self.env(kw.pop("env", None)),
                              timeout=timeout, **kw)

    # --- the counters ---------------------------------------------------------------
    def counters(self):
        """Bytes that left each shaped queue: {host: (sent by host, received by host)}."""
        out = {}
        for i, ns in enumerate(self.ns):
            out[f"h{i}"] = (_tbf_bytes(_sh("tc", "-s", "qdisc", "show", "dev", "eth0", ns=ns)),
                            _tbf_bytes(_sh("tc", "-s", "qdisc", "show", "dev", f"h{i}", ns=self.br)))
        return out

    def tc_show(self):
        """``tc -s qdisc show`` of both ends of every host link, as text."""
        parts = []
        for i, ns in enumerate(self.ns):
            parts.append(f"# h{i} {self.ips[i]} host side (sending), namespace {ns}\n" +
                         _sh("tc", "-s", "qdisc", "show", "dev", "eth0", ns=ns))
            parts.append(f"# h{i} bridge side (receiving), namespace {self.br}\n" +
                         _sh("tc", "-s", "qdisc", "show", "dev", f"h{i}", ns=self.br))
        return "".join(parts)


def _tbf_bytes(text):
    m = re.search(r"qdisc tbf .*?\n\s*Sent (\d+) bytes", text)
    if not m:
        raise RuntimeError(f"no tbf counters in:\n{text}")
    return int(m.group(1))


def counter_delta(before, after):
    return {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after}


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
