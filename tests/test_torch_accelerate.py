"""The accelerate recipe of docs/torch.md: ``accelerate launch`` with 2 CPU processes, and
gradfuse's hook registered on the DDP module ``accelerator.prepare`` returned
(examples/torch_accelerate_digits.py). Skipped where accelerate is not installed."""
import json
import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

from helpers import run_limited  # noqa: E402
from test_torch_ddp import LIMIT, ROOT, _env, _port  # noqa: E402


def test_accelerate_launch_runs_the_hook_on_two_cpu_processes(tmp_path):
    pytest.importorskip("sklearn")
    script = os.path.join(ROOT, "examples", "torch_accelerate_digits.py")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_port()), script,
           "--epochs", "1", "--compress", "1bit", "--save", str(tmp_path / "ckpt")]
    env = dict(_env(), CUDA_VISIBLE_DEVICES="")        # the CPU recipe, also where a GPU is present
    code, out, timed_out = run_limited(cmd, timeout=LIMIT, env=env, cwd=ROOT)
    assert not timed_out and code == 0, out[-6000:]
    rows = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("GRADFUSE-ACCELERATE ")]
    assert sorted(r["rank"] for r in rows) == [0, 1], out[-4000:]
    for r in rows:
        assert r["world_size"] == 2 and r["distributed_type"].endswith("MULTI_CPU") and r["is_ddp"], r
        # the hook ran once per optimizer step, compressed (1-bit: about 1/32 of the fp32 bytes)
        assert r["hook_calls"] == r["iterations"] == r["steps"] > 0, r
        assert 0 < r["bytes_sent"] < r["bytes_reduced"] / 16 and r["identical_on_all_ranks"], r
    # every rank's hook state beside accelerate's checkpoint, readable with weights_only=True
    import torch
    for rank in range(2):
        sd = torch.load(tmp_path / "ckpt" / f"gradfuse-rank{rank}.pt", weights_only=True)
        assert sd["format"] == "gradfuse-torch-2" and sd["buckets"], sd.keys()
