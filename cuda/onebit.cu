// 1-bit compression (sign + per-block mean |c| scale) with fused error feedback, and
// decompress-and-accumulate. GPU twin of gradfuse/_quant.h; the format and the math
// are frozen in docs/compressors.md and must come out bit for bit the same.
//
// NVRTC-compatible: no host headers, own fixed-width types. Float arithmetic uses the
// _rn intrinsics only (__fadd_rn, __fsub_rn, __fdiv_rn, __fmul_rn), which are never
// contracted into an FMA; compile with --fmad=false anyway.
//
// Layout (docs/compressors.md): blocks restart at every tensor of a table (a tensor's last
// block may be short), tensor i's bits start at word wstart[i] and its scales at bstart[i]
// (both prefix sums over the rows lo..hi-1, made by the host: gradfuse/gpu/onebit.py), so
// no block spans two tensors and every block starts on a word.
//
// Compress geometry: ONE WARP PER 1-BIT BLOCK (B elements, B a multiple of 32), 8 warps
// per CTA (blockDim 256), grid ceil(nblocks / 8). A table kernel's warp finds its tensor
// by a binary search of bstart. That makes the canonical order the
// natural one: lane k of the warp sums |c_j| for j = start + k, start + k + 32, ... in
// increasing j (each load instruction of the warp reads 32 consecutive floats), then the
// __shfl_down_sync tree 16, 8, 4, 2, 1 gives lane 0 the total, s = total / count. The
// sign word of elements start + 32i .. start + 32i + 31 is one __ballot_sync (lane k ->
// bit k). Up to GF_OB_REGS values per lane (B <= 32 * GF_OB_REGS) stay in registers
// between the scale and the emit pass (one read of g and e_in); larger blocks read
// them a second time (same bits, more traffic).
//
// A tensor's last, short block behaves as if zero padded: lanes past the count add
// nothing (adding +0.0f changes no lane sum), their ballot bits are 0, and words past
// ceil(count/32) do not exist.


// ------------------------------------------------------------------ compress
// (gf_onebit_compress_body, gf_q_feedback, gf_q_array, gf_q_table: common.cuh)

// e_in/e_out: both NULL (no error feedback) or both n long; they may be the same array
// (in place: each element's e_in is read by the lane that later writes its e_out, before
// writing it). bad: one u64, incremented once per block whose scale is NaN or +-inf.
extern "C" __global__ void gf_onebit_compress_array(const float* x, gf_i64 n, const float* e_in,
                                                    float* e_out, gf_i64 block, gf_u32* bits,
                                                    float* scales, gf_u64* bad)
{
    gf_q_array<1> src;
    src.x = x;
    src.n = n;
    gf_onebit_compress_body(src, (n + block - 1) / block, gf_q_feedback{e_in}, e_out, block, bits, scales, bad);
}

extern "C" __global__ void gf_onebit_compress_table(const gf_i64* ptrs, const gf_i64* offsets,
                                                    const gf_i64* counts, gf_i64 lo, gf_i64 hi,
                                                    const gf_i64* bstart, const gf_i64* wstart,
                                                    gf_i64 nblocks, const float* e_in, float* e_out,
                                                    gf_i64 block, gf_u32* bits, float* scales,
                                                    gf_u64* bad)
{
    gf_q_table<1> src;
    src.ptrs = ptrs; src.offsets = offsets; src.counts = counts;
    src.bstart = bstart; src.wstart = wstart; src.lo = lo; src.hi = hi;
    gf_onebit_compress_body(src, nblocks, gf_q_feedback{e_in}, e_out, block, bits, scales, bad);
}

// ------------------------------------------------------------------ decompress-sum

// The 1-bit decoder: bit 1 -> +s, 0 -> -s (gf_q_dsum_array / gf_q_dsum_table in common.cuh
// are the driver: the element's word and block, the sum over the rows, the divide).
struct gf_ob_decoder {
    enum { BITS = 1 };
    static __device__ __forceinline__ float value(gf_u32 c, float s) { return c & 1u ? s : -s; }
};

// bits: p rows of wstride words, scales: p rows of sstride floats (row r = rank r); one
// array: element j in bit j % 32 of word j / 32, scale j / block.
extern "C" __global__ void gf_onebit_decompress_sum_array(const gf_u32* bits, gf_i64 wstride,
                                                          const float* scales, gf_i64 sstride,
                                                          gf_i64 p, gf_i64 block, float* out,
                                                          gf_i64 n, int mode, float f)
{
    gf_q_dsum_array<gf_ob_decoder>(bits, wstride, scales, sstride, p, block, out, n, mode, f);
}

// Table rows on blockIdx.y, the row's elements on blockIdx.x: element k of row i in bit
// k % 32 of word wstart[i - lo] + k / 32, scale bstart[i - lo] + k / block.
extern "C" __global__ void gf_onebit_decompress_sum_table(const gf_u32* bits, gf_i64 wstride,
                                                          const float* scales, gf_i64 sstride,
                                                          gf_i64 p, gf_i64 block,
                                                          const gf_i64* ptrs, const gf_i64* counts,
                                                          gf_i64 lo, gf_i64 hi, const gf_i64* bstart,
                                                          const gf_i64* wstart, int mode, float f)
{
    gf_q_dsum_table<gf_ob_decoder>(bits, wstride, scales, sstride, p, block, ptrs, counts, lo, hi,
                                   bstart, wstart, mode, f);
}
