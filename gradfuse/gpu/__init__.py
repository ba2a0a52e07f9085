"""GPU kernels of gradfuse: the CUDA twins of ``gradfuse._core``, loaded through cupy.

The kernels live in ``cuda/*.cu`` (package data ``gradfuse.cuda``), one file per family:
``pack.cu``, ``cast.cu``, ``onebit.cu``, ``twobit.cu``, ``sparse.cu``. Each file is
compiled at run time by NVRTC (the one cupy loads) with exactly ``OPTIONS`` (no FMA
contraction, IEEE division, no flush to zero) for the device's architecture, kept in
cupy's kernel cache directory, and loaded with ``cupy.RawModule(path=...)`` once per
device; ``compile_all()`` then checks on the device that subnormals survive.

Contract (same as the CPU kernels, see docs/compressors.md and docs/gpu.md): the same
arguments give the same bits as ``gradfuse._core``; Python validates and allocates, the
kernels loop. Arrays are cupy arrays on the current device (C-contiguous, exact dtypes).
Tables (pointers, offsets, counts) may be numpy or cupy int64 arrays: numpy tables are
validated like the CPU ones and uploaded; cupy tables are used as they are (the caller
validated them once, e.g. when the plan was made) and cost one small device read for the
launch geometry.

Functions that return a count (non-finite blocks, overflow/underflow) synchronise to
read it, unless ``count_out`` (a cupy uint64 array of 1, or 2 for casts) is given: the
kernel then adds into it (it is zeroed first) and the function returns it without
waiting, so the count can stay on the device (e.g. as a wire header).

Importing this module does not import cupy; ``available()`` says whether the GPU path
can run at all.

This code has NOT run on a GPU yet: it compiles (nvcc sm_80/sm_90, NVRTC) and imports,
and ``tests/test_gpu_kernels.py`` / ``scripts/gpu_check.sh`` are ready for the first run.
"""
import hashlib
import math
import os
import tempfile

import numpy as np

# Installed, cuda/ ships as gradfuse.cuda: a namespace package (no __init__.py) holding the
# .cu files. The repository's cuda/ must not be a regular package: run from a checkout
# (the repository root on sys.path), it would shadow NVIDIA's `cuda` namespace
# (cuda.pathfinder, cuda.bindings), and cupy 14 could not be imported.
try:
    from .. import cuda as _cuda
    _PKG_DIRS = [str(d) for d in _cuda.__path__]
except ImportError:                        # a source checkout built in place
    _PKG_DIRS = []

_CUDA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cuda")


def _checkout_file(name):
    """``cuda/<name>`` of the source checkout this package was imported from, if any."""
    root = os.path.dirname(_CUDA_DIR)
    path = os.path.join(_CUDA_DIR, name)
    if os.path.exists(os.path.join(root, "pyproject.toml")) and os.path.exists(path):
        return path
    return None


PRELUDE = "common.cuh"


def source(name):
    """The compilable text of kernel file ``name`` (``"onebit.cu"``).

    A ``.cu`` file comes with the shared prelude ``cuda/common.cuh`` (types, the table
    cursor) in front of it and a ``#line`` directive, so compiler messages still point
    into the ``.cu`` file.
    """
    text = _read(name)
    if name.endswith(".cu"):
        text = _read(PRELUDE) + f'\n#line 1 "{name}"\n' + text
    return text


def _read(name):
    """Text of one file of ``cuda/``.

    In a source checkout (``setup.py build_ext --inplace``, as scripts/gpu_check.sh
    builds) the checkout's own ``cuda/``: an editable install of another checkout must
    not supply the kernels. Otherwise the package data in ``gradfuse.cuda``.
    """
    path = _checkout_file(name) or next(
        (os.path.join(d, name) for d in _PKG_DIRS if os.path.exists(os.path.join(d, name))), None)
    if path is None:
        raise FileNotFoundError(f"kernel source {name!r} not found (no gradfuse.cuda package data, "
                                f"no checkout at {_CUDA_DIR})")
    with open(path) as f:
        return f.read()

# --fmad=false: no contraction of a*b+c into an FMA (the CPU build uses
# -ffp-contract=off); --prec-div=true: IEEE division; --ftz=false: keep subnormals.
# The kernels use the _rn intrinsics anyway, which are never contracted.
OPTIONS = ("--fmad=false", "-std=c++14", "--ftz=false", "--prec-div=true")

FAMILIES = {
    "pack": ("gf_pack", "gf_unpack", "gf_unpack_div_f32", "gf_div_f32"),
    "cast": ("gf_cast_to16", "gf_cast_from16", "gf_pack_cast", "gf_unpack_cast", "gf_sum16"),
    "onebit": ("gf_onebit_compress_array", "gf_onebit_compress_table",
               "gf_onebit_decompress_sum_array", "gf_onebit_decompress_sum_table"),
    "twobit": ("gf_twobit_compress_array", "gf_twobit_compress_table",
               "gf_twobit_decompress_sum_array", "gf_twobit_decompress_sum_table"),
    "sparse": ("gf_sparse_check", "gf_sparse_add_array", "gf_sparse_add_table", "gf_sparse_add_serial",
               "gf_sparse_rows", "gf_sparse_div_array",
               "gf_sp_pass1", "gf_sp_hist", "gf_sp_select", "gf_sp_count", "gf_sp_scan", "gf_sp_write",
               "gf_sp_pick", "gf_sp_iota"),
}

THREADS = 256          # every kernel assumes a multiple of 32 (full warps)
OB_WARPS = THREADS // 32

_cp = None
_MODULES = {}          # (device id, family) -> cupy.RawModule
_FUNCS = {}            # (device id, kernel name) -> cupy.RawKernel
_SMS = {}              # device id -> multiprocessor count

_I64 = np.int64
_F32 = np.float32


def cupy():
    """Import cupy on first use (``import gradfuse`` never does)."""
    global _cp
    if _cp is None:
        import cupy as cp
        _cp = cp
    return _cp


