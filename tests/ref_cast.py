"""Pure-numpy definition of the fp16 / bf16 cast kernels (gradfuse/kernels/_cast.pxi).

Everything works on bit patterns: fp16 and bf16 values are uint16 arrays, float32
values are float32 arrays (compare them through ``.view(np.uint32)``).

fmt codes: 1 = fp16, 2 = bf16.
"""
import numpy as np

FP16 = 1
BF16 = 2

F32_INF = np.uint32(0x7F800000)


def _bits(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


# ---------------------------------------------------------------- element casts

def f32_to_f16(x):
    """numpy's float32 -> float16 (round to nearest even; NaN keeps sign and the top
    10 payload bits, forced non-zero, never quieted), as uint16 bits."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.ascontiguousarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def f16_to_f32(h):
    """numpy's exact float16 -> float32 (NaN payload kept, not quieted)."""
    return np.ascontiguousarray(h, dtype=np.uint16).view(np.float16).astype(np.float32)


def f32_to_bf16(x):
    """float32 -> bf16: round to nearest even on the top 16 bits,
    ``(u + 0x7fff + ((u >> 16) & 1)) >> 16``; NaN -> ``(u >> 16) | 0x0040``."""
    u = _bits(x).astype(np.uint64)            # no 32-bit wrap for NaN patterns
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = np.where(nan, (u >> 16) | 0x0040, r)
    return r.astype(np.uint16)


def bf16_to_f32(h):
    """bf16 -> float32: ``u << 16`` (exact)."""
    return (np.ascontiguousarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to16(fmt, x):
    return f32_to_f16(x) if fmt == FP16 else f32_to_bf16(x)


def from16(fmt, h):
    return f16_to_f32(h) if fmt == FP16 else bf16_to_f32(h)


def isnan16(fmt, h):
    h = np.asarray(h, dtype=np.uint16) & 0x7FFF
    return h > (0x7C00 if fmt == FP16 else 0x7F80)


def isinf16(fmt, h):
    return (np.asarray(h, dtype=np.uint16) & 0x7FFF) == (0x7C00 if fmt == FP16 else 0x7F80)


# ---------------------------------------------------------------- counts

def counts(fmt, x, h):
    """(n_overflow, n_underflow) of converting inputs ``x`` to 16-bit results ``h``:
    finite x whose result is +-inf; non-zero finite x whose result is +-0."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    fin = np.isfinite(x)
    zero16 = (np.asarray(h, dtype=np.uint16) & 0x7FFF) == 0
    ovf = int(np.count_nonzero(fin & isinf16(fmt, h)))
    und = int(np.count_nonzero(fin & (x != 0) & zero16))
    return ovf, und


# ---------------------------------------------------------------- kernels

def cast_to16(fmt, x, prescale=1.0):
    """(bits, n_overflow, n_underflow) of ``cvt(x / (float32)prescale)``; no division
    at all when prescale == 1.0 (so NaN payloads pass untouched). The counts are on
    the inputs x."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if prescale == 1.0:
        q = x
    else:
        with np.errstate(all="ignore"):
            q = x / np.float32(prescale)
    h = to16(fmt, q)
    o, u = counts(fmt, x, h)
    return h, o, u


def cast_from16(fmt, h, divisor=1.0):
    """``to_f32(h) / (float32)divisor``; no division when divisor == 1.0."""
    f = from16(fmt, h)
    if divisor != 1.0:
        with np.errstate(all="ignore"):
            f = f / np.float32(divisor)
    return f


def pack_cast(fmt, arrays, prescale=1.0):
    """The fusion buffer of pack_cast over float32 ``arrays`` (in table order), with
    the summed counts."""
    if not arrays:
        return np.zeros(0, np.uint16), 0, 0
    h, o, u = cast_to16(fmt, np.concatenate([np.ravel(a) for a in arrays]).astype(np.float32), prescale)
    return h, o, u


def unpack_cast(fmt, buf, sizes, divisor=1.0):
    """The float32 tensors unpack_cast writes from ``buf`` for element ``sizes``."""
    f = cast_from16(fmt, buf, divisor)
    out, off = [], 0
    for n in sizes:
        out.append(f[off:off + n].copy())
        off += n
    return out


def sum16(fmt, a, b):
    """``cvt(to_f32(a) + to_f32(b))``: one float32 add, rounded once.

    NaN rule, independent of operand order: a NaN ``a`` (the MPI ``in`` buffer)
    gives ``a`` with its quiet bit set (0x0200 fp16, 0x0040 bf16); else a NaN ``b``
    gives ``b`` quieted; else inf + -inf gives 0xfe00 (fp16) / 0xffc0 (bf16), the
    x86 default NaN. Otherwise the plain numpy formula."""
    a = np.asarray(a, dtype=np.uint16)
    b = np.asarray(b, dtype=np.uint16)
    with np.errstate(all="ignore"):
        s = from16(fmt, a) + from16(fmt, b)
    r = to16(fmt, s)
    q = np.uint16(0x0200 if fmt == FP16 else 0x0040)
    dflt = np.uint16(0xFE00 if fmt == FP16 else 0xFFC0)
    r = np.where(np.isnan(s), dflt, r)
    r = np.where(isnan16(fmt, b), b | q, r)
    r = np.where(isnan16(fmt, a), a | q, r)
    return r.astype(np.uint16)
