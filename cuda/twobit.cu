// 2-bit threshold quantization (MXNet kvstore semantics) with error feedback, and
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
