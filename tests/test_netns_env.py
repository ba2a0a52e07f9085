"""The emulated cluster's MPI environment per link (netns.HEAP_ENV) and its hosts' TCP
congestion control.

The environment tests need neither root nor namespaces; the congestion-control test needs
root and ip and is skipped without them.
"""
import os
import subprocess
import sys

import pytest

from gradfuse.bench import netns

from test_bench_network import needs_root

pytestmark = pytest.mark.slow     # subprocesses touching 320 MB; namespaces


def test_heap_kept_by_default_only_on_fast_links():
    """10 Gbit/s links get the malloc settings that stop MPICH's per-call temporary
    buffer from page-faulting afresh; 1 Gbit/s links (where resident-memory figures are
    taken) keep glibc's defaults; both can be forced."""
    fast, slow = netns.Cluster(2, "10gbit"), netns.Cluster(2, "1gbit")
    assert fast.keep_heap and not slow.keep_heap
    base = {"PATH": "/usr/bin"}
    e_fast, e_slow = fast.env(base), slow.env(base)
    for k, v in netns.HEAP_ENV.items():
        assert e_fast[k] == v
        assert k not in e_slow
    for e in (e_fast, e_slow):                     # MPICH is pushed onto the links either way
        assert all(e[k] == v for k, v in netns.MPI_ENV.items())
    assert netns.Cluster(2, "10gbit", keep_heap=False).env(base).keys().isdisjoint(netns.HEAP_ENV)
    assert netns.Cluster(2, "1gbit", keep_heap=True).env(base)["MALLOC_MMAP_MAX_"] == "0"
    assert netns.Cluster(2, "2.5gbit:50us").keep_heap is False and netns.Cluster(2, "5gbit:0us").keep_heap
    # a value the caller set wins over the cluster's
    assert fast.env(dict(base, MALLOC_MMAP_MAX_="7"))["MALLOC_MMAP_MAX_"] == "7"


def test_heap_env_stops_repeated_page_faults():
    """What HEAP_ENV is for, measured without MPI: a 64 MB block malloc'ed, touched and
    freed 5 times faults its pages in on every round under glibc's defaults (mmap above
    32 MiB), and once under HEAP_ENV."""
    prog = ("import ctypes, resource\n"
            "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p\n"
            "n = 64 << 20\n"
            "def rnd():\n"
            "    p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(ctypes.c_void_p(p))\n"
            "rnd()\n"
            "f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(5): rnd()\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)\n")
    faults = {}
    for keep in (False, True):
        env = dict(os.environ)
        for k in netns.HEAP_ENV:
            env.pop(k, None)
        if keep:
            env.update(netns.HEAP_ENV)
        out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        faults[keep] = int(out.stdout)
    pages = 5 * (64 << 20) // 4096
    assert faults[False] >= pages // 2, faults     # huge pages would cut it; 4 KiB pages: every one
    assert faults[True] < pages // 20, faults


@needs_root
def test_fast_links_get_a_loss_based_congestion_control():
    """On a 10 Gbit/s cluster every host's TCP runs cubic or reno (not the pacing BBR a
    namespace would inherit); a 1 Gbit/s cluster keeps what the machine gives a new
    namespace; both are overridable."""
    def host_cc(c):
        return {subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                               capture_output=True, text=True, check=True).stdout.strip() for ns in c.ns}
    inherited = subprocess.run(["sysctl", "-n", "net.ipv4.tcp_congestion_control"], capture_output=True,
                               text=True).stdout.strip()
    with netns.Cluster(2, "10gbit") as c:
        assert c.cc in netns.LOSS_BASED_CC and host_cc(c) == {c.cc}
    with netns.Cluster(2, "1gbit") as c:
        assert host_cc(c) == {c.cc}
        if inherited:
            assert c.cc == inherited
    with netns.Cluster(2, "1gbit", loss_based_cc=True) as c:
        assert c.cc in netns.LOSS_BASED_CC and host_cc(c) == {c.cc}
