// 2-bit quantization with error feedback and decompress-and-accumulate: MXNet's absolute
// threshold (first half) and the scaled, per-block format (second half). Threshold part:
// decompress-and-accumulate. GPU twin of gradfuse/_quant.h (docs/compressors.md).
//
// NVRTC-compatible: no host headers, own fixed-width types; float arithmetic only
// through __fadd_rn / __fsub_rn / __fdiv_rn / __fmul_rn (never an FMA).
//
// Compress geometry: one thread per element, grid-stride in whole warps (every lane of a
// warp runs the same iterations, so the shuffles see full warps): lane k of a warp holds
// element base + k; lanes 4m..4m+3 make code byte (base + 4m) / 4 through shfl_down, and
// lane 4m writes it (base is a multiple of 32, so a byte never straddles warps). Lanes
// past n carry code 0 (padding codes are 0). Non-finite c: a ballot per iteration,
// popcounted in a register, one atomicAdd per warp at the end.



// gf_src_array / gf_src_table: common.cuh

template <class Src>
__device__ __forceinline__ void gf_twobit_compress_body(Src& src, gf_i64 n, const float* e_in,
                                                        float* e_out, float t, gf_u8* codes,
                                                        gf_u64* bad)
{
    const int lane = threadIdx.x & 31;
    const float nt = -t;
    const gf_i64 warp = ((gf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const gf_i64 nwarps = ((gf_i64)gridDim.x * blockDim.x) >> 5;
    gf_u32 nb = 0;
    for (gf_i64 base = warp * 32; base < n; base += nwarps * 32) {
        gf_i64 j = base + lane;
        gf_u32 code = 0;
        bool nonfinite = false;
        if (j < n) {
            float g = src.get(j);
            float x = e_in ? __fadd_rn(g, e_in[j]) : g;
            bool ge = x >= t, le = x <= nt;          // NaN: both false -> code 0
            code = (gf_u32)ge | ((gf_u32)le << 1);
            nonfinite = gf_nonfinite(x);
            if (e_out) {
                float q = ge ? t : 0.0f;             // t > 0: at most one of the two holds
                q = le ? nt : q;
                e_out[j] = __fsub_rn(x, q);         // q == +0: e == c exactly (-0 kept)
            }
        }
        gf_u32 c1 = __shfl_down_sync(GF_FULL, code, 1);
        gf_u32 c2 = __shfl_down_sync(GF_FULL, code, 2);
        gf_u32 c3 = __shfl_down_sync(GF_FULL, code, 3);
        if ((lane & 3) == 0 && j < n)
            codes[j >> 2] = (gf_u8)(code | (c1 << 2) | (c2 << 4) | (c3 << 6));
        nb += __popc(__ballot_sync(GF_FULL, nonfinite));
    }
    if (lane == 0 && nb) atomicAdd(bad, (gf_u64)nb);
}

// codes: ceil(n/4) bytes; e_in/e_out: both NULL or both n long (may be the same array).
// bad: one u64, incremented by the number of non-finite c_j.
extern "C" __global__ void gf_twobit_compress_array(const float* x, gf_i64 n, const float* e_in,
                                                    float* e_out, float t, gf_u8* codes, gf_u64* bad)
{
    gf_src_array src;
    src.x = x;
    gf_twobit_compress_body(src, n, e_in, e_out, t, codes, bad);
}

extern "C" __global__ void gf_twobit_compress_table(const gf_i64* ptrs, const gf_i64* offsets,
                                                    const gf_i64* counts, gf_i64 lo, gf_i64 hi,
                                                    gf_i64 n, const float* e_in, float* e_out,
                                                    float t, gf_u8* codes, gf_u64* bad)
{
    gf_src_table src;
    src.init(ptrs, offsets, counts, lo, hi);
    gf_twobit_compress_body(src, n, e_in, e_out, t, codes, bad);
}

// gf_apply_div (the divisor modes): common.cuh

// ((v_0 + v_1) + ...) from v_0 in rank order; codes 00 and 11 -> 0.0f, 01 -> +t, 10 -> -t
__device__ __forceinline__ float gf_twobit_sum(const gf_u8* codes, gf_i64 stride, gf_i64 p,
                                               float t, gf_i64 j, int mode, float f)
{
    gf_i64 byte = j >> 2;
    gf_u32 sh = (gf_u32)(j & 3) * 2;
    float acc = 0.0f;
    for (gf_i64 r = 0; r < p; r++) {
        gf_u32 c = (codes[r * stride + byte] >> sh) & 3u;
        float v = c == 1u ? t : (c == 2u ? -t : 0.0f);
        acc = r == 0 ? v : __fadd_rn(acc, v);
    }
    return gf_apply_div(acc, mode, f);
}

// codes: p rows of `stride` bytes (row r = rank r)
extern "C" __global__ void gf_twobit_decompress_sum_array(const gf_u8* codes, gf_i64 stride, gf_i64 p,
                                                          float t, float* out, gf_i64 n,
                                                          int mode, float f)
{
    gf_i64 gs = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 j = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gs)
        out[j] = gf_twobit_sum(codes, stride, p, t, j, mode, f);
}

extern "C" __global__ void gf_twobit_decompress_sum_table(const gf_u8* codes, gf_i64 stride, gf_i64 p,
                                                          float t, const gf_i64* ptrs,
                                                          const gf_i64* offsets, const gf_i64* counts,
                                                          gf_i64 lo, gf_i64 hi, int mode, float f)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 gs = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 m = counts[i], o = offsets[i];
        float* d = (float*)ptrs[i];
        for (gf_i64 k = tid; k < m; k += gs)
            d[k] = gf_twobit_sum(codes, stride, p, t, o + k, mode, f);
    }
}

