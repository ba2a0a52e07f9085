"""The multi-rank checks of the DDP comm hook's Adam correction (tests/test_torch_adam.py
runs it under torchrun). Every check raises on failure; each rank prints ``CHECK <name>
ok`` and finally ``ALL OK rank <r> of <p>``."""
import copy
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradfuse.torch as gt

LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8
SMALL = 0.004      # ~4 KB buckets: several buckets, and DDP rebuilds them after iteration 0


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(),
                               torch.nn.Linear(40, 10))


TEACHER = torch.randn(32, 10, generator=torch.Generator().manual_seed(42))


def batches(rank, n, seed=1):
    """Each rank its own data, labelled by a fixed linear teacher (something to learn)."""
    g = torch.Generator().manual_seed(seed + 100 * rank)
    xs = [torch.randn(16, 32, generator=g) for _ in range(n)]
    return [(x, (x @ TEACHER).argmax(dim=1)) for x in xs]


def params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def same_on_all_ranks(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(o, out[0]) for o in out)


def hooked(compress, cap=None, **opts):
    m = model()
    ddp = DDP(m, **({"bucket_cap_mb": cap} if cap else {}))
    state = gt.CompressionState(compress, module=m, **opts)
    ddp.register_comm_hook(state, gt.comm_hook)
    return m, ddp, state, torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.0, weight_decay=WD)


def step(ddp, opt, x, y):
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


