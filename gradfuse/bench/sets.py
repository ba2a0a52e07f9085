"""The gradient sets the benchmarks and the demo run on, and the timing loop they share."""
import json
import statistics
import sys
import time
from importlib import resources

import numpy as np

GB = 1e9


def resnet50_shapes():
    """The 193 float32 gradient shapes of MXNet's resnet50_v1 (25.6 M parameters)."""
    text = resources.files("gradfuse.data").joinpath("resnet50_v1_grads.json").read_text()
    return [tuple(t["shape"]) for t in json.loads(text)["tensors"]]


def small_shapes(n=2000, seed=0):
    """2000 tensors of 100-5000 float32 elements each."""
    rng = np.random.default_rng(seed)
    return [(int(s),) for s in rng.integers(100, 5001, n)]


SETS = {"resnet50": resnet50_shapes, "small": small_shapes}


def make_set(shapes, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def median_times(methods, rounds, sync=None, progress=None):
    times = {name: [] for name in methods}
    for r in range(rounds):
        for name, fn in methods.items():
            if sync:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            times[name].append(time.perf_counter() - t0)
        if progress:
            progress(r + 1, rounds)
    return {k: statistics.median(v) for k, v in times.items()}


def progress(label):
    def show(done, total):
        if done == total or done % max(1, total // 5) == 0:
            sys.stderr.write(f"  {label}: round {done}/{total}\n")
            sys.stderr.flush()
    return show

