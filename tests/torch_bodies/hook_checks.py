"""More multi-rank checks of gradfuse.torch's hook (tests/test_torch_hook.py runs them under
torchrun, and under a Slurm-like launch: processes started with srun's variables only).

- the state as tensors: ``torch.save`` and ``torch.load`` with PyTorch's default
  ``weights_only=True``, into a fresh model, DDP and state that continue bit-exactly;
  a ``gradfuse-torch-1`` dict loads, another format is refused by name;
- bfloat16 buckets: uncompressed (the bf16 values summed in float32 and rounded once),
  fp16, bf16 and 1-bit;
- no MPI: nothing here imported mpi4py.

Every rank prints ``CHECK <name> ok rank <r>`` and finally ``ALL OK rank <r> of <p>``.
"""
import io
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradfuse.torch as gt
from gradfuse.torch.checkpoint import to_numpy


def model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(),
                               torch.nn.Linear(40, 10)).to(dtype)


def batches(rank, n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 100 * rank)
    return [(torch.randn(16, 32, generator=g).to(dtype), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def params(m):
    return torch.cat([p.detach().float().reshape(-1) for p in m.parameters()])


def train(ddp, opt, data):
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(ddp(x).float(), y).backward()
        opt.step()


def same_on_all_ranks(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(o, out[0]) for o in out)


SMALL = 0.004      # several buckets, rebuilt by DDP after the first iteration


def check_state_roundtrips_through_torch_load(rank):
    first, second = batches(rank, 3, seed=5), batches(rank, 3, seed=6)
    path = os.path.join(os.environ["GRADFUSE_TEST_TMP"], f"hook-rank{rank}.pt")
    for c in ("1bit", "topk", "randomk", "2bit"):
        m = model()
        ddp = DDP(m, bucket_cap_mb=SMALL)
        state = gt.CompressionState(c, module=m, momentum=0.9)
        ddp.register_comm_hook(state, gt.comm_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train(ddp, opt, first)
        torch.save({"model": m.state_dict(), "hook": state.state_dict()}, path)
        train(ddp, opt, second)
        want = params(m)
        # a fresh process's view: new model, DDP (its initial buckets first) and state
        saved = torch.load(path)                     # PyTorch's default: weights_only=True
        m2 = model(seed=1)
        m2.load_state_dict(saved["model"])
        ddp2 = DDP(m2, bucket_cap_mb=SMALL)
        state2 = gt.CompressionState(c, module=m2, momentum=0.9)
        assert state2.load_state_dict(saved["hook"])
        ddp2.register_comm_hook(state2, gt.comm_hook)
        train(ddp2, torch.optim.SGD(ddp2.parameters(), lr=0.1), second)
        got = params(m2)
        assert torch.equal(got, want), f"{c}: resumed from torch.load differs by {float((got - want).abs().max())}"
        # the same without the hook state differs: the state carried something
        m3 = model(seed=1)
        m3.load_state_dict(saved["model"])
        ddp3 = DDP(m3, bucket_cap_mb=SMALL)
        ddp3.register_comm_hook(gt.CompressionState(c, module=m3, momentum=0.9), gt.comm_hook)
        train(ddp3, torch.optim.SGD(ddp3.parameters(), lr=0.1), second)
        assert not torch.equal(params(m3), want), f"{c}: the restored state made no difference"
    # the format before tensors (numpy arrays) loads; any other format is refused by name
    sd = state.state_dict()
    old = dict(to_numpy(sd), format="gradfuse-torch-1")
    assert isinstance(old["buckets"][0]["state"]["buckets"][next(iter(old["buckets"][0]["state"]["buckets"]))]
                      ["residual"], np.ndarray)
    assert state.load_state_dict(old)
    try:
        state.load_state_dict(dict(sd, format="gradfuse-torch-0"))
    except ValueError as e:
        assert "gradfuse-torch-0" in str(e) and "gradfuse-torch-2" in str(e), e
    else:
        raise AssertionError("a state_dict of an unknown format was accepted")
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert _bits(back) == _bits(sd)


def check_load_validates_and_handles_another_world_size(rank):
    """load_state_dict validates through the Pipeline's one path: NaN in a residual is refused
    naming the bucket and the element, and the live state stays; a state of another world size
    keeps the shared part and zeroes the residuals and velocities, with a warning naming them."""
    import copy
    import warnings
    from gradfuse.errors import GradfuseError
    m = model()
    ddp = DDP(m, bucket_cap_mb=SMALL)
    state = gt.CompressionState("1bit", module=m, momentum=0.9)
    ddp.register_comm_hook(state, gt.comm_hook)
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches(rank, 3, seed=7))
    sd = state.state_dict()
    before = _bits(state.state_dict())
    bad = copy.deepcopy(sd)
    entry = next(b for b in bad["buckets"] if not b["warm"])
    key = next(iter(entry["state"]["buckets"]))
    entry["state"]["buckets"][key]["residual"][3] = float("nan")
    try:
        state.load_state_dict(bad)
    except GradfuseError as e:
        assert f"DDP bucket {entry['index']}" in str(e) and f"bucket {key} residual holds nan at element 3" in str(e), e
    else:
        raise AssertionError("a residual with NaN was accepted")
    assert _bits(state.state_dict()) == before, "a refused load changed the live state"
    other = copy.deepcopy(sd)
    p = dist.get_world_size()
    for b in other["buckets"]:
        b["state"]["world_size"] = p + 1
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert state.load_state_dict(other)
    said = [str(x.message) for x in w if f"saved on {p + 1} ranks" in str(x.message)]
    assert said and all("(residual, velocity)" in t for t in said), [str(x.message) for x in w]
    for b in state.state_dict()["buckets"]:
        for e in b["state"]["buckets"].values():
            assert e["residual"].numel() == 0 and e.get("velocity") is None
    assert state.iteration == sd["iteration"]


def _bits(x):
    if isinstance(x, dict):
        return {k: _bits(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_bits(v) for v in x]
    if isinstance(x, torch.Tensor):
        return (str(x.dtype), tuple(x.shape), x.numpy().tobytes())
    return x


def _bf16_grads(ddp_hook_state, rank, x, y):
    m = model(dtype=torch.bfloat16)
    ddp = DDP(m, bucket_cap_mb=SMALL)
    if ddp_hook_state is not None:
        ddp.register_comm_hook(ddp_hook_state(m), gt.comm_hook)
    torch.nn.functional.cross_entropy(ddp(x).float(), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def check_bf16_buckets(rank):
    p = dist.get_world_size()
    x, y = batches(rank, 1, seed=11, dtype=torch.bfloat16)[0]
    local = model(dtype=torch.bfloat16)
    torch.nn.functional.cross_entropy(local(x).float(), y).backward()
    g = torch.cat([q.grad.reshape(-1) for q in local.parameters()])
    every = [torch.empty_like(g) for _ in range(p)]
    dist.all_gather(every, g)
    mean32 = torch.stack([e.float() for e in every]).sum(0) / p
    ulp = torch.ldexp(torch.ones_like(mean32), torch.frexp(mean32)[1] - 8)     # one bf16 ulp at each value
    # uncompressed: DDP's scaling by 1/p (in bf16, as DDP does), a float32 sum, one rounding
    got = _bf16_grads(lambda m: gt.CompressionState(None, module=m), rank, x, y)
    assert got.dtype == torch.bfloat16
    scaled = [(e * (1.0 / p)).float() for e in every]
    acc = scaled[0].clone()
    for s in scaled[1:]:
        acc += s
    ref = acc.to(torch.bfloat16)
    if p == 2:           # a + b in either order: the bits are fixed
        assert torch.equal(got, ref), f"none: {int((got != ref).sum())} elements differ from one rounding"
    else:
        assert bool(((got.float() - ref.float()).abs() <= ulp).all()), "none: more than one bf16 ulp off"
    assert same_on_all_ranks(got)
    # fp16 / bf16 on the wire: each add of the sum rounds once (to at most bf16's unit roundoff
    # 2^-8 of a partial sum, which is at most p times the largest rank's value), then the mean
    # rounds once to bf16
    mag = torch.stack([e.float().abs() for e in every]).max(0).values
    for c in ("bf16", "fp16"):
        got = _bf16_grads(lambda m: gt.CompressionState(c, module=m), rank, x, y)
        err = (got.float() - mean32).abs()
        bound = ulp + (p - 1) * 2.0 ** -8 * mag + 2.0 ** -24
        assert bool((err <= bound).all()), f"{c}: {float((err / bound).max())} times the bound from the mean"
        assert same_on_all_ranks(got), c
    # 1-bit on a bf16 model: a few steps train, identical on every rank, far fewer bytes than DDP's
    m = model(dtype=torch.bfloat16)
    ddp = DDP(m, bucket_cap_mb=SMALL)
    state = gt.CompressionState("1bit", module=m, momentum=0.9)
    ddp.register_comm_hook(state, gt.comm_hook)
    before = params(m)
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches(rank, 3, seed=12, dtype=torch.bfloat16))
    after = params(m)
    assert torch.isfinite(after).all() and not torch.equal(after, before)
    assert same_on_all_ranks(after), "1bit bf16: ranks hold different parameters"
    st = state.stats
    # against DDP's own bf16 ring allreduce of the same gradients (bytes_reduced counts the
    # float32 staging: twice the bf16 bytes)
    ddp_bf16 = 2 * (p - 1) / p * st["bytes_reduced"] / 2
    assert 0 < st["bytes_sent"] < 0.25 * ddp_bf16, (st, ddp_bf16)


def check_no_mpi_was_imported(rank):
    assert "mpi4py" not in sys.modules, "gradfuse.torch imported mpi4py"


def main():
    rank, size = gt.init_process_group("gloo")
    launcher = gt.launch.launcher_env()[4]
    print(f"LAUNCHER {launcher} rank {rank} of {size} local {gt.TorchCommunicator().local_rank} "
          f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    names = sys.argv[1:] or [n for n in globals() if n.startswith("check_")]
    for name in names:
        globals()[name](rank)
        dist.barrier()
        print(f"CHECK {name} ok rank {rank}", flush=True)
    print(f"ALL OK rank {rank} of {size}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
