"""gradfuse.torch's Adam correction: the DDP comm hook with ``adam=`` on 2 and 3 ranks over
gloo under torchrun (tests/torch_bodies/adam_checks.py: exact Adam is torch.optim.AdamW,
local clipping, compressed steps identical on every rank, freeze_iter and warmup_steps,
state_dict bit-exact, check_optimizer's warnings and the GradScaler refusal). Each launch
has a hard time limit. Skipped where torch is not installed (the MXNet venv)."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")

from helpers import run_limited  # noqa: E402
from test_torch_ddp import LIMIT, ROOT, _check, _env, _torchrun  # noqa: E402

BODY = os.path.join(ROOT, "tests", "torch_bodies", "adam_checks.py")


@pytest.mark.parametrize("n", [2, 3])
def test_adam_hook_under_torchrun(n):
    code, out, timed_out = run_limited(_torchrun(n, BODY), timeout=LIMIT, env=_env(), cwd=ROOT)
    _check(out, code, timed_out, n, f"torchrun --nproc_per_node {n} (adam)")
