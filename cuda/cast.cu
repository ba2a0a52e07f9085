// fp16 / bf16 casts of gradfuse (GPU twin of gradfuse/_cast.h, docs/compressors.md).
//
// NVRTC-compatible: no host headers, own fixed-width types. Every rule is integer bit
// math ported line by line from _half.h / _cast.h; CUDA's __float2half / __float2bfloat16
// are NOT used because they return a canonical NaN. Float arithmetic is one IEEE
// division (__fdiv_rn) or addition (__fadd_rn), never contracted into an FMA.
//
// fmt: 1 = fp16, 2 = bf16. scaled = 0: no division at all (prescale/divisor == 1.0).
//
// Counts (float -> 16 bits): cnt[0] += finite x whose result is +-inf,
// cnt[1] += non-zero finite x whose result is +-0; x is the input before the prescale.
// Each thread counts in registers, a warp sums with shfl_down, lane 0 adds atomically.
//
// Geometry: block 256 threads (a multiple of 32 is required: the count reduction uses
// full warps and no thread returns early), grid-stride loops; table kernels put rows on
// blockIdx.y (strided by gridDim.y) and stride over a row's elements with blockIdx.x.


#define GF_FMT_F16 1
#define GF_FMT_BF16 2
#define GF_F16_OVF 0x477ff000u
#define GF_F16_UND 0x33000000u
#define GF_BF16_OVF 0x7f7f8000u
#define GF_BF16_UND 0x00008000u

// numpy's npy_floatbits_to_halfbits (= gf_float_to_half), on the bit pattern f
__device__ __forceinline__ gf_u16 gf_f32bits_to_half(gf_u32 f)
{
    gf_u32 f_exp, f_sig;
    gf_u16 h_sgn, h_sig;
    h_sgn = (gf_u16)((f & 0x80000000u) >> 16);
    f_exp = (f & 0x7f800000u);
    if (f_exp >= 0x47800000u) {                    // overflow, inf or NaN
        if (f_exp == 0x7f800000u) {
            f_sig = (f & 0x007fffffu);
            if (f_sig != 0) {
                gf_u16 ret = (gf_u16)(0x7c00u + (f_sig >> 13));
                if (ret == 0x7c00u) ret++;         // keep it a NaN
                return (gf_u16)(h_sgn + ret);
            }
            return (gf_u16)(h_sgn + 0x7c00u);
        }
        return (gf_u16)(h_sgn + 0x7c00u);          // overflow to signed inf
    }
    if (f_exp <= 0x38000000u) {                    // subnormal half or signed zero
        if (f_exp < 0x33000000u) return h_sgn;
        f_exp >>= 23;
        f_sig = (0x00800000u + (f & 0x007fffffu));
        f_sig >>= (113 - f_exp);
        if (((f_sig & 0x00003fffu) != 0x00001000u) || (f & 0x000007ffu)) f_sig += 0x00001000u;
        h_sig = (gf_u16)(f_sig >> 13);
        return (gf_u16)(h_sgn + h_sig);
    }
    {
        gf_u16 h_exp = (gf_u16)((f_exp - 0x38000000u) >> 13);
        f_sig = (f & 0x007fffffu);
        if ((f_sig & 0x00003fffu) != 0x00001000u) f_sig += 0x00001000u;
        h_sig = (gf_u16)(f_sig >> 13);
        h_sig = (gf_u16)(h_sig + h_exp);          // a carry bumps the exponent, up to inf
        return (gf_u16)(h_sgn + h_sig);
    }
}

