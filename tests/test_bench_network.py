"""python -m gradfuse.bench network and the emulated cluster (gradfuse/bench/netns.py).

The local smoke test needs only MPI; the cluster tests need root, ip and tc and are
skipped without them. Every multi-rank run has a hard time limit.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from gradfuse.bench import netns
from gradfuse.bench.network import parse_where, predict_step
from gradfuse.bench.network_worker import WORKLOADS, buckets

from helpers import run_limited

pytestmark = pytest.mark.slow     # launches ranks and emulated hosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
def _can_make_namespaces():
    """Root, ip and tc, and a kernel/container that lets us add a namespace with a tbf."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    ns = f"{netns.PREFIX}{os.getpid()}-probe"
    try:
        ok = subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode == 0
        ok = ok and subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                                    "rate", "1gbit", "burst", "64k", "latency", "10ms"],
                                   capture_output=True).returncode == 0
        return ok
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


needs_root = pytest.mark.skipif(not _can_make_namespaces(),
                                reason="the emulated cluster needs root, ip, tc and network namespaces with tbf")


def test_where_and_links_are_checked():
    assert parse_where("local:2,1gbit:4,2gbit/50us:3") == [("local", 2), ("1gbit", 4), ("2gbit/50us", 3)]
    for bad in ("local", "1gbit:0", "fast:2", "1gbit:x"):
        with pytest.raises(ValueError, match="PLACE:RANKS|rate must"):
            parse_where(bad)
    assert netns.parse_link("10gbit")[2] == 10e9
    assert netns.parse_link("500mbit:1ms")[:2] == ("500mbit", "1ms")
    with pytest.raises(ValueError, match="delay must"):
        netns.parse_link("1gbit:soon")


def test_workloads_and_buckets():
    bert = WORKLOADS["bert"]()
    assert len(bert) == 199 and sum(int(math.prod(s)) for s in bert) == 109_482_240
    assert WORKLOADS["flat256"]() == [(64_000_000,)]
    # greedy fusion: small tensors share a bucket up to the threshold, big ones go alone
    assert buckets([10, 10, 300, 10, 10], 4 * 25) == [20, 300, 20]
    assert buckets([5, 5], 0) == [5, 5]
    counts = [int(math.prod(s)) for s in WORKLOADS["resnet50"]()]
    bs = buckets(counts, 1 << 20)
    assert sum(bs) == sum(counts) and len(bs) < len(counts)
    assert all(b <= (1 << 18) or b in counts for b in bs)


def test_prediction_is_the_cost_model_summed_over_buckets():
    from gradfuse.compressors import cost
    w = {"bytes": 4 * 3000, "counts": [1000, 2000], "methods": {
        "none": {"threshold": 0, "algorithms": ["ring", "ring"]},
        "mpi4py": {"threshold": None, "algorithms": None}}}
    link = {"bps": 1e9}
    want = sum(cost.predict("none", "ring", n, 2, cost.Link(125e6, 1e-4)) for n in (1000, 2000))
    full, wire = predict_step("none", w, 2, link, 1e-4)
    assert full == pytest.approx(want)
    # the wire part: bytes at the link rate plus 2(p-1) latency steps per bucket, no compute
    assert wire == pytest.approx(2 * (2 * 0.5 * 4 * 1000 / 125e6 + 2 * 1e-4) + 2 * 0.5 * 4 * 1000 / 125e6)
    assert predict_step("mpi4py", w, 2, link, 1e-4)[0] == pytest.approx(want)


def _local_tiny(tmp_path, ranks, methods, timeout):
    """``gradfuse.bench network`` on ``local:<ranks>``, the tiny workload, one round: its
    printed report and its JSON results, after checking that it ran to the end."""
    js = tmp_path / "r.json"
    rc, out, hung = run_limited([sys.executable, "-m", "gradfuse.bench", "network", "--where", f"local:{ranks}",
                                 "--workloads", "tiny", "--rounds", "1", "--no-horovod",
                                 "--methods", methods, "--json", str(js)], timeout=timeout, env=ENV)
    assert not hung and rc == 0, out
    return out, json.loads(js.read_text())


