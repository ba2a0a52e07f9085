"""Wrappers of ``cuda/pack.cu``: batched pack / unpack of a bucket's tensors (byte
tables), float32 unpack + divide and in-place float32 divide, as ``_core.pack``,
``unpack``, ``unpack_div`` and ``div_inplace``."""
import numpy as np

from .launch import _F32, _I64, _arr, _f32_nonzero, _grid_flat, _grid_rows, _launch, _table


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
