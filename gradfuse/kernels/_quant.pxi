# Kernels: 1-bit and 2-bit quantization with error feedback. Included by _core.pyx.
#
# Formats, math and reduction order: docs/compressors.md ("Quantizing compressors"). Numpy twins (the
# definition of the math): tests/ref_quant.py.
from libc.stdint cimport uint32_t

cdef extern from "_quant.h" nogil:
    int64_t gf_q_stream_bytes
    int64_t GF_Q_STREAM_BYTES_DEFAULT
    int64_t gf_onebit_compress(const int64_t* ptrs, const int64_t* counts,
                               int64_t lo, int64_t hi, int64_t n,
                               const float* e_in, float* e_out, int64_t block,
                               uint32_t* bits, float* scales)
    int64_t gf_twobit_compress(const int64_t* ptrs, const int64_t* counts,
                               int64_t lo, int64_t hi, int64_t n,
                               const float* e_in, float* e_out, float t, uint8_t* codes)
    int gf_twobit_decompress_sum(const uint8_t* codes, int64_t stride, int64_t p, float t,
                                 const int64_t* ptrs, const int64_t* counts,
                                 int64_t lo, int64_t hi, int64_t n, double divisor)
    void gf_tb_init_spread()

cdef extern from "_dsum.h" nogil:
    void gf_q_block_decompress_sum(int bits, const uint32_t* words, int64_t wstride,
                                   const float* vals, int64_t vstride, int64_t p, int64_t block,
                                   const int64_t* ptrs, const int64_t* counts,
                                   int64_t lo, int64_t hi, int64_t n, double divisor)

# build the 2-bit encoder's lookup table once, at import (not lazily inside nogil calls)
gf_tb_init_spread()


def set_stream_bytes(nbytes=None):
    """Tensors of at least ``nbytes`` bytes are written by the 1-bit and 2-bit decoders
    with non-temporal stores (the same values; docs/compressors.md, "Decompress-and-sum (both compressors)"); None:
    the default (256 KiB). Returns the previous setting. For the tests and A/B
    measurements of the two kinds of store."""
    global gf_q_stream_bytes
    cdef int64_t old = gf_q_stream_bytes
    cdef int64_t v = GF_Q_STREAM_BYTES_DEFAULT if nbytes is None else int(nbytes)
    if v < 0:
        raise ValueError(f"set_stream_bytes: nbytes must be >= 0, got {nbytes!r}")
    gf_q_stream_bytes = v
    return old


cdef int64_t _q_table_n(str name, const int64_t[::1] ptrs, const int64_t[::1] offsets,
                        const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi) except -1:
    """Validate a float32 table (rows lo..hi-1) and return its element count n."""
    cdef Py_ssize_t i
    cdef int64_t n = 0
    if lo < 0 or lo > hi or hi > ptrs.shape[0] or hi > offsets.shape[0] or hi > counts.shape[0]:
        raise ValueError(f"{name}: table range {lo}:{hi} outside tables of "
                         f"{ptrs.shape[0]}/{offsets.shape[0]}/{counts.shape[0]} rows")
    for i in range(lo, hi):
        if counts[i] < 0:
            raise ValueError(f"{name}: counts[{i}] = {counts[i]} is negative")
        if offsets[i] != n:
            raise ValueError(f"{name}: offsets are not dense: offsets[{i}] = {offsets[i]}, "
                             f"expected {n}")
        if counts[i] > 0 and ptrs[i] == 0:
            raise ValueError(f"{name}: row {i} has {counts[i]} elements and a NULL pointer")
        n += counts[i]
    return n


cdef int _q_check_residual(str name, const float[::1] e_in, float[::1] e_out, int64_t n) except -1:
    if e_in.shape[0] == 0 and e_out.shape[0] == 0:
        return 0
    if e_in.shape[0] != n or e_out.shape[0] != n:
        raise ValueError(f"{name}: e_in and e_out must both be empty (no error feedback) or "
                         f"both have the bucket's {n} elements, got {e_in.shape[0]} and "
                         f"{e_out.shape[0]}")
    return 0


cdef int _q_check_rows(str name, str what, Py_ssize_t row_stride, Py_ssize_t item_stride,
                       Py_ssize_t itemsize, int64_t row_len) except -1:
    """Payload rows may be strided (rows of a wire buffer) but each row must be contiguous."""
    if row_len > 1 and item_stride != itemsize:
        raise ValueError(f"{name}: {what} rows must be contiguous (element stride {item_stride})")
    if row_stride % itemsize != 0 or row_stride < 0:
        raise ValueError(f"{name}: {what} row stride {row_stride} is not a positive multiple of {itemsize}")
    return 0