// ================================================================== scaled 2-bit
// The default 2-bit format (docs/compressors.md "2-bit: the scaled format (the default)"), twin of _twobit.h. Blocks
// of B elements (B a multiple of 32) restart at every tensor; per block s = mean |c| (the
// 1-bit scale's order), t = s * factor, + if c > 0 && c >= t, - if c < 0 && c <= -t,
// v = (sum of the selected |c|, same order) / (float)nsel (0 when nsel = 0). Codes: tensor
// i's words start at wstart[i] (ceil(n_i/16) words), element k in bits 2(k%16)+{0,1} of
// its word k/16; values at bstart[i].
//
// Compress geometry: ONE WARP PER BLOCK, 8 warps per CTA (as cuda/onebit.cu). Lane k takes
// elements start + k + 32 i, i ascending: pass 1 sums |c| (tree 16..1, / count), pass 2
// sums the selected |c| (same tree) and counts them (ballot popcounts), pass 3 writes the
// codes (two ballots, interleaved: group i of 32 elements gives words 2i and 2i+1, the
// second only where the block has elements past 32i + 16) and the residuals. c is read
// again in each pass (g + e_in recomputed: the same float32 add, the same bits); in place
// (e_in == e_out) each element's residual is written by the lane that read it, in the
// last pass.

// gf_q_array, gf_q_table, gf_q_c, gf_abs, gf_nonfinite: common.cuh

// bit i of m moved to bit 2i, for the low 16 bits of m
__device__ __forceinline__ gf_u32 gf_tbb_spread16(gf_u32 m)
{
    m &= 0xffffu;
    m = (m | (m << 8)) & 0x00ff00ffu;
    m = (m | (m << 4)) & 0x0f0f0f0fu;
    m = (m | (m << 2)) & 0x33333333u;
    m = (m | (m << 1)) & 0x55555555u;
    return m;
}

__device__ __forceinline__ float gf_tbb_tree(float acc)
{
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
        acc = __fadd_rn(acc, __shfl_down_sync(GF_FULL, acc, off));
    return __shfl_sync(GF_FULL, acc, 0);
}

