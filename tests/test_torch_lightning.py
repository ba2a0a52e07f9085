"""gradfuse's Lightning strategies, one per Lightning package, on 2 CPU ranks under torchrun.

The bodies are tests/torch_bodies/lightning_checks.py: the other package's Trainer refuses
the strategy; the hook runs once per optimizer step with 1-bit's bytes and the ranks end
identical; a run resumed from a Lightning checkpoint in a fresh Trainer ends bit for bit
where the uninterrupted run does (and without the hook state in the checkpoint it does
not). Skipped where torch or the package is not installed; CI's torch leg has both
packages, as the GPU image does.
"""
import json
import os

import pytest

pytest.importorskip("torch")

from helpers import run_limited  # noqa: E402
from test_torch_ddp import LIMIT, ROOT, _env, _torchrun  # noqa: E402

BODY = os.path.join(ROOT, "tests", "torch_bodies", "lightning_checks.py")


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_strategy_runs_the_hook_and_resumes_bit_exactly(package, tmp_path):
    pytest.importorskip("lightning.pytorch" if package == "lightning" else "pytorch_lightning")
    other = "pytorch_lightning" if package == "lightning" else "lightning.pytorch"
    pytest.importorskip(other)        # the refusal check needs both, as the GPU image has
    code, out, timed_out = run_limited(_torchrun(2, BODY, package, str(tmp_path)), timeout=LIMIT, env=_env(),
                                       cwd=ROOT)
    assert not timed_out, f"hung (killed after {LIMIT} s):\n{out[-4000:]}"
    assert code == 0, out[-6000:]
    for r in range(2):
        assert f"ALL OK rank {r} of 2" in out, out[-4000:]
        for check in ("other_package_refuses_this_strategy", "hook_runs_and_ranks_agree", "resume_is_bit_exact"):
            assert f"CHECK check_{check} ok rank {r}" in out, out[-4000:]


def test_digits_example_on_pytorch_lightning():
    """examples/torch_lightning_digits.py --package pytorch_lightning (test_torch_ddp.py runs
    its default, lightning.pytorch): the hook ran once per optimizer step on both ranks,
    1-bit's bytes, identical parameters."""
    package = "pytorch_lightning"
    pytest.importorskip(package)
    pytest.importorskip("sklearn")
    script = os.path.join(ROOT, "examples", "torch_lightning_digits.py")
    cmd = _torchrun(2, script, "--epochs", "1", "--compress", "1bit", "--package", package)
    code, out, timed_out = run_limited(cmd, timeout=LIMIT, env=_env(), cwd=ROOT)
    assert not timed_out and code == 0, out[-6000:]
    rows = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("GRADFUSE-LIGHTNING ")]
    assert sorted(r["rank"] for r in rows) == [0, 1], out[-4000:]
    for r in rows:
        assert r["package"] == package, r
        assert r["hook_calls"] == r["iterations"] == r["global_step"] > 0, r
        assert 0 < r["bytes_sent"] < r["bytes_reduced"] / 16 and r["identical_on_all_ranks"], r
