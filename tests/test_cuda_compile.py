"""CI check of the CUDA kernels without a GPU: every ``cuda/*.cu`` compiles.

1. nvcc, for sm_80 and sm_90 (one nvcc per file, both targets in one call, files in
   parallel), with the flags the runtime uses (--fmad=false, C++14). A syntax error fails
   the test. Skipped only when nvcc is missing.
2. The NVRTC rules checked as text: no #include (NVRTC has no host headers), no
   <cstdint>-style types, no FMA intrinsics, no CUDA half/bf16 conversions (they return a
   canonical NaN), and every kernel listed in gradfuse.gpu.FAMILIES is defined.
3. If NVRTC itself can be loaded here (cupy's nvrtc binding and a libnvrtc), each file
   compiles with exactly gradfuse.gpu.OPTIONS, as cupy.RawModule will on the device.
"""
import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import tempfile

import pytest

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


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_nvcc_compiles_every_kernel_sm80_sm90():
    nvcc = _nvcc()
    with tempfile.TemporaryDirectory() as tmp:
        def build(name):
            unit = os.path.join(tmp, name)
            with open(unit, "w") as f:
                f.write(_source(name))
            cmd = [nvcc, "-std=c++14", "--fmad=false", "-c",
                   "-gencode", "arch=compute_80,code=sm_80",
                   "-gencode", "arch=compute_90,code=sm_90",
                   "-o", os.path.join(tmp, name + ".o"), unit]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            return name, p.returncode, p.stdout + p.stderr

        with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
            results = list(ex.map(build, CU_FILES))
    failed = [f"{name}:\n{out}" for name, rc, out in results if rc != 0]
    assert not failed, "nvcc failed:\n" + "\n".join(failed)


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


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:
        return None


@pytest.mark.skipif(_nvrtc() is None, reason="no NVRTC library loadable here")
@pytest.mark.parametrize("name", CU_FILES)
def test_nvrtc_compiles_with_runtime_options(name):
    from gradfuse import gpu
    nvrtc = _nvrtc()
    for arch in ("compute_80", "compute_90"):
        prog = nvrtc.createProgram(_source(name), name, [], [])
        try:
            nvrtc.compileProgram(prog, list(gpu.OPTIONS) + [f"-arch={arch}"])
        except Exception as e:
            pytest.fail(f"{name} ({arch}): {e}\n{nvrtc.getProgramLog(prog)}")
        finally:
            nvrtc.destroyProgram(prog)
