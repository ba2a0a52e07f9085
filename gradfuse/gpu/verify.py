"""Compile every kernel on the current device and check there that subnormals survive."""
import numpy as np

# check_subnormals runs the pack and cast wrappers, so this module sits above the families
from .cast import sum16
from .loader import _MODULES, FAMILIES, OPTIONS, cupy, kernel
from .packing import div_f32


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
