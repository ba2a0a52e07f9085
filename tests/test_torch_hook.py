"""gradfuse.torch: the state as tensors, bfloat16 buckets, Slurm as a launcher, no MPI.

The multi-rank bodies are tests/torch_bodies/hook_checks.py (a state saved with torch.save
and read back by torch.load's default weights_only=True continues bit-exactly in a fresh
DDP; the earlier numpy format loads, an unknown one is refused by name; bf16 buckets
uncompressed, fp16, bf16 and 1-bit; mpi4py never imported), run under torchrun and under
a launch that sets only srun's variables (the rank, size, local rank, the host list that
names MASTER_ADDR and the job id that names MASTER_PORT). The launcher's rules are
checked on variables set here: there is no Slurm on this machine.
"""
import os
import random
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from helpers import run_limited  # noqa: E402
from test_torch_ddp import LIMIT, ROOT, _env, _torchrun  # noqa: E402

BODY = os.path.join(ROOT, "tests", "torch_bodies", "hook_checks.py")


def _check(out, code, timed_out, n, what):
    assert not timed_out, f"{what} hung (killed after {LIMIT} s):\n{out[-4000:]}"
    assert code == 0, f"{what} failed (exit {code}):\n{out[-6000:]}"
    for r in range(n):
        assert f"ALL OK rank {r} of {n}" in out, out[-4000:]


@pytest.mark.parametrize("n", [2, 3])
def test_hook_checks_under_torchrun(n, tmp_path):
    env = dict(_env(), GRADFUSE_TEST_TMP=str(tmp_path))
    code, out, timed_out = run_limited(_torchrun(n, BODY), timeout=LIMIT, env=env, cwd=ROOT)
    _check(out, code, timed_out, n, f"torchrun --nproc_per_node {n}")
    assert out.count("LAUNCHER RANK ") == n, out[-3000:]


