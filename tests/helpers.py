"""Shared test helpers: random gradient sets and a subprocess runner with a hard limit."""
import os
import signal
import subprocess

import numpy as np

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
