// Sparse (top-k / random-k) decompress-and-accumulate: GPU twin of gf_sp_decompress_* in
// gradfuse/_sparse.h (docs/compressors.md). The selection kernels (radix select) are
// not ported yet; only the receive side, which every rank runs on all p payloads.
//
//   out[j] = 0.0f; for r in 0..p-1, m in 0..k-1: if indices[r, m] == j: out[j] += values[r, m]
//   then out[j] = out[j] / (float)divisor unless divisor == 1.0
//
// NVRTC-compatible, own fixed-width types, _rn intrinsics only.
//
// Order: the host zeroes the outputs, then launches one scatter-add per rank, in rank
// order (stream order orders the ranks). Inside a rank the indices are strictly
// ascending (the compressors' payload rule), so every thread owns a distinct element
// and the adds do not race; a row that is not strictly ascending (checked first, by
// gf_sparse_check) goes through the serial kernel instead, which adds in m order like
// the CPU. Then one division pass.


// info[0]: smallest flat position r*k+m with an index >= n (atomicMin; starts at ~0);
// info[1]: number of pairs indices[r, m-1] >= indices[r, m] (a row not strictly ascending).
extern "C" __global__ void gf_sparse_check(const gf_u32* indices, gf_i64 p, gf_i64 k, gf_i64 n, gf_u64* info)
{
    gf_i64 total = p * k;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 q = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += stride) {
        gf_u32 j = indices[q];
        if ((gf_i64)j >= n) atomicMin(info, (gf_u64)q);
        if (q % k != 0 && indices[q - 1] >= j) atomicAdd(info + 1, 1ull);
    }
}

// row of bucket position j: last r in [lo, hi) with offsets[r] <= j (dense offsets)
__device__ __forceinline__ gf_i64 gf_row_of(const gf_i64* offsets, gf_i64 lo, gf_i64 hi, gf_i64 j)
{
    gf_i64 a = lo, b = hi - 1;
    while (a < b) {
        gf_i64 m = a + ((b - a + 1) >> 1);
        if (offsets[m] <= j) a = m; else b = m - 1;
    }
    return a;
}

__device__ __forceinline__ float* gf_dst(const gf_i64* ptrs, const gf_i64* offsets, gf_i64 lo, gf_i64 hi,
                                         gf_i64 j)
{
    gf_i64 r = gf_row_of(offsets, lo, hi, j);
    return (float*)ptrs[r] + (j - offsets[r]);
}

// one rank's row: out[idx[m]] += val[m], m parallel (indices unique within the row)
extern "C" __global__ void gf_sparse_add_array(const float* val, const gf_u32* idx, gf_i64 k, float* out)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 m = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; m < k; m += stride) {
        float* d = out + idx[m];
        *d = __fadd_rn(*d, val[m]);
    }
}

extern "C" __global__ void gf_sparse_add_table(const float* val, const gf_u32* idx, gf_i64 k,
                                               const gf_i64* ptrs, const gf_i64* offsets,
                                               gf_i64 lo, gf_i64 hi)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 m = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; m < k; m += stride) {
        float* d = gf_dst(ptrs, offsets, lo, hi, (gf_i64)idx[m]);
        *d = __fadd_rn(*d, val[m]);
    }
}

// the same, one thread in m order (rows that are not strictly ascending)
extern "C" __global__ void gf_sparse_add_serial(const float* val, const gf_u32* idx, gf_i64 k, float* out,
                                                const gf_i64* ptrs, const gf_i64* offsets,
                                                gf_i64 lo, gf_i64 hi)
{
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    for (gf_i64 m = 0; m < k; m++) {
        float* d = out ? out + idx[m] : gf_dst(ptrs, offsets, lo, hi, (gf_i64)idx[m]);
        *d = __fadd_rn(*d, val[m]);
    }
}

// table rows lo..hi-1 (rows on blockIdx.y): zero = 1 sets them to +0.0f, else divides by d
extern "C" __global__ void gf_sparse_rows(const gf_i64* ptrs, const gf_i64* counts, gf_i64 lo, gf_i64 hi,
                                          int zero, float d)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 c = counts[i];
        float* x = (float*)ptrs[i];
        for (gf_i64 t = tid; t < c; t += stride) x[t] = zero ? 0.0f : __fdiv_rn(x[t], d);
    }
}

extern "C" __global__ void gf_sparse_div_array(float* out, gf_i64 n, float d)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 t = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += stride)
        out[t] = __fdiv_rn(out[t], d);
}
