// PowerSGD (GPU twin of kernels/_powersgd.h, numpy twin tests/ref_powersgd.py).
//
// NVRTC-compatible: no host headers. Every operation is an _rn intrinsic (float and
// double), never contracted into an FMA, so the bits are the CPU's.
//
// gf_psgd_orthogonalize: one warp (a block of 32 threads) per matrix, matrices strided
// over the grid. Column i's dot products are the CPU's order exactly: lane l adds the
// products of rows l, l + 32, ... in row order (double), then a butterfly over lane
// l ^ h for h = 16 .. 1 (every lane ends with the same bits); a zero column stays zero.
//
// gf_psgd_gather / gf_psgd_scatter: rows lo..hi-1 on blockIdx.y (strided), a row's
// elements on blockIdx.x; route[i - lo] >= 0: the row's offset in W (and e, A), else
// -1 - route its offset in U. gather counts non-finite values into bad[0].

__device__ __forceinline__ double gf_psgd_dot(const float* x, gf_i64 rows, gf_i64 cols, gf_i64 a, gf_i64 b)
{
    double s = 0.0;
    for (gf_i64 k = threadIdx.x; k < rows; k += 32) {
        const float* r = x + k * cols;
        s = __dadd_rn(s, __dmul_rn((double)r[a], (double)r[b]));
    }
    for (int h = 16; h >= 1; h >>= 1)
        s = __dadd_rn(s, __shfl_sync(GF_FULL, s, (int)(threadIdx.x ^ h)));
    return s;
}

extern "C" __global__ void gf_psgd_orthogonalize(float* base, const gf_i64* offsets, const gf_i64* rows,
                                                 const gf_i64* cols, gf_i64 count, double eps)
{
    for (gf_i64 b = blockIdx.x; b < count; b += gridDim.x) {
        float* x = base + offsets[b];
        gf_i64 n = rows[b], r = cols[b];
        for (gf_i64 i = 0; i < r; i++) {
            double s = gf_psgd_dot(x, n, r, i, i);
            if (s == 0.0) continue;            // the same on every lane: no divergence
            double d = __dadd_rn(__dsqrt_rn(s), eps);
            for (gf_i64 k = threadIdx.x; k < n; k += 32) x[k * r + i] = (float)__ddiv_rn((double)x[k * r + i], d);
            __syncwarp();
            for (gf_i64 j = i + 1; j < r; j++) {
                double t = gf_psgd_dot(x, n, r, i, j);
                for (gf_i64 k = threadIdx.x; k < n; k += 32)
                    x[k * r + j] = (float)__dsub_rn((double)x[k * r + j], __dmul_rn(t, (double)x[k * r + i]));
                __syncwarp();
            }
        }
    }
}

extern "C" __global__ void gf_psgd_gather(const gf_i64* src, const gf_i64* counts, const gf_i64* route, gf_i64 lo,
                                          gf_i64 hi, const float* e, float* W, float* U, gf_u64* bad)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    gf_u64 mine = 0;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 c = counts[i], to = route[i - lo];
        const float* g = (const float*)src[i];
        for (gf_i64 k = tid; k < c; k += stride) {
            float v = g[k];
            if (to >= 0) {
                if (e) v = __fadd_rn(v, e[to + k]);
                W[to + k] = v;
            } else {
                U[-1 - to + k] = v;
            }
            mine += gf_nonfinite(v);
        }
    }
    if (mine) atomicAdd(bad, mine);
}

extern "C" __global__ void gf_psgd_scatter(const gf_i64* dst, const gf_i64* counts, const gf_i64* route, gf_i64 lo,
                                           gf_i64 hi, const float* A, const float* W, float* e_out, const float* U,
                                           float divisor)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 c = counts[i], to = route[i - lo];
        float* o = (float*)dst[i];
        for (gf_i64 k = tid; k < c; k += stride) {
            if (to >= 0) {
                float v = A[to + k];
                if (e_out) e_out[to + k] = __fsub_rn(W[to + k], v);
                o[k] = v;
            } else {
                float u = U[-1 - to + k];
                o[k] = divisor == 1.0f ? u : __fdiv_rn(u, divisor);
            }
        }
    }
}
