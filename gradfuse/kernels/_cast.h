/*
 * fp16 / bf16 cast kernels of gradfuse: float32 <-> 16-bit casts (optionally with a
 * prescale division / a divisor), and the 16-bit sums of the MPI reduction op.
 *
 * Every kernel has a portable scalar body and an AVX2+F16C body chosen at run time
 * (gf_use_avx2). Both give the same bits for every input; the definition is the
 * scalar code, which itself is numpy's:
 *
 *   fp16: float -> half is gf_float_to_half (numpy's npy_floatbits_to_halfbits):
 *         round to nearest even, overflow -> signed inf, NaN keeps its sign and the
 *         top 10 payload bits, forced non-zero (a signalling NaN stays signalling).
 *         half -> float is exact; a NaN keeps its payload, it is not quieted.
 *         The F16C instructions quiet NaNs, so the SIMD bodies patch NaN lanes with
 *         the integer rule (only when a vector holds a NaN: movemask test).
 *   bf16: float -> bf16 is (u + 0x7fff + ((u >> 16) & 1)) >> 16 (round to nearest
 *         even on the top 16 bits), NaN -> (u >> 16) | 0x0040; bf16 -> float is
 *         u << 16.
 *
 * Counts (float -> 16-bit): n_overflow = finite inputs x whose result is +-inf,
 * n_underflow = non-zero finite inputs x whose result is +-0. With a prescale the
 * converted value is q = x / p (float32 division, p finite and non-zero, checked by
 * the caller), so x finite implies q is not NaN; the tests below are on |q|:
 *   fp16:  overflow  <=> x finite and |q| >= 65520     (bits 0x477ff000)
 *          underflow <=> x != 0     and |q| <= 2^-25   (bits 0x33000000)
 *   bf16:  overflow  <=> x finite and |q| >= bits 0x7f7f8000
 *          underflow <=> x != 0     and |q| <= bits 0x00008000
 * (ties at those limits round away from the finite / non-zero value: to even.)
 *
 * Sums: r = cvt(to_f32(a) + to_f32(b)), float32 add rounded once. NaN operands are
 * resolved explicitly so that the result does not depend on which operand order a
 * compiler or the hardware picks: a NaN a gives a with its quiet bit set, else a NaN
 * b gives b with its quiet bit set, else inf + -inf gives the x86 default NaN
 * (0xfe00 fp16, 0xffc0 bf16).
 *
 * No FMA, no fast-math: the build uses -ffp-contract=off -fno-fast-math; division
 * and addition are single IEEE operations in every path.
 */
#ifndef GRADFUSE_CAST_H
#define GRADFUSE_CAST_H

#include <stdint.h>
#include <string.h>
#include "_half.h"
#include "_simd.h"

#if GF_X86 && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GF_CAST_SIMD 1
#define GF_AVX2 __attribute__((target("avx2,f16c")))
#else
#define GF_CAST_SIMD 0
#endif

#define GF_FMT_F16 1
#define GF_FMT_BF16 2

#define GF_F16_OVF 0x477ff000u
#define GF_F16_UND 0x33000000u
#define GF_BF16_OVF 0x7f7f8000u
#define GF_BF16_UND 0x00008000u

/* ------------------------------------------------------------------ scalar */