def available():
    """True when cupy imports and sees at least one CUDA device."""
    try:
        cp = cupy()
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _device():
    return cupy().cuda.runtime.getDevice()


def arch_option(cc, supported):
    """NVRTC's ``-arch`` for a device of compute capability ``cc`` (e.g. 90): its own
    machine code (``sm_90``, a cubin) when this NVRTC knows the device, else PTX for the
    newest virtual architecture not above it (the driver finishes it). Returns
    (option, "cubin" | "ptx")."""
    if cc in supported:
        return f"-arch=sm_{cc}", "cubin"
    lower = [a for a in supported if a <= cc]
    if not lower:
        raise RuntimeError(f"NVRTC supports architectures {sorted(supported)}, none of them at or "
                           f"below this device's compute capability {cc}")
    return f"-arch=compute_{max(lower)}", "ptx"


def compile_family(family, cc):
    """Compile ``cuda/<family>.cu`` with NVRTC for compute capability ``cc``, with exactly
    ``OPTIONS``; returns (binary bytes, "cubin" | "ptx").

    Not ``cupy.RawModule(code=...)``: cupy appends ``-ftz=true`` after the caller's
    options (``cupy/cuda/compiler.py``, cupy issue #9576), the later flag wins, and every
    ``_rn`` intrinsic would then flush subnormals to zero, which the CPU kernels do not.
    So gradfuse calls the NVRTC that cupy loads (``cupy.cuda.nvrtc``) itself and gives
    ``RawModule`` the binary (``module()``).
    """
    nv = cupy().cuda.nvrtc
    option, kind = arch_option(int(cc), tuple(int(a) for a in nv.getSupportedArchs()))
    name = family + ".cu"
    prog = nv.createProgram(source(name), name, [], [])
    try:
        try:
            nv.compileProgram(prog, list(OPTIONS) + [option])
        except nv.NVRTCError as e:
            raise RuntimeError(f"NVRTC {'.'.join(map(str, nv.getVersion()))} could not compile "
                               f"cuda/{name} ({option}, {' '.join(OPTIONS)}): {e}\n"
                               f"{nv.getProgramLog(prog)}") from None
        return (nv.getCUBIN(prog) if kind == "cubin" else nv.getPTX(prog)), kind
    finally:
        nv.destroyProgram(prog)


