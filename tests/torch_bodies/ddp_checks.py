"""The multi-rank checks of gradfuse.torch's DDP comm hook (tests/test_torch_ddp.py runs it).

Launched by torchrun (RANK/WORLD_SIZE) or mpiexec (PMI_RANK/PMI_SIZE, MASTER_ADDR/PORT
set by the test). Every check raises on failure; each rank prints ``CHECK <name> ok``
and finally ``ALL OK rank <r> of <p>``.
"""
import copy
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import gradfuse.torch as gt
from gradfuse.torch.checkpoint import to_numpy

LOSSY = ("1bit", "2bit", "topk", "randomk")


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(),
                               torch.nn.Linear(40, 10))


def batches(rank, n, seed=1):
    g = torch.Generator().manual_seed(seed + 100 * rank)      # each rank its own data
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def train(ddp, opt, data):
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def same_on_all_ranks(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(o, out[0]) for o in out)


def hooked(compress, cap=None, **opts):
    m = model()
    kw = {"bucket_cap_mb": cap} if cap else {}
    ddp = DDP(m, **kw)
    state = gt.CompressionState(compress, module=m, **opts)
    ddp.register_comm_hook(state, gt.comm_hook)
    return m, ddp, state


SMALL = 0.004      # ~4 KB buckets: several buckets, and DDP rebuilds them after iteration 0


def check_none_is_ddp(rank):
    data = batches(rank, 4)
    ref = model()
    rddp = DDP(ref, bucket_cap_mb=SMALL)
    train(rddp, torch.optim.SGD(rddp.parameters(), lr=0.1, momentum=0.9), data)
    m, ddp, state = hooked(None, cap=SMALL)
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), data)
    assert torch.equal(params(m), params(ref)), float((params(m) - params(ref)).abs().max())
    assert state.iteration == 4 and state.calls > 4, (state.iteration, state.calls)     # several buckets
    assert state.layout_changes >= 1, "DDP did not rebuild its buckets (or the rebuild went unseen)"


def check_fp16_matches_pytorch_hook(rank):
    x, y = batches(rank, 1)[0]
    grads = {}
    for name in ("pytorch", "gradfuse", "local"):
        m = model()
        if name == "local":
            torch.nn.functional.cross_entropy(m(x), y).backward()
            grads[name] = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
            continue
        ddp = DDP(m, bucket_cap_mb=SMALL)
        if name == "pytorch":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            ddp.register_comm_hook(gt.CompressionState("fp16", module=m), gt.comm_hook)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads[name] = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    # both round each rank's gradient to fp16 and sum in fp16; they differ in where they divide by
    # p and how the sum rounds: a few fp16 ulps of the largest rank's contribution
    mag = grads["local"].abs()
    dist.all_reduce(mag, op=dist.ReduceOp.MAX)
    diff = (grads["gradfuse"] - grads["pytorch"]).abs()
    bound = 4 * 2.0 ** -11 * mag + 2.0 ** -24
    assert bool((diff <= bound).all()), f"max diff {float(diff.max())}, bound there {float(bound[diff.argmax()])}"
    # and fp16 really ran: both differ from the fp32 mean by fp16 rounding, not by nothing
    ref = grads["local"].clone()
    dist.all_reduce(ref)
    ref /= dist.get_world_size()
    assert not torch.equal(grads["gradfuse"], ref)


def check_lossy_train_identically_on_all_ranks(rank):
    data = batches(rank, 5)
    for c in LOSSY:
        m, ddp, state = hooked(c, cap=SMALL, momentum=0.9)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train(ddp, opt, data)
        p = params(m)
        assert torch.isfinite(p).all(), c
        assert same_on_all_ranks(p), f"{c}: ranks hold different parameters"
        st = state.stats
        assert st["steps"] == state.calls and st["bytes_sent"] > 0, (c, st)
        # compressed: far fewer bytes than DDP's ring allreduce of the same gradients
        plain = 2 * (dist.get_world_size() - 1) / dist.get_world_size() * st["bytes_reduced"]
        assert st["bytes_sent"] < 0.5 * plain, (c, st["bytes_sent"], plain)
        # after DDP's rebuild only the live layouts keep state
        live = {b["index"] for b in state.state_dict()["buckets"]}
        assert len(state.state_dict()["buckets"]) == len(live), (c, state.state_dict()["buckets"])


