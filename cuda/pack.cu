// Batched pack / unpack of gradfuse fusion buckets (GPU twin of _core.pack/unpack/unpack_div).
//
// NVRTC-compatible: no host headers; fixed-width types are defined here. Compile with
// --fmad=false (the only float arithmetic here is a division, done with __fdiv_rn).
//
// Table (the plan's, byte based like _core.pack): rows lo..hi-1, row i copies nbytes[i]
// bytes between the tensor at address ptrs[i] and buf + offsets[i].
//
// Launch geometry: grid (gx, gy), block 256. Rows go to blockIdx.y (a row loop strides
// by gridDim.y, so any number of rows works with gy <= 65535); inside a row, the CTAs of
// blockIdx.x stride over the row's 16-byte (else 4-byte, else 1-byte) words. The width
// is picked per row from the alignment of both addresses and of the byte count.


struct __align__(16) gf_v16 { gf_u32 a, b, c, d; };

__device__ __forceinline__ void gf_copy_row(void* dst, const void* src, gf_i64 nbytes)
{
    gf_u64 d = (gf_u64)dst, s = (gf_u64)src;
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    if (((d | s | (gf_u64)nbytes) & 15) == 0) {
        gf_v16* D = (gf_v16*)dst;
        const gf_v16* S = (const gf_v16*)src;
        gf_i64 m = nbytes >> 4;
        for (gf_i64 k = tid; k < m; k += stride) D[k] = S[k];
    } else if (((d | s | (gf_u64)nbytes) & 3) == 0) {
        gf_u32* D = (gf_u32*)dst;
        const gf_u32* S = (const gf_u32*)src;
        gf_i64 m = nbytes >> 2;
        for (gf_i64 k = tid; k < m; k += stride) D[k] = S[k];
    } else {
        gf_u8* D = (gf_u8*)dst;
        const gf_u8* S = (const gf_u8*)src;
        for (gf_i64 k = tid; k < nbytes; k += stride) D[k] = S[k];
    }
}

// buf[offsets[i] .. +nbytes[i]) = *ptrs[i], rows lo..hi-1
extern "C" __global__ void gf_pack(gf_u8* buf, const gf_i64* ptrs, const gf_i64* offsets,
                                   const gf_i64* nbytes, gf_i64 lo, gf_i64 hi)
{
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 nb = nbytes[i];
        if (nb > 0) gf_copy_row(buf + offsets[i], (const void*)ptrs[i], nb);
    }
}

// *ptrs[i] = buf[offsets[i] .. +nbytes[i]), rows lo..hi-1
extern "C" __global__ void gf_unpack(const gf_u8* buf, const gf_i64* ptrs, const gf_i64* offsets,
                                     const gf_i64* nbytes, gf_i64 lo, gf_i64 hi)
{
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 nb = nbytes[i];
        if (nb > 0) gf_copy_row((void*)ptrs[i], buf + offsets[i], nb);
    }
}

// x / d with x86's NaN rule: a NaN x comes back quieted with its payload (divss/divps),
// where the GPU would return the canonical NaN. d is finite and non-zero (checked by
// the caller), so x is the only possible NaN operand.
__device__ __forceinline__ float gf_div_x86(float x, float d)
{
    gf_u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(u | 0x00400000u);
    return __fdiv_rn(x, d);
}

// float32 unpack + divide (averaging): dst_i[k] = buf[offsets[i]/4 + k] / d, with
// byte offsets/nbytes as in gf_unpack (multiples of 4). The same bits as _core.unpack_div
// with code float32: one IEEE division per element, NaNs quieted with payload kept.
extern "C" __global__ void gf_unpack_div_f32(const gf_u8* buf, const gf_i64* ptrs, const gf_i64* offsets,
                                             const gf_i64* nbytes, gf_i64 lo, gf_i64 hi, float d)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 m = nbytes[i] >> 2;
        const float* S = (const float*)(buf + offsets[i]);
        float* D = (float*)ptrs[i];
        for (gf_i64 k = tid; k < m; k += stride) D[k] = gf_div_x86(S[k], d);
    }
}

// In-place float32 division of one array (the in-place / direct bucket case).
extern "C" __global__ void gf_div_f32(float* x, gf_i64 n, float d)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 k = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride)
        x[k] = gf_div_x86(x[k], d);
}
