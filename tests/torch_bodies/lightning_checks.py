"""gradfuse's Lightning strategies on 2 CPU ranks (tests/test_torch_lightning.py runs it
under torchrun): ``python lightning_checks.py PACKAGE CKPT_DIR``, PACKAGE ``lightning``
(``lightning.pytorch``) or ``pytorch_lightning``.

Checks, each raising on failure; every rank prints ``CHECK <name> ok`` and finally
``ALL OK rank <r> of <p>``:

- the other package's Trainer refuses this package's strategy (why there are two classes);
- the hook runs once per optimizer step with 1-bit's bytes, and the ranks end identical;
- resume: 2 epochs uninterrupted, against 1 epoch, a checkpoint, and a fresh Trainer,
  model and strategy that resume from it for the second epoch: the parameters and the hook
  state are the same bit for bit; the same resume without the hook state in the
  checkpoint differs (so the state carried something), and the checkpoint file loads with
  ``torch.load(weights_only=True)``.
"""
import glob
import importlib
import os
import sys

import torch
import torch.distributed as dist

PACKAGE, CKPT = sys.argv[1], sys.argv[2]
pl = importlib.import_module("lightning.pytorch" if PACKAGE == "lightning" else "pytorch_lightning")
OTHER = importlib.import_module("pytorch_lightning" if PACKAGE == "lightning" else "lightning.pytorch")
mod = importlib.import_module(f"gradfuse.torch.{PACKAGE}")
GradfuseDDPStrategy = mod.GradfuseDDPStrategy


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.0)     # the momentum is in the hook


def loader():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)


def trainer(strategy, epochs, **kw):
    return pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                      max_epochs=epochs, enable_progress_bar=False, enable_model_summary=False, logger=False,
                      num_sanity_val_steps=0, **kw)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def strategy():
    return GradfuseDDPStrategy("1bit", momentum=0.9, process_group_backend="gloo")


def check_other_package_refuses_this_strategy(rank):
    try:
        OTHER.Trainer(accelerator="cpu", devices=1, strategy=strategy(), logger=False)
    except Exception as e:                 # each package checks isinstance against its own Strategy
        assert "strategy" in str(e).lower() or "Strategy" in type(e).__name__, e
    else:
        raise AssertionError(f"{OTHER.__name__}.Trainer took {mod.__name__}'s strategy")


def check_hook_runs_and_ranks_agree(rank):
    s = strategy()
    model = Net()
    t = trainer(s, 1, enable_checkpointing=False)
    t.fit(model, loader())
    st = s.gradfuse_state
    assert t.global_step > 0 and st.calls == st.iteration == t.global_step, (t.global_step, st.calls, st.iteration)
    stats = st.stats
    assert 0 < stats["bytes_sent"] < stats["bytes_reduced"] / 16, stats
    p = flat(model)
    out = [torch.empty_like(p) for _ in range(dist.get_world_size())]
    dist.all_gather(out, p)
    assert all(torch.equal(o, out[0]) for o in out), "ranks hold different parameters"


def _states_equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()
    return a == b


def check_resume_is_bit_exact(rank):
    ckdir = os.path.join(CKPT, PACKAGE)
    from importlib import import_module
    callbacks = import_module(f"{pl.__name__}.callbacks")
    # uninterrupted: 2 epochs, a checkpoint after each
    s_full, m_full = strategy(), Net()
    ck = callbacks.ModelCheckpoint(dirpath=ckdir, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    trainer(s_full, 2, callbacks=[ck]).fit(m_full, loader())
    first = os.path.join(ckdir, "epoch=0.ckpt")
    assert os.path.exists(first), sorted(glob.glob(os.path.join(ckdir, "*")))
    raw = torch.load(first, weights_only=True)         # PyTorch's default: tensors and plain values only
    assert raw["gradfuse"]["world_size"] == dist.get_world_size() and len(raw["gradfuse"]["ranks"]) == 2
    # resumed: a fresh model, strategy and Trainer continue from epoch 0's checkpoint
    s_res, m_res = strategy(), Net()
    trainer(s_res, 2, enable_checkpointing=False).fit(m_res, loader(), ckpt_path=first)
    assert s_res.gradfuse_state.iteration == s_full.gradfuse_state.iteration
    a, b = flat(m_full), flat(m_res)
    assert torch.equal(a, b), f"resumed run differs by {float((a - b).abs().max())}"
    assert _states_equal(s_full.gradfuse_state.state_dict(), s_res.gradfuse_state.state_dict()), \
        "hook state differs after the resumed run"
    # without the hook state the same resume differs: the checkpointed residuals and velocity matter
    if rank == 0:
        raw.pop("gradfuse")
        torch.save(raw, os.path.join(ckdir, "no_hook_state.ckpt"))
    dist.barrier()
    s_bare, m_bare = strategy(), Net()
    trainer(s_bare, 2, enable_checkpointing=False).fit(m_bare, loader(),
                                                       ckpt_path=os.path.join(ckdir, "no_hook_state.ckpt"))
    assert not torch.equal(flat(m_bare), a), "the hook state made no difference to the resumed run"


def main():
    names = sys.argv[3:] or [n for n in globals() if n.startswith("check_")]
    dist_ready = False
    for name in names:
        globals()[name](int(os.environ["RANK"]))
        if dist.is_initialized():
            dist_ready = True
            dist.barrier()
        print(f"CHECK {name} ok rank {os.environ['RANK']}", flush=True)
    assert dist_ready
    print(f"ALL OK rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)


if __name__ == "__main__":
    main()
