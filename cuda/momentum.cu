// DGC's momentum correction (GPU twin of kernels/_momentum.h, numpy twin tests/ref_momentum.py).
//
// NVRTC-compatible: no host headers. Every float operation is an _rn intrinsic, never
// contracted into an FMA (the module is compiled with --fmad=false as well), so the bits
// are the CPU's: u = (m * u_in) + g, two roundings; Nesterov out = (q * u) + g, with q the
// momentum (m is the velocity's decay: the momentum times a pending learning-rate scale).
//
// gf_momentum_update: table rows lo..hi-1 (g of row i: counts[i] floats at ptrs[i],
// bucket positions offsets[i] ..); rows on blockIdx.y (strided by gridDim.y), a row's
// elements on blockIdx.x. Each element is read by the thread that writes it, so out may
// be the gradients themselves and u_out may be u_in.

extern "C" __global__ void gf_momentum_update(const gf_i64* ptrs, const gf_i64* offsets, const gf_i64* counts,
                                              gf_i64 lo, gf_i64 hi, const float* u_in, float* u_out,
                                              float m, const gf_i64* out, float nesterov)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 c = counts[i], o = offsets[i];
        const float* g = (const float*)ptrs[i];
        float* dst = out ? (float*)out[i] : 0;
        for (gf_i64 k = tid; k < c; k += stride) {
            float gk = g[k];
            float u = __fadd_rn(__fmul_rn(m, u_in[o + k]), gk);
            u_out[o + k] = u;
            if (dst) dst[k] = nesterov != 0.0f ? __fadd_rn(__fmul_rn(nesterov, u), gk) : u;
        }
    }
}

// Momentum factor masking: u[j] = 0 where e_out[j] == 0 and e_in[j] + x[j] != 0 (the
// compressor sent element j's non-zero value and cleared its residual).
extern "C" __global__ void gf_momentum_mask(const float* e_in, const float* x, const float* e_out, float* u,
                                            gf_i64 n)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 j = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        float c = __fadd_rn(e_in[j], x[j]);
        if (e_out[j] == 0.0f && c != 0.0f) u[j] = 0.0f;
    }
}
