"""gradfuse.torch: the DDP comm hook on 2 and 3 ranks over gloo (torchrun and mpiexec), and Lightning.

The multi-rank bodies are tests/torch_bodies/ddp_checks.py (compress=None is DDP bit for
bit; fp16 is PyTorch's fp16_compress_hook to fp16 rounding; every lossy compressor leaves
identical parameters on all ranks; state_dict restores bit-exactly; start_iter; DDP's
bucket rebuild; under mpiexec, the hook's result is the core Pipeline's over MPI bit for
bit). Each launch has a hard time limit: a hang fails. Skipped where torch is not
installed (the MXNet venv); CI runs them in the numpy-2 venv.
"""
import json
import os
import socket
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import mpiexec_path  # noqa: E402
from helpers import run_limited  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BODY = os.path.join(ROOT, "tests", "torch_bodies", "ddp_checks.py")
LIMIT = 300


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRADFUSE_STALL_TIMEOUT_S"):
        env.pop(k, None)
    return env


def _torchrun(n, script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr",
            "127.0.0.1", "--master_port", str(_port()), script, *args]


def _check(out, code, timed_out, n, what):
    assert not timed_out, f"{what} hung (killed after {LIMIT} s):\n{out[-4000:]}"
    assert code == 0, f"{what} failed (exit {code}):\n{out[-6000:]}"
    for r in range(n):
        assert f"ALL OK rank {r} of {n}" in out, out[-4000:]


@pytest.mark.parametrize("n", [2, 3])
def test_hook_under_torchrun(n):
    code, out, timed_out = run_limited(_torchrun(n, BODY), timeout=LIMIT, env=_env(), cwd=ROOT)
    _check(out, code, timed_out, n, f"torchrun --nproc_per_node {n}")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_hook_under_mpiexec(n):
    """Rank and size from mpiexec's environment (PMI_RANK/PMI_SIZE), rendezvous at MASTER_ADDR/PORT."""
    pytest.importorskip("mpi4py")
    mpiexec = mpiexec_path()
    assert mpiexec, "mpiexec not found: install the mpich extra"
    env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    checks = ["check_none_is_ddp", "check_lossy_train_identically_on_all_ranks", "check_hook_equals_core_pipeline"]
    code, out, timed_out = run_limited([mpiexec, "-n", str(n), sys.executable, BODY, *checks], timeout=LIMIT,
                                       env=env, cwd=ROOT)
    _check(out, code, timed_out, n, f"mpiexec -n {n}")


def test_lightning_strategy_runs_the_hook_on_cpu():
    """Lightning's DDPStrategy ignores comm hooks on CPU; GradfuseDDPStrategy's hook really runs
    (its counters and bytes), once per optimizer step, on every rank."""
    pytest.importorskip("lightning.pytorch")       # the example's default package
    pytest.importorskip("sklearn")
    script = os.path.join(ROOT, "examples", "torch_lightning_digits.py")
    code, out, timed_out = run_limited(_torchrun(2, script, "--epochs", "1", "--compress", "1bit"), timeout=LIMIT,
                                       env=_env(), cwd=ROOT)
    assert not timed_out and code == 0, out[-6000:]
    rows = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("GRADFUSE-LIGHTNING ")]
    assert sorted(r["rank"] for r in rows) == [0, 1], out[-4000:]
    for r in rows:
        assert r["global_step"] > 0 and r["hook_calls"] == r["iterations"] == r["global_step"], r
        assert r["steps"] == r["hook_calls"] and r["bytes_reduced"] > 0, r
        # 1-bit: about 1/32 of the fp32 bytes (plus scales and headers), far from an allreduce's
        assert 0 < r["bytes_sent"] < r["bytes_reduced"] / 16, r
        assert r["identical_on_all_ranks"], r


def test_launcher_env_reads_torchrun_and_mpiexec():
    from gradfuse.torch.launch import launcher_env
    assert launcher_env({"RANK": "1", "WORLD_SIZE": "3"})[:2] == (1, 3)
    assert launcher_env({"PMI_RANK": "2", "PMI_SIZE": "3"})[:2] == (2, 3)
    assert launcher_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})[:2] == (0, 2)
    assert launcher_env({}) is None
    with pytest.raises(ValueError, match="PMI_RANK=3 is not a rank of PMI_SIZE=3"):
        launcher_env({"PMI_RANK": "3", "PMI_SIZE": "3"})


def test_state_needs_an_initialized_process_group():
    import torch.distributed as dist
    import gradfuse.torch as gt
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        gt.CompressionState("1bit")


def test_powersgd_hook_matches_torchs_powersgd_hook():
    """gradfuse's PowerSGD through the hook and torch's powerSGD_hook, same initial Q and data,
    20 steps on 2 ranks at rank 1 and rank 2: max|dw| / max|w| <= 1e-5
    (tests/torch_bodies/powersgd_checks.py)."""
    script = os.path.join(ROOT, "tests", "torch_bodies", "powersgd_checks.py")
    code, out, timed_out = run_limited(_torchrun(2, script), timeout=LIMIT, env=_env(), cwd=ROOT)
    _check(out, code, timed_out, 2, "torchrun powersgd_checks.py")
    assert out.count("POWERSGD rank=1 ") == 2 and out.count("POWERSGD rank=2 ") == 2, out[-3000:]