// gf_half_to_float: exact; a NaN keeps sign and payload (not quieted)
__device__ __forceinline__ gf_u32 gf_half_to_f32bits(gf_u16 h)
{
    gf_u32 sign = ((gf_u32)(h & 0x8000u)) << 16;
    gf_u32 h_exp = (h & 0x7c00u);
    gf_u32 h_sig = (h & 0x03ffu);
    if (h_exp == 0) {
        if (h_sig == 0) return sign;               // signed zero
        h_sig <<= 1;                               // subnormal: normalise
        while ((h_sig & 0x0400u) == 0) { h_sig <<= 1; h_exp++; }
        {
            gf_u32 f_exp = ((gf_u32)(127 - 15 - h_exp)) << 23;
            gf_u32 f_sig = ((gf_u32)(h_sig & 0x03ffu)) << 13;
            return sign + f_exp + f_sig;
        }
    }
    if (h_exp == 0x7c00u) return sign + 0x7f800000u + (h_sig << 13);   // inf or NaN
    return sign + (((gf_u32)(h & 0x7fffu) + 0x1c000u) << 13);
}

__device__ __forceinline__ gf_u16 gf_f32bits_to_bf16(gf_u32 u)
{
    if ((u & 0x7fffffffu) > 0x7f800000u) return (gf_u16)((u >> 16) | 0x0040u);
    return (gf_u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ gf_u32 gf_bf16_to_f32bits(gf_u16 h) { return ((gf_u32)h) << 16; }

__device__ __forceinline__ gf_u16 gf_cvt16(int fmt, gf_u32 u)
{
    return fmt == GF_FMT_F16 ? gf_f32bits_to_half(u) : gf_f32bits_to_bf16(u);
}

__device__ __forceinline__ gf_u32 gf_from16bits(int fmt, gf_u16 h)
{
    return fmt == GF_FMT_F16 ? gf_half_to_f32bits(h) : gf_bf16_to_f32bits(h);
}

// x / d (bit patterns) with x86's rule: a NaN x comes back quieted, payload kept;
// d is finite and non-zero (the caller checks), so x is the only possible NaN.
__device__ __forceinline__ gf_u32 gf_div_bits(gf_u32 x, float d)
{
    if ((x & 0x7fffffffu) > 0x7f800000u) return x | 0x00400000u;
    return __float_as_uint(__fdiv_rn(__uint_as_float(x), d));
}

// one element float32 -> 16 bits, with its counts
__device__ __forceinline__ gf_u16 gf_to16_one(int fmt, gf_u32 ux, int scaled, float p,
                                              gf_u32 tovf, gf_u32 tund, gf_u32* o, gf_u32* un)
{
    gf_u32 uq = scaled ? gf_div_bits(ux, p) : ux;
    gf_u32 ax = ux & 0x7fffffffu, aq = uq & 0x7fffffffu;
    *o += (ax < 0x7f800000u) & (aq >= tovf);
    *un += (ax != 0u) & (aq <= tund);
    return gf_cvt16(fmt, uq);
}

// warp-sum the two per-thread counts and add them to cnt[0], cnt[1]
__device__ __forceinline__ void gf_flush_counts(gf_u64* cnt, gf_u32 o, gf_u32 un)
{
    gf_u64 a = o, b = un;
    for (int off = 16; off >= 1; off >>= 1) {
        a += __shfl_down_sync(GF_FULL, a, off);
        b += __shfl_down_sync(GF_FULL, b, off);
    }
    if ((threadIdx.x & 31) == 0 && (a | b)) {
        if (a) atomicAdd(cnt, a);
        if (b) atomicAdd(cnt + 1, b);
    }
}

__device__ __forceinline__ gf_u32 gf_tovf(int fmt) { return fmt == GF_FMT_F16 ? GF_F16_OVF : GF_BF16_OVF; }
__device__ __forceinline__ gf_u32 gf_tund(int fmt) { return fmt == GF_FMT_F16 ? GF_F16_UND : GF_BF16_UND; }

// dst[k] = cvt(src[k] / p), k < n; cnt[2] (u64) accumulates overflow/underflow counts
extern "C" __global__ void gf_cast_to16(int fmt, const float* src, gf_u16* dst, gf_i64 n,
                                        int scaled, float p, gf_u64* cnt)
{
    gf_u32 tovf = gf_tovf(fmt), tund = gf_tund(fmt), o = 0, un = 0;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    const gf_u32* s = (const gf_u32*)src;
    for (gf_i64 k = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride)
        dst[k] = gf_to16_one(fmt, s[k], scaled, p, tovf, tund, &o, &un);
    gf_flush_counts(cnt, o, un);
}

// dst[k] = to_f32(src[k]) / d (no division when scaled == 0)
extern "C" __global__ void gf_cast_from16(int fmt, const gf_u16* src, float* dst, gf_i64 n,
                                          int scaled, float d)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    gf_u32* o = (gf_u32*)dst;
    for (gf_i64 k = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        gf_u32 u = gf_from16bits(fmt, src[k]);
        o[k] = scaled ? gf_div_bits(u, d) : u;
    }
}

// Fused pack + cast: buf[offsets[i] + k] = cvt(src_i[k] / p), rows lo..hi-1 (element
// offsets and counts, like _core.pack_cast)
extern "C" __global__ void gf_pack_cast(int fmt, gf_u16* buf, const gf_i64* ptrs, const gf_i64* offsets,
                                        const gf_i64* counts, gf_i64 lo, gf_i64 hi,
                                        int scaled, float p, gf_u64* cnt)
{
    gf_u32 tovf = gf_tovf(fmt), tund = gf_tund(fmt), o = 0, un = 0;
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 m = counts[i];
        const gf_u32* s = (const gf_u32*)ptrs[i];
        gf_u16* d = buf + offsets[i];
        for (gf_i64 k = tid; k < m; k += stride)
            d[k] = gf_to16_one(fmt, s[k], scaled, p, tovf, tund, &o, &un);
    }
    gf_flush_counts(cnt, o, un);
}

