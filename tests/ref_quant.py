"""Numpy reference of the 1-bit and 2-bit quantization kernels (the definition of the math).

All arithmetic is float32, in the canonical order of docs/compressors.md ("Quantizing compressors").
"""
import functools

import numpy as np

F32 = np.float32


def _quiet(f):
    """Overflow/NaN are defined results here, not warnings."""
    @functools.wraps(f)
    def g(*a, **k):
        with np.errstate(all="ignore"):
            return f(*a, **k)
    return g


def _residual_in(g, e):
    g = np.ascontiguousarray(g, dtype=F32)
    if e is None or (len(e) == 0 and len(g) > 0):   # empty residual: no error feedback
        return g.copy(), False
    return (g + np.asarray(e, dtype=F32)).astype(F32), True


def _segments(n, counts):
    """(start, count) of each tensor of a bucket of n elements (counts None: one tensor)."""
    counts = [n] if counts is None else [int(c) for c in counts]
    if sum(counts) != n:
        raise ValueError(f"counts sum to {sum(counts)}, the bucket has {n} elements")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if counts else []
    return list(zip((int(s) for s in starts), counts))


def onebit_sizes(counts, block):
    """(words, scales) of a bucket with these tensor counts: sums of ceil(n_i/32), ceil(n_i/B)."""
    return (sum(-(-int(c) // 32) for c in counts), sum(-(-int(c) // block) for c in counts))


@_quiet
def _onebit_scales_one(c, block):
    n = len(c)
    nblocks = -(-n // block)
    a = np.zeros(nblocks * block, dtype=F32)
    a[:n] = np.abs(c)
    a = a.reshape(nblocks, block // 32, 32)
    lanes = np.zeros((nblocks, 32), dtype=F32)
    for i in range(block // 32):            # lane k: elements (j - start) % 32 == k, increasing j
        lanes = lanes + a[:, i, :]
    for off in (16, 8, 4, 2, 1):            # CUDA shfl_down order
        lanes[:, :off] = lanes[:, :off] + lanes[:, off:2 * off]
    counts = np.full(nblocks, block, dtype=F32)
    if nblocks:
        counts[-1] = F32(n - (nblocks - 1) * block)
    return (lanes[:, 0] / counts).astype(F32)


@_quiet
def onebit_scales(c, block, counts=None):
    """Per-block mean |c| in the canonical order: 32 lane sums, shfl_down tree, / count.
    Blocks restart at every tensor (``counts``: the bucket's tensor element counts)."""
    if block < 32 or block % 32:
        raise ValueError("block must be a multiple of 32, >= 32")
    parts = [_onebit_scales_one(c[s:s + m], block) for s, m in _segments(len(c), counts)]
    return np.concatenate(parts).astype(F32) if parts else np.zeros(0, F32)


def _pack_bits(bit):
    nw = -(-len(bit) // 32)
    padded = np.zeros(nw * 32, dtype=bool)
    padded[:len(bit)] = bit
    return np.packbits(padded, bitorder="little").view("<u4").astype(np.uint32) if nw else \
        np.zeros(0, dtype=np.uint32)


@_quiet
def onebit_compress(g, e, block, counts=None):
    """Returns (bits uint32[sum ceil(n_i/32)], scales float32[sum ceil(n_i/block)],
    residual or None, nbad). Each tensor's bits start on a new word, its blocks on a new
    scale (docs/compressors.md); ``counts`` None: one tensor."""
    c, fb = _residual_in(g, e)
    s = onebit_scales(c, block, counts)
    bit = c >= 0                                        # -0 -> True, NaN -> False
    words, sj = [], []
    si = 0
    for st, m in _segments(len(c), counts):
        words.append(_pack_bits(bit[st:st + m]))
        nb = -(-m // block)
        sj.append(np.repeat(s[si:si + nb], block)[:m])
        si += nb
    bits = np.concatenate(words).astype(np.uint32) if words else np.zeros(0, np.uint32)
    sj = np.concatenate(sj).astype(F32) if sj else np.zeros(0, F32)
    v = np.where(bit, sj, -sj).astype(F32)
    res = (c - v).astype(F32) if fb else None
    nbad = int(np.count_nonzero(~np.isfinite(s)))
    return bits, s, res, nbad


def onebit_decode(bits, scales, block, n, counts=None):
    bits = np.asarray(bits, dtype="<u4")
    scales = np.asarray(scales, dtype=F32)
    out, w, si = [], 0, 0
    for _, m in _segments(n, counts):
        nw, nb = -(-m // 32), -(-m // block)
        bit = np.unpackbits(bits[w:w + nw].view(np.uint8), bitorder="little")[:m]
        sj = np.repeat(scales[si:si + nb], block)[:m]
        out.append(np.where(bit.astype(bool), sj, -sj).astype(F32))
        w, si = w + nw, si + nb
    return np.concatenate(out).astype(F32) if out else np.zeros(0, F32)


def _sum_div(vals, divisor):
    acc = vals[0].copy()
    for v in vals[1:]:
        acc = (acc + v).astype(F32)
    if divisor != 1.0:
        acc = (acc / F32(divisor)).astype(F32)
    return acc


@_quiet
def onebit_decompress_sum(bits, scales, block, n, divisor, counts=None):
    """bits (p, nwords), scales (p, nblocks): ((v0 + v1) + ...) / float32(divisor)."""
    return _sum_div([onebit_decode(bits[r], scales[r], block, n, counts) for r in range(len(bits))],
                    divisor)


@_quiet
def twobit_compress(g, e, threshold):
    """Returns (codes uint8[ceil(n/4)], residual or None, number of non-finite c)."""
    t = F32(threshold)
    c, fb = _residual_in(g, e)
    n = len(c)
    ge = c >= t
    le = c <= -t
    q = np.where(ge, t, np.where(le, -t, F32(0))).astype(F32)
    code = np.where(ge, 1, np.where(le, 2, 0)).astype(np.uint8)
    nb = -(-n // 4)
    pad = np.zeros(nb * 4, dtype=np.uint8)
    pad[:n] = code
    pad = pad.reshape(nb, 4)
    codes = (pad[:, 0] | (pad[:, 1] << 2) | (pad[:, 2] << 4) | (pad[:, 3] << 6)).astype(np.uint8)
    res = (c - q).astype(F32) if fb else None
    return codes, res, int(np.count_nonzero(~np.isfinite(c)))


def twobit_decode(codes, threshold, n):
    t = F32(threshold)
    codes = np.asarray(codes, dtype=np.uint8)
    k = np.stack([(codes >> (2 * i)) & 3 for i in range(4)], axis=1).reshape(-1)[:n]
    return np.where(k == 1, t, np.where(k == 2, -t, F32(0))).astype(F32)


@_quiet
def twobit_decompress_sum(codes, threshold, n, divisor):
    return _sum_div([twobit_decode(codes[r], threshold, n) for r in range(len(codes))], divisor)


# ---------------------------------------------------------------- 2-bit, per-block scale

def twobit_block_sizes(counts, block):
    """(words, values) of a scaled 2-bit bucket: sums of ceil(n_i/16) and ceil(n_i/B)."""
    return (sum(-(-int(c) // 16) for c in counts), sum(-(-int(c) // block) for c in counts))


def _lane_mean(a, block, n):
    """Canonical block means of a (already |.|, masked): 32 lanes, shfl_down tree, / n."""
    nblocks = len(n)
    lanes = np.zeros((nblocks, 32), dtype=F32)
    a = a.reshape(nblocks, block // 32, 32)
    for i in range(block // 32):
        lanes = lanes + a[:, i, :]
    for off in (16, 8, 4, 2, 1):
        lanes[:, :off] = lanes[:, :off] + lanes[:, off:2 * off]
    return lanes[:, 0], n


@_quiet
def _twobit_block_one(c, block, factor):
    """(codes per element 0/1/2, values per block, decoded per element) of one tensor."""
    m = len(c)
    nb = -(-m // block)
    cnt = np.full(nb, block, dtype=np.int64)
    if nb:
        cnt[-1] = m - (nb - 1) * block
    a = np.zeros(nb * block, dtype=F32)
    a[:m] = c
    s_tot, _ = _lane_mean(np.abs(a), block, cnt)
    s = (s_tot / cnt.astype(F32)).astype(F32)
    t = (s * F32(factor)).astype(F32)
    tj = np.repeat(t, block)
    pos = (a > 0) & (a >= tj)
    neg = (a < 0) & (a <= -tj)
    pos[m:] = neg[m:] = False
    sel = pos | neg
    v_tot, _ = _lane_mean(np.where(sel, np.abs(a), F32(0)).astype(F32), block, cnt)
    nsel = sel.reshape(nb, block).sum(axis=1)
    v = np.where(nsel > 0, v_tot / np.maximum(nsel, 1).astype(F32), F32(0)).astype(F32)
    vj = np.repeat(v, block)
    q = np.where(pos, vj, np.where(neg, -vj, F32(0))).astype(F32)[:m]
    code = np.where(pos, 1, np.where(neg, 2, 0)).astype(np.uint8)[:m]
    return code, v, s, q


def _pack_codes(code):
    nw = -(-len(code) // 16)
    pad = np.zeros(nw * 16, dtype=np.uint32)
    pad[:len(code)] = code
    pad = pad.reshape(nw, 16)
    w = np.zeros(nw, dtype=np.uint32)
    for k in range(16):
        w |= pad[:, k] << np.uint32(2 * k)
    return w


@_quiet
def twobit_block_compress(g, e, block, factor, counts=None):
    """Scaled 2-bit (docs/compressors.md "2-bit: the scaled format (the default)"): returns (codes uint32[sum
    ceil(n_i/16)], values float32[sum ceil(n_i/B)], residual or None, nbad = blocks whose
    mean |c| is non-finite). Blocks restart at every tensor."""
    c, fb = _residual_in(g, e)
    words, vals, qs, nbad = [], [], [], 0
    for st, m in _segments(len(c), counts):
        code, v, s, q = _twobit_block_one(c[st:st + m], block, factor)
        words.append(_pack_codes(code))
        vals.append(v)
        qs.append(q)
        nbad += int(np.count_nonzero(~np.isfinite(s)))
    codes = np.concatenate(words).astype(np.uint32) if words else np.zeros(0, np.uint32)
    values = np.concatenate(vals).astype(F32) if vals else np.zeros(0, F32)
    q = np.concatenate(qs).astype(F32) if qs else np.zeros(0, F32)
    res = (c - q).astype(F32) if fb else None
    return codes, values, res, nbad


def twobit_block_decode(codes, values, block, n, counts=None):
    codes = np.asarray(codes, dtype=np.uint32)
    values = np.asarray(values, dtype=F32)
    out, w, b = [], 0, 0
    for _, m in _segments(n, counts):
        nw, nb = -(-m // 16), -(-m // block)
        k = np.stack([(codes[w:w + nw] >> np.uint32(2 * i)) & np.uint32(3) for i in range(16)],
                     axis=1).reshape(-1)[:m]
        vj = np.repeat(values[b:b + nb], block)[:m]
        out.append(np.where(k == 1, vj, np.where(k == 2, -vj, F32(0))).astype(F32))
        w, b = w + nw, b + nb
    return np.concatenate(out).astype(F32) if out else np.zeros(0, F32)


@_quiet
def twobit_block_decompress_sum(codes, values, block, n, divisor, counts=None):
    """codes (p, words), values (p, blocks): ((v0 + v1) + ...) / float32(divisor)."""
    return _sum_div([twobit_block_decode(codes[r], values[r], block, n, counts) for r in range(len(codes))],
                    divisor)
