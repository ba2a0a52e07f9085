"""Loading the CUDA kernels of ``gradfuse.gpu``: sources, NVRTC, the module caches.

``source()`` reads ``cuda/<family>.cu`` (the checkout's own, else the package data
``gradfuse.cuda``) with the shared prelude in front of it; ``compile_family()`` compiles
it with NVRTC (the one cupy loads) with exactly ``OPTIONS`` for the device's
architecture; ``module_path()`` keeps the result in cupy's kernel cache directory;
``module()`` and ``kernel()`` load it with ``cupy.RawModule(path=...)`` once per device.
``cupy()`` imports cupy on first use: importing this module does not.
"""
import hashlib
import importlib.util
import os
import tempfile

# Installed, cuda/ ships as gradfuse.cuda: a namespace package (no __init__.py) holding the
# .cu files. The repository's cuda/ must not be a regular package: run from a checkout
# (the repository root on sys.path), it would shadow NVIDIA's `cuda` namespace
# (cuda.pathfinder, cuda.bindings), and cupy 14 could not be imported.
# Only its folders are needed, so it is looked up, not imported: import checkers, which
# find no gradfuse.cuda in a checkout, read `from .. import cuda` as importing gradfuse.
_spec = importlib.util.find_spec("..cuda", __package__)       # gradfuse.cuda
_PKG_DIRS = [str(d) for d in _spec.submodule_search_locations] if _spec is not None else []

# the repository's top-level cuda/ (this file is gradfuse/gpu/loader.py)
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
    cursor, the blocked 1-bit/2-bit layout and decode-and-sum) in front of it and a ``#line`` directive, so compiler messages still point
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
               "gf_twobit_decompress_sum_array", "gf_twobit_decompress_sum_table",
               "gf_twobit_block_compress_array", "gf_twobit_block_compress_table",
               "gf_twobit_block_decompress_sum_array", "gf_twobit_block_decompress_sum_table"),
    "sparse": ("gf_sparse_check", "gf_sparse_add_array", "gf_sparse_add_table", "gf_sparse_add_serial",
               "gf_sparse_rows", "gf_sparse_div_array",
               "gf_sp_pass1", "gf_sp_hist", "gf_sp_select", "gf_sp_count", "gf_sp_scan", "gf_sp_write",
               "gf_sp_take", "gf_sp_rk_draw", "gf_sp_pick"),
    "momentum": ("gf_momentum_update", "gf_momentum_mask"),
    "adam": ("gf_adam_moment", "gf_adam_onebit_compress_table", "gf_adam_apply", "gf_adam_plain"),
    "powersgd": ("gf_psgd_orthogonalize", "gf_psgd_gather", "gf_psgd_scatter"),
}

_cp = None
_MODULES = {}          # (device id, family) -> cupy.RawModule
_FUNCS = {}            # (device id, kernel name) -> cupy.RawKernel


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