template <class Src>
__device__ __forceinline__ void gf_twobit_block_body(const Src& src, gf_i64 nblocks, const float* e_in,
                                                     float* e_out, gf_i64 block, float factor,
                                                     gf_u32* codes, float* values, gf_u64* bad)
{
    const int lane = threadIdx.x & 31;
    const gf_i64 b = (gf_i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= nblocks) return;                       // whole warp leaves together
    const gf_q_block bl = src.at(b, block);
    const gf_i64 count = bl.count;
    const gf_i64 ng = (count + 31) >> 5;            // groups of 32 elements

    // 1) s = mean |c|
    float acc = 0.0f;
    for (gf_i64 i = 0; i < ng; i++) {
        gf_i64 k = i * 32 + lane;
        if (k < count) acc = __fadd_rn(acc, gf_abs(gf_q_c(bl, e_in, k)));
    }
    const float s = __fdiv_rn(gf_tbb_tree(acc), (float)count);
    const float t = __fmul_rn(s, factor), nt = -t;

    // 2) v = mean |c| of the selected
    float sel = 0.0f;
    gf_i64 nsel = 0;
    for (gf_i64 i = 0; i < ng; i++) {
        gf_i64 k = i * 32 + lane;
        bool on = false;
        if (k < count) {
            float x = gf_q_c(bl, e_in, k);
            on = (x > 0.0f && x >= t) || (x < 0.0f && x <= nt);
            if (on) sel = __fadd_rn(sel, gf_abs(x));
        }
        nsel += __popc(__ballot_sync(GF_FULL, on));
    }
    const float tot = gf_tbb_tree(sel);
    const float v = nsel ? __fdiv_rn(tot, (float)nsel) : 0.0f, nv = -v;

    // 3) codes and residuals
    gf_u32* wb = codes + bl.wpos;
    float* eo = e_out ? e_out + bl.epos : 0;
    for (gf_i64 i = 0; i < ng; i++) {
        gf_i64 k = i * 32 + lane;
        bool in = k < count;
        float x = in ? gf_q_c(bl, e_in, k) : 0.0f;
        bool pos = in && x > 0.0f && x >= t;
        bool neg = in && x < 0.0f && x <= nt;
        gf_u32 pm = __ballot_sync(GF_FULL, pos), nm = __ballot_sync(GF_FULL, neg);
        if (lane == 0) {
            wb[2 * i] = gf_tbb_spread16(pm) | (gf_tbb_spread16(nm) << 1);
            if (i * 32 + 16 < count)
                wb[2 * i + 1] = gf_tbb_spread16(pm >> 16) | (gf_tbb_spread16(nm >> 16) << 1);
        }
        if (eo && in) eo[k] = __fsub_rn(x, pos ? v : (neg ? nv : 0.0f));
    }
    if (lane == 0) {
        values[b] = v;
        if (gf_nonfinite(s)) atomicAdd(bad, 1ull);
    }
}

// e_in/e_out: both NULL or both n long (may be the same array). bad: one u64, +1 per block
// whose mean |c| is NaN or +-inf.
extern "C" __global__ void gf_twobit_block_compress_array(const float* x, gf_i64 n, const float* e_in,
                                                          float* e_out, gf_i64 block, float factor,
                                                          gf_u32* codes, float* values, gf_u64* bad)
{
    gf_q_array<2> src;
    src.x = x;
    src.n = n;
    gf_twobit_block_body(src, (n + block - 1) / block, e_in, e_out, block, factor, codes, values, bad);
}

extern "C" __global__ void gf_twobit_block_compress_table(const gf_i64* ptrs, const gf_i64* offsets,
                                                          const gf_i64* counts, gf_i64 lo, gf_i64 hi,
                                                          const gf_i64* bstart, const gf_i64* wstart,
                                                          gf_i64 nblocks, const float* e_in, float* e_out,
                                                          gf_i64 block, float factor, gf_u32* codes,
                                                          float* values, gf_u64* bad)
{
    gf_q_table<2> src;
    src.ptrs = ptrs; src.offsets = offsets; src.counts = counts;
    src.bstart = bstart; src.wstart = wstart; src.lo = lo; src.hi = hi;
    gf_twobit_block_body(src, nblocks, e_in, e_out, block, factor, codes, values, bad);
}

// The scaled 2-bit decoder: code 1 -> +v, 2 -> -v, 0 and 3 -> 0 (gf_q_dsum_array /
// gf_q_dsum_table in common.cuh are the driver: the element's word and block, the sum over
// the rows, the divide).
struct gf_tbb_decoder {
    enum { BITS = 2 };
    static __device__ __forceinline__ float value(gf_u32 c, float v)
    {
        c &= 3u;
        return c == 1u ? v : (c == 2u ? -v : 0.0f);
    }
};

// codes: p rows of cstride words, values: p rows of vstride floats (row r = rank r); one
// array: element j in bits 2(j % 16), 2(j % 16) + 1 of word j / 16, value j / block.
extern "C" __global__ void gf_twobit_block_decompress_sum_array(const gf_u32* codes, gf_i64 cstride,
                                                                const float* values, gf_i64 vstride,
                                                                gf_i64 p, gf_i64 block, float* out,
                                                                gf_i64 n, int mode, float f)
{
    gf_q_dsum_array<gf_tbb_decoder>(codes, cstride, values, vstride, p, block, out, n, mode, f);
}

extern "C" __global__ void gf_twobit_block_decompress_sum_table(const gf_u32* codes, gf_i64 cstride,
                                                                const float* values, gf_i64 vstride,
                                                                gf_i64 p, gf_i64 block,
                                                                const gf_i64* ptrs, const gf_i64* counts,
                                                                gf_i64 lo, gf_i64 hi, const gf_i64* bstart,
                                                                const gf_i64* wstart, int mode, float f)
{
    gf_q_dsum_table<gf_tbb_decoder>(codes, cstride, values, vstride, p, block, ptrs, counts, lo, hi,
                                    bstart, wstart, mode, f);
}
