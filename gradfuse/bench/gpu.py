"""GPU kernel benchmark: GB/s beside a device-to-device copy of the same bytes, in one run.

    python -m gradfuse.bench gpu [--mb 256] [--repeat 20] [--out gpu_bench.md]

Every kernel runs on a bucket of ``--mb`` MB of float32 (default 256 MB, 64 Mi elements)
and is timed with CUDA events (median of ``--repeat`` runs after warm-up). "GB/s" counts
the bytes the kernel must read and write once (e.g. 1-bit compress with error feedback:
g and e_in read, e_out, bits and scales written); "% copy" compares that with a
device-to-device copy (``cupy.copyto``, bytes read + written) measured in the same run.
The 1-bit compress with error feedback is also compared with the same math written with
cupy array ops and ``cupy.packbits`` (targets: >= 50 % of copy, >= 5x cupy).

``--pipeline`` adds a second table: one ``gradfuse.Pipeline`` step on the ResNet-50
gradient set (193 float32 tensors, 25.6 M elements) on the GPU and on the host, per
compressor, one rank (so the time is the pipeline's own work: pack, compress, decode,
write back), beside a D2D copy of the same gradients.

Prints a markdown table; ``--out`` (or ``$OUT/gpu_bench.md`` when ``OUT`` is set) also
writes it to a file.
"""
import argparse
import os
import statistics
import sys

import numpy as np


def _time(cp, fn, repeat, warmup=3):
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeat):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(times)


