"""Time random-k's position draw on ResNet-50's gradient shapes (all 193 tensors as one table),
beside np.copyto of the gradient bytes, in one process: python scripts/randomk_draw_time.py"""
import time
import numpy as np
from gradfuse import _core
from gradfuse.bench.sets import resnet50_shapes
from gradfuse.compressors.topk import ks_for
from gradfuse.compressors.randomk import step_seed

counts = np.array([int(np.prod(s)) for s in resnet50_shapes()], np.int64)
n = int(counts.sum())
ks = ks_for(0.01, counts)
idx = np.empty(int(ks.sum()), np.uint32)
src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
def best(f, r=30):
    t = []
    for _ in range(r):
        t0 = time.perf_counter(); f(); t.append(time.perf_counter() - t0)
    return min(t) * 1e3, float(np.median(t)) * 1e3
d = best(lambda: _core.randomk_indices(step_seed(0, 3, 0), counts, ks, idx))
c = best(lambda: np.copyto(dst, src))
print(f"ResNet-50: n={n} tensors={len(counts)} K={idx.size}")
print(f"randomk_indices (draw K positions): min {d[0]:.3f} ms, median {d[1]:.3f} ms")
print(f"np.copyto of the {4*n/1e6:.0f} MB gradients: min {c[0]:.2f} ms, median {c[1]:.2f} ms")
