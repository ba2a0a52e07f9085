/*
 * Finiteness checks over a pointer table of float32 tensors (gradfuse.compressors.jobs):
 * a step's verdict, before any residual is touched, in one call per bucket.
 *
 * gf_fin_pairwise_sum is numpy's float32 pairwise sum (numpy/core/src/umath/
 * loops_utils.h.src, ``pairwise_sum``, numpy 1.x) operation for operation: fewer than 8
 * elements summed in order from 0.0f; up to 128, eight accumulators r[j] (elements
 * j, j + 8, ...) combined as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the
 * rest in order; above 128 the halves n2 = n/2 - (n/2) % 8 and n - n2, summed apart and
 * added. np.add.reduce hands its inner loop chunks of numpy's buffer size (8192
 * elements by default, np.getbufsize()), so the sum is 0.0f + pw(x[0:8192]) +
 * pw(x[8192:16384]) + ... in order (gf_fin_sum). Every add is a float32 add
 * (-ffp-contract=off; no reassociation), so the result is
 * np.add.reduce(x, dtype=np.float32)'s bits for a contiguous array at the default
 * buffer size (tests/test_kernels_finite.py checks it).
 */
#ifndef GRADFUSE_FINITE_H
#define GRADFUSE_FINITE_H

#include <stdint.h>
#include <string.h>
#include "_simd.h"

#if GF_X86 && (defined(__GNUC__) || defined(__clang__))
#define GF_FIN_HAVE_AVX2 1
#include <immintrin.h>
#else
#define GF_FIN_HAVE_AVX2 0
#endif

/* numpy's pairwise base cases, shared by the scalar and AVX2 twins: a running sum below
 * 8 elements, and the fold of the eight accumulators r[0..7] plus the tail from i on */
static inline float gf_fin_short_sum(const float* a, int64_t n)
{
    float res = 0.0f;
    int64_t i;
    for (i = 0; i < n; i++)
        res += a[i];
    return res;
}

static inline float gf_fin_fold8(const float* r, const float* a, int64_t i, int64_t n)
{
    float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++)
        res += a[i];
    return res;
}

static float gf_fin_pairwise_sum(const float* a, int64_t n)
{
    if (n < 8) {
        return gf_fin_short_sum(a, n);
    } else if (n <= 128) {
        float r[8];
        int64_t i, j;
        for (j = 0; j < 8; j++)
            r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (j = 0; j < 8; j++)
                r[j] += a[i + j];
        return gf_fin_fold8(r, a, i, n);
    } else {
        int64_t n2 = n / 2;
        n2 -= n2 % 8;
        return gf_fin_pairwise_sum(a, n2) + gf_fin_pairwise_sum(a + n2, n - n2);
    }
}

#if GF_FIN_HAVE_AVX2
/* The same operations with the eight accumulators r[0..7] as the lanes of one register
 * (lane j adds a[i + j], as r[j] does): the same bits. */
__attribute__((target("avx2")))
static float gf_fin_pairwise_sum_avx2(const float* a, int64_t n)
{
    if (n < 8) {
        return gf_fin_short_sum(a, n);
    } else if (n <= 128) {
        float r[8];
        int64_t i;
        __m256 v = _mm256_loadu_ps(a);
        for (i = 8; i < n - (n % 8); i += 8)
            v = _mm256_add_ps(v, _mm256_loadu_ps(a + i));
        _mm256_storeu_ps(r, v);
        return gf_fin_fold8(r, a, i, n);
    } else {
        int64_t n2 = n / 2;
        n2 -= n2 % 8;
        return gf_fin_pairwise_sum_avx2(a, n2) + gf_fin_pairwise_sum_avx2(a + n2, n - n2);
    }
}
#endif

#define GF_FIN_CHUNK 8192

