"""The hook on CUDA buckets against the host path, bucket by bucket: on a GPU
(scripts/gpu_check.sh's DDP section) or on the kernel emulator (tests/test_torch_cuda_emulated.py).

    torchrun --nproc_per_node 1 tests/torch_bodies/cuda_buckets.py nccl     # a GPU: world size 1 over NCCL
    torchrun --nproc_per_node 2 tests/torch_bodies/cuda_buckets.py gloo     # 2 ranks on one GPU, host-staged
    GRADFUSE_GPU_EMULATOR=1 torchrun --nproc_per_node 2 tests/torch_bodies/cuda_buckets.py gloo direct

A DDP model on the device trains a few steps with gradfuse's hook; every bucket the hook
gets is copied to the host first, and after each backward pass a second hook state
reduces those copies on the host path (same compressor, same names, same order). The
device's averaged gradients must equal the host path's bit for bit: gradfuse's CUDA
kernels are bit-identical to its CPU kernels (docs/gpu.md), and the hook adds no
arithmetic. Every compressor that exists (none, fp16, bf16, 1bit, 2bit, topk, randomk;
the lossy ones with DGC momentum 0.9), fp32 and bf16 models; the Adam correction
(``adam=``, exact warm-up, the freeze, then 1-bit and 2-bit moments, with and without
``clip``), bit for bit too; PowerSGD at ranks 1, 2 and 4 to tolerance (its products are
cuBLAS's on a GPU and numpy's on the emulator, gradfuse's kernels on the host path; its
Gram-Schmidt, gather and scatter kernels are bit-identical, tests/test_gpu_powersgd.py). It also checks that the
step ran on the GPU path (a device communicator was made: ``TorchDeviceCommunicator`` on
NCCL, ``TorchHostStaged`` on gloo) and that the future DDP got was complete.

On the emulator (``GRADFUSE_GPU_EMULATOR=1``; no GPU, no CUDA build of torch) CPU tensors
stand in for CUDA tensors: ``EmulatorBridge`` replaces ``gradfuse.torch.device.BRIDGE``
while DDP runs; the DLPack intake is the real one (the emulator's ``cupy.from_dlpack``),
the data plane's buffers reach torch as CPU tensors, and the third argument ``direct``
makes the data plane the direct one (NCCL's role) on gloo.

Every rank prints ``CHECK <name> ok rank <r>`` and finally ``ALL OK rank <r> of <p>``.
"""
import contextlib
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

EMULATED = os.environ.get("GRADFUSE_GPU_EMULATOR", "").strip() == "1"
if EMULATED:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuda_emu"))
    import fakecupy
    fakecupy.install()

import gradfuse.torch as gt  # noqa: E402
from gradfuse.torch import device as gdev  # noqa: E402

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "gloo"
DIRECT = sys.argv[2:3] == ["direct"]
COMPRESSORS = (None, "fp16", "bf16", "1bit", "2bit", "topk", "randomk")
HOST_GROUP = []         # a gloo group of every rank, for the host path's reference (made in main)


class EmulatorBridge(gdev.Bridge):
    """The emulator's stand-ins where a GPU has CUDA tensors and streams (see the module docstring)."""

    def __init__(self, direct):
        self._direct = direct
        self.active = False

    def is_device(self, tensor):
        return self.active

    def device_index(self, tensor):
        return 0

    def to_torch(self, arr):
        return torch.from_numpy(np.asarray(arr))

    def cupy_stream(self, tensor):
        return fakecupy.cuda.Stream()

    def torch_stream(self, device):
        return contextlib.nullcontext()

    def future(self, tensor):
        return torch.futures.Future()

    def direct(self, group):
        return self._direct


BRIDGE = EmulatorBridge(DIRECT) if EMULATED else None
if BRIDGE is not None:
    gdev.BRIDGE = BRIDGE            # buckets are "on the GPU" only while BRIDGE.active (DDP's backward)
DEVICE = torch.device("cpu") if EMULATED else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))
                                                          % max(1, torch.cuda.device_count()))


class HostBucket:
    """A host copy of one GradBucket, as the hook reads it (replayed on the host path)."""

    def __init__(self, bucket):
        self._buf = bucket.buffer().detach().to("cpu", copy=True)
        self._index, self._last = bucket.index(), bucket.is_last()
        self._params = list(bucket.parameters())
        self._shapes = [tuple(g.shape) for g in bucket.gradients()]

    def buffer(self):
        return self._buf

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def parameters(self):
        return self._params

    def gradients(self):
        out, off = [], 0
        for s in self._shapes:
            n = int(np.prod(s, dtype=np.int64))
            out.append(self._buf[off:off + n].view(s))
            off += n
        return out


