"""Run a script with the SIMT emulator standing in for cupy (tests/cuda_emu):

    python tests/scripts/run_emulated.py examples/numpy_digits_compression.py --device gpu ...

so the GPU branches of examples run on a machine without a GPU (under mpiexec too)."""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "cuda_emu"))
import fakecupy  # noqa: E402

fakecupy.install()
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
