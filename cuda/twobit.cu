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
            nonfinite = (__float_as_uint(x) & 0x7fffffffu) >= 0x7f800000u;
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

// Divisor modes (host-chosen like _quant.h's gf_q_divide): 0 none, 1 x / f, 2 x * f
// (f then holds the exact reciprocal of a power-of-two divisor).
__device__ __forceinline__ float gf_apply_div(float x, int mode, float f)
{
    if (mode == 1) return __fdiv_rn(x, f);
    if (mode == 2) return __fmul_rn(x, f);
    return x;
}

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
// The default 2-bit format (docs/compressors.md "2-bit: layout"), twin of _twobit.h. Blocks
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

struct gf_tbb_block {
    const float* x;
    gf_i64 epos, count, wpos;
};

struct gf_tbb_array {
    const float* x;
    gf_i64 n;
    __device__ __forceinline__ gf_tbb_block at(gf_i64 g, gf_i64 block) const
    {
        gf_tbb_block r;
        r.epos = g * block;
        r.x = x + r.epos;
        r.count = n - r.epos < block ? n - r.epos : block;
        r.wpos = r.epos >> 4;
        return r;
    }
};

// Rows lo..hi-1 of a table (dense offsets); bstart/wstart: R + 1 prefix sums of the rows'
// ceil(count/B) blocks and ceil(count/16) words.
struct gf_tbb_table {
    const gf_i64* ptrs;
    const gf_i64* offsets;
    const gf_i64* counts;
    const gf_i64* bstart;
    const gf_i64* wstart;
    gf_i64 lo, hi;
    __device__ __forceinline__ gf_tbb_block at(gf_i64 g, gf_i64 block) const
    {
        gf_i64 a = 0, b = hi - lo - 1;
        while (a < b) {
            gf_i64 m = a + ((b - a + 1) >> 1);
            if (bstart[m] <= g) a = m; else b = m - 1;
        }
        const gf_i64 row = lo + a, k0 = (g - bstart[a]) * block;
        gf_tbb_block r;
        r.x = (const float*)ptrs[row] + k0;
        r.epos = offsets[row] + k0;
        r.count = counts[row] - k0 < block ? counts[row] - k0 : block;
        r.wpos = wstart[a] + (k0 >> 4);
        return r;
    }
};

__device__ __forceinline__ float gf_tbb_c(const gf_tbb_block& bl, const float* e_in, gf_i64 k)
{
    float g = bl.x[k];
    return e_in ? __fadd_rn(g, e_in[bl.epos + k]) : g;
}

__device__ __forceinline__ float gf_tbb_abs(float x)
{
    return __uint_as_float(__float_as_uint(x) & 0x7fffffffu);
}

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
    const gf_tbb_block bl = src.at(b, block);
    const gf_i64 count = bl.count;
    const gf_i64 ng = (count + 31) >> 5;            // groups of 32 elements

    // 1) s = mean |c|
    float acc = 0.0f;
    for (gf_i64 i = 0; i < ng; i++) {
        gf_i64 k = i * 32 + lane;
        if (k < count) acc = __fadd_rn(acc, gf_tbb_abs(gf_tbb_c(bl, e_in, k)));
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
            float x = gf_tbb_c(bl, e_in, k);
            on = (x > 0.0f && x >= t) || (x < 0.0f && x <= nt);
            if (on) sel = __fadd_rn(sel, gf_tbb_abs(x));
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
        float x = in ? gf_tbb_c(bl, e_in, k) : 0.0f;
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
        if ((__float_as_uint(s) & 0x7fffffffu) >= 0x7f800000u) atomicAdd(bad, 1ull);
    }
}

// e_in/e_out: both NULL or both n long (may be the same array). bad: one u64, +1 per block
// whose mean |c| is NaN or +-inf.
extern "C" __global__ void gf_twobit_block_compress_array(const float* x, gf_i64 n, const float* e_in,
                                                          float* e_out, gf_i64 block, float factor,
                                                          gf_u32* codes, float* values, gf_u64* bad)
{
    gf_tbb_array src;
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
    gf_tbb_table src;
    src.ptrs = ptrs; src.offsets = offsets; src.counts = counts;
    src.bstart = bstart; src.wstart = wstart; src.lo = lo; src.hi = hi;
    gf_twobit_block_body(src, nblocks, e_in, e_out, block, factor, codes, values, bad);
}

// ((v_0 + v_1) + ...) from v_0 in rank order, then divided; code 1 -> +v, 2 -> -v, else 0
__device__ __forceinline__ float gf_tbb_sum(const gf_u32* codes, gf_i64 cstride, const float* values,
                                            gf_i64 vstride, gf_i64 p, gf_i64 w, gf_u32 sh, gf_i64 b,
                                            int mode, float f)
{
    float acc = 0.0f;
    for (gf_i64 r = 0; r < p; r++) {
        float v = values[r * vstride + b];
        gf_u32 c = (codes[r * cstride + w] >> sh) & 3u;
        float x = c == 1u ? v : (c == 2u ? -v : 0.0f);
        acc = r == 0 ? x : __fadd_rn(acc, x);
    }
    return gf_apply_div(acc, mode, f);
}

extern "C" __global__ void gf_twobit_block_decompress_sum_array(const gf_u32* codes, gf_i64 cstride,
                                                                const float* values, gf_i64 vstride,
                                                                gf_i64 p, gf_i64 block, float* out,
                                                                gf_i64 n, int mode, float f)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 j = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        out[j] = gf_tbb_sum(codes, cstride, values, vstride, p, j >> 4, (gf_u32)(j & 15) * 2, j / block,
                            mode, f);
}

extern "C" __global__ void gf_twobit_block_decompress_sum_table(const gf_u32* codes, gf_i64 cstride,
                                                                const float* values, gf_i64 vstride,
                                                                gf_i64 p, gf_i64 block,
                                                                const gf_i64* ptrs, const gf_i64* counts,
                                                                gf_i64 lo, gf_i64 hi, const gf_i64* bstart,
                                                                const gf_i64* wstart, int mode, float f)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 m = counts[i], w0 = wstart[i - lo], b0 = bstart[i - lo];
        float* d = (float*)ptrs[i];
        for (gf_i64 k = tid; k < m; k += stride)
            d[k] = gf_tbb_sum(codes, cstride, values, vstride, p, w0 + (k >> 4), (gf_u32)(k & 15) * 2,
                              b0 + k / block, mode, f);
    }
}