def _cache_dir():
    """Where compiled modules are kept between processes: cupy's kernel cache directory
    (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), else the temporary directory."""
    for d in (os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache"),
              os.path.join(tempfile.gettempdir(), "gradfuse-kernels")):
        try:
            os.makedirs(d, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise RuntimeError("no writable directory for compiled GPU kernels (set CUPY_CACHE_DIR)")


def module_path(family, cc):
    """The compiled module of ``family`` for compute capability ``cc``, compiled on the
    first call with this source, these options and this NVRTC, then reused (also by other
    processes: ranks write the file atomically)."""
    nv = cupy().cuda.nvrtc
    key = hashlib.sha256("\0".join([source(family + ".cu"), " ".join(OPTIONS), str(cc),
                                     repr(nv.getVersion()), repr(nv.getSupportedArchs())]).encode())
    stem = os.path.join(_cache_dir(), f"gradfuse_{family}_sm{cc}_{key.hexdigest()[:24]}")
    for kind in ("cubin", "ptx"):
        if os.path.exists(f"{stem}.{kind}"):
            return f"{stem}.{kind}"
    binary, kind = compile_family(family, cc)
    path = f"{stem}.{kind}"
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".gradfuse_", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(binary)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def module(family):
    """The ``cupy.RawModule`` of ``cuda/<family>.cu`` for the current device."""
    cp = cupy()
    key = (_device(), family)
    mod = _MODULES.get(key)
    if mod is None:
        if family not in FAMILIES:
            raise ValueError(f"unknown kernel family {family!r}; known: {sorted(FAMILIES)}")
        mod = cp.RawModule(path=module_path(family, int(cp.cuda.Device().compute_capability)))
        _MODULES[key] = mod
    return mod


def kernel(name):
    """The ``cupy.RawKernel`` called ``name`` (e.g. ``"gf_pack"``), compiled on first use."""
    key = (_device(), name)
    fn = _FUNCS.get(key)
    if fn is None:
        fam = next((f for f, names in FAMILIES.items() if name in names), None)
        if fam is None:
            raise ValueError(f"unknown kernel {name!r}")
        fn = module(fam).get_function(name)
        _FUNCS[key] = fn
    return fn


def compile_all():
    """Compile every kernel of every family on the current device and check there that
    subnormals survive (``check_subnormals``); returns the kernels' names."""
    done = []
    for fam, names in FAMILIES.items():
        for name in names:
            kernel(name)
            done.append(f"{fam}.cu:{name}")
    check_subnormals()
    return done


def check_subnormals():
    """Run a float32 division and a bf16 sum on the device: subnormal inputs and results
    must keep their bits, as on the CPU. Raises RuntimeError if the loaded kernels flush
    them to zero (compiled with flush-to-zero, which would break bit-exactness)."""
    cp = cupy()
    x = np.array([1e-40, -3e-39, 2.0 ** -126, 1.5], np.float32)
    got_div = cp.asarray(x)
    div_f32(got_div, 2.0)
    with np.errstate(all="ignore"):
        want_div = x / np.float32(2.0)
    a = np.array([0x0001, 0x8001, 0x0070], np.uint16)
    got_sum = cp.asarray(np.array([0x0001, 0x8001, 0x0010], np.uint16))
    sum16(2, cp.asarray(a), got_sum)
    want_sum = np.array([0x0002, 0x8002, 0x0080], np.uint16)
    got_div, got_sum = got_div.get(), got_sum.get()
    if not (np.array_equal(got_div.view(np.uint32), want_div.view(np.uint32))
            and np.array_equal(got_sum, want_sum)):
        paths = sorted({getattr(m, "file_path", None) or "?" for m in _MODULES.values()})
        raise RuntimeError(
            "the GPU kernels flush subnormals to zero on this device (float32 "
            f"{x.tolist()} / 2 gave {got_div.tolist()}, want {want_div.tolist()}; bf16 sum gave "
            f"{[hex(v) for v in got_sum]}, want {[hex(v) for v in want_sum]}), so their results "
            f"would differ from the CPU kernels'. They must be compiled with {OPTIONS} and nothing "
            f"after them; compiled modules: {paths}")


def _sms():
    dev = _device()
    if dev not in _SMS:
        _SMS[dev] = cupy().cuda.Device(dev).attributes["MultiProcessorCount"]
    return _SMS[dev]


# ------------------------------------------------------------------ argument checks

def _arr(a, dtype, name, who, ndim=1):
    cp = cupy()
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{who}: {name} must be a cupy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{who}: {name} must be {np.dtype(dtype)}, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{who}: {name} must have {ndim} dimension(s), got shape {a.shape}")
    if ndim == 1 and a.size > 1 and a.strides[0] != a.itemsize:
        raise ValueError(f"{who}: {name} must be contiguous")
    if a.size and a.device.id != _device():
        raise ValueError(f"{who}: {name} is on device {a.device.id}, the current device is {_device()}")
    return a


def _ptr(a):
    """Kernel argument for an optional array: the array, or a NULL pointer."""
    return a if a is not None and a.size else np.uint64(0)


def _f32_nonzero(v, who, name):
    f = _F32(v)
    if not np.isfinite(f) or f == 0:
        raise ValueError(f"{who}: {name} must be finite and non-zero as a float32, got {v!r}")
    return f


def _scale_arg(v, who, name):
    """(scaled, float32) as _cast.pxi's _cast_scale: no division at all when v == 1.0."""
    if float(v) == 1.0:
        return np.int32(0), _F32(1.0)
    return np.int32(1), _f32_nonzero(v, who, name)


def divisor_mode(divisor, who="decompress_sum"):
    """(mode, operand) exactly as _quant.h's gf_q_divide chooses: 0 none, 1 divide by
    (float)divisor, 2 multiply by its exact reciprocal (power-of-two divisors)."""
    if float(divisor) == 1.0:
        return np.int32(0), _F32(1.0)
    f = _f32_nonzero(divisor, who, "divisor")
    m, _ = math.frexp(float(f))
    with np.errstate(all="ignore"):
        r = _F32(1.0) / f
        exact = bool(r != 0 and np.isfinite(r) and r * f == _F32(1.0))
    if m in (0.5, -0.5) and exact:
        return np.int32(2), r
    return np.int32(1), f


class Resident(np.ndarray):
    """A host int64 table that will not change, with its device copies (one per device).

    Make one with ``resident(table)``. The wrappers validate it like any host table but
    upload it once per device instead of at every call; the pipeline keeps its plans'
    offset/count tables this way and uploads each step's pointer tables once.
    """

    def __array_finalize__(self, obj):
        self._dev = {}          # device id -> cupy copy (views and results start empty)


def resident(table):
    """A read-only ``Resident`` view of an int64 host table (see ``Resident``)."""
    r = np.ascontiguousarray(table, dtype=_I64).view(Resident)
    r._dev = {}
    r.flags.writeable = False
    return r


def _upload(t):
    """The device copy of host table ``t`` (cached on ``Resident`` tables)."""
    if isinstance(t, Resident) and t.ndim == 1 and t.flags.c_contiguous:
        dev = _device()
        d = t._dev.get(dev)
        if d is None:
            d = t._dev[dev] = cupy().asarray(t.view(np.ndarray))
        return d
    return cupy().asarray(t)


def _table(who, ptrs, offsets, counts, lo, hi, dense=False, buflen=None, align=1):
    """Device copies of a table and the largest row count of rows lo..hi-1. ``align``:
    pointers, offsets and counts of those rows must be multiples of it (a kernel that
    moves whole floats would fault on a misaligned address: a sticky CUDA error)."""
    cp = cupy()
    lo, hi = int(lo), int(hi)
    host = not isinstance(counts, cp.ndarray)
    if host:
        ptrs, offsets, counts = (t if isinstance(t, Resident) else np.ascontiguousarray(t, dtype=_I64)
                                 for t in (ptrs, offsets, counts))
    if lo < 0 or lo > hi or hi > len(ptrs) or hi > len(offsets) or hi > len(counts):
        raise IndexError(f"{who}: table range {lo}:{hi} outside tables of "
                         f"{len(ptrs)}/{len(offsets)}/{len(counts)} rows")
    if host:
        c, o, p = counts[lo:hi], offsets[lo:hi], ptrs[lo:hi]
        if (c < 0).any() or (o < 0).any():
            raise ValueError(f"{who}: a row has a negative offset or count")
        if ((c > 0) & (p == 0)).any():
            raise ValueError(f"{who}: a row has elements and a NULL pointer")
        if dense and len(c) and not np.array_equal(o, np.concatenate([[0], np.cumsum(c)[:-1]])):
            raise ValueError(f"{who}: offsets are not dense from 0")
        if buflen is not None and len(c) and int((o + c).max()) > buflen:
            raise ValueError(f"{who}: buffer of {buflen} elements too short for the table")
        misaligned = bool(((p | o | c) & (align - 1)).any())
        n = int(c.sum())
        mx = int(c.max()) if len(c) else 0
        dev = tuple(_upload(t) for t in (ptrs, offsets, counts))
    else:
        for t, nm in ((ptrs, "ptrs"), (offsets, "offsets"), (counts, "counts")):
            _arr(t, _I64, nm, who)
        if hi > lo:
            c = counts[lo:hi]
            bits = (ptrs[lo:hi] | offsets[lo:hi] | c) & (align - 1)
            stats = cp.stack([c.sum(), c.max(), bits.max()]).get()    # one device read
            n, mx, misaligned = int(stats[0]), int(stats[1]), bool(stats[2])
        else:
            n = mx = 0
            misaligned = False
        dev = (ptrs, offsets, counts)
    if misaligned:
        raise ValueError(f"{who}: pointers, offsets and byte counts must be multiples of {align}")
    return dev, n, mx


def _grid_flat(n):
    """Grid-stride launch for n elements: at most 32 CTAs per multiprocessor."""
    return (max(1, min(-(-n // THREADS), 32 * _sms())),)


def _grid_rows(rows, maxcount, unit=1):
    """Rows on y (<= 65535, strided), a row's elements (in `unit`s) on x."""
    gy = max(1, min(rows, 65535))
    gx = max(1, min(-(-maxcount // (THREADS * unit)), 32 * _sms()))
    gx = max(1, min(gx, (1 << 22) // gy))    # bound the empty CTAs of short rows
    return (gx, gy)


def _counter(count_out, k, who):
    cp = cupy()
    if count_out is None:
        return cp.zeros(k, np.uint64), True
    _arr(count_out, np.uint64, "count_out", who)
    if count_out.size != k:
        raise ValueError(f"{who}: count_out must have {k} element(s)")
    count_out.fill(0)
    return count_out, False


def _launch(name, grid, args):
    kernel(name)(grid, (THREADS,), args)


# ------------------------------------------------------------------ pack / unpack

def pack(buf, ptrs, offsets, nbytes, lo, hi):
    """Copy tensors lo..hi-1 of the (byte) table into ``buf`` (cupy uint8) at their offsets."""
    _arr(buf, np.uint8, "buf", "pack")
    (p, o, c), _, mx = _table("pack", ptrs, offsets, nbytes, lo, hi, buflen=buf.size)
    if hi > lo and mx > 0:
        _launch("gf_pack", _grid_rows(hi - lo, mx, 16), (buf, p, o, c, _I64(lo), _I64(hi)))


def unpack(buf, ptrs, offsets, nbytes, lo, hi):
    """Copy tensors lo..hi-1 out of ``buf`` (cupy uint8) into their destinations."""
    _arr(buf, np.uint8, "buf", "unpack")
    (p, o, c), _, mx = _table("unpack", ptrs, offsets, nbytes, lo, hi, buflen=buf.size)
    if hi > lo and mx > 0:
        _launch("gf_unpack", _grid_rows(hi - lo, mx, 16), (buf, p, o, c, _I64(lo), _I64(hi)))


def unpack_div_f32(buf, ptrs, offsets, nbytes, lo, hi, divisor):
    """float32 unpack and divide (``_core.unpack_div`` with code float32): one IEEE
    division per element, even by 1.0 (as the CPU kernel, which quiets signalling NaNs
    then); a NaN comes back quieted with its payload, as x86 division does."""
    d = _f32_nonzero(divisor, "unpack_div_f32", "divisor")
    _arr(buf, np.uint8, "buf", "unpack_div_f32")
    # whole floats (the CPU kernel copies bytes and would accept any offset)
    (p, o, c), _, mx = _table("unpack_div_f32", ptrs, offsets, nbytes, lo, hi, buflen=buf.size, align=4)
    if hi > lo and mx > 0:
        _launch("gf_unpack_div_f32", _grid_rows(hi - lo, mx // 4, 1),
                (buf, p, o, c, _I64(lo), _I64(hi), d))


def div_f32(x, divisor):
    """In-place float32 ``x /= (float)divisor`` (``_core.div_inplace`` with code float32;
    like it, divides even by 1.0)."""
    _arr(x, _F32, "x", "div_f32")
    if x.size == 0:
        return
    d = _f32_nonzero(divisor, "div_f32", "divisor")
    _launch("gf_div_f32", _grid_flat(x.size), (x, _I64(x.size), d))


# ------------------------------------------------------------------ fp16 / bf16

def _fmt(fmt, who):
    if fmt not in (1, 2):
        raise ValueError(f"{who}: fmt must be 1 (fp16) or 2 (bf16), got {fmt}")
    return np.int32(fmt)


def _counts_result(cnt, owned):
    if owned:
        c = cnt.get()
        return int(c[0]), int(c[1])
    return cnt


def cast_to16(fmt, src, dst, prescale=1.0, count_out=None):
    """dst[k] = cvt(src[k] / (float)prescale) (fmt 1 fp16, 2 bf16); returns
    ``(n_overflow, n_underflow)`` (or ``count_out``), as ``_core.cast_to16``."""
    who = "cast_to16"
    f = _fmt(fmt, who)
    scaled, p = _scale_arg(prescale, who, "prescale")
    _arr(src, _F32, "src", who)
    _arr(dst, np.uint16, "dst", who)
    if dst.size < src.size:
        raise ValueError(f"{who}: output of {dst.size} elements shorter than input of {src.size}")
    cnt, owned = _counter(count_out, 2, who)
    if src.size:
        _launch("gf_cast_to16", _grid_flat(src.size), (f, src, dst, _I64(src.size), scaled, p, cnt))
    return _counts_result(cnt, owned)


def cast_from16(fmt, src, dst, divisor=1.0):
    """dst[k] = to_f32(src[k]) / (float)divisor, as ``_core.cast_from16``."""
    who = "cast_from16"
    f = _fmt(fmt, who)
    scaled, d = _scale_arg(divisor, who, "divisor")
    _arr(src, np.uint16, "src", who)
    _arr(dst, _F32, "dst", who)
    if dst.size < src.size:
        raise ValueError(f"{who}: output of {dst.size} elements shorter than input of {src.size}")
    if src.size:
        _launch("gf_cast_from16", _grid_flat(src.size), (f, src, dst, _I64(src.size), scaled, d))


def pack_cast(fmt, buf, ptrs, offsets, counts, lo, hi, prescale, count_out=None):
    """Fused pack + cast of float32 table rows lo..hi-1 into ``buf`` (cupy uint16, element
    offsets); returns ``(n_overflow, n_underflow)`` or ``count_out``, as ``_core.pack_cast``."""
    who = "pack_cast"
    f = _fmt(fmt, who)
    scaled, p = _scale_arg(prescale, who, "prescale")
    _arr(buf, np.uint16, "buf", who)
    (tp, to, tc), _, mx = _table(who, ptrs, offsets, counts, lo, hi, buflen=buf.size)
    cnt, owned = _counter(count_out, 2, who)
    if hi > lo and mx > 0:
        _launch("gf_pack_cast", _grid_rows(hi - lo, mx),
                (f, buf, tp, to, tc, _I64(lo), _I64(hi), scaled, p, cnt))
    return _counts_result(cnt, owned)


def unpack_cast(fmt, buf, ptrs, offsets, counts, lo, hi, divisor):
    """Fused unpack + cast out of ``buf`` (cupy uint16) into float32 table rows lo..hi-1."""
    who = "unpack_cast"
    f = _fmt(fmt, who)
    scaled, d = _scale_arg(divisor, who, "divisor")
    _arr(buf, np.uint16, "buf", who)
    (tp, to, tc), _, mx = _table(who, ptrs, offsets, counts, lo, hi, buflen=buf.size)
    if hi > lo and mx > 0:
        _launch("gf_unpack_cast", _grid_rows(hi - lo, mx), (f, buf, tp, to, tc, _I64(lo), _I64(hi), scaled, d))


def sum16(fmt, a, b):
    """b[k] = cvt(to_f32(a[k]) + to_f32(b[k])) with the CPU's NaN rule (``_core.sum16``)."""
    who = "sum16"
    f = _fmt(fmt, who)
    _arr(a, np.uint16, "a", who)
    _arr(b, np.uint16, "b", who)
    if b.size < a.size:
        raise ValueError(f"{who}: in/out buffer of {b.size} elements shorter than input of {a.size}")
    if a.size:
        _launch("gf_sum16", _grid_flat(a.size), (f, a, b, _I64(a.size)))


# ------------------------------------------------------------------ 1-bit / 2-bit

def _residuals(who, e_in, e_out, n):
    e_in = None if e_in is None or e_in.size == 0 else _arr(e_in, _F32, "e_in", who)
    e_out = None if e_out is None or e_out.size == 0 else _arr(e_out, _F32, "e_out", who)
    if e_in is None and e_out is None:
        return None, None
    if e_in is None or e_out is None or e_in.size != n or e_out.size != n:
        raise ValueError(f"{who}: e_in and e_out must both be empty (no error feedback) or both "
                         f"have the bucket's {n} elements")
    return e_in, e_out


def _block(block, who):
    block = int(block)
    if block < 32 or block % 32:
        raise ValueError(f"{who}: block size must be a multiple of 32 and >= 32, got {block}")
    return block


def _threshold(t, who):
    t32 = _F32(t)
    if not (t32 > 0) or not np.isfinite(t32):
        raise ValueError(f"{who}: threshold must be finite and > 0 as a float32, got {t}")
    return t32


def _bad_result(bad, owned):
    return int(bad.get()[0]) if owned else bad


def _onebit_compress(who, src_args, table_kernel, n, e_in, e_out, block, bits, scales, count_out):
    block = _block(block, who)
    e_in, e_out = _residuals(who, e_in, e_out, n)
    _arr(bits, np.uint32, "bits", who)
    _arr(scales, _F32, "scales", who)
    nwords, nblocks = -(-n // 32), -(-n // block)
    if bits.size != nwords:
        raise ValueError(f"{who}: bits must have ceil(n/32) = {nwords} words, got {bits.size}")
    if scales.size != nblocks:
        raise ValueError(f"{who}: scales must have ceil(n/block) = {nblocks} floats, got {scales.size}")
    bad, owned = _counter(count_out, 1, who)
    if n:
        grid = (-(-nblocks // OB_WARPS),)
        name = "gf_onebit_compress_table" if table_kernel else "gf_onebit_compress_array"
        _launch(name, grid, src_args + (_I64(n), _ptr(e_in), _ptr(e_out), _I64(block), bits, scales, bad))
    return _bad_result(bad, owned)


def onebit_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, block, bits, scales, count_out=None):
    """1-bit compress with error feedback over table rows lo..hi-1 (dense offsets), as
    ``_core.onebit_compress``; returns the number of non-finite block scales."""
    who = "onebit_compress"
    (p, o, c), n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    return _onebit_compress(who, (p, o, c, _I64(lo), _I64(hi)), True, n, e_in, e_out, block,
                            bits, scales, count_out)


def onebit_compress_array(x, e_in, e_out, block, bits, scales, count_out=None):
    """``onebit_compress`` of one contiguous float32 cupy array."""
    who = "onebit_compress_array"
    _arr(x, _F32, "x", who)
    return _onebit_compress(who, (x,), False, x.size, e_in, e_out, block, bits, scales, count_out)


def _rows(a, dtype, name, who, ncols):
    _arr(a, dtype, name, who, ndim=2)
    if a.shape[1] != ncols:
        raise ValueError(f"{who}: {name} rows must have {ncols} elements, got {a.shape[1]}")
    item = a.itemsize
    if ncols > 1 and a.strides[1] != item:
        raise ValueError(f"{who}: {name} rows must be contiguous (element stride {a.strides[1]})")
    if a.strides[0] % item or a.strides[0] < 0:
        raise ValueError(f"{who}: {name} row stride {a.strides[0]} is not a positive multiple of {item}")
    return _I64(a.strides[0] // item)


def _onebit_decompress(who, bits, scales, block, n, divisor):
    block = _block(block, who)
    mode, f = divisor_mode(divisor, who)
    p = bits.shape[0] if getattr(bits, "ndim", 0) == 2 else 0
    if p < 1:
        raise ValueError(f"{who}: need at least one payload row (bits of shape (p, ceil(n/32)))")
    if scales.shape[0] != p:
        raise ValueError(f"{who}: bits has {p} rows but scales has {scales.shape[0]}")
    ws = _rows(bits, np.uint32, "bits", who, -(-n // 32))
    ss = _rows(scales, _F32, "scales", who, -(-n // block))
    return (bits, ws, scales, ss, _I64(p), _I64(block)), mode, f


def onebit_decompress_sum(bits, scales, block, ptrs, offsets, counts, lo, hi, divisor):
    """Decode p 1-bit payloads (row r = rank r), sum in rank order from v_0, divide, and
    write into table rows lo..hi-1, as ``_core.onebit_decompress_sum``."""
    who = "onebit_decompress_sum"
    (tp, to, tc), n, mx = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    args, mode, f = _onebit_decompress(who, bits, scales, block, n, divisor)
    if n:
        _launch("gf_onebit_decompress_sum_table", _grid_rows(hi - lo, mx),
                args + (tp, to, tc, _I64(lo), _I64(hi), mode, f))


def onebit_decompress_sum_array(bits, scales, block, out, divisor):
    """``onebit_decompress_sum`` into one contiguous float32 cupy array (n = out.size)."""
    who = "onebit_decompress_sum_array"
    _arr(out, _F32, "out", who)
    args, mode, f = _onebit_decompress(who, bits, scales, block, out.size, divisor)
    if out.size:
        _launch("gf_onebit_decompress_sum_array", _grid_flat(out.size),
                args + (out, _I64(out.size), mode, f))


def _twobit_compress(who, src_args, table_kernel, n, e_in, e_out, threshold, codes, count_out):
    t = _threshold(threshold, who)
    e_in, e_out = _residuals(who, e_in, e_out, n)
    _arr(codes, np.uint8, "codes", who)
    if codes.size != -(-n // 4):
        raise ValueError(f"{who}: codes must have ceil(n/4) = {-(-n // 4)} bytes, got {codes.size}")
    bad, owned = _counter(count_out, 1, who)
    if n:
        name = "gf_twobit_compress_table" if table_kernel else "gf_twobit_compress_array"
        _launch(name, _grid_flat(n), src_args + (_I64(n), _ptr(e_in), _ptr(e_out), t, codes, bad))
    return _bad_result(bad, owned)


def twobit_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, threshold, codes, count_out=None):
    """2-bit threshold compress with error feedback over table rows lo..hi-1, as
    ``_core.twobit_compress``; returns the number of non-finite c."""
    who = "twobit_compress"
    (p, o, c), n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    return _twobit_compress(who, (p, o, c, _I64(lo), _I64(hi)), True, n, e_in, e_out,
                            threshold, codes, count_out)


def twobit_compress_array(x, e_in, e_out, threshold, codes, count_out=None):
    """``twobit_compress`` of one contiguous float32 cupy array."""
    who = "twobit_compress_array"
    _arr(x, _F32, "x", who)
    return _twobit_compress(who, (x,), False, x.size, e_in, e_out, threshold, codes, count_out)


def _twobit_decompress(who, codes, threshold, n, divisor):
    t = _threshold(threshold, who)
    mode, f = divisor_mode(divisor, who)
    p = codes.shape[0] if getattr(codes, "ndim", 0) == 2 else 0
    if p < 1:
        raise ValueError(f"{who}: need at least one payload row (codes of shape (p, ceil(n/4)))")
    stride = _rows(codes, np.uint8, "codes", who, -(-n // 4))
    return (codes, stride, _I64(p), t), mode, f


def twobit_decompress_sum(codes, threshold, ptrs, offsets, counts, lo, hi, divisor):
    """Decode p 2-bit payloads, sum in rank order from v_0, divide, write into table rows
    lo..hi-1, as ``_core.twobit_decompress_sum``."""
    who = "twobit_decompress_sum"
    (tp, to, tc), n, mx = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    args, mode, f = _twobit_decompress(who, codes, threshold, n, divisor)
    if n:
        _launch("gf_twobit_decompress_sum_table", _grid_rows(hi - lo, mx),
                args + (tp, to, tc, _I64(lo), _I64(hi), mode, f))


def twobit_decompress_sum_array(codes, threshold, out, divisor):
    """``twobit_decompress_sum`` into one contiguous float32 cupy array."""
    who = "twobit_decompress_sum_array"
    _arr(out, _F32, "out", who)
    args, mode, f = _twobit_decompress(who, codes, threshold, out.size, divisor)
    if out.size:
        _launch("gf_twobit_decompress_sum_array", _grid_flat(out.size),
                args + (out, _I64(out.size), mode, f))


# ------------------------------------------------------------------ sparse (top-k / random-k)

_SP_MAX_N = 0xFFFFFFFF


def _sparse_payloads(who, values, indices, n):
    """Validate p sparse payload rows like _sparse.pxi; returns (p, k, serial)."""
    cp = cupy()
    _arr(values, _F32, "values", who, ndim=2)
    _arr(indices, np.uint32, "indices", who, ndim=2)
    if values.shape != indices.shape:
        raise ValueError(f"{who}: values shape {values.shape} != indices shape {indices.shape}")
    for a, nm in ((values, "values"), (indices, "indices")):
        if a.size and not a.flags.c_contiguous:
            raise ValueError(f"{who}: {nm} must be C-contiguous")
    if n > _SP_MAX_N:
        raise ValueError(f"{who}: bucket of {n} elements, more than {_SP_MAX_N}")
    p, k = indices.shape
    if p * k == 0:
        return p, k, False
    info = cp.zeros(2, np.uint64)
    info[0] = np.uint64(0xFFFFFFFFFFFFFFFF)
    _launch("gf_sparse_check", _grid_flat(p * k), (indices, _I64(p), _I64(k), _I64(n), info))
    first_bad, nonasc = (int(v) for v in info.get())
    if first_bad != 0xFFFFFFFFFFFFFFFF:
        r, m = divmod(first_bad, k)
        bad = int(indices[r, m].get()) if hasattr(indices[r, m], "get") else int(indices[r, m])
        raise ValueError(f"{who}: index {bad} at indices[{r}, {m}] is out of range "
                         f"for a bucket of {n} elements")
    return p, k, nonasc > 0


def sparse_decompress_sum_array(values, indices, out, divisor):
    """Sum p sparse payloads (row r = rank r) into ``out``, then divide, as
    ``_core.sparse_decompress_sum_array``: 0.0f plus the values in rank order, then
    / (float)divisor unless divisor == 1.0. Every index is checked before anything is
    written. Rows that are not strictly ascending are added serially (in m order)."""
    who = "sparse_decompress_sum_array"
    _arr(out, _F32, "out", who)
    n = out.size
    p, k, serial = _sparse_payloads(who, values, indices, n)
    if n == 0:
        return
    out.fill(0)
    if k:
        for r in range(p):
            if serial:
                _launch("gf_sparse_add_serial", (1,), (values[r], indices[r], _I64(k), out,
                                                      np.uint64(0), np.uint64(0), _I64(0), _I64(0)))
            else:
                _launch("gf_sparse_add_array", _grid_flat(k), (values[r], indices[r], _I64(k), out))
    if float(divisor) != 1.0:
        _launch("gf_sparse_div_array", _grid_flat(n), (out, _I64(n), _F32(divisor)))


def sparse_decompress_sum(values, indices, ptrs, offsets, counts, lo, hi, divisor):
    """``sparse_decompress_sum_array`` into table rows lo..hi-1 (dense offsets), as
    ``_core.sparse_decompress_sum``: every destination element is written."""
    who = "sparse_decompress_sum"
    (tp, to, tc), n, mx = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    p, k, serial = _sparse_payloads(who, values, indices, n)
    if n == 0:
        return
    lo_, hi_ = _I64(lo), _I64(hi)
    grid = _grid_rows(hi - lo, mx)
    _launch("gf_sparse_rows", grid, (tp, tc, lo_, hi_, np.int32(1), _F32(1.0)))
    if k:
        for r in range(p):
            if serial:
                _launch("gf_sparse_add_serial", (1,), (values[r], indices[r], _I64(k), np.uint64(0),
                                                      tp, to, lo_, hi_))
            else:
                _launch("gf_sparse_add_table", _grid_flat(k), (values[r], indices[r], _I64(k), tp, to, lo_, hi_))
    if float(divisor) != 1.0:
        _launch("gf_sparse_rows", grid, (tp, tc, lo_, hi_, np.int32(0), _F32(divisor)))


# ------------------------------------------------------------------ sparse compress (top-k / random-k selection)
#
# GPU twins of _core.topk_compress(_array), randomk_indices, randomk_compress(_array)
# (gradfuse/kernels/_sparse.pxi): same arguments, same bits, same count. The radix select of
# cuda/sparse.cu (docs/gpu.md): level 1 fused into the pass that makes c (top-k) or a
# hash pass (random-k), two more digit levels, then a tile count, a scan and an ordered
# write. Nothing here synchronises except reading the count when count_out is None.

_SP_TILE = 1024                   # elements per warp tile of gf_sp_count / gf_sp_write
_SP_LEVELS = ((21, 11), (10, 11), (0, 10))    # (shift, width) of the key's three digits


def _sp_grid_hist(n):
    """Histogram passes: about 8 blocks of 256 per multiprocessor (one 8 KiB shared
    histogram each, flushed once per block), fewer for small buckets."""
    return (max(1, min(-(-n // (THREADS * 8)), 8 * _sms())),)


def _sp_grid_tiles(ntiles):
    return (max(1, min(-(-ntiles // OB_WARPS), 32 * _sms())),)


def _sp_keys(kind, arr=None, table=None, lo=0, hi=0, seed=0):
    """The key-stream arguments of the gf_sp_* kernels (GF_SP_KEY_PARAMS)."""
    z = np.uint64(0)
    p, o, c = table if table is not None else (z, z, z)
    return (np.int32(kind), arr if arr is not None else z, p, o, c, _I64(lo), _I64(hi), np.uint64(seed))


def _sp_table(who, ptrs, offsets, counts, lo, hi):
    """Device table and n, validated like _sparse.pxi's _sp_table_n (ValueError)."""
    lo, hi = int(lo), int(hi)
    if lo < 0 or lo > hi or hi > len(ptrs) or hi > len(offsets) or hi > len(counts):
        raise ValueError(f"{who}: table range {lo}:{hi} outside tables of "
                         f"{len(ptrs)}/{len(offsets)}/{len(counts)} rows")
    dev, n, _ = _table(who, ptrs, offsets, counts, lo, hi, dense=True)
    if n > _SP_MAX_N:
        raise ValueError(f"{who}: bucket of more than {_SP_MAX_N} elements "
                         "(indices are uint32 positions inside the bucket)")
    return dev, n


def _sp_check(who, n, e_in, e_out, k, values, indices):
    """_sparse.pxi's _sp_check_common: returns (e_in, e_out, k) (residuals None when empty)."""
    _arr(values, _F32, "values", who)
    _arr(indices, np.uint32, "indices", who)
    if n > _SP_MAX_N:
        raise ValueError(f"{who}: bucket of {n} elements, more than {_SP_MAX_N} "
                         "(indices are uint32 positions inside the bucket)")
    e_in, e_out = _residuals(who, e_in, e_out, n)
    k = int(k)
    if k < 0 or k > n:
        raise ValueError(f"{who}: k = {k} outside 0..{n}")
    if values.size != k:
        raise ValueError(f"{who}: values has {values.size} elements, expected k = {k}")
    if indices.size != k:
        raise ValueError(f"{who}: indices has {indices.size} elements, expected k = {k}")
    return e_in, e_out, k


def _sp_select(keys, n, k, hist, indices, values=None, e_zero=None, level1=False):
    """indices <- the k largest keys of the stream (0 < k < n), ties to the lower index,
    ascending; values[m] <- their raw words, e_zero[indices] <- 0 when given. hist: 5120
    zeroed u32 (three levels); level1: its first 2048 already hold the level-1 histogram."""
    cp = cupy()
    state = cp.zeros(2, np.uint64)                  # prefix, count of keys above it
    n64, k64 = _I64(n), _I64(k)
    grid = _sp_grid_hist(n)
    at = 0
    for lv, (shift, width) in enumerate(_SP_LEVELS):
        h = hist[at:at + (1 << width)]
        at += 1 << width
        if lv or not level1:
            _launch("gf_sp_hist", grid, keys + (n64, np.int32(shift), np.int32(width), state, h))
        _launch("gf_sp_select", (1,), (h, np.int32(width), k64, state))
    ntiles = -(-n // _SP_TILE)
    tiles = cp.empty(4 * ntiles, np.uint32)
    counts, pre = tiles[:2 * ntiles], tiles[2 * ntiles:]
    tgrid = _sp_grid_tiles(ntiles)
    _launch("gf_sp_count", tgrid, keys + (n64, state, counts))
    _launch("gf_sp_scan", (1,), (counts, _I64(ntiles), pre))
    _launch("gf_sp_write", tgrid, keys + (n64, state, k64, counts, pre, _ptr(values), indices, _ptr(e_zero)))


def _sp_hist_buffer():
    return cupy().zeros(sum(1 << w for _, w in _SP_LEVELS), np.uint32)


def _topk(who, src, n, e_in, e_out, k, values, indices, count_out):
    e_in, e_out, k = _sp_check(who, n, e_in, e_out, k, values, indices)
    bad, owned = _counter(count_out, 1, who)
    if n:
        mode = 0 if k == 0 else (2 if k == n else 1)
        hist = _sp_hist_buffer() if mode == 1 else None
        _launch("gf_sp_pass1", _sp_grid_hist(n),
                src + (_I64(n), _ptr(e_in), _ptr(e_out), np.int32(mode), _ptr(hist), bad,
                       _ptr(values), _ptr(indices)))
        if mode == 1:
            keys = _sp_keys(0, e_out) if e_out is not None else src   # c lives in e_out
            _sp_select(keys, n, k, hist, indices, values, e_out, level1=True)
    return _bad_result(bad, owned)


def topk_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, k, values, indices, count_out=None):
    """Top-k with error feedback over table rows lo..hi-1 (dense offsets), as
    ``_core.topk_compress``: c = g + e_in (c = g when e_in/e_out are empty); indices <- the
    k positions of the largest bits(c) & 0x7fffffff, ties to the lower position, ascending;
    values <- c there; e_out <- c with 0 at the indices (e_out may be e_in). Returns the
    number of non-finite c (or ``count_out``)."""
    who = "topk_compress"
    table, n = _sp_table(who, ptrs, offsets, counts, lo, hi)
    return _topk(who, _sp_keys(1, None, table, lo, hi), n, e_in, e_out, k, values, indices, count_out)


def topk_compress_array(x, e_in, e_out, k, values, indices, count_out=None):
    """``topk_compress`` of one contiguous float32 cupy array."""
    who = "topk_compress_array"
    _arr(x, _F32, "x", who)
    return _topk(who, _sp_keys(0, x), x.size, e_in, e_out, k, values, indices, count_out)


def _rk_seed(seed, who):
    seed = int(seed)
    if not 0 <= seed <= 0xFFFFFFFFFFFFFFFF:
        raise OverflowError(f"{who}: seed {seed} does not fit in a uint64")
    return seed


def _rk_indices(seed, n, k, out):
    if k == 0:
        return
    if k >= n:
        _launch("gf_sp_iota", _grid_flat(n), (out, _I64(n)))
        return
    _sp_select(_sp_keys(2, seed=seed), n, k, _sp_hist_buffer(), out)


def randomk_indices(seed, n, k, out):
    """out <- the k positions i in 0..n-1 with the smallest h_i, ties to the lower i,
    ascending, as ``_core.randomk_indices`` (h_i = splitmix64_mix(seed + i +
    0x9e3779b97f4a7c15) >> 32, uint64 wrap-around)."""
    who = "randomk_indices"
    seed = _rk_seed(seed, who)
    n, k = int(n), int(k)
    _arr(out, np.uint32, "out", who)
    if n < 0 or n > _SP_MAX_N:
        raise ValueError(f"{who}: n = {n} outside 0..{_SP_MAX_N}")
    if k < 0 or k > n:
        raise ValueError(f"{who}: k = {k} outside 0..{n}")
    if out.size != k:
        raise ValueError(f"{who}: out has {out.size} elements, expected k = {k}")
    _rk_indices(seed, n, k, out)


def _randomk(who, src, n, e_in, e_out, seed, k, values, indices, count_out):
    seed = _rk_seed(seed, who)
    e_in, e_out, k = _sp_check(who, n, e_in, e_out, k, values, indices)
    bad, owned = _counter(count_out, 1, who)
    if n:
        _rk_indices(seed, n, k, indices)
        _launch("gf_sp_pass1", _sp_grid_hist(n),
                src + (_I64(n), _ptr(e_in), _ptr(e_out), np.int32(0), np.uint64(0), bad,
                       np.uint64(0), np.uint64(0)))
        if k:
            _launch("gf_sp_pick", _grid_flat(k), src + (indices, _I64(k), _ptr(e_out), values))
    return _bad_result(bad, owned)


def randomk_compress(ptrs, offsets, counts, lo, hi, e_in, e_out, seed, k, values, indices, count_out=None):
    """Random-k with error feedback over table rows lo..hi-1, as ``_core.randomk_compress``:
    indices <- randomk_indices(seed, n, k); c = g + e_in; values <- c at the indices;
    e_out <- c with 0 there. Returns the number of non-finite c (or ``count_out``)."""
    who = "randomk_compress"
    table, n = _sp_table(who, ptrs, offsets, counts, lo, hi)
    return _randomk(who, _sp_keys(1, None, table, lo, hi), n, e_in, e_out, seed, k, values, indices,
                    count_out)


def randomk_compress_array(x, e_in, e_out, seed, k, values, indices, count_out=None):
    """``randomk_compress`` of one contiguous float32 cupy array."""
    who = "randomk_compress_array"
    _arr(x, _F32, "x", who)
    return _randomk(who, _sp_keys(0, x), x.size, e_in, e_out, seed, k, values, indices, count_out)