cdef int _q_check_block(str name, int block) except -1:
    if block < 32 or block % 32 != 0:
        raise ValueError(f"{name}: block size must be a multiple of 32 and >= 32, got {block}")
    return 0


cdef int _q_block_sizes(const int64_t* counts, Py_ssize_t lo, Py_ssize_t hi, int block, int bits,
                        int64_t* nwords, int64_t* nblocks) except -1:
    """Words and block floats of the blocked payload of rows lo..hi-1 with ``bits``-bit codes
    (1-bit, scaled 2-bit): every tensor's codes start on a new word and its blocks restart,
    so sum ceil(n_i/(32/bits)) words, sum ceil(n_i/block) floats."""
    cdef Py_ssize_t i
    cdef int64_t cpw = 32 // bits
    nwords[0] = 0
    nblocks[0] = 0
    if counts == NULL:
        return 0
    for i in range(lo, hi):
        nwords[0] += (counts[i] + cpw - 1) // cpw
        nblocks[0] += (counts[i] + block - 1) // block
    return 0


cdef int _q_check_divisor(str name, double divisor) except -1:
    cdef float f = <float> divisor
    if not (f == f) or f == 0.0 or f == float("inf") or f == -float("inf"):
        raise ValueError(f"{name}: divisor must be finite and non-zero as a float32, "
                         f"got {divisor}")
    return 0


cdef float _q_check_threshold(str name, double threshold) except? -1.0:
    cdef float t = <float> threshold
    if not (t > 0.0) or t == float("inf"):
        raise ValueError(f"{name}: threshold must be finite and > 0 as a float32, got {threshold}")
    return t


cdef int64_t _onebit_compress_raw(str name, const int64_t* ptrs, const int64_t* counts,
                                  Py_ssize_t lo, Py_ssize_t hi, int64_t n,
                                  const float[::1] e_in, float[::1] e_out, int block,
                                  uint32_t[::1] bits, float[::1] scales) except -2:
    cdef int64_t nwords, nblocks
    cdef int64_t r
    cdef const float* ein = NULL
    cdef float* eout = NULL
    _q_check_block(name, block)
    _q_block_sizes(counts, lo, hi, block, 1, &nwords, &nblocks)
    _q_check_residual(name, e_in, e_out, n)
    if bits.shape[0] != nwords:
        raise ValueError(f"{name}: bits must have {nwords} words (the sum over the tensors of "
                         f"ceil(n_i/32)), got {bits.shape[0]}")
    if scales.shape[0] != nblocks:
        raise ValueError(f"{name}: scales must have {nblocks} floats (the sum over the tensors of "
                         f"ceil(n_i/block)), got {scales.shape[0]}")
    if n == 0:
        return 0
    if e_in.shape[0] > 0:
        ein = &e_in[0]
        eout = &e_out[0]
    with nogil:
        r = gf_onebit_compress(ptrs, counts, lo, hi, n, ein, eout, block, &bits[0], &scales[0])
    if r < 0:
        raise MemoryError(f"{name}: cannot allocate the staging buffer")
    return r


def onebit_compress(const int64_t[::1] src_ptrs, const int64_t[::1] offsets,
                    const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi,
                    const float[::1] e_in, float[::1] e_out, int block,
                    uint32_t[::1] bits, float[::1] scales):
    """1-bit sign compression with per-block ``mean |c|`` scales and error feedback.

    c = g + e_in (or c = g when e_in/e_out are empty); blocks of ``block`` elements
    restart at every tensor (row) of the table, a tensor's last block may be short;
    for each block ``s = mean |c|`` in the canonical lane/tree order; bit = c >= 0; residual
    e_out = c - (s if bit else -s). e_in and e_out may be the same array; when they
    differ e_in is never written. Each tensor's bits start on a new word: ``bits`` has
    sum(ceil(n_i/32)) words, ``scales`` sum(ceil(n_i/block)) floats, tensor after
    tensor. Returns the number of blocks whose scale is not finite.
    """
    cdef int64_t n = _q_table_n("onebit_compress", src_ptrs, offsets, counts, lo, hi)
    if n == 0:
        return _onebit_compress_raw("onebit_compress", NULL, NULL, lo, hi, 0, e_in, e_out,
                                    block, bits, scales)
    return _onebit_compress_raw("onebit_compress", &src_ptrs[0], &counts[0], lo, hi, n,
                                e_in, e_out, block, bits, scales)