static inline uint16_t gf_float_to_bf16(float value)
{
    uint32_t u = gf_f32_bits(value);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float gf_bf16_to_float(uint16_t h)
{
    return gf_bits_f32(((uint32_t)h) << 16);
}

static inline int gf_half_isnan(uint16_t h) { return (h & 0x7fffu) > 0x7c00u; }
static inline int gf_bf16_isnan(uint16_t h) { return (h & 0x7fffu) > 0x7f80u; }

/* float32 -> 16-bit, elements [0, n); scaled: divide by p first. Adds counts. */
static void gf_to16_scalar(int fmt, const float* src, uint16_t* dst, int64_t n,
                           int scaled, float p, int64_t* ovf, int64_t* und)
{
    int64_t i, o = 0, u = 0;
    uint32_t tovf = fmt == GF_FMT_F16 ? GF_F16_OVF : GF_BF16_OVF;
    uint32_t tund = fmt == GF_FMT_F16 ? GF_F16_UND : GF_BF16_UND;
    for (i = 0; i < n; i++) {
        float x = src[i];
        float q = scaled ? x / p : x;
        uint32_t ax = gf_f32_bits(x) & 0x7fffffffu;
        uint32_t aq = gf_f32_bits(q) & 0x7fffffffu;
        dst[i] = fmt == GF_FMT_F16 ? gf_float_to_half(q) : gf_float_to_bf16(q);
        o += (ax < 0x7f800000u) & (aq >= tovf);
        u += (ax != 0) & (aq <= tund);
    }
    *ovf += o;
    *und += u;
}

static void gf_from16_scalar(int fmt, const uint16_t* src, float* dst, int64_t n,
                             int scaled, float d)
{
    int64_t i;
    if (fmt == GF_FMT_F16) {
        if (scaled) for (i = 0; i < n; i++) dst[i] = gf_half_to_float(src[i]) / d;
        else        for (i = 0; i < n; i++) dst[i] = gf_half_to_float(src[i]);
    } else {
        if (scaled) for (i = 0; i < n; i++) dst[i] = gf_bf16_to_float(src[i]) / d;
        else        for (i = 0; i < n; i++) dst[i] = gf_bf16_to_float(src[i]);
    }
}

static inline uint16_t gf_sum16_one(int fmt, uint16_t a, uint16_t b)
{
    if (fmt == GF_FMT_F16) {
        float s;
        if (gf_half_isnan(a)) return (uint16_t)(a | 0x0200u);
        if (gf_half_isnan(b)) return (uint16_t)(b | 0x0200u);
        s = gf_half_to_float(a) + gf_half_to_float(b);
        if (s != s) return 0xfe00u;
        return gf_float_to_half(s);
    } else {
        float s;
        if (gf_bf16_isnan(a)) return (uint16_t)(a | 0x0040u);
        if (gf_bf16_isnan(b)) return (uint16_t)(b | 0x0040u);
        s = gf_bf16_to_float(a) + gf_bf16_to_float(b);
        if (s != s) return 0xffc0u;
        return gf_float_to_bf16(s);
    }
}

static void gf_sum16_scalar(int fmt, const uint16_t* a, uint16_t* b, int64_t n)
{
    int64_t i;
    for (i = 0; i < n; i++) b[i] = gf_sum16_one(fmt, a[i], b[i]);
}

/* ------------------------------------------------------------------ AVX2 + F16C */
#if GF_CAST_SIMD

/* 8 int32 lanes (each <= 0xffff) -> 8 uint16 */
GF_AVX2 static inline __m128i gf_pack8(__m256i v)
{
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

/* 8 int32 masks (0 / -1) -> 8 int16 masks */
GF_AVX2 static inline __m128i gf_packmask8(__m256i m)
{
    return _mm_packs_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
}

/* numpy's float -> half for NaN lanes: sign | 0x7c00 | sig >> 13, forced non-zero */
GF_AVX2 static inline __m128i gf_f16_nanfix(__m256 q, __m128i h, __m256 nanm)
{
    __m256i u = _mm256_castps_si256(q);
    __m256i sig = _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x007fffff)), 13);
    __m256i r = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                _mm256_or_si256(_mm256_set1_epi32(0x7c00), sig));
    __m256i zero = _mm256_cmpeq_epi32(sig, _mm256_setzero_si256());
    r = _mm256_sub_epi32(r, zero);                     /* +1 where the payload was 0 */
    return _mm_blendv_epi8(h, gf_pack8(r), gf_packmask8(_mm256_castps_si256(nanm)));
}