class Reference:
    """torch.optim.AdamW on each rank's gradient (clipped to ``clip`` first), averaged by an
    all_reduce: what the hook's exact Adam computes."""

    def __init__(self, clip=None):
        self.m, self.clip = model(), clip
        self.opt = torch.optim.AdamW(self.m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def step(self, x, y):
        self.opt.zero_grad()
        torch.nn.functional.cross_entropy(self.m(x), y).backward()
        for p in self.m.parameters():
            if self.clip is not None:
                p.grad.clamp_(-self.clip, self.clip)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.opt.step()


def rel_change(a, ref, w0):
    return float((a - ref).norm() / (ref - w0).norm())


def check_exact_adam_is_torch_adamw(rank):
    """compress=None, adam={}: SGD(momentum 0, weight_decay) on the hook's steps is
    torch.optim.AdamW on the averaged gradients, after every one of 40 steps."""
    for clip in (None, 0.05):
        m, ddp, state, opt = hooked(None, adam={} if clip is None else {"clip": clip})
        ref = Reference(clip)
        w0 = params(m)
        worst = 0.0
        for x, y in batches(rank, 40, seed=3):
            step(ddp, opt, x, y)
            ref.step(x, y)
            worst = max(worst, rel_change(params(m), params(ref.m), w0))
        assert worst < 2e-6, f"clip={clip}: the hook's Adam differs from AdamW by {worst:.2e} of the change"
        assert float((params(ref.m) - w0).norm()) > 0.1 * float(w0.norm())
        assert same_on_all_ranks(params(m))
        if rank == 0:
            print(f"exact Adam vs torch.optim.AdamW, clip={clip}: {worst:.2e} of the parameters' change", flush=True)


def check_lossy_adam_trains_identically_on_all_ranks(rank):
    """1bit, 2bit, topk with freeze_iter=5: the first 5 iterations are exact Adam, then the
    compressed steps keep every rank's parameters identical and the loss falls."""
    data = batches(rank, 30, seed=4)
    for c in ("1bit", "2bit", "topk"):
        m, ddp, state, opt = hooked(c, cap=SMALL, adam={"freeze_iter": 5})
        ref = Reference()
        w0 = params(m)
        losses = []
        for i, (x, y) in enumerate(data):
            losses.append(step(ddp, opt, x, y))
            if i < 5:
                ref.step(x, y)
                assert rel_change(params(m), params(ref.m), w0) < 1e-5, f"{c}: iteration {i} was not exact Adam"
        assert same_on_all_ranks(params(m)), f"{c}: ranks differ"
        assert np.mean(losses[-5:]) < np.mean(losses[:5]), f"{c}: did not train: {losses}"
        frozen = {int(e["arrays"]["adam.freeze"][0]) for b in state.state_dict()["buckets"]
                  for e in b["state"]["buckets"].values()}
        assert 0 not in frozen, f"{c}: a bucket's v never froze: {frozen}"


def check_freeze_iter_counts_iterations(rank):
    """freeze_iter counts DDP iterations (across DDP's bucket rebuild after iteration 0);
    warmup_steps counts each layout's own calls and starts again with the rebuilt layout."""
    data = batches(rank, 6, seed=5)

    def per_iteration(state, ddp, opt):
        sent = [0]
        for x, y in data:
            step(ddp, opt, x, y)
            sent.append(state.stats["bytes_sent"])
        return [b - a for a, b in zip(sent, sent[1:])]      # exact: the gradients' ring bytes; then 1-bit's
    m, ddp, state, opt = hooked("1bit", cap=SMALL, adam={"freeze_iter": 3})
    sent = per_iteration(state, ddp, opt)
    assert min(sent[:3]) > 10 * max(sent[3:]), f"freeze_iter=3: bytes sent per iteration {sent}"
    m, ddp, state, opt = hooked("1bit", cap=SMALL, adam={}, warmup_steps=2)
    sent = per_iteration(state, ddp, opt)
    # iteration 0 on DDP's first layout, then the rebuilt layout's 2 exact calls: compressed from iteration 3
    assert state.layout_changes > 0 and min(sent[:3]) > 10 * max(sent[3:]), (state.layout_changes, sent)


def _equal_states(x, y):
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal_states(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_equal_states(a, b) for a, b in zip(x, y))
    if isinstance(x, torch.Tensor):
        x, y = x.numpy(), y.numpy()
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    return x == y


def check_state_dict_is_bit_exact(rank):
    """Before and after the freeze: m, v, the counters, the freeze step and the mask come back,
    and the restored run continues bit-identically."""
    for at in (2, 5):
        first, second = batches(rank, at, seed=6), batches(rank, 3, seed=7)
        m, ddp, state, opt = hooked("1bit", adam={"freeze_iter": 3})
        for x, y in first:
            step(ddp, opt, x, y)
        saved_params = [p.detach().clone() for p in m.parameters()]
        saved = copy.deepcopy(state.state_dict())
        arrays = [e["arrays"] for b in saved["buckets"] for e in b["state"]["buckets"].values()]
        assert arrays and all({"adam.m", "adam.v", "adam.step", "adam.freeze"} <= set(a) for a in arrays)
        assert all(("adam.mask" in a) == (at > 3) for a in arrays), (at, [sorted(a) for a in arrays])
        for x, y in second:
            step(ddp, opt, x, y)
        a, sd_a = params(m), copy.deepcopy(state.state_dict())
        with torch.no_grad():
            for p, q in zip(m.parameters(), saved_params):
                p.copy_(q)
        assert state.load_state_dict(saved)
        for x, y in second:
            step(ddp, opt, x, y)
        assert torch.equal(params(m), a), f"at {at}: the restored run differs"
        assert _equal_states(state.state_dict(), sd_a), f"at {at}: the states differ after the restored run"


def check_optimizer_warnings_and_scaler(rank):
    m = model()
    state = gt.CompressionState("1bit", adam={})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert state.check_optimizer(torch.optim.AdamW(m.parameters(), lr=LR))
        assert not state.check_optimizer(torch.optim.AdamW(m.parameters(), lr=LR))      # once
    assert len(w) == 1 and "Adam would run twice" in str(w[0].message), [str(x.message) for x in w]
    try:
        state.check_optimizer(torch.optim.SGD(m.parameters(), lr=LR), scaler=torch.amp.GradScaler("cpu"))
    except ValueError as e:
        assert "GradScaler would unscale them" in str(e), e
    else:
        raise AssertionError("a GradScaler was accepted with adam")
    plain = gt.CompressionState("1bit")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert plain.check_optimizer(torch.optim.Adam(m.parameters(), lr=LR))
    assert "adam={}" in str(w[0].message), str(w[0].message)
    assert not gt.CompressionState("fp16").check_optimizer(torch.optim.Adam(m.parameters(), lr=LR))
    for bad, match in (({"adam": {"betas": (0.9, 1.5)}}, "betas"), ({"adam": {"freeze_iter": 0}}, "freeze_iter"),
                       ({"adam": {"lr": 1}}, "unknown key"), ({"adam": {}, "momentum": 0.9}, "exclude each other"),
                       ({"adam": {}, "start_iter": 2}, "freeze_iter instead")):
        try:
            gt.CompressionState("1bit", **bad)
        except (TypeError, ValueError) as e:
            assert match in str(e), (bad, e)
        else:
            raise AssertionError(f"accepted {bad}")


def main():
    rank, size = gt.init_process_group("gloo")
    names = sys.argv[1:] or [n for n in globals() if n.startswith("check_")]
    for name in names:
        globals()[name](rank)
        dist.barrier()
        print(f"CHECK {name} ok rank {rank}", flush=True)
    print(f"ALL OK rank {rank} of {size}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
