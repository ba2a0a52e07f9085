"""CI check of the CUDA kernels without a GPU: every ``cuda/*.cu`` compiles.

1. nvcc, for sm_80 and sm_90 (one nvcc per file, both targets in one call, files in
   parallel), with the flags the runtime uses (--fmad=false, C++14). A syntax error fails
   the test. Then ptxas's resource report: each kernel's registers and static shared
   memory fit a launch of gpu.THREADS threads, and nothing spills. Skipped only when nvcc
   is missing.
2. The NVRTC rules checked as text: no #include (NVRTC has no host headers), no
   <cstdint>-style types, no FMA intrinsics, no CUDA half/bf16 conversions (they return a
   canonical NaN), and every kernel listed in gradfuse.gpu.FAMILIES is defined.
3. NVRTC itself (the ``nvidia-cuda-nvrtc`` wheel, loaded with ctypes, no cupy and no GPU):
   each file compiles with exactly gradfuse.gpu.OPTIONS, as cupy.RawModule will on the
   device, without warnings, and exports its kernels under their C names.
"""
import concurrent.futures as cf
import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import tempfile

import pytest

pytestmark = pytest.mark.slow     # compilers: nvcc and NVRTC over every kernel

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_DIR = os.path.join(os.path.dirname(HERE), "cuda")
CU_FILES = sorted(f for f in os.listdir(CUDA_DIR) if f.endswith(".cu"))


def _nvcc():
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc") if os.path.exists(p)), None)


def _source(name):
    """What NVRTC compiles: the prelude (cuda/common.cuh) + the file, as gradfuse.gpu builds it."""
    from gradfuse import gpu
    return gpu.source(name)


def test_files_present():
    from gradfuse import gpu
    assert sorted(f + ".cu" for f in gpu.FAMILIES) == CU_FILES


@pytest.mark.one_leg             # nvcc on the .cu sources: numpy's version plays no part
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_nvcc_compiles_every_kernel_sm80_sm90():
    nvcc = _nvcc()
    with tempfile.TemporaryDirectory() as tmp:
        def build(name):
            unit = os.path.join(tmp, name)
            with open(unit, "w") as f:
                f.write(_source(name))
            cmd = [nvcc, "-std=c++14", "--fmad=false", "-c", "-Xptxas", "-v",
                   "-gencode", "arch=compute_80,code=sm_80",
                   "-gencode", "arch=compute_90,code=sm_90",
                   "-o", os.path.join(tmp, name + ".o"), unit]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            return name, p.returncode, p.stdout + p.stderr

        with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
            results = list(ex.map(build, CU_FILES))
    failed = [f"{name}:\n{out}" for name, rc, out in results if rc != 0]
    assert not failed, "nvcc failed:\n" + "\n".join(failed)

    # What only a launch on a GPU would otherwise tell: every kernel's resources (ptxas -v)
    # fit the one launch shape gradfuse uses, THREADS threads and no dynamic shared memory.
    from gradfuse import gpu
    seen, problems = set(), []
    for name, _, out in results:
        for kernel, arch, body in re.findall(r"Compiling entry function '(\w+)' for '(sm_\d+)'(.*?)"
                                             r"(?=Compiling entry function|\Z)", out, re.S):
            seen.add(kernel)
            regs = int(re.search(r"Used (\d+) registers", body).group(1))
            smem = sum(int(b) for b in re.findall(r"(\d+) bytes smem", body))
            spill = [int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", body)]
            if regs * gpu.THREADS > 65536:      # registers per block on sm_80 / sm_90
                problems.append(f"{kernel} ({arch}): {regs} registers x {gpu.THREADS} threads > 65536")
            if smem > 48 * 1024:                # static shared memory without an opt-in
                problems.append(f"{kernel} ({arch}): {smem} bytes of static shared memory > 48 KiB")
            if any(spill):
                problems.append(f"{kernel} ({arch}): spills registers to local memory ({spill} bytes)")
    assert not problems, "\n".join(problems)
    expected = {k for fam in gpu.FAMILIES.values() for k in fam}
    assert seen >= expected, f"ptxas reported no resources for {sorted(expected - seen)}"


@pytest.mark.parametrize("name", CU_FILES)
def test_nvrtc_rules(name):
    from gradfuse import gpu
    src = _source(name)
    code = re.sub(r"//[^\n]*", "", src)                       # rules apply to code, not comments
    assert not re.search(r"^\s*#\s*include", code, re.M), f"{name}: NVRTC has no host headers"
    for bad in ("uint32_t", "int64_t", "uint16_t", "uint8_t", "size_t"):
        assert not re.search(rf"\b{bad}\b", code), f"{name}: use the file's own typedefs, not {bad}"
    for bad in ("__fmaf_rn", "fmaf(", "__fmaf", "__float2half", "__float2bfloat16", "__half2float",
                "__frcp", "__fdividef", "__expf"):
        assert bad not in code, f"{name}: {bad} breaks the CPU bit rules"
    fam = name[:-3]
    for kernel in gpu.FAMILIES[fam]:
        assert re.search(rf'extern "C" __global__ void {kernel}\(', code), f"{name}: {kernel} missing"


class _NVRTC:
    """NVRTC through ctypes: the library cupy.RawModule calls on the device, without cupy.

    Found in the ``nvidia-cuda-nvrtc`` wheel (the test extra installs it on Linux x86_64, as
    the GPU image has it), else wherever the dynamic loader finds ``libnvrtc``.
    """

    def __init__(self, lib):
        self.lib = lib
        self.path = lib._name
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, rc, what):
        if rc != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, source, name, options):
        """Compile to PTX; return (ok, log, ptx)."""
        lib, prog = self.lib, ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                           0, None, None), "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "log size")
            buf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, buf), "log")
            log = buf.value.decode(errors="replace")
            ptx = b""
            if rc == 0:
                self._check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
                pbuf = ctypes.create_string_buffer(size.value)
                self._check(lib.nvrtcGetPTX(prog, pbuf), "PTX")
                ptx = pbuf.value
            return rc == 0, log, ptx
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_candidates():
    try:
        import nvidia
        for root in nvidia.__path__:
            yield from sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")), reverse=True)
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    if found:
        yield found
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
        yield from sorted(glob.glob(os.path.join(d, "libnvrtc.so*")), reverse=True)