/* counts of one vector of 8: x the input, q the converted value */
#define GF_COUNT8(x, q, acco, accu, vtovf1, vtund1)                                              \
    do {                                                                                         \
        __m256i ax_ = _mm256_and_si256(_mm256_castps_si256(x), vabs);                           \
        __m256i aq_ = _mm256_and_si256(_mm256_castps_si256(q), vabs);                           \
        __m256i o_ = _mm256_and_si256(_mm256_cmpgt_epi32(vinf, ax_), _mm256_cmpgt_epi32(aq_, vtovf1)); \
        __m256i u_ = _mm256_andnot_si256(_mm256_cmpeq_epi32(ax_, _mm256_setzero_si256()),      \
                                         _mm256_cmpgt_epi32(vtund1, aq_));                      \
        acco = _mm256_sub_epi32(acco, o_);                                                       \
        accu = _mm256_sub_epi32(accu, u_);                                                       \
    } while (0)

GF_AVX2 static inline int64_t gf_hsum_epi32(__m256i v)
{
    uint32_t t[8];
    int64_t s = 0;
    int k;
    _mm256_storeu_si256((__m256i*)t, v);
    for (k = 0; k < 8; k++) s += t[k];
    return s;
}

/* bf16 rounding of 8 float32 lanes, as int32 lanes holding the 16-bit result */
GF_AVX2 static inline __m256i gf_bf16_round8(__m256 q)
{
    __m256i u = _mm256_castps_si256(q);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nanv = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
    __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                       _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, nanv, isnan);
}

/* Body of float32 -> 16-bit; scaled is a compile-time constant at each call site. */
GF_AVX2 static inline __attribute__((always_inline)) int64_t
gf_to16_avx2_body(int fmt, const float* src, uint16_t* dst, int64_t n, int scaled, float p,
                  int64_t* ovf, int64_t* und)
{
    const __m256i vabs = _mm256_set1_epi32(0x7fffffff);
    const __m256i vinf = _mm256_set1_epi32(0x7f800000);
    const __m256i vtovf1 = _mm256_set1_epi32((int)((fmt == GF_FMT_F16 ? GF_F16_OVF : GF_BF16_OVF) - 1));
    const __m256i vtund1 = _mm256_set1_epi32((int)((fmt == GF_FMT_F16 ? GF_F16_UND : GF_BF16_UND) + 1));
    const __m256 vp = _mm256_set1_ps(p);
    int64_t i = 0;
    while (n - i >= 16) {
        /* lane counters are flushed every 2^27 elements (2^24 per lane): no wrap */
        int64_t end = i + ((int64_t)1 << 27);
        __m256i acco = _mm256_setzero_si256(), accu = _mm256_setzero_si256();
        if (end > n) end = n;
        for (; i + 16 <= end; i += 16) {
            __m256 x0 = _mm256_loadu_ps(src + i);
            __m256 x1 = _mm256_loadu_ps(src + i + 8);
            __m256 q0 = scaled ? _mm256_div_ps(x0, vp) : x0;
            __m256 q1 = scaled ? _mm256_div_ps(x1, vp) : x1;
            if (fmt == GF_FMT_F16) {
                __m128i h0 = _mm256_cvtps_ph(q0, _MM_FROUND_TO_NEAREST_INT);
                __m128i h1 = _mm256_cvtps_ph(q1, _MM_FROUND_TO_NEAREST_INT);
                __m256 n0 = _mm256_cmp_ps(q0, q0, _CMP_UNORD_Q);
                __m256 n1 = _mm256_cmp_ps(q1, q1, _CMP_UNORD_Q);
                if (_mm256_movemask_ps(_mm256_or_ps(n0, n1))) {
                    h0 = gf_f16_nanfix(q0, h0, n0);
                    h1 = gf_f16_nanfix(q1, h1, n1);
                }
                _mm_storeu_si128((__m128i*)(dst + i), h0);
                _mm_storeu_si128((__m128i*)(dst + i + 8), h1);
            } else {
                __m256i r = _mm256_packus_epi32(gf_bf16_round8(q0), gf_bf16_round8(q1));
                _mm256_storeu_si256((__m256i*)(dst + i), _mm256_permute4x64_epi64(r, 0xD8));
            }
            GF_COUNT8(x0, q0, acco, accu, vtovf1, vtund1);
            GF_COUNT8(x1, q1, acco, accu, vtovf1, vtund1);
        }
        *ovf += gf_hsum_epi32(acco);
        *und += gf_hsum_epi32(accu);
    }
    return i;
}