/* np.add.reduce(x, dtype=np.float32) of a contiguous float32 array (see above) */
static float gf_fin_sum(const float* a, int64_t n)
{
    float res = 0.0f;
    int64_t i0;
#if GF_FIN_HAVE_AVX2
    if (gf_use_avx2) {
        for (i0 = 0; i0 < n; i0 += GF_FIN_CHUNK)
            res += gf_fin_pairwise_sum_avx2(a + i0, n - i0 < GF_FIN_CHUNK ? n - i0 : GF_FIN_CHUNK);
        return res;
    }
#endif
    for (i0 = 0; i0 < n; i0 += GF_FIN_CHUNK)
        res += gf_fin_pairwise_sum(a + i0, n - i0 < GF_FIN_CHUNK ? n - i0 : GF_FIN_CHUNK);
    return res;
}

static inline int gf_fin_isfinite(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x7fffffffu) < 0x7f800000u;
}

/* The first row lo..hi-1 whose float32 sum (gf_fin_sum) is not
 * finite, or -1 when every row's is. */
static int64_t gf_fin_first_bad_sum(const int64_t* ptrs, const int64_t* counts, int64_t lo, int64_t hi)
{
    int64_t r;
    for (r = lo; r < hi; r++)
        if (counts[r] > 0 && !gf_fin_isfinite(gf_fin_sum((const float*) (uintptr_t) ptrs[r], counts[r])))
            return r;
    return -1;
}

/* The largest bits(x) & 0x7fffffff over rows lo..hi-1 (0 when empty): for finite
 * values the order of these patterns is the order of |x|; >= 0x7f800000 means an inf
 * or NaN. Stops early at the first non-finite value. */
#if GF_FIN_HAVE_AVX2
__attribute__((target("avx2")))
static uint32_t gf_fin_absmax_block_avx2(const uint32_t* x, int64_t len)
{
    const __m256i vabs = _mm256_set1_epi32(0x7fffffff);
    __m256i m0 = _mm256_setzero_si256(), m1 = m0;
    uint32_t tmp[8], m = 0;
    int64_t i = 0;
    int t;
    for (; i + 16 <= len; i += 16) {
        m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256((const __m256i*) (x + i)), vabs));
        m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_loadu_si256((const __m256i*) (x + i + 8)), vabs));
    }
    _mm256_storeu_si256((__m256i*) tmp, _mm256_max_epu32(m0, m1));
    for (t = 0; t < 8; t++)
        m = tmp[t] > m ? tmp[t] : m;
    for (; i < len; i++) {
        uint32_t v = x[i] & 0x7fffffffu;
        m = v > m ? v : m;
    }
    return m;
}
#endif

static uint32_t gf_fin_absmax_bits(const int64_t* ptrs, const int64_t* counts, int64_t lo, int64_t hi)
{
    uint32_t best = 0;
    int64_t r, i, i0, len;
    for (r = lo; r < hi; r++) {
        const uint32_t* x = (const uint32_t*) (uintptr_t) ptrs[r];
        for (i0 = 0; i0 < counts[r]; i0 += 4096) {      /* blocks: a NaN stops the scan soon */
            uint32_t m = 0;
            len = counts[r] - i0 < 4096 ? counts[r] - i0 : 4096;
#if GF_FIN_HAVE_AVX2
            if (gf_use_avx2) {
                m = gf_fin_absmax_block_avx2(x + i0, len);
                best = m > best ? m : best;
                if (best >= 0x7f800000u)
                    return best;
                continue;
            }
#endif
            for (i = i0; i < i0 + len; i++) {
                uint32_t v = x[i] & 0x7fffffffu;
                m = v > m ? v : m;
            }
            best = m > best ? m : best;
            if (best >= 0x7f800000u)
                return best;
        }
    }
    return best;
}

/* The number of 16-bit words w with (w & mask) == mask (inf/NaN of fp16: 0x7C00, of
 * bf16: 0x7F80), as numpy's count_nonzero((buf & mask) == mask). */
static int64_t gf_fin_count_masked16(const uint16_t* w, int64_t n, uint16_t mask)
{
    int64_t i, i0, bad = 0;
    for (i0 = 0; i0 < n; i0 += 4096) {         /* blocks: the inner count fits 16 bits */
        int64_t len = n - i0 < 4096 ? n - i0 : 4096;
        uint32_t c = 0;
        for (i = i0; i < i0 + len; i++)
            c += (uint16_t) (w[i] & mask) == mask;
        bad += c;
    }
    return bad;
}

#endif
