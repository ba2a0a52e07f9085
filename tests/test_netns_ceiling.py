"""The emulated cluster's MPI environment per link (netns.HEAP_ENV) and the link-ceiling
probe scripts/net_ceiling.py.

The environment tests and the loopback test of the probe's TCP worker need neither root
nor namespaces; the probe's end-to-end run needs root, ip, tc and ethtool and is skipped
without them.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from gradfuse.bench import netns

from test_bench_network import needs_root

pytestmark = pytest.mark.slow     # network probes over loopback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
SCRIPT = os.path.join(ROOT, "scripts", "net_ceiling.py")


def _load_probe():
    spec = importlib.util.spec_from_file_location("net_ceiling", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_probe_worker_over_loopback():
    """The probe's TCP worker (one process per host, every connection carrying data both
    ways) counts what each side received in the common window; on loopback it must see
    data both ways over 2 connections and leave nothing running."""
    probe = _load_probe()
    port = probe.PORT
    t0 = time.monotonic() + 1.0
    t_start, t_stop = t0 + 0.3, t0 + 1.0
    outs = {}
    procs = []
    for role in ("server", "client"):
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gf-ceiling-{os.getpid()}-{role}.json")
        outs[role] = out
        procs.append(subprocess.Popen([sys.executable, SCRIPT, "--worker", role, "127.0.0.1", "127.0.0.1", "2",
                                       repr(t_start), repr(t_stop), out], env=ENV))
        if role == "server":
            time.sleep(0.3)
    try:
        for p in procs:
            assert p.wait(timeout=60) == 0
        res = {r: json.load(open(f)) for r, f in outs.items()}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in outs.values():
            if os.path.exists(f):
                os.unlink(f)
    assert port == probe.PORT
    for r in res.values():
        assert r["bps"] > 1e7, res               # loopback moves far more than 10 Mbit/s
        assert r["cpu_user"] >= 0 and r["cpu_sys"] >= 0


def test_probe_cpu_split_and_variants():
    probe = _load_probe()
    a = {"user": 100, "sys": 100, "idle": 100, "irq": 0, "softirq": 0, "steal": 0}
    b = {"user": 150, "sys": 150, "idle": 200, "irq": 0, "softirq": 0, "steal": 0}
    split = probe.cpu_split(a, b)
    n = os.cpu_count()
    assert split["user"] == pytest.approx(25 * n) and split["idle"] == pytest.approx(50 * n)
    with pytest.raises(SystemExit):        # a variant naming no dimension is refused
        probe.main(["--variant", "colour=red"])


@needs_root
@pytest.mark.skipif(shutil.which("ethtool") is None, reason="the probe sets offloads with ethtool")
def test_probe_end_to_end_respects_the_tbf():
    """Raw TCP both ways through a 1 Gbit/s cluster: each direction gets traffic through,
    and no more than the tbf's rate (payload under 1 Gbit/s); unshaped, more gets through
    than the shaped link allows. The namespaces are gone afterwards."""
    proc = subprocess.Popen([sys.executable, SCRIPT, "--link", "1gbit", "--shape", "tbf,none", "--rounds", "1",
                             "--seconds", "1", "--json", "/dev/stdout"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == 0, out
    trials = json.loads(out[out.index("[\n"):])
    shaped = [t for t in trials if t["variant"]["shape"] == "tbf"][0]
    free = [t for t in trials if t["variant"]["shape"] == "none"][0]
    for d in ("fwd", "rev"):
        assert 0.05 < shaped[d] <= 1.0, shaped
    assert free["fwd"] + free["rev"] > shaped["fwd"] + shaped["rev"], (free, shaped)
    assert not [n for n in netns._namespaces() if n.startswith(f"{netns.PREFIX}{proc.pid}-")]


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