def test_local_smoke_two_ranks(tmp_path):
    out, r = _local_tiny(tmp_path, 2, "none,1bit,randomk,mpi4py", 120)
    assert r[0]["p"] == 2 and set(r[0]["workloads"]["tiny"]["methods"]) == {"none", "1bit", "randomk", "mpi4py"}
    assert "#### tiny (4 tensors, 0.1 MB), 2 ranks, local" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"none", "1bit", "randomk", "mpi4py"}
    assert "| 1.00x |" in rows["none"]
    # 1-bit sends about 1/32 of the bytes: its MB sent per rank is far below fp32's
    sent = {k: float(v.split("|")[7]) for k, v in rows.items() if k != "method"}
    assert sent["1bit"] < sent["none"] / 10


def test_local_four_ranks_checks_gradfuse_sums_in_rank_order(tmp_path):
    """From 4 ranks MPICH's allreduce adds in pairs, gradfuse's sums between the ranks of one
    host in rank order: the bench's exactness check takes either, bit for bit (it stopped
    every 4- and 8-rank local run before)."""
    _, r = _local_tiny(tmp_path, 4, "none,mpi4py", 180)
    assert r[0]["p"] == 4 and set(r[0]["workloads"]["tiny"]["methods"]) == {"none", "mpi4py"}


def test_emulated_needs_root_message():
    if os.geteuid() == 0:
        pytest.skip("runs as root here")
    rc, out, hung = run_limited([sys.executable, "-m", "gradfuse.bench", "network", "--where", "1gbit:2"],
                                timeout=60, env=ENV)
    assert rc == 2 and "needs root" in out


@needs_root
def test_cluster_shapes_both_ends_and_tears_down():
    """Traffic between two hosts crosses both shaped queues; nothing is left afterwards,
    also when the body raises."""
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Cluster(2, "1gbit") as c:
            names = set(c.ns) | {c.br, c.head}
            assert names <= set(netns._namespaces())
            qd = subprocess.run(["ip", "netns", "exec", c.br, "tc", "qdisc", "show", "dev", "h1"],
                                capture_output=True, text=True).stdout
            assert "tbf" in qd and "rate 1Gbit" in qd
            before = c.counters()
            prog = ("from mpi4py import MPI; import numpy as np; c = MPI.COMM_WORLD; "
                    "a = np.ones(1_000_000, np.float32); c.Allreduce(MPI.IN_PLACE, a); "
                    "assert a[0] == 2.0 and a[-1] == 2.0")
            mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
            r = c.run(c.mpiexec([sys.executable, "-c", prog], mpiexec=mpiexec if os.path.exists(mpiexec) else "mpiexec"),
                      env=ENV, timeout=120, capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
            d = netns.counter_delta(before, c.counters())
            # a 4 MB allreduce on 2 ranks sends at least 4 MB each way through each link
            for h, (sent, recv) in d.items():
                assert sent >= 4e6 and recv >= 4e6, (h, d)
            raise RuntimeError("boom")
    assert not names & set(netns._namespaces())


@needs_root
def test_cleanup_removes_leftovers_of_dead_runs():
    dead = f"{netns.PREFIX}999999999-h0"      # no such pid
    subprocess.run(["ip", "netns", "add", dead], check=True)
    try:
        assert dead in netns.cleanup(only_dead=True)
    finally:
        subprocess.run(["ip", "netns", "del", dead], capture_output=True)
    assert dead not in netns._namespaces()


def test_netns_needs_root_error():
    if os.geteuid() == 0:
        pytest.skip("runs as root here")
    with pytest.raises(PermissionError, match="needs root"):
        netns.Cluster(2).up()