def onebit_compress_array(const float[::1] x, const float[::1] e_in, float[::1] e_out,
                          int block, uint32_t[::1] bits, float[::1] scales):
    """onebit_compress on one contiguous float32 array (a 1-row table)."""
    cdef int64_t n = x.shape[0]
    cdef int64_t ptr = <int64_t> <uintptr_t> &x[0] if n > 0 else 0
    return _onebit_compress_raw("onebit_compress_array", &ptr, &n, 0, 1, n, e_in, e_out,
                                block, bits, scales)


cdef int _q_block_decompress_raw(str name, int bits, str wname, str vname,
                                 const uint32_t[:, :] words, const float[:, :] vals, int block,
                                 const int64_t* ptrs, const int64_t* counts,
                                 Py_ssize_t lo, Py_ssize_t hi, int64_t n, double divisor) except -1:
    """Checks and the decode-and-sum of p blocked payloads with ``bits``-bit codes (1-bit,
    scaled 2-bit): ``words`` (called ``wname``) and their block floats ``vals`` (``vname``)."""
    cdef int64_t p = words.shape[0], nwords, nblocks
    _q_check_block(name, block)
    _q_check_divisor(name, divisor)
    _q_block_sizes(counts, lo, hi, block, bits, &nwords, &nblocks)
    if p < 1:
        raise ValueError(f"{name}: need at least one payload row")
    if vals.shape[0] != p:
        raise ValueError(f"{name}: {wname} has {p} rows but {vname} has {vals.shape[0]}")
    if words.shape[1] != nwords:
        raise ValueError(f"{name}: {wname} rows must have {nwords} words (the sum over the tensors "
                         f"of ceil(n_i/{32 // bits})), got {words.shape[1]}")
    if vals.shape[1] != nblocks:
        raise ValueError(f"{name}: {vname} rows must have {nblocks} floats (the sum over the "
                         f"tensors of ceil(n_i/block)), got {vals.shape[1]}")
    if n == 0:
        return 0
    _q_check_rows(name, wname, words.strides[0], words.strides[1], sizeof(uint32_t), nwords)
    _q_check_rows(name, vname, vals.strides[0], vals.strides[1], sizeof(float), nblocks)
    with nogil:
        gf_q_block_decompress_sum(bits, &words[0, 0], words.strides[0] // sizeof(uint32_t), &vals[0, 0],
                                  vals.strides[0] // sizeof(float), p, block,
                                  ptrs, counts, lo, hi, n, divisor)
    return 0


def onebit_decompress_sum(const uint32_t[:, :] bits, const float[:, :] scales, int block,
                          const int64_t[::1] dst_ptrs, const int64_t[::1] offsets,
                          const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi,
                          double divisor):
    """Decode p 1-bit payloads (row r = rank r) and write their sum / divisor.

    The payload layout is onebit_compress's (per-tensor blocks and words) for the same
    table counts. dst[j] = (((v_0 + v_1) + v_2) + ... + v_{p-1}) / (float)divisor, in
    float32, starting from v_0; no division when divisor == 1.0.
    """
    cdef int64_t n = _q_table_n("onebit_decompress_sum", dst_ptrs, offsets, counts, lo, hi)
    if n == 0:
        _q_block_decompress_raw("onebit_decompress_sum", 1, "bits", "scales", bits, scales, block,
                                NULL, NULL, lo, hi, 0, divisor)
        return
    _q_block_decompress_raw("onebit_decompress_sum", 1, "bits", "scales", bits, scales, block,
                            &dst_ptrs[0], &counts[0], lo, hi, n, divisor)


def onebit_decompress_sum_array(const uint32_t[:, :] bits, const float[:, :] scales,
                                int block, float[::1] out, double divisor):
    """onebit_decompress_sum into one contiguous float32 array (n = len(out))."""
    cdef int64_t n = out.shape[0]
    cdef int64_t ptr = <int64_t> <uintptr_t> &out[0] if n > 0 else 0
    _q_block_decompress_raw("onebit_decompress_sum_array", 1, "bits", "scales", bits, scales, block,
                            &ptr, &n, 0, 1, n, divisor)


cdef int64_t _twobit_compress_raw(str name, const int64_t* ptrs, const int64_t* counts,
                                  Py_ssize_t lo, Py_ssize_t hi, int64_t n,
                                  const float[::1] e_in, float[::1] e_out, double threshold,
                                  uint8_t[::1] codes) except -2:
    cdef int64_t nbytes = (n + 3) // 4
    cdef int64_t r
    cdef const float* ein = NULL
    cdef float* eout = NULL
    cdef float t = _q_check_threshold(name, threshold)
    _q_check_residual(name, e_in, e_out, n)
    if codes.shape[0] != nbytes:
        raise ValueError(f"{name}: codes must have ceil(n/4) = {nbytes} bytes, got {codes.shape[0]}")
    if n == 0:
        return 0
    if e_in.shape[0] > 0:
        ein = &e_in[0]
        eout = &e_out[0]
    with nogil:
        r = gf_twobit_compress(ptrs, counts, lo, hi, n, ein, eout, t, &codes[0])
    if r < 0:
        raise MemoryError(f"{name}: cannot allocate the staging buffer")
    return r