GF_AVX2 static int64_t gf_to16_f16_plain(const float* s, uint16_t* d, int64_t n, int64_t* o, int64_t* u)
{ return gf_to16_avx2_body(GF_FMT_F16, s, d, n, 0, 1.0f, o, u); }
GF_AVX2 static int64_t gf_to16_f16_scaled(const float* s, uint16_t* d, int64_t n, float p, int64_t* o, int64_t* u)
{ return gf_to16_avx2_body(GF_FMT_F16, s, d, n, 1, p, o, u); }
GF_AVX2 static int64_t gf_to16_bf16_plain(const float* s, uint16_t* d, int64_t n, int64_t* o, int64_t* u)
{ return gf_to16_avx2_body(GF_FMT_BF16, s, d, n, 0, 1.0f, o, u); }
GF_AVX2 static int64_t gf_to16_bf16_scaled(const float* s, uint16_t* d, int64_t n, float p, int64_t* o, int64_t* u)
{ return gf_to16_avx2_body(GF_FMT_BF16, s, d, n, 1, p, o, u); }

/* numpy's half -> float for NaN lanes: the payload is kept, not quieted */
GF_AVX2 static inline __m256 gf_f16_to_f32_8(__m128i h)
{
    __m256 f = _mm256_cvtph_ps(h);
    __m256 nanm = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(nanm)) {
        __m256i h32 = _mm256_cvtepu16_epi32(h);
        __m256i r = _mm256_or_si256(
            _mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x8000)), 16),
            _mm256_or_si256(_mm256_set1_epi32(0x7f800000),
                            _mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x03ff)), 13)));
        f = _mm256_blendv_ps(f, _mm256_castsi256_ps(r), nanm);
    }
    return f;
}

GF_AVX2 static inline __attribute__((always_inline)) int64_t
gf_from16_avx2_body(int fmt, const uint16_t* src, float* dst, int64_t n, int scaled, float d)
{
    const __m256 vd = _mm256_set1_ps(d);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 f0, f1;
        if (fmt == GF_FMT_F16) {
            f0 = gf_f16_to_f32_8(_mm_loadu_si128((const __m128i*)(src + i)));
            f1 = gf_f16_to_f32_8(_mm_loadu_si128((const __m128i*)(src + i + 8)));
        } else {
            __m256i h = _mm256_loadu_si256((const __m256i*)(src + i));
            f0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
            f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
        }
        if (scaled) {
            f0 = _mm256_div_ps(f0, vd);
            f1 = _mm256_div_ps(f1, vd);
        }
        _mm256_storeu_ps(dst + i, f0);
        _mm256_storeu_ps(dst + i + 8, f1);
    }
    return i;
}

GF_AVX2 static int64_t gf_from16_f16_plain(const uint16_t* s, float* d, int64_t n)
{ return gf_from16_avx2_body(GF_FMT_F16, s, d, n, 0, 1.0f); }
GF_AVX2 static int64_t gf_from16_f16_scaled(const uint16_t* s, float* d, int64_t n, float v)
{ return gf_from16_avx2_body(GF_FMT_F16, s, d, n, 1, v); }
GF_AVX2 static int64_t gf_from16_bf16_plain(const uint16_t* s, float* d, int64_t n)
{ return gf_from16_avx2_body(GF_FMT_BF16, s, d, n, 0, 1.0f); }
GF_AVX2 static int64_t gf_from16_bf16_scaled(const uint16_t* s, float* d, int64_t n, float v)
{ return gf_from16_avx2_body(GF_FMT_BF16, s, d, n, 1, v); }