// Fused unpack + cast: dst_i[k] = to_f32(buf[offsets[i] + k]) / d, rows lo..hi-1
extern "C" __global__ void gf_unpack_cast(int fmt, const gf_u16* buf, const gf_i64* ptrs,
                                          const gf_i64* offsets, const gf_i64* counts,
                                          gf_i64 lo, gf_i64 hi, int scaled, float d)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 m = counts[i];
        const gf_u16* s = buf + offsets[i];
        gf_u32* o = (gf_u32*)ptrs[i];
        for (gf_i64 k = tid; k < m; k += stride) {
            gf_u32 u = gf_from16bits(fmt, s[k]);
            o[k] = scaled ? gf_div_bits(u, d) : u;
        }
    }
}

__device__ __forceinline__ int gf_isnan16(int fmt, gf_u16 h)
{
    return fmt == GF_FMT_F16 ? (h & 0x7fffu) > 0x7c00u : (h & 0x7fffu) > 0x7f80u;
}

// 16-bit sum (the MPI op's rule): b[k] = cvt(to_f32(a[k]) + to_f32(b[k])), with the
// explicit NaN rule: NaN a -> a | Q, else NaN b -> b | Q, else inf + -inf -> the x86
// default NaN (0xfe00 fp16, 0xffc0 bf16). Used for a deterministic rank-order sum of
// gathered 16-bit payloads on the GPU.
extern "C" __global__ void gf_sum16(int fmt, const gf_u16* a, gf_u16* b, gf_i64 n)
{
    gf_u16 q = fmt == GF_FMT_F16 ? 0x0200u : 0x0040u;
    gf_u16 dn = fmt == GF_FMT_F16 ? 0xfe00u : 0xffc0u;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 k = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        gf_u16 x = a[k], y = b[k], r;
        if (gf_isnan16(fmt, x)) r = (gf_u16)(x | q);
        else if (gf_isnan16(fmt, y)) r = (gf_u16)(y | q);
        else {
            float s = __fadd_rn(__uint_as_float(gf_from16bits(fmt, x)),
                                __uint_as_float(gf_from16bits(fmt, y)));
            gf_u32 us = __float_as_uint(s);
            r = (us & 0x7fffffffu) > 0x7f800000u ? dn : gf_cvt16(fmt, us);
        }
        b[k] = r;
    }
}