def twobit_compress(const int64_t[::1] src_ptrs, const int64_t[::1] offsets,
                    const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi,
                    const float[::1] e_in, float[::1] e_out, float threshold,
                    uint8_t[::1] codes):
    """2-bit threshold quantization (MXNet kvstore) with error feedback.

    c = g + e_in; code 0b01 (+t) if c >= t, 0b10 (-t) if c <= -t, else 0b00;
    e_out = c - q. 4 codes per byte, LSB first; ``codes`` has ceil(n/4) bytes.
    Returns the number of non-finite c (NaN/Inf), which the caller must refuse.
    """
    cdef int64_t n = _q_table_n("twobit_compress", src_ptrs, offsets, counts, lo, hi)
    if n == 0:
        return _twobit_compress_raw("twobit_compress", NULL, NULL, lo, hi, 0, e_in, e_out,
                                    threshold, codes)
    return _twobit_compress_raw("twobit_compress", &src_ptrs[0], &counts[0], lo, hi, n,
                                e_in, e_out, threshold, codes)


def twobit_compress_array(const float[::1] x, const float[::1] e_in, float[::1] e_out,
                          float threshold, uint8_t[::1] codes):
    """twobit_compress on one contiguous float32 array (a 1-row table)."""
    cdef int64_t n = x.shape[0]
    cdef int64_t ptr = <int64_t> <uintptr_t> &x[0] if n > 0 else 0
    return _twobit_compress_raw("twobit_compress_array", &ptr, &n, 0, 1, n, e_in, e_out,
                                threshold, codes)


cdef int _twobit_decompress_raw(str name, const uint8_t[:, :] codes, double threshold,
                                const int64_t* ptrs, const int64_t* counts,
                                Py_ssize_t lo, Py_ssize_t hi, int64_t n, double divisor) except -1:
    cdef int64_t p = codes.shape[0], nbytes = (n + 3) // 4
    cdef int r
    cdef float t = _q_check_threshold(name, threshold)
    _q_check_divisor(name, divisor)
    if p < 1:
        raise ValueError(f"{name}: need at least one payload row")
    if codes.shape[1] != nbytes:
        raise ValueError(f"{name}: codes rows must have ceil(n/4) = {nbytes} bytes, "
                         f"got {codes.shape[1]}")
    if n == 0:
        return 0
    _q_check_rows(name, "codes", codes.strides[0], codes.strides[1], 1, nbytes)
    with nogil:
        r = gf_twobit_decompress_sum(&codes[0, 0], codes.strides[0], p, t, ptrs, counts, lo, hi, n, divisor)
    if r < 0:
        raise MemoryError(f"{name}: cannot allocate the staging buffer")
    return 0


def twobit_decompress_sum(const uint8_t[:, :] codes, float threshold,
                          const int64_t[::1] dst_ptrs, const int64_t[::1] offsets,
                          const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi,
                          double divisor):
    """Decode p 2-bit payloads (row r = rank r) and write their sum / divisor.

    Codes 0b00 and 0b11 decode to 0, 0b01 to +t, 0b10 to -t; summed in rank order
    starting from v_0, then / (float)divisor (none when divisor == 1.0).
    """
    cdef int64_t n = _q_table_n("twobit_decompress_sum", dst_ptrs, offsets, counts, lo, hi)
    if n == 0:
        _twobit_decompress_raw("twobit_decompress_sum", codes, threshold, NULL, NULL,
                               lo, hi, 0, divisor)
        return
    _twobit_decompress_raw("twobit_decompress_sum", codes, threshold, &dst_ptrs[0],
                           &counts[0], lo, hi, n, divisor)


def twobit_decompress_sum_array(const uint8_t[:, :] codes, float threshold,
                                float[::1] out, double divisor):
    """twobit_decompress_sum into one contiguous float32 array (n = len(out))."""
    cdef int64_t n = out.shape[0]
    cdef int64_t ptr = <int64_t> <uintptr_t> &out[0] if n > 0 else 0
    _twobit_decompress_raw("twobit_decompress_sum_array", codes, threshold, &ptr, &n,
                           0, 1, n, divisor)
