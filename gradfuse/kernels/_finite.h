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

static float gf_fin_pairwise_sum(const float* a, int64_t n)
{
    if (n < 8) {
        float res = 0.0f;
        int64_t i;
        for (i = 0; i < n; i++)
            res += a[i];
        return res;
    } else if (n <= 128) {
        float r[8], res;
        int64_t i, j;
        for (j = 0; j < 8; j++)
            r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (j = 0; j < 8; j++)
                r[j] += a[i + j];
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    } else {
        int64_t n2 = n / 2;
        n2 -= n2 % 8;
        return gf_fin_pairwise_sum(a, n2) + gf_fin_pairwise_sum(a + n2, n - n2);
    }
}

#define GF_FIN_CHUNK 8192

/* np.add.reduce(x, dtype=np.float32) of a contiguous float32 array (see above) */
static float gf_fin_sum(const float* a, int64_t n)
{
    float res = 0.0f;
    int64_t i0;
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
static uint32_t gf_fin_absmax_bits(const int64_t* ptrs, const int64_t* counts, int64_t lo, int64_t hi)
{
    uint32_t best = 0;
    int64_t r, i, i0, len;
    for (r = lo; r < hi; r++) {
        const uint32_t* x = (const uint32_t*) (uintptr_t) ptrs[r];
        for (i0 = 0; i0 < counts[r]; i0 += 4096) {      /* blocks: a NaN stops the scan soon */
            uint32_t m = 0;
            len = counts[r] - i0 < 4096 ? counts[r] - i0 : 4096;
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

#endif
