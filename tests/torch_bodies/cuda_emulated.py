"""The hook's CUDA bucket path on the kernel emulator (tests/test_torch_cuda_emulated.py runs it
under torchrun with GRADFUSE_GPU_EMULATOR=1; no GPU, no CUDA build of torch).

CPU tensors stand in for device tensors: ``gradfuse.torch.device.BRIDGE`` is replaced by
``EmulatorBridge``, which calls the buckets "on the GPU", keeps the real DLPack intake
(``cupy.from_dlpack``, here the emulator's cupy over the tensor's memory), and hands the
data plane's buffers back to torch as CPU tensors (where a GPU's ``torch.from_dlpack``
gives CUDA tensors), so torch's collectives run on gloo in both data-plane modes: direct
(``TorchDeviceCommunicator``, NCCL's role) and host-staged (``TorchHostStaged``). Everything
between them is the real GPU path: cupy views of the bucket, the Pipeline's CudaBackend,
the CUDA kernels of cuda/ (on the SIMT emulator), the device communicator chosen through
``device_communicator``, the future.

Checks: for every compressor that exists (none, fp16, bf16, 1bit, 2bit, topk, randomk;
the lossy ones with DGC momentum 0.9) and both modes, a few DDP steps on the "device" path
leave parameters bit-identical to the host path's, the step ran on the CudaBackend, and
the device communicator was the expected one; a bf16 model too (none, bf16, 1bit).
Every rank prints ``CHECK <name> ok rank <r>`` and finally ``ALL OK rank <r> of <p>``.
"""
import contextlib
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "cuda_emu"))
import fakecupy  # noqa: E402

fakecupy.install()

import gradfuse.torch as gt  # noqa: E402
from gradfuse.torch import device as gdev  # noqa: E402

COMPRESSORS = (None, "fp16", "bf16", "1bit", "2bit", "topk", "randomk")


class EmulatorBridge(gdev.Bridge):
    """The emulator's stand-ins where a GPU has CUDA tensors and streams (see the module docstring)."""

    def __init__(self, direct):
        self._direct = direct
        self.device_steps = 0
        self.comms = set()

    def is_device(self, tensor):
        return True

    def device_index(self, tensor):
        return 0

    def to_torch(self, arr):
        self.comms.add("direct")
        return torch.from_numpy(np.asarray(arr))

    def cupy_stream(self, tensor):
        self.device_steps += 1
        return fakecupy.cuda.Stream()

    def torch_stream(self, device):
        return contextlib.nullcontext()

    def future(self, tensor):
        return torch.futures.Future()

    def direct(self, group):
        return self._direct


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 10)).to(dtype)


def run(compress, rank, dtype=torch.float32, steps=3):
    m = model(dtype)
    ddp = DDP(m, bucket_cap_mb=0.002)
    opts = {"momentum": 0.9} if compress not in (None, "fp16", "bf16") else {}
    state = gt.CompressionState(compress, module=m, **opts)
    ddp.register_comm_hook(state, gt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + 100 * rank)
    for _ in range(steps):
        x, y = torch.randn(8, 24, generator=g).to(dtype), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(ddp(x).float(), y).backward()
        opt.step()
    return torch.cat([p.detach().float().reshape(-1) for p in m.parameters()]), state


def _device_run(compress, rank, direct, dtype=torch.float32):
    bridge = EmulatorBridge(direct)
    real, gdev.BRIDGE = gdev.BRIDGE, bridge
    try:
        p, state = run(compress, rank, dtype)
    finally:
        gdev.BRIDGE = real
    kinds = {type(pipe._ctx.gpu_comm).__name__ for pipe, _ in state._pipes.values() if pipe._ctx.gpu_comm}
    return p, state, bridge, kinds


def _check_modes(rank, dtype, compressors):
    for compress in compressors:
        host, hstate = run(compress, rank, dtype)
        assert not any(pipe._ctx.gpu_comm for pipe, _ in hstate._pipes.values()), "the host run used a GPU comm"
        for direct, want in ((True, "TorchDeviceCommunicator"), (False, "TorchHostStaged")):
            dev, state, bridge, kinds = _device_run(compress, rank, direct, dtype)
            where = f"{compress} ({dtype}, {'direct' if direct else 'host-staged'})"
            assert bridge.device_steps == state.calls > 0, (where, bridge.device_steps, state.calls)
            assert kinds == {want}, (where, kinds)
            if direct and dist.get_world_size() > 1:
                assert bridge.comms == {"direct"}, where
            assert torch.equal(dev, host), f"{where}: the device path differs from the host path by " \
                f"{float((dev - host).abs().max())}"
            assert state.stats["bytes_sent"] == hstate.stats["bytes_sent"], (where, state.stats, hstate.stats)


def check_every_compressor_on_the_device_path(rank):
    _check_modes(rank, torch.float32, COMPRESSORS)


def check_bf16_model_on_the_device_path(rank):
    _check_modes(rank, torch.bfloat16, (None, "bf16", "1bit"))


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
