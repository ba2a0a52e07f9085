// The Adam correction (GPU twin of gradfuse/kernels/_adam.h, numpy twin tests/ref_adam.py):
// the moment update in the frozen preconditioner's units, fused with error feedback and
// 1-bit compression; the step after the exchange; plain Adam.
//
// NVRTC-compatible: no host headers. Every float operation is an _rn intrinsic (never
// contracted into an FMA; the module is compiled with --fmad=false as well), in _adam.h's
// order, so the bits are the CPU's:
//
//   moment  x = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(__fmul_rn(c1, g), r))
//   step    s = __fdiv_rn(__fmul_rn(a, m), __fadd_rn(__fmul_rn(b, __fsqrt_rn(v)), eps))
//   plain   m = b1 m + c1 g;  v = b2 v + c2 (g g);  out = s
//   apply   mask != 0: m = mb, out = a * mb;  else m = 0, out = 0
//
// The row kernels put table rows on blockIdx.y (strided by gridDim.y) and a row's elements
// on blockIdx.x; each element is read by the thread that writes it. The 1-bit kernel is
// cuda/onebit.cu's compress (gf_onebit_compress_body, common.cuh: one warp per block)
// reading the moment instead of g.

// c = (b1 m + (c1 g) r) + e of element k of block bl (m, r, e indexed by bucket position)
struct gf_adam_val {
    const float* m;
    const float* r;
    const float* e_in;
    float b1, c1;
    __device__ __forceinline__ float operator()(const gf_q_block& bl, gf_i64 k) const
    {
        gf_i64 j = bl.epos + k;
        float q = __fmul_rn(__fmul_rn(c1, bl.x[k]), r[j]);
        float x = __fadd_rn(__fmul_rn(b1, m[j]), q);
        return e_in ? __fadd_rn(x, e_in[j]) : x;
    }
};

extern "C" __global__ void gf_adam_moment(const gf_i64* ptrs, const gf_i64* offsets, const gf_i64* counts,
                                          gf_i64 lo, gf_i64 hi, const float* m, const float* r, float b1, float c1,
                                          float* x)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 c = counts[i], o = offsets[i];
        const float* g = (const float*)ptrs[i];
        for (gf_i64 k = tid; k < c; k += stride) {
            float q = __fmul_rn(__fmul_rn(c1, g[k]), r[o + k]);
            x[o + k] = __fadd_rn(__fmul_rn(b1, m[o + k]), q);
        }
    }
}

// gf_onebit_compress_table of c = (b1 m + (c1 g) r) + e_in (e_in/e_out NULL: without error
// feedback; they may be the same array).
extern "C" __global__ void gf_adam_onebit_compress_table(const gf_i64* ptrs, const gf_i64* offsets,
                                                         const gf_i64* counts, gf_i64 lo, gf_i64 hi,
                                                         const gf_i64* bstart, const gf_i64* wstart,
                                                         gf_i64 nblocks, const float* m, const float* r,
                                                         float b1, float c1, const float* e_in, float* e_out,
                                                         gf_i64 block, gf_u32* bits, float* scales, gf_u64* bad)
{
    gf_q_table<1> src;
    src.ptrs = ptrs; src.offsets = offsets; src.counts = counts;
    src.bstart = bstart; src.wstart = wstart; src.lo = lo; src.hi = hi;
    gf_adam_val val;
    val.m = m; val.r = r; val.e_in = e_in; val.b1 = b1; val.c1 = c1;
    gf_onebit_compress_body(src, nblocks, val, e_out, block, bits, scales, bad);
}

// After the exchange: the outputs hold the exchanged moment mb; m = mb, out = a * mb, or
// both 0 where mask is 0 (mask NULL: none).
extern "C" __global__ void gf_adam_apply(const gf_i64* ptrs, const gf_i64* offsets, const gf_i64* counts,
                                         gf_i64 lo, gf_i64 hi, float* m, const unsigned char* mask, float a)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 c = counts[i], o = offsets[i];
        float* out = (float*)ptrs[i];
        for (gf_i64 k = tid; k < c; k += stride) {
            float mb = out[k];
            if (mask && !mask[o + k]) {
                m[o + k] = 0.0f;
                out[k] = 0.0f;
            } else {
                m[o + k] = mb;
                out[k] = __fmul_rn(a, mb);
            }
        }
    }
}

// Plain Adam: the outputs hold the averaged gradient g and receive the step; m, v in place.
extern "C" __global__ void gf_adam_plain(const gf_i64* ptrs, const gf_i64* offsets, const gf_i64* counts,
                                         gf_i64 lo, gf_i64 hi, float* m, float* v, float b1, float c1, float b2,
                                         float c2, float a, float b, float eps)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 c = counts[i], o = offsets[i];
        float* out = (float*)ptrs[i];
        for (gf_i64 k = tid; k < c; k += stride) {
            float g = out[k];
            float mk = __fadd_rn(__fmul_rn(b1, m[o + k]), __fmul_rn(c1, g));
            float vk = __fadd_rn(__fmul_rn(b2, v[o + k]), __fmul_rn(c2, __fmul_rn(g, g)));
            m[o + k] = mk;
            v[o + k] = vk;
            out[k] = __fdiv_rn(__fmul_rn(a, mk), __fadd_rn(__fmul_rn(b, __fsqrt_rn(vk)), eps));
        }
    }
}