def _slurm_port():
    """A free port of the form 15000 + the last four digits of a job id."""
    for _ in range(200):
        port = random.randrange(15000, 25000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 15000-24999")


def test_hook_under_a_slurm_step(tmp_path):
    """Two processes with srun's variables only (no RANK, no MASTER_*): gradfuse.torch reads
    the rank and size, the local rank and size from the step's tasks per node, MASTER_ADDR
    from the first host of SLURM_STEP_NODELIST (a compressed list) and MASTER_PORT from the
    job id, and the hook checks pass."""
    port = _slurm_port()
    job = f"77{port - 15000:04d}"
    base = dict(_env(), GRADFUSE_TEST_TMP=str(tmp_path), SLURM_JOB_ID=job, SLURM_STEP_ID="0",
                SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2", SLURM_NODEID="0",
                SLURM_STEP_NODELIST="127.0.0.[1-2]", SLURM_JOB_NODELIST="127.0.0.[1-2]")
    procs = []
    for r in range(2):
        env = dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))
        procs.append(subprocess.Popen([sys.executable, BODY, "check_bf16_buckets", "check_no_mpi_was_imported"],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline, outs = time.monotonic() + LIMIT, []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), out[-6000:]
    for r in range(2):
        assert f"ALL OK rank {r} of 2" in out, out[-4000:]
        assert f"LAUNCHER SLURM_PROCID rank {r} of 2 local {r} master 127.0.0.1:{port}" in out, out[-3000:]


def test_launcher_precedence_and_slurm_rules():
    from gradfuse.torch.launch import launcher_env, rendezvous
    slurm = {"SLURM_STEP_ID": "3", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242",
             "SLURM_STEP_NODELIST": "gpu[07-08]"}
    assert launcher_env(slurm) == (5, 8, 1, 4, "SLURM_PROCID")
    # a batch script (no step): its SLURM_NTASKS counts tasks that never started
    assert launcher_env({k: v for k, v in slurm.items() if k != "SLURM_STEP_ID"}) is None
    # precedence: torchrun, then PMI / Open MPI, then Slurm
    pmi = {"PMI_RANK": "1", "PMI_SIZE": "2"}
    assert launcher_env(dict(slurm, **pmi))[4] == "PMI_RANK"
    assert launcher_env(dict(slurm, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2"))[4] == "OMPI_COMM_WORLD_RANK"
    assert launcher_env(dict(slurm, RANK="0", WORLD_SIZE="3", **pmi))[:2] == (0, 3)
    # inside a step the step's own task count wins over the job's
    assert launcher_env(dict(slurm, SLURM_STEP_NUM_TASKS="6"))[1] == 6
    with pytest.raises(ValueError, match="SLURM_PROCID=8 is not a rank of SLURM_NTASKS=8"):
        launcher_env(dict(slurm, SLURM_PROCID="8"))
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not an integer"):
        launcher_env(dict(slurm, SLURM_PROCID="x"))
    # rendezvous: the first host and 15000 + the job id's last four digits, unless set
    assert rendezvous(slurm) == ("gpu07", "19242")
    assert rendezvous(dict(slurm, SLURM_JOB_ID="1234567")) == ("gpu07", str(15000 + 4567))
    assert rendezvous(dict(slurm, MASTER_ADDR="head", MASTER_PORT="1234")) == ("head", "1234")
    assert rendezvous({k: v for k, v in slurm.items() if k != "SLURM_STEP_ID"}) == ("127.0.0.1", "29500")
    assert rendezvous({}) == ("127.0.0.1", "29500")


def test_slurm_host_lists():
    from gradfuse.torch.launch import _tasks_per_node, expand_hostlist
    assert expand_hostlist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_hostlist("gpu5") == ["gpu5"]
    assert expand_hostlist("a[9-11]") == ["a9", "a10", "a11"]
    assert expand_hostlist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    assert expand_hostlist("x-1,node[001-002]-ib") == ["x-1", "node001-ib", "node002-ib"]
    for bad in ("node[01-", "node[a-b]", "", "n]1["):
        with pytest.raises(ValueError, match="Slurm host list"):
            expand_hostlist(bad)
    assert _tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_without_mpi4py_gradfuse_and_the_torch_binding_import_and_mpi_names_the_extra():
    """mpi4py hidden (as where `pip install gradfuse[torch]` installed none): import gradfuse
    and gradfuse.torch work; the MPI path raises an ImportError naming the extra."""
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "import gradfuse, gradfuse.torch, gradfuse.torch.hook, gradfuse.torch.launch\n"
        "try:\n"
        "    gradfuse.Pipeline()\n"
        "except ImportError as e:\n"
        "    assert \"gradfuse[mpi]\" in str(e) and \"gradfuse[mpich]\" in str(e), e\n"
        "    print('NAMED THE EXTRA')\n"
        "else:\n"
        "    raise SystemExit('the MPI path ran without mpi4py')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "NAMED THE EXTRA" in out.stdout, out.stdout + out.stderr


def test_pick_gives_each_rank_of_another_world_size_a_saved_state():
    """A Lightning checkpoint of 2 ranks resumed on 4 (or 1): rank r takes saved rank r % 2's
    state, whose shared part load_state_dict keeps (before: None, the hook started from zero)."""
    from gradfuse.torch.checkpoint import RANKS_FORMAT, pick
    saved = {"format": RANKS_FORMAT, "world_size": 2, "ranks": [{"r": 0}, {"r": 1}]}
    assert pick(saved, 1, 2) == {"r": 1}
    assert [pick(saved, r, 4) for r in range(4)] == [{"r": 0}, {"r": 1}, {"r": 0}, {"r": 1}]
    assert pick(saved, 0, 1) == {"r": 0}
    with pytest.raises(ValueError, match="says it holds the hook states of 2 ranks and holds 1"):
        pick(dict(saved, ranks=[{}]), 0, 2)
