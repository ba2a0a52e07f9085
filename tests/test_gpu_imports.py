"""The GPU modules import without cupy, and never import it on their own."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_importing_gradfuse_and_gpu_modules_does_not_import_cupy():
    code = ("import sys, gradfuse, gradfuse.gpu, gradfuse.bench.gpu, gradfuse.comm.nccl\n"
            "from gradfuse.comm import make_gpu_communicator\n"
            "assert 'cupy' not in sys.modules, 'cupy was imported'\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0 and "ok" in p.stdout, p.stdout + p.stderr


def test_available_false_without_cupy_or_device():
    from gradfuse import gpu
    try:
        import cupy
        has_device = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_device = False
    assert gpu.available() == has_device


def test_kernel_sources_found():
    from gradfuse import gpu
    for fam in gpu.FAMILIES:
        src = gpu.source(fam + ".cu")
        for name in gpu.FAMILIES[fam]:
            assert f"void {name}(" in src


def test_repository_cuda_folder_does_not_shadow_nvidia_cuda_namespace(tmp_path):
    """cupy 14 imports ``cuda.pathfinder`` (NVIDIA's ``cuda`` namespace package). Run from
    a checkout, the repository root is on sys.path, so its ``cuda/`` folder must stay a
    namespace portion (no __init__.py), not a package that hides NVIDIA's. Simulated with
    a site directory holding a ``cuda/pathfinder`` namespace portion, as the
    cuda-pathfinder wheel installs it; the kernels must still be found."""
    assert not os.path.exists(os.path.join(ROOT, "cuda", "__init__.py"))
    site = tmp_path / "site"
    (site / "cuda" / "pathfinder").mkdir(parents=True)
    (site / "cuda" / "pathfinder" / "__init__.py").write_text("FOUND = 'nvidia'\n")
    code = ("import cuda.pathfinder, gradfuse.gpu as g\n"
            "assert cuda.pathfinder.FOUND == 'nvidia'\n"
            "assert 'extern \"C\"' in g.source('onebit.cu')\n"
            "print('ok')\n")
    # "-c" puts the working directory (the repository root) first on sys.path, as
    # `python -m pytest` and `python -` in scripts/gpu_check.sh do
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0 and "ok" in p.stdout, p.stdout + p.stderr
