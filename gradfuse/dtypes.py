"""The dtypes gradfuse reduces, and their codes in the kernels and on the wire."""
import numpy as np

# Must match the DEF codes in _core.pyx.
CODE = {
    np.dtype(np.float16): 1,
    np.dtype(np.float32): 2,
    np.dtype(np.float64): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
}
DTYPE = {c: d for d, c in CODE.items()}
FLOAT_CODES = (1, 2, 3)
SUPPORTED = ", ".join(str(d) for d in CODE)


def name(code):
    """Readable dtype name for a kernel code (``'unsupported'`` for 0)."""
    return str(DTYPE[code]) if code in DTYPE else "unsupported"
