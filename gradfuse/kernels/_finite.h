/*
 * Finiteness checks over a pointer table of float32 tensors (gradfuse.step.jobs):
 * max |x| of a bucket's inputs (the step's bound, input_bound, and the 16-bit verdict,
 * halves_cannot_fail), in one call per bucket, and the inf/NaN count of a summed 16-bit
 * payload.
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
