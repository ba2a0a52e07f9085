#!/usr/bin/env python
"""Decode-and-sum speed of the 1-bit and scaled 2-bit kernels on ResNet-50's gradients
(102 MB, one table), p payloads, one core: median and best of ``--reps``.

    python scripts/decode_speed.py                 # p = 2, divisor 2 (averaging)
    python scripts/decode_speed.py --p 3 --reps 21

Where the kernels have ``gradfuse._core.set_stream_bytes`` (non-temporal stores for large
tensors, docs/compressors.md, "One write per element"), the streamed and the plain stores
are measured in turn (A B A B) in the same process; an older build prints one row.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    from gradfuse import _core
    from gradfuse.bench.sets import make_set, resnet50_shapes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=2, help="payloads (ranks) summed")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--block", type=int, default=512)
    args = ap.parse_args(argv)
    if args.p < 1 or args.reps < 1:
        ap.error("--p and --reps must be >= 1")
    g = make_set(resnet50_shapes(), 1)
    cnt = np.array([a.size for a in g], np.int64)
    ptrs = np.array([a.ctypes.data for a in g], np.int64)
    offs = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.int64)
    p, block = args.p, args.block
    rng = np.random.default_rng(0)
    nw1 = int(sum((c + 31) // 32 for c in cnt))
    nw2 = int(sum((c + 15) // 16 for c in cnt))
    nb = int(sum(-(-c // block) for c in cnt))
    bits = rng.integers(0, 1 << 32, size=(p, nw1), dtype=np.uint64).astype(np.uint32)
    codes = rng.integers(0, 1 << 32, size=(p, nw2), dtype=np.uint64).astype(np.uint32)
    scales = rng.random((p, nb), dtype=np.float32)
    divisor = float(p)

    def times(f):
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts), 1e3 * min(ts)

    setter = getattr(_core, "set_stream_bytes", None)
    modes = [("streamed", None), ("plain", 1 << 62)] * 2 if setter else [("this build", None)]
    rows = {}
    for label, threshold in modes:
        if setter:
            setter(threshold)
        one = times(lambda: _core.onebit_decompress_sum(bits, scales, block, ptrs, offs, cnt, 0, len(g), divisor))
        two = times(lambda: _core.twobit_block_decompress_sum(codes, scales, block, ptrs, offs, cnt, 0, len(g),
                                                              divisor))
        rows.setdefault(label, []).append((one, two))
    if setter:
        setter(None)
    total = cnt.sum() * 4
    print(f"ResNet-50 gradients ({total / 1e6:.1f} MB, {len(g)} tensors), p = {p}, block {block}, "
          f"{args.reps} reps; ms median / best")
    print("| stores | 1-bit | scaled 2-bit |\n|---|---:|---:|")
    for label, runs in rows.items():
        for one, two in runs:
            print(f"| {label} | {one[0]:.2f} / {one[1]:.2f} | {two[0]:.2f} / {two[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