GF_AVX2 static int64_t gf_sum16_f16_avx2(const uint16_t* a, uint16_t* b, int64_t n)
{
    const __m128i v7fff = _mm_set1_epi16(0x7fff);
    const __m128i vinf = _mm_set1_epi16(0x7c00);
    const __m128i vq = _mm_set1_epi16(0x0200);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i x = _mm_loadu_si128((const __m128i*)(a + i));
        __m128i y = _mm_loadu_si128((const __m128i*)(b + i));
        __m256 s = _mm256_add_ps(_mm256_cvtph_ps(x), _mm256_cvtph_ps(y));
        __m128i r = _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT);
        __m128i xn = _mm_cmpgt_epi16(_mm_and_si128(x, v7fff), vinf);
        __m128i yn = _mm_cmpgt_epi16(_mm_and_si128(y, v7fff), vinf);
        /* both inputs finite/inf: r is exact numpy bits (inf + -inf -> 0xfe00) */
        r = _mm_blendv_epi8(r, _mm_or_si128(y, vq), yn);
        r = _mm_blendv_epi8(r, _mm_or_si128(x, vq), xn);
        _mm_storeu_si128((__m128i*)(b + i), r);
    }
    return i;
}

GF_AVX2 static int64_t gf_sum16_bf16_avx2(const uint16_t* a, uint16_t* b, int64_t n)
{
    const __m256i v7fff = _mm256_set1_epi16(0x7fff);
    const __m256i vinf = _mm256_set1_epi16(0x7f80);
    const __m256i vq = _mm256_set1_epi16(0x0040);
    const __m256i z = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i x = _mm256_loadu_si256((const __m256i*)(a + i));
        __m256i y = _mm256_loadu_si256((const __m256i*)(b + i));
        /* unpack within 128-bit lanes; packus below undoes the same interleave */
        __m256 slo = _mm256_add_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x)),
                                   _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, y)));
        __m256 shi = _mm256_add_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x)),
                                   _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, y)));
        __m256i r = _mm256_packus_epi32(gf_bf16_round8(slo), gf_bf16_round8(shi));
        __m256i xn = _mm256_cmpgt_epi16(_mm256_and_si256(x, v7fff), vinf);
        __m256i yn = _mm256_cmpgt_epi16(_mm256_and_si256(y, v7fff), vinf);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(y, vq), yn);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(x, vq), xn);
        _mm256_storeu_si256((__m256i*)(b + i), r);
    }
    return i;
}

#endif /* GF_CAST_SIMD */

/* ------------------------------------------------------------------ dispatch */

/* dst[k] = cvt(scaled ? src[k] / p : src[k]); adds the counts to *ovf / *und */
static void gf_cast_to16(int fmt, const float* src, uint16_t* dst, int64_t n,
                         int scaled, float p, int64_t* ovf, int64_t* und)
{
    int64_t i = 0;
#if GF_CAST_SIMD
    if (gf_use_avx2) {
        if (fmt == GF_FMT_F16)
            i = scaled ? gf_to16_f16_scaled(src, dst, n, p, ovf, und)
                       : gf_to16_f16_plain(src, dst, n, ovf, und);
        else
            i = scaled ? gf_to16_bf16_scaled(src, dst, n, p, ovf, und)
                       : gf_to16_bf16_plain(src, dst, n, ovf, und);
    }
#endif
    gf_to16_scalar(fmt, src + i, dst + i, n - i, scaled, p, ovf, und);
}

/* dst[k] = scaled ? to_f32(src[k]) / d : to_f32(src[k]) */
static void gf_cast_from16(int fmt, const uint16_t* src, float* dst, int64_t n, int scaled, float d)
{
    int64_t i = 0;
#if GF_CAST_SIMD
    if (gf_use_avx2) {
        if (fmt == GF_FMT_F16)
            i = scaled ? gf_from16_f16_scaled(src, dst, n, d) : gf_from16_f16_plain(src, dst, n);
        else
            i = scaled ? gf_from16_bf16_scaled(src, dst, n, d) : gf_from16_bf16_plain(src, dst, n);
    }
#endif
    gf_from16_scalar(fmt, src + i, dst + i, n - i, scaled, d);
}

/* b[k] = cvt(to_f32(a[k]) + to_f32(b[k])) */
static void gf_sum16(int fmt, const uint16_t* a, uint16_t* b, int64_t n)
{
    int64_t i = 0;
#if GF_CAST_SIMD
    if (gf_use_avx2)
        i = fmt == GF_FMT_F16 ? gf_sum16_f16_avx2(a, b, n) : gf_sum16_bf16_avx2(a, b, n);
#endif
    gf_sum16_scalar(fmt, a + i, b + i, n - i);
}

#endif
