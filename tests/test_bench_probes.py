"""The small benches docs/benchmarks.md quotes (gradfuse.bench.probes, gradfuse.bench.powersgd_ddp):
bytes per step, extra resident memory, the copy floor, the cost-model table, PowerSGD in DDP.
Each runs as a user runs it (``python -m gradfuse.bench ...``), with small sizes."""
import json
import os
import socket
import sys

import pytest

from conftest import mpiexec_path
from gradfuse.bench import powersgd_ddp, probes
from helpers import run_limited

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
BENCH = [sys.executable, "-m", "gradfuse.bench"]


def _rows(out):
    """The markdown table rows of ``out``, cells stripped."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


@pytest.mark.mpi
def test_bytes_on_two_ranks_counts_each_compressors_payload():
    """1-bit sends a bit per element plus a scale per 512-element block (~30x under the
    fp32 allreduce of 2 ranks, S bytes); top-k at 1 % about 50x; none is the ring's S."""
    cmd = [mpiexec_path(), "-n", "2"] + BENCH + ["bytes", "--sets", "resnet50", "--compress", "none,1bit,topk"]
    rc, out, hung = run_limited(cmd, timeout=180, env=ENV, cwd=ROOT)
    assert not hung and rc == 0, out
    rows = {r[1]: r for r in _rows(out) if r[0] == "resnet50"}
    assert set(rows) == {"none", "1bit", "topk"}, out
    assert int(rows["none"][4]) == int(rows["none"][3]) > 102e6      # 2(p-1)/p x S = S at p = 2
    assert 29.0 < float(rows["1bit"][5].rstrip("x")) < 31.0, rows["1bit"]
    assert 45.0 < float(rows["topk"][5].rstrip("x")) < 51.0, rows["topk"]


def test_bytes_refuses_an_unknown_compressor():
    rc, out, _ = run_limited(BENCH + ["bytes", "--compress", "1bit,nosuch"], timeout=60, env=ENV, cwd=ROOT)
    assert rc != 0 and "--compress: unknown nosuch" in out, out


def test_memory_of_one_rank_holds_the_residual():
    """On one rank a 1-bit pipeline keeps its residual (S) and little else: between 0.9x
    and 1.65x of the gradient bytes after a few steps."""
    rc, out, hung = run_limited(BENCH + ["memory", "--steps", "3", "1bit"], timeout=120, env=ENV, cwd=ROOT)
    assert not hung and rc == 0, out
    line = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert line["compressor"] == "1bit" and line["p"] == 1 and line["steps"] == 3
    assert 0.9 < line["extra_x"] < 1.65, line


def test_memory_refuses_an_option_without_a_value():
    with pytest.raises(SystemExit) as e:
        probes.memory_main(["1bit:algorithm"])
    assert e.value.code == 2


def test_floor_on_one_rank_prints_the_copy_time(capsys):
    rc, out, hung = run_limited(BENCH + ["floor", "--mb", "4", "--rounds", "3"], timeout=60, env=ENV, cwd=ROOT)
    assert not hung and rc == 0, out
    assert "1 ranks, 4.0 MB each: copy" in out and "GB/s read+write" in out, out
    with pytest.raises(SystemExit):
        probes.floor_main(["--mb", "0"])


def test_cost_table_and_crossovers(capsys):
    """The model's table: two-phase 1-bit's bytes do not grow with p, so it stays ahead of
    the fp32 ring at 256 ranks on 1 Gbit/s, while the allgather falls behind before that."""
    probes.cost_main(["--links", "1gbit", "--ranks", "2,16,256"])
    out = capsys.readouterr().out
    first = out.split("one bucket")[0]
    rows = {r[0]: r[1:] for r in _rows(first)}
    assert set(rows) == set(probes.COST_ROWS) | {"fastest", "method"}
    assert rows["fastest"][-1] == "1bit twophase"
    assert float(rows["1bit allgather"][-1]) > float(rows["fp32 ring"][-1])
    assert "1bit allgather: slower than the fp32 ring from p = " in first
    assert "1bit twophase: faster than the fp32 ring up to p = 256" in first
    with pytest.raises(SystemExit):
        probes.cost_main(["--ranks", "1,2"])


def test_powersgd_ddp_checks_its_options_before_importing_torch():
    for argv in (["--methods", "none,sgd"], ["--rank", "0"], ["--seeds", "0"]):
        with pytest.raises(SystemExit) as e:
            powersgd_ddp.main(argv)
        assert e.value.code == 2


@pytest.mark.slow
def test_powersgd_ddp_under_torchrun():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "-m", "gradfuse.bench", "powersgd-ddp", "--seeds", "1", "--epochs", "1",
           "--start-iter", "2", "--methods", "none,gradfuse"]
    rc, out, hung = run_limited(cmd, timeout=300, env=env, cwd=ROOT)
    assert not hung and rc == 0, out[-4000:]
    res = json.loads([ln for ln in out.splitlines() if ln.startswith('{"rank"')][-1])
    assert res["rank"] == 1 and res["epochs"] == 1
    for m in ("none", "gradfuse"):
        assert len(res[m]) == 1 and 0.0 <= res[m][0] <= 1.0 and res[f"{m}_mean"] == res[m][0]
    assert res["none"][0] > 0.2, res         # one epoch beats chance (0.1): the runs train
