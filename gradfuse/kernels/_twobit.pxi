# Kernels: scaled 2-bit quantization (per-tensor blocks, a value per block) with error
# feedback. Included by _core.pyx after _quant.pxi (whose argument checks and blocked
# decode-and-sum, _q_block_decompress_raw, it shares).
#
# Format and math: docs/compressors.md ("2-bit: the scaled format (the default)"); numpy twin: tests/ref_quant.py
# (twobit_block_*); GPU twin: cuda/twobit.cu (gradfuse.gpu.twobit_block_*).

cdef extern from "_twobit.h" nogil:
    int64_t gf_twobit_block_compress(const int64_t* ptrs, const int64_t* counts,
                                     int64_t lo, int64_t hi, int64_t n,
                                     const float* e_in, float* e_out, int64_t block,
                                     float factor, uint32_t* codes, float* values)


cdef float _tbb_check_factor(str name, double factor) except? -1.0:
    cdef float f = <float> factor
    if not (f >= 0.0) or f == float("inf"):
        raise ValueError(f"{name}: factor must be finite and >= 0 as a float32, got {factor}")
    return f


cdef int64_t _tbb_compress_raw(str name, const int64_t* ptrs, const int64_t* counts,
                               Py_ssize_t lo, Py_ssize_t hi, int64_t n,
                               const float[::1] e_in, float[::1] e_out, int block, double factor,
                               uint32_t[::1] codes, float[::1] values) except -2:
    cdef int64_t nwords, nblocks
    cdef int64_t r
    cdef const float* ein = NULL
    cdef float* eout = NULL
    cdef float f = _tbb_check_factor(name, factor)
    _q_check_block(name, block)
    _q_block_sizes(counts, lo, hi, block, 2, &nwords, &nblocks)
    _q_check_residual(name, e_in, e_out, n)
    if codes.shape[0] != nwords:
        raise ValueError(f"{name}: codes must have {nwords} words (the sum over the tensors of "
                         f"ceil(n_i/16)), got {codes.shape[0]}")
    if values.shape[0] != nblocks:
        raise ValueError(f"{name}: values must have {nblocks} floats (the sum over the tensors of "
                         f"ceil(n_i/block)), got {values.shape[0]}")
    if n == 0:
        return 0
    if e_in.shape[0] > 0:
        ein = &e_in[0]
        eout = &e_out[0]
    with nogil:
        r = gf_twobit_block_compress(ptrs, counts, lo, hi, n, ein, eout, block, f, &codes[0], &values[0])
    if r < 0:
        raise MemoryError(f"{name}: cannot allocate the staging buffer")
    return r


def twobit_block_compress(const int64_t[::1] src_ptrs, const int64_t[::1] offsets,
                          const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi,
                          const float[::1] e_in, float[::1] e_out, int block, double factor,
                          uint32_t[::1] codes, float[::1] values):
    """Scaled 2-bit compression with error feedback, blocks per tensor.

    c = g + e_in (or g when e_in/e_out are empty); per block ``s = mean |c|`` (the 1-bit
    scale's order), t = s * factor; code + if c > 0 and c >= t, - if c < 0 and c <= -t;
    ``v = mean |c|`` of the selected (0 if none); e_out = c - (+v, -v or 0). ``codes`` has
    sum(ceil(n_i/16)) words, ``values`` sum(ceil(n_i/block)) floats, tensor after tensor.
    Returns the number of blocks whose ``mean |c|`` is not finite.
    """
    cdef int64_t n = _q_table_n("twobit_block_compress", src_ptrs, offsets, counts, lo, hi)
    if n == 0:
        return _tbb_compress_raw("twobit_block_compress", NULL, NULL, lo, hi, 0, e_in, e_out,
                                 block, factor, codes, values)
    return _tbb_compress_raw("twobit_block_compress", &src_ptrs[0], &counts[0], lo, hi, n,
                             e_in, e_out, block, factor, codes, values)


def twobit_block_compress_array(const float[::1] x, const float[::1] e_in, float[::1] e_out,
                                int block, double factor, uint32_t[::1] codes, float[::1] values):
    """twobit_block_compress on one contiguous float32 array (a 1-row table)."""
    cdef int64_t n = x.shape[0]
    cdef int64_t ptr = <int64_t> <uintptr_t> &x[0] if n > 0 else 0
    return _tbb_compress_raw("twobit_block_compress_array", &ptr, &n, 0, 1, n, e_in, e_out,
                             block, factor, codes, values)


def twobit_block_decompress_sum(const uint32_t[:, :] codes, const float[:, :] values, int block,
                                const int64_t[::1] dst_ptrs, const int64_t[::1] offsets,
                                const int64_t[::1] counts, Py_ssize_t lo, Py_ssize_t hi,
                                double divisor):
    """Decode p scaled 2-bit payloads (row r = rank r) and write their sum / divisor:
    ((v_0 + v_1) + ...) in float32 from v_0, then / (float)divisor (none when 1.0)."""
    cdef int64_t n = _q_table_n("twobit_block_decompress_sum", dst_ptrs, offsets, counts, lo, hi)
    if n == 0:
        _q_block_decompress_raw("twobit_block_decompress_sum", 2, "codes", "values", codes, values, block,
                                NULL, NULL, lo, hi, 0, divisor)
        return
    _q_block_decompress_raw("twobit_block_decompress_sum", 2, "codes", "values", codes, values, block,
                            &dst_ptrs[0], &counts[0], lo, hi, n, divisor)


def twobit_block_decompress_sum_array(const uint32_t[:, :] codes, const float[:, :] values,
                                      int block, float[::1] out, double divisor):
    """twobit_block_decompress_sum into one contiguous float32 array (n = len(out))."""
    cdef int64_t n = out.shape[0]
    cdef int64_t ptr = <int64_t> <uintptr_t> &out[0] if n > 0 else 0
    _q_block_decompress_raw("twobit_block_decompress_sum_array", 2, "codes", "values", codes, values,
                            block, &ptr, &n, 0, 1, n, divisor)