def model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 10)).to(DEVICE, dtype)


def compare(compress, rank, dtype, steps=3, opts=None, rtol=0.0):
    """``rtol`` 0: bit for bit; else every gradient within ``rtol`` of the largest |value|
    of its tensor on the host path."""
    m = model(dtype)
    ddp = DDP(m, bucket_cap_mb=0.002, **({"device_ids": [DEVICE.index]} if DEVICE.type == "cuda" else {}))
    if opts is None:
        opts = {"momentum": 0.9} if compress not in (None, "fp16", "bf16") else {}
    state = gt.CompressionState(compress, module=m, **opts)
    # the host path on a gloo group of the same ranks (an NCCL group moves no CPU tensors)
    host = gt.CompressionState(compress, process_group=HOST_GROUP[0], module=m, **opts)
    seen, futures = [], []

    def recording_hook(st, bucket):
        seen.append(HostBucket(bucket))
        fut = gt.comm_hook(st, bucket)
        futures.append(fut)
        return fut
    ddp.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + 100 * rank)
    where = f"{compress} {opts} ({dtype}, {BACKEND}{', direct' if DIRECT else ''})"
    for step in range(steps):
        x, y = torch.randn(8, 24, generator=g).to(DEVICE, dtype), torch.randint(0, 10, (8,), generator=g).to(DEVICE)
        opt.zero_grad(set_to_none=False)
        seen.clear()
        if BRIDGE is not None:
            BRIDGE.active = True
        try:
            torch.nn.functional.cross_entropy(ddp(x).float(), y).backward()
        finally:
            if BRIDGE is not None:
                BRIDGE.active = False
        if DEVICE.type == "cuda":
            torch.cuda.synchronize(DEVICE)
        assert all(f.done() for f in futures), f"{where}: a future DDP waited for is not complete"
        got = {id(p): p.grad.detach().to("cpu") for p in m.parameters()}
        for hb in seen:          # the host path on the same inputs, in the same order
            host.reduce(hb).wait()
            for p, want in zip(hb.parameters(), hb.gradients()):
                if rtol:
                    d = (got[id(p)].double() - want.double()).abs()
                    bound = rtol * float(want.double().abs().max())
                    if not bool(torch.isfinite(got[id(p)]).all()) or float(d.max()) > bound:
                        raise AssertionError(f"{where}, step {step}, bucket {hb.index()}: the device path differs "
                                             f"from the host path by {float(d.max())} (bound {bound})")
                elif not torch.equal(got[id(p)], want):
                    d = (got[id(p)].float() - want.float()).abs()
                    raise AssertionError(f"{where}, step {step}, bucket {hb.index()}: the device path differs from "
                                         f"the host path in {int((d != 0).sum())} of {d.numel()} elements "
                                         f"(max {float(d.max())})")
        opt.step()
    kinds = {type(pipe._ctx.gpu_comm).__name__ for pipe, _ in state._pipes.values() if pipe._ctx.gpu_comm}
    want = "TorchDeviceCommunicator" if (BACKEND == "nccl" or DIRECT) else "TorchHostStaged"
    assert kinds == {want}, (where, kinds)
    assert state.stats["bytes_sent"] == host.stats["bytes_sent"], (where, state.stats, host.stats)


def check_every_compressor_fp32(rank):
    for c in COMPRESSORS:
        compare(c, rank, torch.float32)


def check_bf16_model(rank):
    for c in (None, "bf16", "1bit"):
        compare(c, rank, torch.bfloat16)


def check_adam_correction(rank):
    for c, adam in (("1bit", {"freeze_iter": 2}), ("2bit", {"freeze_iter": 2, "clip": 0.05}),
                    ("1bit", {"betas": (0.8, 0.99), "eps": 1e-6})):
        compare(c, rank, torch.float32, steps=5, opts={"adam": adam})


def check_powersgd(rank):
    # float32 products of up to 40 terms, summed in another order: rounding, carried over
    # 4 steps through error feedback and the warm-started Q
    for r in (1, 2, 4):
        compare("powersgd", rank, torch.float32, steps=4, opts={"rank": r}, rtol=1e-4)


def main():
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    rank, size = gt.init_process_group(BACKEND)
    HOST_GROUP.append(dist.new_group(backend="gloo"))
    print(f"DEVICE {DEVICE} backend {BACKEND} emulated {EMULATED} rank {rank} of {size}", flush=True)
    names = sys.argv[3:] or [n for n in globals() if n.startswith("check_")]
    for name in names:
        globals()[name](rank)
        dist.barrier()
        print(f"CHECK {name} ok rank {rank}", flush=True)
    print(f"ALL OK rank {rank} of {size}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
