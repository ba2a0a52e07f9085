"""Speed of the two 2-bit CPU kernels (scaled and MXNet absolute) on 4M elements, one core,
best of 7: compress with error feedback, and decompress-and-sum of 2 payloads.

    python scripts/twobit_speed.py
"""
import time, numpy as np
from gradfuse import _core as core
n = 1 << 22
rng = np.random.default_rng(0)
x = rng.standard_normal(n).astype(np.float32); e = (rng.standard_normal(n) * 0.1).astype(np.float32)
eo = np.empty_like(e)
codes8 = np.empty((n + 3) // 4, np.uint8); codes = np.empty(n // 16, np.uint32); vals = np.empty(n // 512, np.float32)
def best(f, r=7):
    t = []
    for _ in range(r):
        t0 = time.perf_counter(); f(); t.append(time.perf_counter() - t0)
    return min(t)
ta = best(lambda: core.twobit_compress_array(x, e, eo, 0.5, codes8))
tb = best(lambda: core.twobit_block_compress_array(x, e, eo, 512, 1.0, codes, vals))
out = np.empty(n, np.float32)
C8 = np.stack([codes8, codes8]); C = np.stack([codes, codes]); V = np.stack([vals, vals])
da = best(lambda: core.twobit_decompress_sum_array(C8, 0.5, out, 2.0))
db = best(lambda: core.twobit_block_decompress_sum_array(C, V, 512, out, 2.0))
print(f"n = {n}: compress+EF absolute {ta*1e3:.2f} ms ({n*4/ta/1e9:.2f} GB/s), scaled {tb*1e3:.2f} ms ({n*4/tb/1e9:.2f} GB/s); "
      f"decompress-sum p=2 absolute {da*1e3:.2f} ms, scaled {db*1e3:.2f} ms")