def cupy_onebit_ef(cp, g, e, block):
    """The 1-bit + error feedback math with cupy array ops (not the canonical order: the
    baseline a user would write)."""
    n = g.size
    c = g + e
    nb = -(-n // block)
    pad = nb * block - n
    a = cp.abs(c)
    if pad:
        a = cp.concatenate([a, cp.zeros(pad, cp.float32)])
    counts = cp.full(nb, block, cp.float32)
    counts[-1] = n - (nb - 1) * block
    s = a.reshape(nb, block).sum(axis=1) / counts
    bit = c >= 0
    bits = cp.packbits(bit, bitorder="little")
    sj = cp.repeat(s, block)[:n]
    e_out = c - cp.where(bit, sj, -sj)
    return bits, s, e_out


def _table_lines(emit):
    """(lines, out): ``out(*lines)`` keeps each line and hands it to ``emit`` at once, so a
    run cut short has already passed on the rows it finished."""
    lines = []

    def out(*new):
        for line in new:
            lines.append(line)
            if emit is not None:
                emit(line)
    return lines, out


def run(mb=256, repeat=20, block=512, p=4, emit=None):
    """The kernel table; each line goes to ``emit`` as soon as it is measured."""
    from .. import gpu
    if not gpu.available():
        raise SystemExit("bench_gpu: no CUDA device visible to cupy")
    cp = gpu.cupy()
    gpu.compile_all()
    n = (mb << 20) // 4
    rng = cp.random.default_rng(0)
    g = rng.standard_normal(n, dtype=cp.float32)
    e_in = (rng.standard_normal(n, dtype=cp.float32) * cp.float32(0.01))
    e_out = cp.empty_like(g)
    dst = cp.empty_like(g)
    nw, nb = -(-n // 32), -(-n // block)
    bits = cp.empty(nw, cp.uint32)
    scales = cp.empty(nb, cp.float32)
    codes = cp.empty(-(-n // 4), cp.uint8)
    h16 = cp.empty(n, cp.uint16)
    bad = cp.zeros(1, cp.uint64)
    cnt = cp.zeros(2, cp.uint64)
    empty = cp.zeros(0, cp.float32)
    F = 4 * n
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    lines, out = _table_lines(emit)
    out(f"GPU kernels on {gpu_name}, bucket {mb} MB float32 ({n} elements), median of {repeat} "
        f"(cupy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()})",
        "",
        "| kernel | bytes moved (MB) | time (ms) | GB/s | % of D2D copy | x cupy ops |",
        "|---|---:|---:|---:|---:|---:|")

    def row(label, nbytes, t, t_ref):
        bw = nbytes / t
        ratio = f"{t_ref / t:.1f}" if t_ref else ""
        out(f"| {label} | {nbytes / 1e6:.0f} | {t * 1e3:.3f} | {bw / 1e9:.0f} | "
            f"{100 * bw / bw_copy:.0f} % | {ratio} |")

    t_copy = _time(cp, lambda: cp.copyto(dst, g), repeat)
    bw_copy = 2 * F / t_copy
    row("D2D copy (cupy.copyto)", 2 * F, t_copy, None)

    # pack / unpack: the bucket as 1024 tensors of mixed sizes, through the device table
    sizes = np.random.default_rng(1).integers(1, 2 * n // 1024, 1024)
    sizes = (sizes * (n / sizes.sum())).astype(np.int64)
    sizes[-1] += n - sizes.sum()
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    ptrs = (np.int64(dst.data.ptr) + offs * 4).astype(np.int64)
    # resident host tables, as the Pipeline keeps them: uploaded once, validated on the
    # host, no device read per call (a cupy table costs a small D2H read for the geometry)
    tp, to, tb = gpu.resident(ptrs), gpu.resident(offs * 4), gpu.resident(sizes * 4)
    buf8 = g.view(cp.uint8)
    hi = len(sizes)
    row("pack, 1024 tensors", 2 * F,
        _time(cp, lambda: gpu.pack(buf8, tp, to, tb, 0, hi), repeat), None)
    row("unpack, 1024 tensors", 2 * F,
        _time(cp, lambda: gpu.unpack(buf8, tp, to, tb, 0, hi), repeat), None)
    row("unpack + divide (f32)", 2 * F,
        _time(cp, lambda: gpu.unpack_div_f32(buf8, tp, to, tb, 0, hi, 3.0), repeat), None)

    for fmt, name in ((1, "fp16"), (2, "bf16")):
        row(f"cast f32 -> {name} (+counts)", F + F // 2,
            _time(cp, lambda: gpu.cast_to16(fmt, g, h16, 1.0, count_out=cnt), repeat), None)
        row(f"cast {name} -> f32, / 3", F + F // 2,
            _time(cp, lambda: gpu.cast_from16(fmt, h16, dst, 3.0), repeat), None)

    ob_bytes = 3 * F + 4 * nw + 4 * nb
    t_ob = _time(cp, lambda: gpu.onebit_compress_array(g, e_in, e_out, block, bits, scales, count_out=bad), repeat)
    t_cupy = _time(cp, lambda: cupy_onebit_ef(cp, g, e_in, block), max(3, repeat // 4), warmup=1)
    row(f"1-bit compress + EF (B={block})", ob_bytes, t_ob, t_cupy)
    row("  same math in cupy ops + packbits", ob_bytes, t_cupy, None)
    row(f"1-bit compress, no EF", F + 4 * nw + 4 * nb,
        _time(cp, lambda: gpu.onebit_compress_array(g, empty, empty, block, bits, scales, count_out=bad),
              repeat), None)
    for blk in (2048,):
        nb2 = -(-n // blk)
        sc2 = cp.empty(nb2, cp.float32)
        row(f"1-bit compress + EF (B={blk}, re-reading path)", 3 * F + 4 * nw + 4 * nb2,
            _time(cp, lambda: gpu.onebit_compress_array(g, e_in, e_out, blk, bits, sc2, count_out=bad),
                  repeat), None)
    bits_p = cp.tile(bits, (p, 1))
    scales_p = cp.tile(scales, (p, 1))
    row("1-bit decompress-sum, p=1", F + 4 * nw + 4 * nb,
        _time(cp, lambda: gpu.onebit_decompress_sum_array(bits[None, :], scales[None, :], block, dst, 1.0),
              repeat), None)
    row(f"1-bit decompress-sum, p={p}, / {p}", F + p * (4 * nw + 4 * nb),
        _time(cp, lambda: gpu.onebit_decompress_sum_array(bits_p, scales_p, block, dst, float(p)),
              repeat), None)
    row("2-bit compress + EF", 3 * F + F // 16,
        _time(cp, lambda: gpu.twobit_compress_array(g, e_in, e_out, 0.5, codes, count_out=bad), repeat),
        None)
    codes_p = cp.tile(codes, (p, 1))
    row(f"2-bit decompress-sum, p={p}, / {p}", F + p * F // 16,
        _time(cp, lambda: gpu.twobit_decompress_sum_array(codes_p, 0.5, dst, float(p)), repeat), None)

    ob_pct = 100 * (ob_bytes / t_ob) / bw_copy
    out("", f"1-bit compress + EF: {ob_pct:.0f} % of copy bandwidth (target >= 50 %), "
        f"{t_cupy / t_ob:.1f}x the cupy version (target >= 5x): "
        f"{'MET' if ob_pct >= 50 and t_cupy / t_ob >= 5 else 'NOT MET'}")
    return "\n".join(lines)


def _wall(fn, repeat, warmup=2):
    import time
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


PIPELINE_COMPRESSORS = ("none", "fp16", "bf16", "1bit", "2bit", "topk", "randomk")


def run_pipeline(repeat=10, compressors=PIPELINE_COMPRESSORS, shapes=None, emit=None):
    """Pipeline step on the ResNet-50 set (or ``shapes``), GPU vs host, one rank
    (``allreduce`` into preallocated outputs; every GPU step ends with a stream
    synchronize). Each table line goes to ``emit`` as soon as it is measured, so a run
    cut short keeps the rows it finished; returns the whole table."""
    from ..pipeline import Pipeline
    from .sets import resnet50_shapes
    from ..comm.single import SingleProcessCommunicator
    from .. import gpu
    cp = gpu.cupy()
    comm = SingleProcessCommunicator()
    rng = np.random.default_rng(0)
    set_name = "ResNet-50 gradients" if shapes is None else "gradients"
    shapes = resnet50_shapes() if shapes is None else shapes
    lines, out = _table_lines(emit)
    host = {f"g{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    host_out = {k: np.empty_like(v) for k, v in host.items()}
    dev = {k: cp.asarray(v) for k, v in host.items()}
    dev_out = {k: cp.empty_like(v) for k, v in dev.items()}
    n = sum(v.size for v in host.values())
    flat, flat2 = cp.empty(n, cp.float32), cp.empty(n, cp.float32)
    t_copy = _time(cp, lambda: cp.copyto(flat2, flat), repeat)
    out(f"Pipeline step on {set_name} ({len(shapes)} float32 tensors, {n} elements, "
        f"{4 * n / 1e6:.0f} MB), one rank, median of {repeat}; D2D copy of the same bytes: "
        f"{t_copy * 1e3:.3f} ms", "",
        "| compressor | GPU step (ms) | host step (ms) | host / GPU | GPU step / D2D copy | same bits |",
        "|---|---:|---:|---:|---:|---|")
    for name in compressors:
        pd = Pipeline(compress=name, comm=comm)
        ph = Pipeline(compress=name, comm=comm)
        t_dev = _wall(lambda: pd.allreduce(dev, out=dev_out), repeat)
        t_host = _wall(lambda: ph.allreduce(host, out=host_out), max(3, repeat // 3))
        # both pipelines ran the same number of steps on the same gradients? compare one more
        pd2 = Pipeline(compress=name, comm=comm)
        ph2 = Pipeline(compress=name, comm=comm)
        a = pd2.allreduce(dev)
        b = ph2.allreduce(host)
        same = all(np.array_equal(a[k].get().view(np.uint32), b[k].view(np.uint32)) for k in host)
        out(f"| {name} | {t_dev * 1e3:.2f} | {t_host * 1e3:.2f} | {t_host / t_dev:.1f} | "
            f"{t_dev / t_copy:.1f} | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradfuse.bench gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--out", default=None)
    ap.add_argument("--pipeline", action="store_true", help="also time Pipeline steps on ResNet-50 (GPU vs host)")
    ap.add_argument("--only-pipeline", action="store_true", help="only the Pipeline table")
    args = ap.parse_args(argv)
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], "gpu_bench.md")
    # every table, and every Pipeline row, is printed and written as soon as it is
    # measured: a run stopped by a time limit keeps what it finished
    sink = open(out, "w") if out else None

    def emit(text):
        print(text, flush=True)
        if sink is not None:
            sink.write(text + "\n")
            sink.flush()

    try:
        if not args.only_pipeline:
            run(args.mb, args.repeat, args.block, emit=emit)
        if args.pipeline or args.only_pipeline:
            if not args.only_pipeline:
                emit("")
            run_pipeline(max(3, args.repeat // 2), emit=emit)
    finally:
        if sink is not None:
            sink.close()
            print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
