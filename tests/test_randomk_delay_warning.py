"""Random-k below ratio 0.25 with error feedback meeting momentum >= 0.5 warns, once per
process: a compressor made with DGC's momentum correction, gradfuse.mxnet's trainers (the
optimizer's momentum, corrected or not) and the torch hook's ``check_optimizer``. Top-k,
ratio >= 0.25, momentum < 0.5 and error feedback off do not warn.
"""
import os
import re
import sys
import warnings

import pytest

from helpers import run_limited

from gradfuse.compressors import create
from gradfuse.compressors import randomk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESSAGE = r"delayed update of about 100 steps \(Stich and Karimireddy, 2019\).*compress='topk'"


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test starts as a process that has not warned yet."""
    monkeypatch.setattr(randomk, "_warned", False)


def caught(make):
    """The DelayedUpdateWarnings that ``make()`` gives, every one recorded."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        make()
    return [str(x.message) for x in w if issubclass(x.category, randomk.DelayedUpdateWarning)]


def test_a_compressor_with_the_momentum_correction_warns_once_per_process():
    first = caught(lambda: [create("randomk", ratio=0.01, momentum=0.9) for _ in range(3)])
    assert len(first) == 1, first
    assert "random-k at ratio 0.01 with error feedback and momentum 0.9" in first[0]
    assert re.search(MESSAGE, first[0]), first[0]
    assert caught(lambda: create("randomk", ratio=0.05, momentum=0.99)) == []     # once per process


@pytest.mark.parametrize("name, options", [
    ("topk", {"ratio": 0.01, "momentum": 0.9}),
    ("randomk", {"ratio": 0.25, "momentum": 0.9}),
    ("randomk", {"ratio": 0.01, "momentum": 0.4}),
    ("randomk", {"ratio": 0.01}),
])
def test_a_compressor_that_is_not_a_delayed_update_with_momentum_does_not_warn(name, options):
    assert caught(lambda: create(name, **options)) == []
    assert randomk._warned is False


def test_error_feedback_off_does_not_warn():
    c = create("randomk", ratio=0.01, error_feedback=False)
    assert caught(lambda: randomk.warn_delayed_update([c], 0.9, "test")) == []
    on = create("randomk", ratio=0.01)
    assert caught(lambda: randomk.warn_delayed_update([c, on], 0.9, "test")) != []


# --- gradfuse.mxnet: the optimizer's momentum --------------------------------------------
@pytest.fixture
def hvd():
    pytest.importorskip("mxnet")
    pytest.importorskip("mpi4py")
    import gradfuse.mxnet as hvd
    hvd.init()
    return hvd


def trainer(hvd, optimizer="sgd", momentum=0.9, **kw):
    from mxnet import gluon
    net = gluon.nn.Dense(4, in_units=8)
    net.initialize()
    return hvd.DistributedTrainer(net.collect_params(), optimizer, {"learning_rate": 0.1, "momentum": momentum},
                                  **kw)


@pytest.mark.parametrize("kw", [{}, {"momentum_correction": False}, {"momentum_correction": True}])
def test_mxnet_trainers_warn_once_for_randomk_with_sgd_momentum(hvd, kw):
    got = caught(lambda: [trainer(hvd, compress="randomk", ratio=0.01, **kw) for _ in range(2)])
    assert len(got) == 1 and got[0].startswith("DistributedTrainer: random-k at ratio 0.01"), got
    assert caught(lambda: trainer(hvd, "nag", compress="randomk", ratio=0.01, **kw)) == []


def test_mxnet_distributed_optimizer_and_nag_warn(hvd):
    import mxnet as mx
    got = caught(lambda: hvd.DistributedOptimizer(mx.optimizer.create("nag", learning_rate=0.1, momentum=0.9),
                                                  compress="randomk", ratio=0.02))
    assert len(got) == 1 and got[0].startswith("DistributedOptimizer: random-k at ratio 0.02"), got


@pytest.mark.parametrize("optimizer, momentum, kw", [
    ("sgd", 0.9, {"compress": "topk", "ratio": 0.01}),
    ("sgd", 0.9, {"compress": "randomk", "ratio": 0.25}),
    ("sgd", 0.4, {"compress": "randomk", "ratio": 0.01}),
    ("sgd", 0.9, {"compress": "randomk", "ratio": 0.01, "error_feedback": False}),
    ("sgd", 0.0, {"compress": "randomk", "ratio": 0.01}),
])
def test_mxnet_trainers_do_not_warn_otherwise(hvd, optimizer, momentum, kw):
    assert caught(lambda: trainer(hvd, optimizer, momentum, **kw)) == []


# --- the torch hook: check_optimizer -----------------------------------------------------
TORCH_BODY = """
import os, sys, warnings, tempfile
import torch, torch.distributed as dist
import gradfuse.torch as gt
from gradfuse.compressors import randomk
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "pg"), rank=0,
                        world_size=1)
m = torch.nn.Linear(8, 4)

def caught(make):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        make()
    return [str(x.message) for x in w if issubclass(x.category, randomk.DelayedUpdateWarning)]

def sgd(momentum):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum)

# no warning: top-k, ratio 0.25, momentum 0.4, error feedback off, Adam
quiet = [(gt.CompressionState("topk", ratio=0.01), sgd(0.9)),
         (gt.CompressionState("randomk", ratio=0.25), sgd(0.9)),
         (gt.CompressionState("randomk", ratio=0.01), sgd(0.4)),
         (gt.CompressionState("randomk", ratio=0.01, error_feedback=False), sgd(0.9)),
         (gt.CompressionState("randomk", ratio=0.01), torch.optim.AdamW(m.parameters()))]
for state, opt in quiet:
    assert caught(lambda: state.check_optimizer(opt)) == [], (state.compress, opt)
assert not randomk._warned
state = gt.CompressionState("randomk", ratio=0.01)
got = caught(lambda: [state.check_optimizer(sgd(0.9)) for _ in range(2)])
assert len(got) == 1 and got[0].startswith("gradfuse.torch: SGD: random-k at ratio 0.01"), got
randomk._warned = False                   # as a new process: the hook's own momentum correction
got = caught(lambda: [gt.CompressionState("randomk", ratio=0.01, momentum=0.9) for _ in range(2)])
assert len(got) == 1 and "momentum 0.9" in got[0], got
dist.destroy_process_group()
print("TORCH OK")
"""


def test_torch_hook_warns_once_for_randomk_with_sgd_momentum():
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code, out, timed_out = run_limited([sys.executable, "-c", TORCH_BODY], timeout=300, env=env, cwd=ROOT)
    assert not timed_out and code == 0 and "TORCH OK" in out, out[-4000:]


def test_ratio_one_tenth_warns():
    """Ratio 0.1 did not train the digits CNN either (docs/choosing.md): it warns."""
    got = caught(lambda: create("randomk", ratio=0.1, momentum=0.9))
    assert len(got) == 1 and "random-k at ratio 0.1 " in got[0], got