def _load_nvrtc():
    for path in _nvrtc_candidates():
        if "builtins" in os.path.basename(path):
            continue
        # libnvrtc loads its libnvrtc-builtins.so.X.Y at compile time; NVRTC 13.0's wheel
        # cannot find it by itself, and cupy (cuda-pathfinder) preloads it only when it
        # loads libnvrtc itself, which it skips once this process has. Preload it globally
        # first, or cupy's own kernels in the same process (the device check's) fail to compile.
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
            try:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
        try:
            return _NVRTC(ctypes.CDLL(path))
        except (OSError, AttributeError, RuntimeError):
            continue
    return None


NVRTC = _load_nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="no NVRTC library loadable here (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("name", CU_FILES)
def test_nvrtc_compiles_with_runtime_options(name):
    """Each file compiles under NVRTC with exactly gradfuse.gpu.OPTIONS, for both targets,
    without a warning, and the PTX exports every kernel of its family under its C name."""
    from gradfuse import gpu
    for arch in ("compute_80", "compute_90"):
        ok, log, ptx = NVRTC.compile(_source(name), name, list(gpu.OPTIONS) + [f"-arch={arch}"])
        assert ok, f"{name} ({arch}, NVRTC {NVRTC.version} at {NVRTC.path}):\n{log}"
        assert "warning" not in log.lower(), f"{name} ({arch}): NVRTC warned:\n{log}"
        for kernel in gpu.FAMILIES[name[:-3]]:
            assert f".entry {kernel}(".encode() in ptx, f"{name} ({arch}): {kernel} not in the PTX"
        # The CPU rounding policy, checked in the machine code's source: no fused multiply-add
        # on floats (the CPU build has none either) and no approximate division or math.
        text = ptx.decode()
        fused = sorted(set(re.findall(r"\b(?:fma|mad)\.[a-z.]*f(?:16|32|64)\b", text)))
        assert not fused, f"{name} ({arch}): fused float ops in the PTX: {fused}"
        approx = sorted(set(re.findall(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.(?:approx|full)\.[a-z0-9.]+", text)))
        assert not approx, f"{name} ({arch}): approximate float ops in the PTX: {approx}"


def test_arch_option():
    """The device's own machine code when NVRTC knows it, else PTX for the newest lower
    virtual architecture; a device older than all of them is a clear error."""
    from gradfuse import gpu
    supported = (75, 80, 86, 89, 90)
    assert gpu.arch_option(90, supported) == ("-arch=sm_90", "cubin")
    assert gpu.arch_option(100, supported) == ("-arch=compute_90", "ptx")
    assert gpu.arch_option(87, supported) == ("-arch=compute_86", "ptx")
    with pytest.raises(RuntimeError, match="none of them at or below.*70"):
        gpu.arch_option(70, supported)


def _cupy_with_nvrtc():
    """Real cupy (no GPU needed) whose NVRTC binding loads, else None."""
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # cupy warns when NCCL is missing
            import cupy
        if getattr(cupy, "__version__", "").startswith("0.0-simt"):
            return None                              # the emulator's stand-in
        cupy.cuda.nvrtc.getVersion()
        return cupy
    except Exception:
        return None


CUPY = _cupy_with_nvrtc()


@pytest.mark.skipif(CUPY is None, reason="cupy with a loadable NVRTC is not installed "
                                          "(CI's numpy-2 leg installs cupy-cuda13x)")
@pytest.mark.parametrize("name", CU_FILES)
def test_compile_family_through_cupys_nvrtc(name, tmp_path, monkeypatch):
    """gradfuse's own compile path (gpu.compile_family / module_path) through the NVRTC
    binding real cupy uses, no GPU needed: a cubin for sm_80 and sm_90, PTX without any
    flush-to-zero instruction for an architecture NVRTC does not know, written once to
    the cache directory and reused."""
    from gradfuse import gpu
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    fam = name[:-3]
    for cc in (80, 90):
        binary, kind = gpu.compile_family(fam, cc)
        assert kind == "cubin" and binary[:4] == b"\x7fELF", (fam, cc, kind, binary[:8])
    ptx, kind = gpu.compile_family(fam, 10_000)
    assert kind == "ptx"
    assert b".ftz" not in ptx, f"{name}: flush-to-zero instructions in the PTX"
    for kernel in gpu.FAMILIES[fam]:
        assert f".entry {kernel}(".encode() in ptx
    path = gpu.module_path(fam, 90)
    assert path.startswith(str(tmp_path)) and path.endswith(".cubin")
    monkeypatch.setattr(gpu.loader, "compile_family", lambda *a: pytest.fail("compiled again"))
    assert gpu.module_path(fam, 90) == path
