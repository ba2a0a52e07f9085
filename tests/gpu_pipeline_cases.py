"""Shared cases of the GPU pipeline tests (1 rank in tests/test_gpu_pipeline.py, several
ranks in tests/mpi/test_gpu_pipeline.py): the same step on numpy and on cupy arrays must
give the same bits, outputs and residuals, for every compressor."""
import numpy as np

import gradfuse

# (name, options): every built-in compressor, and the variants with their own code paths
COMPRESSORS = [
    ("none", {}),
    ("fp16", {}),
    ("fp16", {"predivide": True}),
    ("fp16", {"error_feedback": True}),
    ("fp16", {"sum16": "nccl"}),        # NCCL's own half sum where the data communicator is NCCL
    ("bf16", {}),
    ("1bit", {"algorithm": "allgather", "block_size": 64}),
    ("1bit", {"algorithm": "twophase", "block_size": 64}),
    ("2bit", {"threshold": 0.05}),
    ("2bit", {"algorithm": "allgather", "block_size": 64}),
    ("2bit", {"algorithm": "twophase", "block_size": 64}),
    ("topk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.05, "seed": 7}),
    ("randomk", {"ratio": 0.05, "seed": 7, "algorithm": "allreduce"}),   # the sparse allreduce job
]


def case_id(case):
    name, opts = case
    return name + "".join(f"-{k}={v}" for k, v in sorted(opts.items()))


def make_grads(rank, step, dtypes=True):
    """A dict of tensors: several float32 (fused and direct), and float16/float64 ones."""
    rng = np.random.default_rng(1000 * step + rank)
    g = {
        "conv1.w": rng.standard_normal((16, 3, 3, 3)).astype(np.float32),
        "conv1.b": rng.standard_normal(16).astype(np.float32),
        "fc.w": rng.standard_normal((40, 50)).astype(np.float32),        # 8000 B: direct at 4096
        "fc.b": (rng.standard_normal(50) * 1e-3).astype(np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.asarray(rng.standard_normal(), np.float32).reshape(()),
    }
    if dtypes:
        g["half"] = rng.standard_normal(33).astype(np.float16)
        g["double"] = rng.standard_normal(17).astype(np.float64)
    return g


def pipelines(name, opts, comm=None):
    cfg = dict(compress=name, fusion_threshold=4096, comm=comm, **opts)
    return gradfuse.Pipeline(**cfg), gradfuse.Pipeline(**cfg)


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def residuals(pipe):
    sd = pipe.state_dict()
    return {k: (v["residual"], v["server_residual"]) for k, v in sd["buckets"].items()}, sd["step"]


def run_steps(cp, name, opts, rank, comm=None, steps=3, mode="out"):
    """Run ``steps`` steps on the host and on the GPU; assert equal bits every step."""
    host, dev = pipelines(name, opts, comm)
    for step in range(steps):
        g = make_grads(rank, step)
        gd = {k: cp.asarray(v) for k, v in g.items()}
        if mode == "inplace":
            want = host.allreduce_(g)
            got = dev.allreduce_(gd)
            assert got is gd
        elif mode == "out":
            want = host.allreduce(g)
            outs = {k: cp.empty(v.shape, v.dtype) for k, v in g.items()}
            got = dev.allreduce(gd, out=outs)
            assert got is outs
        else:
            want = host.allreduce(g)
            got = dev.allreduce(gd)
        for k in g:
            assert isinstance(got[k], cp.ndarray), k
            w, d = want[k], got[k].get()
            assert same_bits(w, d), (name, opts, step, k, w.ravel()[:6], d.ravel()[:6])
        rh, sh = residuals(host)
        rd, sd = residuals(dev)
        assert sh == sd and sorted(rh) == sorted(rd)
        for key in rh:
            assert same_bits(rh[key][0], rd[key][0]) and same_bits(rh[key][1], rd[key][1]), (name, key)
    return host, dev
