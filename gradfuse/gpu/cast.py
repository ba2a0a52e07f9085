"""Wrappers of ``cuda/cast.cu``: float32 <-> fp16 / bf16 with overflow and underflow
counts, fused pack + cast and unpack + cast, and the 16-bit sum, as ``_core.cast_to16``,
``cast_from16``, ``pack_cast``, ``unpack_cast`` and ``sum16``."""
import numpy as np

from .launch import _F32, _I64, _arr, _counter, _grid_flat, _grid_rows, _launch, _scale_arg, _table


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
