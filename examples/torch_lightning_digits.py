"""Lightning on CPU with gradfuse's DDP comm hook (digits MLP).

    torchrun --nproc_per_node 2 examples/torch_lightning_digits.py --compress 1bit
    python examples/torch_lightning_digits.py --devices 2 --compress topk     # Lightning starts the ranks
    torchrun --nproc_per_node 2 examples/torch_lightning_digits.py --package pytorch_lightning

``--package lightning`` (default) runs ``lightning.pytorch`` with
``gradfuse.torch.lightning.GradfuseDDPStrategy``; ``--package pytorch_lightning`` the older
package with ``gradfuse.torch.pytorch_lightning.GradfuseDDPStrategy`` (each package's
Trainer takes only its own strategies). Lightning's own ``DDPStrategy(ddp_comm_hook=...)``
ignores the hook on CPU; gradfuse's strategy registers it on any device. The momentum
lives in the hook state (``momentum=0.9``), so the module's SGD runs with momentum 0.
At the end every rank prints the hook's counters and checks that all ranks hold the same
parameters.
"""
import argparse
import json
import os
import sys

import importlib

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

# the package decides the base classes below, so it is read before the other arguments
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--package", choices=["lightning", "pytorch_lightning"], default="lightning")
PACKAGE = _pre.parse_known_args()[0].package
pl = importlib.import_module("lightning.pytorch" if PACKAGE == "lightning" else "pytorch_lightning")
GradfuseDDPStrategy = importlib.import_module(f"gradfuse.torch.{PACKAGE}").GradfuseDDPStrategy


class DigitsMLP(pl.LightningModule):
    def __init__(self, lr=0.1, hidden=128):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                       torch.nn.ReLU(), torch.nn.Linear(hidden, 10))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.0)   # the momentum is in the hook state


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compress", default="1bit")
    ap.add_argument("--devices", type=int, default=None, help="default: torchrun's WORLD_SIZE, else 2")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--package", choices=["lightning", "pytorch_lightning"], default="lightning",
                    help="which Lightning package runs (default: lightning, i.e. lightning.pytorch)")
    args = ap.parse_args()
    devices = args.devices or int(os.environ.get("WORLD_SIZE", 2))
    pl.seed_everything(args.seed, verbose=False)
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=360, random_state=0, stratify=d.target)
    train = DataLoader(TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr).long()), batch_size=32, shuffle=True)
    model = DigitsMLP()
    compress = None if args.compress == "none" else args.compress
    strategy = GradfuseDDPStrategy(compress, momentum=args.momentum, process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=args.epochs,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False)
    trainer.fit(model, train)
    state = strategy.gradfuse_state
    with torch.no_grad():
        acc = float((model.net(torch.from_numpy(xte)).argmax(1) == torch.from_numpy(yte)).float().mean())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    st = state.stats
    line = "GRADFUSE-LIGHTNING " + json.dumps({
        "rank": dist.get_rank(), "world_size": dist.get_world_size(), "compress": args.compress, "package": pl.__name__,
        "hook_calls": state.calls, "iterations": state.iteration, "steps": st["steps"],
        "bytes_sent": st["bytes_sent"], "bytes_reduced": st["bytes_reduced"], "global_step": trainer.global_step,
        "test_acc": acc, "identical_on_all_ranks": all(torch.equal(o, out[0]) for o in out)}) + "\n"
    # one write() of the whole line: the ranks share the pipe, and print's separate writes of
    # the text and its newline interleaved two ranks' lines (seen in CI)
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())


if __name__ == "__main__":
    main()
