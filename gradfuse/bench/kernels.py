"""Local kernel benchmarks: fusion pack/unpack, the compressor kernels and the Adam
correction's passes, each beside ``np.copyto`` of the same bytes and the plain numpy
version of the same math."""
import numpy as np

from .sets import GB, SETS, make_set, median_times, progress


# --- fusion ---------------------------------------------------------------------------
def bench_fusion(rounds):
    from .. import _core
    from ..fusion.plan import aligned_empty
    rows = []
    for set_name, shapes_fn in SETS.items():
        arrays = make_set(shapes_fn(), 1)
        outs = [np.empty_like(a) for a in arrays]
        nb = np.array([a.nbytes for a in arrays], np.int64)
        off = np.concatenate([[0], np.cumsum(nb)[:-1]]).astype(np.int64)
        src = np.array([a.ctypes.data for a in arrays], np.int64)
        dst = np.array([a.ctypes.data for a in outs], np.int64)
        total = int(nb.sum())
        buf = aligned_empty(total)
        n = len(arrays)
        a_src = aligned_empty(total)
        a_dst = aligned_empty(total)
        a_src[:] = 1

        def pack_unpack():
            _core.pack(buf, src, off, nb, 0, n)
            _core.unpack(buf, dst, off, nb, 0, n)

        def copyto():
            np.copyto(a_dst, a_src)

        def numpy_concat():
            flat = np.concatenate([a.ravel() for a in arrays])
            offs = 0
            for o in outs:
                o.ravel()[:] = flat[offs:offs + o.size]
                offs += o.size

        pack_unpack()
        t = median_times({"pack+unpack": pack_unpack, "np.copyto": copyto, "numpy concat+split": numpy_concat},
                          rounds, progress=progress(f"fusion {set_name}"))
        assert all(np.array_equal(a, o) for a, o in zip(arrays, outs)), "pack/unpack corrupted data"
        gbs = {"pack+unpack": 4 * total / t["pack+unpack"] / GB,       # read+write, twice
               "np.copyto": 2 * total / t["np.copyto"] / GB,           # read+write, once
               "numpy concat+split": 4 * total / t["numpy concat+split"] / GB}
        rows.append((set_name, n, total, gbs))
    print(f"\n### fusion kernels: pack+unpack vs np.copyto ({rounds} rounds, median)\n")
    print("| set | tensors | MB | pack+unpack GB/s | np.copyto GB/s | ratio to copy | numpy concat+split GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for set_name, n, total, g in rows:
        print(f"| {set_name} | {n} | {total / 1e6:.1f} | {g['pack+unpack']:.2f} | {g['np.copyto']:.2f} | "
              f"{g['pack+unpack'] / g['np.copyto']:.2f}x | {g['numpy concat+split']:.2f} |")
    print("\nGB/s count bytes read plus bytes written: pack+unpack moves 4x the set's bytes, a copy 2x.")


# --- compressors -----------------------------------------------------------------------
def _numpy_baselines(n, seed=0):
    """Straightforward numpy versions of each compressor's math (speed baselines only)."""
    def onebit(g, e, block=512):
        c = g + e
        s = np.abs(c[: n - n % block].reshape(-1, block)).mean(axis=1)
        packed = np.packbits(c >= 0, bitorder="little")
        s_full = np.repeat(s, block)
        v = np.where(c[: s_full.size] >= 0, s_full, -s_full)
        e[: s_full.size] = c[: s_full.size] - v
        return packed, s

    def twobit(g, e, t=0.5):
        c = g + e
        q = np.where(c >= t, t, np.where(c <= -t, -t, 0)).astype(np.float32)
        codes = (c >= t).astype(np.uint8) | ((c <= -t).astype(np.uint8) << 1)
        packed = codes.reshape(-1, 4)
        packed = packed[:, 0] | (packed[:, 1] << 2) | (packed[:, 2] << 4) | (packed[:, 3] << 6)
        e[:] = c - q
        return packed

    def topk(g, e, ratio=0.01):
        c = g + e
        k = max(1, int(np.ceil(ratio * n)))
        idx = np.sort(np.argpartition(-np.abs(c), k)[:k])
        vals = c[idx]
        e[:] = c
        e[idx] = 0
        return vals, idx

    def randomk(g, e, ratio=0.01):
        c = g + e
        k = max(1, int(np.ceil(ratio * n)))
        idx = np.sort(np.random.default_rng(seed).choice(n, k, replace=False))
        vals = c[idx]
        e[:] = c
        e[idx] = 0
        return vals

    def bf16(g):
        u = g.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    return {"1bit": onebit, "2bit": twobit, "topk": topk, "randomk": randomk,
            "fp16": lambda g: g.astype(np.float16), "bf16": bf16}


def bench_compress(rounds, n=1 << 24):
    from .. import _core
    from ..compressors import BucketContext, create
    from ..fusion.plan import aligned_empty
    from ..step.exchange import Wire
    rng = np.random.default_rng(0)
    g = rng.standard_normal(n).astype(np.float32)
    table = (np.array([g.ctypes.data], np.int64), np.zeros(1, np.int64), np.array([n], np.int64), 0, 1)
    copy_src, copy_dst = aligned_empty(4 * n), aligned_empty(4 * n)
    copy_src[:] = 1
    base = _numpy_baselines(n)
    ctx = BucketContext(counts=(n,))
    rows = []
    for name, opts in [("fp16", {}), ("bf16", {}), ("1bit", {}), ("2bit", {}), ("topk", {}), ("randomk", {})]:
        comp = create(name, **opts)
        ef = comp.error_feedback
        e_in, e_out = (np.zeros(n, np.float32), np.zeros(n, np.float32)) if ef else (np.zeros(0, np.float32),) * 2
        wire = Wire(comp.bucket_layout(ctx))
        row = aligned_empty(wire.nbytes)
        payloads = wire.views(row)
        out = np.empty(n, np.float32)
        dst_table = (np.array([out.ctypes.data], np.int64), np.zeros(1, np.int64), np.array([n], np.int64), 0, 1)
        rows2d = [pl.reshape(1, -1) for pl in payloads]
        if comp.collective == "allreduce":
            def compress():
                comp.pack(table, payloads[0])
            touched = 4 * n + 2 * n
            def numpy_ref():
                base[name](g)
        else:
            def compress():
                comp.compress_table(table, e_in, e_out, payloads, ctx)
            touched = 4 * n * (3 if ef else 1) + wire.nbytes
            e_np = np.zeros(n, np.float32)
            def numpy_ref():
                base[name](g, e_np)

        def decompress():
            comp.decompress_sum_table(rows2d, dst_table, 1.0, ctx)

        def copy():
            np.copyto(copy_dst, copy_src)

        compress()
        t = median_times({"compress": compress, "decompress": decompress, "numpy": numpy_ref, "copy": copy},
                          rounds, progress=progress(f"compress {name}"))
        copy_bw = 2 * 4 * n / t["copy"]
        rows.append({
            "name": name, "ef": ef,
            "c_gbs": 4 * n / t["compress"] / GB, "d_gbs": 4 * n / t["decompress"] / GB,
            "vs_numpy": t["numpy"] / t["compress"],
            "vs_bw": (touched / t["compress"]) / copy_bw,
            "wire": (4 * n) / (wire.nbytes - 8),
            "touched_per_elem": touched / n,
        })
    print(f"\n### compressor kernels, one {4 * n / 1e6:.0f} MB float32 bucket ({rounds} rounds, median)\n")
    print("| compressor | error feedback | compress GB/s | decompress GB/s | compress vs numpy | "
          "compress vs memory-bandwidth limit | fp32 bytes / wire bytes |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {'yes' if r['ef'] else 'no'} | {r['c_gbs']:.2f} | {r['d_gbs']:.2f} | "
              f"{r['vs_numpy']:.1f}x | {r['vs_bw']:.2f}x | {r['wire']:.1f}x |")
    print("\nGB/s are gradient bytes (4 per element) per second. The bandwidth limit is the bytes the "
          "kernel must touch (gradient, residual read and written, payload) at np.copyto's speed in the "
          "same run; 1.00x means memory speed. numpy: the straightforward numpy version of the same math.")




# --- the Adam correction -------------------------------------------------------------------
def bench_adam(rounds):
    """The Adam correction's passes over the ResNet-50 set as one bucket (193 tensors, 1-bit
    blocks per tensor), each beside the memory-bandwidth limit of the bytes it must read and
    write (np.copyto's GB/s in the same run): the fused moment + error feedback + 1-bit pass,
    the same as two passes (moment, then 1-bit), the step after the exchange, plain Adam."""
    from .. import _core
    from ..compressors import BucketContext, create
    from ..fusion.plan import aligned_empty
    from .sets import resnet50_shapes
    arrays = make_set(resnet50_shapes(), 1)
    counts = np.array([a.size for a in arrays], np.int64)
    n = int(counts.sum())
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    ptrs = np.array([a.ctypes.data for a in arrays], np.int64)
    k = len(arrays)
    rng = np.random.default_rng(2)

    def f32(scale=1.0):
        a = aligned_empty(4 * n).view(np.float32)
        a[:] = rng.standard_normal(n).astype(np.float32) * np.float32(scale)
        return a
    m, r, e_in, e_out, x, v = f32(0.1), np.abs(f32(10.0)), f32(0.01), f32(), f32(), f32() ** 2
    mask = (rng.random(n) > 0.01).astype(np.uint8)
    comp = create("1bit")
    ctx = BucketContext(counts=tuple(counts.tolist()))
    (wdt, nw), (sdt, ns) = comp.bucket_layout(ctx)
    bits, scales = np.zeros(nw, np.uint32), np.zeros(ns, np.float32)
    payload = 4 * nw + 4 * ns
    b1, c1 = 0.9, float(np.float32(1) - np.float32(0.9))
    copy_src, copy_dst = aligned_empty(4 * n), aligned_empty(4 * n)
    copy_src[:] = 1
    saved = [a.copy() for a in arrays]

    def restore():
        for a, s in zip(arrays, saved):
            np.copyto(a, s)

    methods = {
        "fused": (lambda: _core.adam_onebit_compress(ptrs, offsets, counts, 0, k, m, r, b1, c1, e_in, e_out, 512,
                                                      bits, scales), 4 * n * 5 + payload),
        "two passes": (lambda: (_core.adam_moment(ptrs, offsets, counts, 0, k, m, r, b1, c1, x),
                                comp.compress_table((np.array([x.ctypes.data + 4 * int(o) for o in offsets],
                                                              np.int64), offsets, counts, 0, k),
                                                    e_in, e_out, [bits, scales], ctx)), 4 * n * 7 + payload),
        "apply": (lambda: _core.adam_apply(ptrs, offsets, counts, 0, k, x, mask, 0.5), 4 * n * 3 + n),
        "plain": (lambda: _core.adam_plain(ptrs, offsets, counts, 0, k, x, v, b1, c1, 0.999, 0.001, 1.0, 1.0,
                                           1e-8), 4 * n * 6),
    }
    timed = {name: fn for name, (fn, _) in methods.items()}
    timed["copy"] = lambda: np.copyto(copy_dst, copy_src)
    timed["restore"] = restore        # apply/plain overwrite the gradients: put them back each round
    for fn in timed.values():
        fn()
    t = median_times(timed, rounds, progress=progress("compress adam"))
    copy_bw = 2 * 4 * n / t["copy"]
    print(f"\n### the Adam correction's passes, ResNet-50 set as one bucket ({k} tensors, {n / 1e6:.1f} M elements, "
          f"{4 * n / 1e6:.0f} MB; {rounds} rounds, median)\n")
    print("| pass | bytes read + written per element | time (ms) | GB/s of those bytes | "
          "vs memory-bandwidth limit |")
    print("|---|---:|---:|---:|---:|")
    for name, (_, touched) in methods.items():
        gbs = touched / t[name] / GB
        print(f"| {name} | {touched / n:.2f} | {1e3 * t[name]:.1f} | {gbs:.2f} | {touched / t[name] / copy_bw:.2f}x |")
    print(f"| np.copyto | 8.00 | {1e3 * t['copy']:.1f} | {copy_bw / GB:.2f} | 1.00x |")
    print("\nfused: the moment b1 m + (c1 g) r, error feedback and 1-bit in one pass (reads g, m, r, e; writes e "
          "and the payload); two passes: the moment into a work array, then 1-bit's own kernel; apply: after the "
          "exchange, m and the step (reads the outputs and the mask, writes m and the outputs); plain: exact Adam "
          "(reads g, m, v; writes m, v, the step). The limit: those bytes at np.copyto's speed in the same run.")