def check_state_dict_is_bit_exact(rank):
    first, second = batches(rank, 3, seed=5), batches(rank, 3, seed=6)
    for c in ("1bit", "topk", "randomk"):
        m, ddp, state = hooked(c, momentum=0.9)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train(ddp, opt, first)
        saved_params = [p.detach().clone() for p in m.parameters()]
        saved = copy.deepcopy(state.state_dict())
        entries = [to_numpy(e) for b in saved["buckets"] for e in b["state"]["buckets"].values()]
        assert entries and all(np.any(e["velocity"] != 0) and np.any(e["residual"] != 0) for e in entries), \
            f"{c}: the saved state holds no velocity or residual"
        train(ddp, opt, second)
        a, sd_a = params(m), copy.deepcopy(state.state_dict())
        with torch.no_grad():
            for p, q in zip(m.parameters(), saved_params):
                p.copy_(q)
        assert state.load_state_dict(saved)
        train(ddp, opt, second)
        assert torch.equal(params(m), a), f"{c}: restored run differs by {float((params(m) - a).abs().max())}"
        assert _equal_states(state.state_dict(), sd_a), f"{c}: residuals/velocities differ after the restored run"


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


def check_start_iter_runs_uncompressed_first(rank):
    data = batches(rank, 2, seed=7)
    m, ddp, state = hooked("1bit", momentum=0.9, start_iter=2)
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), data)
    r, rddp, rstate = hooked(None, momentum=0.9)
    train(rddp, torch.optim.SGD(rddp.parameters(), lr=0.1), data)
    assert torch.equal(params(m), params(r)), "start_iter=2: the first two iterations were not uncompressed"
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches(rank, 1, seed=8))
    assert state.stats["bytes_sent"] < rstate.stats["bytes_sent"] * 1.2, "iteration 2 was not compressed"


def check_bad_input_and_momentum_warning(rank):
    try:
        gt.CompressionState("3bit")
    except ValueError as e:
        assert "3bit" in str(e) and "1bit" in str(e), e
    else:
        raise AssertionError("an unknown compressor was accepted")
    state = gt.CompressionState("topk", momentum=0.9)
    m = model()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert state.check_optimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
        assert not state.check_optimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))   # once
    assert len(w) == 1 and "momentum=0" in str(w[0].message), [str(x.message) for x in w]


def check_hook_equals_core_pipeline(rank):
    """Under mpiexec: the hook's averaged bucket is bit for bit gradfuse.Pipeline's over MPI on
    the same tensors (the binding adds no arithmetic of its own)."""
    import os
    if "PMI_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        return
    import gradfuse
    x, y = batches(rank, 1, seed=9)[0]
    for c in ("1bit", "topk", "randomk", "2bit"):
        m = model()
        local = model()
        torch.nn.functional.cross_entropy(local(x), y).backward()
        ddp = DDP(m)
        order = []

        def recording_hook(state, bucket):       # the bucket's tensor order, as DDP hands it
            order.extend(id(p) for p in bucket.parameters())
            return gt.comm_hook(state, bucket)
        ddp.register_comm_hook(gt.CompressionState(c, module=m, momentum=0.9), recording_hook)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        pos = {id(p): n for n, p in m.named_parameters()}
        lp = dict(local.named_parameters())
        named = [(pos[i], lp[pos[i]]) for i in order]
        grads = [p.grad.detach().numpy().copy() for _, p in named]
        pipe = gradfuse.Pipeline(c, momentum=0.9, fusion_threshold=1 << 40, direct_threshold=1 << 40)
        out = pipe.allreduce(grads, names=[f"bucket0.{n}" for n, _ in named])
        got = {n: p.grad.numpy() for n, p in m.named_parameters()}
        for (n, _), o in zip(named, out):
            assert np.array_equal(got[n], o), (f"{c}: {n} differs from the core pipeline's result: "
                                               f"{np.flatnonzero(got[n] != o)[:10]} {got[n].ravel()[:6]} {o.ravel()[:6]}")


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
