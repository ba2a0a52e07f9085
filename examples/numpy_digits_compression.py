"""Data-parallel softmax regression on scikit-learn's digits, with any gradfuse compressor.

A compression-accuracy experiment that needs no framework: each rank trains on its shard
of the training set, gradients are averaged with ``gradfuse.Pipeline``, and the test
accuracy is printed per epoch, so compressors can be compared side by side.

    mpiexec -n 2 python examples/numpy_digits_compression.py --compress 1bit
    mpiexec -n 2 python examples/numpy_digits_compression.py --compress all   # table of all
    mpiexec -n 2 python examples/numpy_digits_compression.py --compress all --device gpu

For compressors compared at the settings people train with (Gluon models, momentum 0.9,
5 paired seeds, confidence intervals, plots), use the experiment runner instead:
``gradfuse-experiments`` (docs/experiments.md).

``--device gpu`` keeps the model, the data and the gradients on the GPU as cupy arrays
(rank r uses GPU ``local_rank % device count``); the same Pipeline reduces them with the
CUDA kernels and NCCL (or MPI through host memory where NCCL cannot run, e.g. two ranks
on one GPU).
"""
import argparse

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import gradfuse


def softmax_grads(xp, W, b, X, y):
    z = X @ W + b
    z -= z.max(axis=1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[xp.arange(len(y)), y] -= 1.0
    p /= len(y)
    return (X.T @ p).astype(np.float32), p.sum(axis=0).astype(np.float32)


def train(xp, compress, epochs, lr, batch, rank, size, data, verbose):
    Xtr, Xte, ytr, yte = (xp.asarray(a) for a in data)
    shard = slice(rank, None, size)
    X, y = Xtr[shard], ytr[shard]
    rng = np.random.default_rng(0)                      # same init on every rank
    W = xp.asarray((rng.standard_normal((64, 10)) * 0.01).astype(np.float32))
    b = xp.zeros(10, np.float32)
    pipe = gradfuse.Pipeline(compress=compress)
    order_rng = np.random.default_rng(rank)
    steps = len(y) // batch
    acc = 0.0
    for epoch in range(epochs):
        perm = order_rng.permutation(len(y))
        for s in range(steps):
            idx = perm[s * batch:(s + 1) * batch]
            idx = xp.asarray(idx)
            gW, gb = softmax_grads(xp, W, b, X[idx], y[idx])
            avg = pipe.allreduce({"W": gW, "b": gb})   # averaged across ranks
            W -= lr * avg["W"]
            b -= lr * avg["b"]
        acc = float(xp.mean((Xte @ W + b).argmax(axis=1) == yte))
        if verbose:
            print(f"  [{compress}] epoch {epoch + 1}/{epochs}: test accuracy {acc:.4f}", flush=True)
    return acc, pipe.stats.bytes_sent / max(pipe.stats.steps, 1), W


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compress", default="none", help="a compressor name, or 'all'")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    args = ap.parse_args()
    gradfuse.init()
    rank, size = gradfuse.rank(), gradfuse.size()
    xp = np
    if args.device == "gpu":
        import cupy as xp
        xp.cuda.Device(gradfuse.local_rank() % xp.cuda.runtime.getDeviceCount()).use()
    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    data = train_test_split(X, digits.target, test_size=0.25, random_state=0)
    names = gradfuse.compressors.available() if args.compress == "all" else [args.compress]
    results = []
    for name in names:
        acc, sent, W = train(xp, name, args.epochs, args.lr, args.batch, rank, size, data, rank == 0)
        # every rank must hold the same model: compare a checksum
        from mpi4py import MPI
        W = W if isinstance(W, np.ndarray) else W.get()
        same = len(set(MPI.COMM_WORLD.allgather(W.tobytes()))) == 1
        results.append((name, acc, sent, same))
    if rank == 0:
        print(f"\n{size} rank(s) on {args.device}, {args.epochs} epochs, batch {args.batch} per rank, "
              f"lr {args.lr}")
        # Pipeline.stats.bytes_sent: compressed payloads as sent; 'none' (an fp32 allreduce by the
        # MPI library) as a bandwidth-optimal allreduce's 2(p-1)/p x the gradient bytes
        print("| compressor | test accuracy | bytes sent per step per rank | model identical on all ranks |")
        print("|---|---:|---:|---|")
        for name, acc, sent, same in results:
            print(f"| {name} | {acc:.4f} | {sent:.0f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
