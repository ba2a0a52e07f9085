"""Shared test helpers: random gradient sets and a subprocess runner with a hard limit."""
import os
import signal
import subprocess

import numpy as np

# float32 values that stress the kernels: casts' edges (fp16 max and its overflow point,
# subnormals of both formats), huge and tiny values, signed zeros
SPECIAL = np.array([0.0, -0.0, 65504, -65504, 65520, -65520, 1e5, -1e5, 6e-8, -6e-8, 1e-8,
                    -1e-8, 1e-40, -1e-40, 1.4e-45, -1.4e-45, 3e38, -3e38, 1.0, -1.0],
                   dtype=np.float32)
NONFINITE = np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32)


def gen(n, seed, kind="normal"):
    """``n`` float32 values of one kind: normal (random scale), zero, negzero, special
    (SPECIAL), nonfinite (normal with 1 % NaN/Inf) or bits (any 32-bit pattern)."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 100.0])).astype(np.float32)
    if kind == "zero":
        return np.zeros(n, np.float32)
    if kind == "negzero":
        return np.full(n, -0.0, np.float32)
    if kind == "special":
        return rng.choice(SPECIAL, n).astype(np.float32)
    if kind == "nonfinite":
        x = (rng.standard_normal(n)).astype(np.float32)
        if n:
            k = rng.integers(0, n, max(1, n // 100))
            x[k] = rng.choice(NONFINITE, len(k))
        return x
    if kind == "bits":        # arbitrary patterns: NaN payloads, subnormals, everything
        return rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    raise AssertionError(kind)


SHAPES = [(), (0,), (1,), (7,), (31,), (32,), (33,), (97,), (3, 5), (2, 0, 3), (64, 17), (1009,), (4, 4, 4)]
DTYPES = [np.float16, np.float32, np.float64]


def random_set(seed, rank=0, max_tensors=24, dtypes=DTYPES, integral=False):
    """A random tensor set whose names/shapes/dtypes depend on ``seed`` only, values on rank too."""
    meta = np.random.default_rng(seed)
    n = int(meta.integers(0, max_tensors + 1))
    shapes = [SHAPES[i] for i in meta.integers(0, len(SHAPES), n)]
    dts = [dtypes[i] for i in meta.integers(0, len(dtypes), n)]
    vals = np.random.default_rng([seed, rank])
    out = {}
    for i, (s, dt) in enumerate(zip(shapes, dts)):
        if integral:
            a = np.asarray(vals.integers(-50, 50, size=s), dtype=dt)
        else:
            a = np.asarray(vals.standard_normal(s) * 10, dtype=dt)
        out[f"t{i}.{np.dtype(dt).name}"] = a
    return out


def run_limited(cmd, timeout, env=None, cwd=None):
    """Run ``cmd`` in its own process group; kill the whole group at ``timeout`` seconds.

    Returns (returncode, output, timed_out). A hang is reported, never waited out.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return proc.returncode, out, True
