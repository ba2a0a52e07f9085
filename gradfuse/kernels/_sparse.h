/*
 * Top-k and random-k sparsification kernels (see docs/compressors.md ("Sparse compressors")).
 *
 * Everything here is integer selection logic plus one float32 add per element
 * (c = g + e) and float32 adds/divides on decompress, so the scalar and AVX2 paths
 * give identical bits by construction: the AVX2 code only speeds up the element-wise
 * add, the hash and the candidate scan, it never changes an order.
 *
 * Selection ("the k largest keys, ties to the lower index, indices ascending") is a
 * radix select on 32-bit keys, O(n), with no n-sized scratch:
 *   top-k:    raw = bits(c), key = raw & 0x7fffffff   (|c| as uint32: the order of |c|,
 *                                                      NaN patterns above +inf)
 *   random-k: raw = key = ~h, h = splitmix64(seed + i) >> 32 (largest ~h == smallest h)
 * The key is cut in three digits, bits 31..21, 20..10, 9..0. Level 1: a histogram of
 * the top digit (fused into the pass that produces c or h) gives the bin B1 holding the
 * k-th largest key. Then either (few candidates: the usual case) one scan collects the
 * (index, raw) of every element with top digit >= B1, in ascending index order, and
 * levels 2 and 3 and the output run on those candidates only; or (many candidates,
 * e.g. an all-zero bucket) levels 2, 3 and the output are each a pass over the source.
 * The levels give the threshold key T with count(key > T) < k <= count(key >= T); the
 * output is every element with key > T plus the first k - count(key > T) with key == T.
 *
 * Return codes of the int functions: >= 0 success (compress: the number of non-finite
 * c values), -1: out of memory.
 */
#ifndef GRADFUSE_SPARSE_H
#define GRADFUSE_SPARSE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "_simd.h"

#if GF_X86 && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GF_SP_HAVE_AVX2 1
#else
#define GF_SP_HAVE_AVX2 0
#endif

/* tests only: 1 forces the scratch-free path of gf_sp_select (levels over the source),
   2 turns off the speculative candidate scan of random-k's first pass; 0: automatic */
static int gf_sp_test_mode = 0;

#define GF_SP_B1 2048                   /* level-1 bins: key >> 21 */
#define GF_SP_BLK 2048                  /* staging block of the hash/table streams */

static inline uint32_t gf_sp_fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline uint64_t gf_sp_splitmix64_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* h_i of random-k: the high 32 bits of splitmix64 of the state seed + i. */
static inline uint32_t gf_sp_rk_hash(uint64_t seed, uint64_t i)
{
    return (uint32_t) (gf_sp_splitmix64_mix(seed + i + 0x9e3779b97f4a7c15ULL) >> 32);
}

/* ------------------------------------------------------------------------------ */
/* random-k keys: buf[i] = ~h(i0 + i), i < len                                      */

static void gf_sp_rk_fill_scalar(uint64_t seed, int64_t i0, int64_t len, uint32_t* buf)
{
    int64_t i;
    for (i = 0; i < len; i++)
        buf[i] = ~gf_sp_rk_hash(seed, (uint64_t) (i0 + i));
}

#if GF_SP_HAVE_AVX2
/* low 64 bits of a * c per lane, from 32-bit products (AVX2 has no vpmullq) */
__attribute__((target("avx2")))
static inline __m256i gf_sp_mul64c(__m256i a, uint64_t c)
{
    const __m256i clo = _mm256_set1_epi64x((long long) (c & 0xffffffffULL));
    const __m256i chi = _mm256_set1_epi64x((long long) (c >> 32));
    __m256i lo = _mm256_mul_epu32(a, clo);                              /* alo*clo */
    __m256i x1 = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), clo);      /* ahi*clo */
    __m256i x2 = _mm256_mul_epu32(a, chi);                              /* alo*chi */
    __m256i cross = _mm256_slli_epi64(_mm256_add_epi64(x1, x2), 32);
    return _mm256_add_epi64(lo, cross);
}

__attribute__((target("avx2")))
static void gf_sp_rk_fill_avx2(uint64_t seed, int64_t i0, int64_t len, uint32_t* buf)
{
    int64_t i = 0;
    const __m256i step = _mm256_set1_epi64x(8);
    __m256i z0 = _mm256_add_epi64(_mm256_set1_epi64x((long long) (seed + (uint64_t) i0 + 0x9e3779b97f4a7c15ULL)),
                                  _mm256_setr_epi64x(0, 1, 2, 3));
    __m256i z1 = _mm256_add_epi64(z0, _mm256_set1_epi64x(4));
    const __m256i ones = _mm256_set1_epi32(-1);
    const __m256i perm = _mm256_setr_epi32(1, 3, 5, 7, 0, 2, 4, 6);
    for (; i + 8 <= len; i += 8) {
        __m256i a = z0, b = z1;
        a = gf_sp_mul64c(_mm256_xor_si256(a, _mm256_srli_epi64(a, 30)), 0xbf58476d1ce4e5b9ULL);
        b = gf_sp_mul64c(_mm256_xor_si256(b, _mm256_srli_epi64(b, 30)), 0xbf58476d1ce4e5b9ULL);
        a = gf_sp_mul64c(_mm256_xor_si256(a, _mm256_srli_epi64(a, 27)), 0x94d049bb133111ebULL);
        b = gf_sp_mul64c(_mm256_xor_si256(b, _mm256_srli_epi64(b, 27)), 0x94d049bb133111ebULL);
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 31));
        b = _mm256_xor_si256(b, _mm256_srli_epi64(b, 31));
        /* the high 32-bit words of the 4 + 4 lanes, in lane order */
        __m256i ha = _mm256_permutevar8x32_epi32(a, perm);
        __m256i hb = _mm256_permutevar8x32_epi32(b, perm);
        __m256i h = _mm256_permute2x128_si256(ha, hb, 0x20);
        _mm256_storeu_si256((__m256i*) (buf + i), _mm256_xor_si256(h, ones));
        z0 = _mm256_add_epi64(z0, step);
        z1 = _mm256_add_epi64(z1, step);
    }
    gf_sp_rk_fill_scalar(seed, i0 + i, len - i, buf + i);
}
#endif

static inline void gf_sp_rk_fill(uint64_t seed, int64_t i0, int64_t len, uint32_t* buf)
{
#if GF_SP_HAVE_AVX2
    if (gf_use_avx2) { gf_sp_rk_fill_avx2(seed, i0, len, buf); return; }
#endif
    gf_sp_rk_fill_scalar(seed, i0, len, buf);
}

/* ------------------------------------------------------------------------------ */
/* key streams: the bucket's raw words in index order, one block at a time          */

#define GF_SP_ARRAY 0   /* contiguous uint32 words (c in e_out) */
#define GF_SP_TABLE 1   /* float32 tensors of a table */
#define GF_SP_HASH 2    /* ~h_i of random-k, computed into a staging block */

typedef struct {
    int kind;
    uint32_t mask;              /* key = raw & mask */
    int64_t n;
    const uint32_t* arr;
    const int64_t *src, *offsets, *counts;
    int64_t lo, hi;
    uint64_t seed;
} gf_sp_stream;

typedef struct {
    int64_t t, pos, j;          /* table row and position in it; next bucket index */
    uint32_t buf[GF_SP_BLK];
} gf_sp_iter;

static void gf_sp_iter_init(const gf_sp_stream* s, gf_sp_iter* it)
{
    it->t = s->lo;
    it->pos = 0;
    it->j = 0;
}

/* Next block: *p <- its raw words, *j0 <- bucket index of the first; returns its length (0: end). */
static int64_t gf_sp_next(const gf_sp_stream* s, gf_sp_iter* it, const uint32_t** p, int64_t* j0)
{
    int64_t len;
    if (s->kind == GF_SP_TABLE) {
        while (it->t < s->hi && it->pos >= s->counts[it->t]) {
            it->t++;
            it->pos = 0;
        }
        if (it->t >= s->hi)
            return 0;
        len = s->counts[it->t] - it->pos;
        if (len > (int64_t) 1 << 20)
            len = (int64_t) 1 << 20;
        *p = (const uint32_t*) (uintptr_t) s->src[it->t] + it->pos;
        *j0 = s->offsets[it->t] + it->pos;
        it->pos += len;
        return len;
    }
    if (it->j >= s->n)
        return 0;
    if (s->kind == GF_SP_ARRAY) {
        len = s->n - it->j;
        if (len > (int64_t) 1 << 20)
            len = (int64_t) 1 << 20;
        *p = s->arr + it->j;
    } else {
        len = s->n - it->j;
        if (len > GF_SP_BLK)
            len = GF_SP_BLK;
        gf_sp_rk_fill(s->seed, it->j, len, it->buf);
        *p = it->buf;
    }
    *j0 = it->j;
    it->j += len;
    return len;
}

/* ------------------------------------------------------------------------------ */
/* level-1 histogram (4 interleaved copies: repeated bins don't serialise)           */

static void gf_sp_hist1_run(const uint32_t* raw, int64_t len, uint32_t mask, uint32_t* h4)
{
    int64_t i = 0;
    for (; i + 4 <= len; i += 4) {
        h4[(raw[i] & mask) >> 21]++;
        h4[GF_SP_B1 + ((raw[i + 1] & mask) >> 21)]++;
        h4[2 * GF_SP_B1 + ((raw[i + 2] & mask) >> 21)]++;
        h4[3 * GF_SP_B1 + ((raw[i + 3] & mask) >> 21)]++;
    }
    for (; i < len; i++)
        h4[(raw[i] & mask) >> 21]++;
}

static void gf_sp_hist1_fold(uint32_t* h4)
{
    int b;
    for (b = 0; b < GF_SP_B1; b++)
        h4[b] += h4[GF_SP_B1 + b] + h4[2 * GF_SP_B1 + b] + h4[3 * GF_SP_B1 + b];
}

static int64_t gf_sp_count_nonfinite(const uint32_t* raw, int64_t len)
{
    int64_t i, bad = 0;
    for (i = 0; i < len; i++)
        bad += (raw[i] & 0x7fffffffu) >= 0x7f800000u;
    return bad;
}

/* ------------------------------------------------------------------------------ */
/* candidate scan: (idx, raw) of every element with key >> 21 >= B1, ascending.     */
/* The branch-free scalar loop stores one slot past the last candidate.             */

static int64_t gf_sp_scan_scalar(const uint32_t* raw, int64_t len, int64_t j0, uint32_t mask,
                                 uint32_t B1, uint32_t* cidx, uint32_t* craw)
{
    int64_t i, m = 0;
    for (i = 0; i < len; i++) {
        cidx[m] = (uint32_t) (j0 + i);
        craw[m] = raw[i];
        m += ((raw[i] & mask) >> 21) >= B1;
    }
    return m;
}

#if GF_SP_HAVE_AVX2
__attribute__((target("avx2")))
static int64_t gf_sp_scan_avx2(const uint32_t* raw, int64_t len, int64_t j0, uint32_t mask,
                               uint32_t B1, uint32_t* cidx, uint32_t* craw)
{
    int64_t i = 0, m = 0;
    /* key >> 21 >= B1 <=> (signed) key >> 21 > B1 - 1: both sides are in -1..2047 */
    const __m256i vm = _mm256_set1_epi32((int) mask);
    const __m256i vb = _mm256_set1_epi32((int) B1 - 1);
    for (; i + 32 <= len; i += 32) {
        __m256i k0 = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + i)), vm), 21);
        __m256i k1 = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + i + 8)), vm), 21);
        __m256i k2 = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + i + 16)), vm), 21);
        __m256i k3 = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + i + 24)), vm), 21);
        uint32_t b0 = (uint32_t) _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k0, vb)));
        uint32_t b1 = (uint32_t) _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k1, vb)));
        uint32_t b2 = (uint32_t) _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k2, vb)));
        uint32_t b3 = (uint32_t) _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k3, vb)));
        uint32_t bits = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
        while (bits) {
            int q = __builtin_ctz(bits);
            cidx[m] = (uint32_t) (j0 + i + q);
            craw[m] = raw[i + q];
            m++;
            bits &= bits - 1;
        }
    }
    return m + gf_sp_scan_scalar(raw + i, len - i, j0 + i, mask, B1, cidx + m, craw + m);
}
#endif

/* ------------------------------------------------------------------------------ */
/* levels 2 and 3, and the output                                                   */

/* the bin of the k-th largest key among bins[nb-1..0], after *cum keys above them */
static uint32_t gf_sp_find_bin(const uint32_t* hist, int64_t nb, int64_t* cum, int64_t k)
{
    int64_t b;
    for (b = nb - 1; b > 0; b--) {
        if (*cum + (int64_t) hist[b] >= k)
            return (uint32_t) b;
        *cum += hist[b];
    }
    return 0;
}

#define GF_SP_HS (GF_SP_B1 + 16)    /* stride of the 4 level-2/3 histograms; bin B1: dump */

/* 4-way histogram h4 (stride GF_SP_HS) of the digit (key >> shift) & (2^bits - 1) over
   the keys with key >> (shift + bits) == prefix; the others go to the dump bin GF_SP_B1.
   Branch-free: the filter is unpredictable when many keys share the top digits. */
static inline uint32_t gf_sp_digit_or_dump(uint32_t key, int top, int shift, uint32_t dmask, uint32_t prefix)
{
    uint32_t sel = (uint32_t) 0 - (uint32_t) ((key >> top) == prefix);     /* all ones if in */
    return (((key >> shift) & dmask) & sel) | ((uint32_t) GF_SP_B1 & ~sel);
}

static void gf_sp_hist_level(const uint32_t* raw, int64_t len, uint32_t mask, int shift, int bits,
                             uint32_t prefix, uint32_t* h4)
{
    int64_t i = 0;
    const uint32_t dmask = ((uint32_t) 1 << bits) - 1;
    const int top = shift + bits;
    /* select by mask arithmetic, not ?: (which compilers turn into a branch) */
#define GF_SP_DIGIT(w) gf_sp_digit_or_dump((w) & mask, top, shift, dmask, prefix)
    for (; i + 4 <= len; i += 4) {
        h4[GF_SP_DIGIT(raw[i])]++;
        h4[GF_SP_HS + GF_SP_DIGIT(raw[i + 1])]++;
        h4[2 * GF_SP_HS + GF_SP_DIGIT(raw[i + 2])]++;
        h4[3 * GF_SP_HS + GF_SP_DIGIT(raw[i + 3])]++;
    }
    for (; i < len; i++)
        h4[GF_SP_DIGIT(raw[i])]++;
#undef GF_SP_DIGIT
}

static void gf_sp_hist_fold(uint32_t* h4, int64_t nb)
{
    int64_t b;
    for (b = 0; b < nb; b++)
        h4[b] += h4[GF_SP_HS + b] + h4[2 * GF_SP_HS + b] + h4[3 * GF_SP_HS + b];
}

/* out <- (idx, raw) of keys > T and the first *need keys == T, in order, at most cap
   of them; returns the count. Branch-free (slot m is written before it is kept). */
static int64_t gf_sp_emit(const uint32_t* raw, const uint32_t* idx, int64_t len, int64_t j0,
                          uint32_t mask, uint32_t T, int64_t* need, int64_t cap,
                          uint32_t* oidx, uint32_t* oraw)
{
    int64_t i, m = 0, nd = *need;
    for (i = 0; i < len && m < cap; i++) {
        uint32_t w = raw[i], key = w & mask;
        int64_t eq = key == T;
        int64_t take = (key > T) | (eq & (nd > 0));
        oidx[m] = idx ? idx[i] : (uint32_t) (j0 + i);
        if (oraw)
            oraw[m] = w;
        m += take;
        nd -= eq & take;
    }
    *need = nd;
    return m;
}

/*
 * Select the k largest keys of the stream (ties to the lower index) into oidx[0..k-1]
 * ascending, and their raw words into oraw (if not NULL). hist1: the folded level-1
 * histogram. 0 < k < n. Returns 0, or -1 when out of memory.
 */
static int gf_sp_select(const gf_sp_stream* s, int64_t k, const uint32_t* hist1,
                        uint32_t* oidx, uint32_t* oraw,
                        const uint32_t* sidx, const uint32_t* sraw, int64_t nspec, uint32_t sB)
{
    static const int shifts[2] = {10, 0}, widths[2] = {11, 10};
    int64_t cum = 0, ncand, m, need, len, j0;
    uint32_t prefix;
    uint32_t *cidx = NULL, *craw = NULL, *h4;
    const uint32_t* p;
    gf_sp_iter* it;
    int lv;

    it = (gf_sp_iter*) malloc(sizeof(gf_sp_iter));
    h4 = (uint32_t*) malloc(4 * GF_SP_HS * sizeof(uint32_t));
    if (it == NULL || h4 == NULL) {
        free(it);
        free(h4);
        return -1;
    }
    prefix = gf_sp_find_bin(hist1, GF_SP_B1, &cum, k);
    ncand = cum + (int64_t) hist1[prefix];
    if (gf_sp_test_mode != 1 && ncand <= s->n / 4 + 1024) {
        cidx = (uint32_t*) malloc((size_t) (ncand + 1) * sizeof(uint32_t));
        craw = (uint32_t*) malloc((size_t) (ncand + 1) * sizeof(uint32_t));
        if (cidx == NULL || craw == NULL) {
            free(cidx);
            free(craw);
            cidx = craw = NULL;      /* fall back on the scratch-free path */
        }
    }
    if (cidx != NULL) {
        /* few candidates: collect them, then levels 2, 3 and the output on them only */
        m = 0;
        if (sidx != NULL && prefix >= sB) {
            /* the speculative scan of pass 1 (top digit >= sB) holds every candidate */
            int64_t i;
            for (i = 0; i < nspec; i++) {
                cidx[m] = sidx[i];
                craw[m] = sraw[i];
                m += ((sraw[i] & s->mask) >> 21) >= prefix;
            }
        } else {
            gf_sp_iter_init(s, it);
            while ((len = gf_sp_next(s, it, &p, &j0)) > 0) {
#if GF_SP_HAVE_AVX2
                if (gf_use_avx2)
                    m += gf_sp_scan_avx2(p, len, j0, s->mask, prefix, cidx + m, craw + m);
                else
#endif
                    m += gf_sp_scan_scalar(p, len, j0, s->mask, prefix, cidx + m, craw + m);
            }
        }
        /* m == ncand */
        for (lv = 0; lv < 2; lv++) {
            memset(h4, 0, 4 * GF_SP_HS * sizeof(uint32_t));
            gf_sp_hist_level(craw, ncand, s->mask, shifts[lv], widths[lv], prefix, h4);
            gf_sp_hist_fold(h4, (int64_t) 1 << widths[lv]);
            prefix = (prefix << widths[lv]) | gf_sp_find_bin(h4, (int64_t) 1 << widths[lv], &cum, k);
        }
        need = k - cum;
        gf_sp_emit(craw, cidx, ncand, 0, s->mask, prefix, &need, k, oidx, oraw);
        free(cidx);
        free(craw);
    } else {
        /* many candidates: levels 2, 3 and the output are passes over the source */
        for (lv = 0; lv < 2; lv++) {
            memset(h4, 0, 4 * GF_SP_HS * sizeof(uint32_t));
            gf_sp_iter_init(s, it);
            while ((len = gf_sp_next(s, it, &p, &j0)) > 0)
                gf_sp_hist_level(p, len, s->mask, shifts[lv], widths[lv], prefix, h4);
            gf_sp_hist_fold(h4, (int64_t) 1 << widths[lv]);
            prefix = (prefix << widths[lv]) | gf_sp_find_bin(h4, (int64_t) 1 << widths[lv], &cum, k);
        }
        need = k - cum;
        m = 0;
        gf_sp_iter_init(s, it);
        while (m < k && (len = gf_sp_next(s, it, &p, &j0)) > 0)
            m += gf_sp_emit(p, NULL, len, j0, s->mask, prefix, &need, k - m,
                            oidx + m, oraw ? oraw + m : NULL);
    }
    free(it);
    free(h4);
    return 0;
}

/* Level-1 histogram of a whole stream (plus the non-finite count when count_bad). */
static int64_t gf_sp_hist1_stream(const gf_sp_stream* s, uint32_t* h4, int count_bad, gf_sp_iter* it)
{
    int64_t len, j0, bad = 0;
    const uint32_t* p;
    gf_sp_iter_init(s, it);
    while ((len = gf_sp_next(s, it, &p, &j0)) > 0) {
        gf_sp_hist1_run(p, len, s->mask, h4);
        if (count_bad)
            bad += gf_sp_count_nonfinite(p, len);
    }
    gf_sp_hist1_fold(h4);
    return bad;
}

/* k == n: everything, in order */
static void gf_sp_take_all(const gf_sp_stream* s, gf_sp_iter* it, uint32_t* oidx, uint32_t* oraw)
{
    int64_t len, j0, i;
    const uint32_t* p;
    gf_sp_iter_init(s, it);
    while ((len = gf_sp_next(s, it, &p, &j0)) > 0)
        for (i = 0; i < len; i++) {
            oidx[j0 + i] = (uint32_t) (j0 + i);
            if (oraw)
                oraw[j0 + i] = p[i];
        }
}

/* ------------------------------------------------------------------------------ */
/* top-k                                                                            */

/* c = g + e into c, level-1 histogram of bits(c) & 0x7fffffff; returns the non-finite count */
static int64_t gf_sp_c_run_scalar(const float* g, const float* e, float* c, int64_t cnt, uint32_t* h4)
{
    int64_t i, i0, len, bad = 0;
    for (i0 = 0; i0 < cnt; i0 += GF_SP_BLK) {      /* blocks: c is re-read from L1 */
        len = cnt - i0 < GF_SP_BLK ? cnt - i0 : GF_SP_BLK;
        for (i = i0; i < i0 + len; i++)
            c[i] = g[i] + e[i];
        gf_sp_hist1_run((const uint32_t*) c + i0, len, 0x7fffffffu, h4);
        bad += gf_sp_count_nonfinite((const uint32_t*) c + i0, len);
    }
    return bad;
}

#if GF_SP_HAVE_AVX2
__attribute__((target("avx2")))
static int64_t gf_sp_c_run_avx2(const float* g, const float* e, float* c, int64_t cnt, uint32_t* h4)
{
    int64_t i = 0, bad = 0;
    const __m256i vabs = _mm256_set1_epi32(0x7fffffff);
    const __m256i vfin = _mm256_set1_epi32(0x7f7fffff);
    __m256i vbad = _mm256_setzero_si256();
    uint32_t tmp[8];
    int t;
    for (; i + 8 <= cnt; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(g + i), _mm256_loadu_ps(e + i));
        _mm256_storeu_ps(c + i, v);
        __m256i kv = _mm256_and_si256(_mm256_castps_si256(v), vabs);
        vbad = _mm256_sub_epi32(vbad, _mm256_cmpgt_epi32(kv, vfin));
        _mm256_storeu_si256((__m256i*) tmp, _mm256_srli_epi32(kv, 21));
        h4[tmp[0]]++;
        h4[GF_SP_B1 + tmp[1]]++;
        h4[2 * GF_SP_B1 + tmp[2]]++;
        h4[3 * GF_SP_B1 + tmp[3]]++;
        h4[tmp[4]]++;
        h4[GF_SP_B1 + tmp[5]]++;
        h4[2 * GF_SP_B1 + tmp[6]]++;
        h4[3 * GF_SP_B1 + tmp[7]]++;
    }
    _mm256_storeu_si256((__m256i*) tmp, vbad);
    for (t = 0; t < 8; t++)
        bad += tmp[t];
    return bad + gf_sp_c_run_scalar(g + i, e + i, c + i, cnt - i, h4);
}
#endif

/*
 * Top-k over a table. e_in/e_out: both NULL or both n long (may be equal). values,
 * indices: k long. Returns the number of non-finite c, or -1 when out of memory.
 */
static int64_t gf_sp_topk(const int64_t* src, const int64_t* offsets, const int64_t* counts,
                          int64_t lo, int64_t hi, int64_t n,
                          const float* e_in, float* e_out, int64_t k,
                          float* values, uint32_t* indices)
{
    uint32_t* h4;
    gf_sp_iter* it;
    gf_sp_stream s;
    int64_t t, m, nonfinite = 0;
    int rc = 0;

    h4 = (uint32_t*) calloc(4 * GF_SP_B1, sizeof(uint32_t));
    it = (gf_sp_iter*) malloc(sizeof(gf_sp_iter));
    if (h4 == NULL || it == NULL) {
        free(h4);
        free(it);
        return -1;
    }
    memset(&s, 0, sizeof(s));
    s.mask = 0x7fffffffu;
    s.n = n;
    if (e_out) {
        /* pass 1: c = g + e into e_out, fused with the level-1 histogram */
        for (t = lo; t < hi; t++) {
            const float* g = (const float*) (uintptr_t) src[t];
            int64_t off = offsets[t], cnt = counts[t];
            if (cnt <= 0)
                continue;
#if GF_SP_HAVE_AVX2
            if (gf_use_avx2)
                nonfinite += gf_sp_c_run_avx2(g, e_in + off, e_out + off, cnt, h4);
            else
#endif
                nonfinite += gf_sp_c_run_scalar(g, e_in + off, e_out + off, cnt, h4);
        }
        gf_sp_hist1_fold(h4);
        s.kind = GF_SP_ARRAY;
        s.arr = (const uint32_t*) e_out;
    } else {
        s.kind = GF_SP_TABLE;
        s.src = src;
        s.offsets = offsets;
        s.counts = counts;
        s.lo = lo;
        s.hi = hi;
        nonfinite = gf_sp_hist1_stream(&s, h4, 1, it);
    }
    if (k >= n)
        gf_sp_take_all(&s, it, indices, (uint32_t*) values);
    else if (k > 0)
        rc = gf_sp_select(&s, k, h4, indices, (uint32_t*) values, NULL, NULL, 0, 0);
    if (rc == 0 && e_out)
        for (m = 0; m < k; m++)
            e_out[indices[m]] = 0.0f;
    free(h4);
    free(it);
    return rc < 0 ? -1 : nonfinite;
}

/* ------------------------------------------------------------------------------ */
/* random-k                                                                         */

/* out[0..k-1] <- the random-k indices (ascending). Returns 0 or -1 (out of memory). */
static int gf_sp_randomk_indices(uint64_t seed, int64_t n, int64_t k, uint32_t* out)
{
    uint32_t* h4;
    gf_sp_iter* it;
    gf_sp_stream s;
    int64_t j, nbins, cap = 0, m = 0, len, j0;
    uint32_t *sidx = NULL, *sraw = NULL, sB = 0;
    const uint32_t* p;
    int rc, overflow = 0;
    if (k <= 0)
        return 0;
    if (k >= n) {
        for (j = 0; j < n; j++)
            out[j] = (uint32_t) j;
        return 0;
    }
    h4 = (uint32_t*) calloc(4 * GF_SP_B1, sizeof(uint32_t));
    it = (gf_sp_iter*) malloc(sizeof(gf_sp_iter));
    if (h4 == NULL || it == NULL) {
        free(h4);
        free(it);
        return -1;
    }
    memset(&s, 0, sizeof(s));
    s.kind = GF_SP_HASH;
    s.mask = 0xffffffffu;
    s.n = n;
    s.seed = seed;
    /* The keys are hashes, so about (2048 - b) / 2048 * n of them have a top digit >= b:
       pass 1 also collects, speculatively, the elements with a top digit >= sB, a bin
       or more below where the k-th largest key should fall. If the true bin B1 is >= sB
       (and the buffer did not fill up), the selection needs no second hash pass;
       otherwise gf_sp_select scans the stream as usual. Same result either way. */
    nbins = ((k + k / 8 + 256) * GF_SP_B1 + n - 1) / n + 1;
    if (nbins < GF_SP_B1 && gf_sp_test_mode == 0) {
        sB = (uint32_t) (GF_SP_B1 - nbins);
        cap = nbins * n / GF_SP_B1;
        cap += cap / 8 + 2 * GF_SP_BLK + 4096;
        if (cap <= n / 4 + 1024) {
            sidx = (uint32_t*) malloc((size_t) cap * sizeof(uint32_t));
            sraw = (uint32_t*) malloc((size_t) cap * sizeof(uint32_t));
            if (sidx == NULL || sraw == NULL) {
                free(sidx);
                free(sraw);
                sidx = sraw = NULL;
            }
        }
    }
    if (sidx != NULL) {
        gf_sp_iter_init(&s, it);
        while ((len = gf_sp_next(&s, it, &p, &j0)) > 0) {
            gf_sp_hist1_run(p, len, s.mask, h4);
            if (overflow)
                continue;
            if (m + len + 1 > cap) {
                overflow = 1;
                continue;
            }
#if GF_SP_HAVE_AVX2
            if (gf_use_avx2)
                m += gf_sp_scan_avx2(p, len, j0, s.mask, sB, sidx + m, sraw + m);
            else
#endif
                m += gf_sp_scan_scalar(p, len, j0, s.mask, sB, sidx + m, sraw + m);
        }
        gf_sp_hist1_fold(h4);
    } else {
        gf_sp_hist1_stream(&s, h4, 0, it);
    }
    if (overflow || sidx == NULL)
        rc = gf_sp_select(&s, k, h4, out, NULL, NULL, NULL, 0, 0);
    else
        rc = gf_sp_select(&s, k, h4, out, NULL, sidx, sraw, m, sB);
    free(sidx);
    free(sraw);
    free(h4);
    free(it);
    return rc;
}

/*
 * Random-k over a table, given the indices (ascending, < n): one merge pass computes
 * c = g + e, writes values[m] = c[indices[m]], e_out = c off the indices and 0 on them.
 * Returns the number of non-finite c.
 */
static int64_t gf_sp_gather_table(const int64_t* src, const int64_t* offsets, const int64_t* counts,
                                  int64_t lo, int64_t hi, const float* e_in, float* e_out,
                                  int64_t k, const uint32_t* indices, float* values)
{
    int64_t t, i, m = 0, bad = 0;
    for (t = lo; t < hi; t++) {
        const float* g = (const float*) (uintptr_t) src[t];
        int64_t off = offsets[t], cnt = counts[t];
        int64_t end = off + cnt;
        if (cnt <= 0)
            continue;
        if (e_out) {
            const float* e = e_in + off;
            float* eo = e_out + off;
            int64_t start = 0;
            while (start < cnt) {
                int64_t stop = (m < k && (int64_t) indices[m] < end) ? (int64_t) indices[m] - off : cnt;
                for (i = start; i < stop; i++) {
                    float v = g[i] + e[i];
                    eo[i] = v;
                    bad += (gf_sp_fbits(v) & 0x7fffffffu) >= 0x7f800000u;
                }
                if (stop < cnt) {
                    float v = g[stop] + e[stop];
                    values[m++] = v;
                    eo[stop] = 0.0f;
                    bad += (gf_sp_fbits(v) & 0x7fffffffu) >= 0x7f800000u;
                    stop++;
                }
                start = stop;
            }
        } else {
            for (i = 0; i < cnt; i++)
                bad += (gf_sp_fbits(g[i]) & 0x7fffffffu) >= 0x7f800000u;
            for (; m < k && (int64_t) indices[m] < end; m++)
                values[m] = g[indices[m] - off];
        }
    }
    return bad;
}

/* ------------------------------------------------------------------------------ */
/* decompress-and-accumulate                                                        */

/* Find the table row lo..hi-1 whose [offset, offset+count) holds j (count > 0). */
static inline int64_t gf_sp_find_row(const int64_t* offsets, const int64_t* counts,
                                     int64_t lo, int64_t hi, int64_t j)
{
    int64_t a = lo, b = hi - 1;          /* last row with offset <= j, and count > 0 */
    while (a < b) {
        int64_t mid = a + (b - a + 1) / 2;
        if (offsets[mid] <= j) a = mid; else b = mid - 1;
    }
    /* empty rows share the offset of the next row: step back to one that holds j */
    while (a > lo && (counts[a] <= 0 || j >= offsets[a] + counts[a]))
        a--;
    return a;
}

static void gf_sp_decompress_table(const float* values, const uint32_t* indices, int64_t p, int64_t k,
                                   const int64_t* dst, const int64_t* offsets, const int64_t* counts,
                                   int64_t lo, int64_t hi, double divisor)
{
    int64_t t, i, r, m, row;
    float fdiv = (float) divisor;
    for (t = lo; t < hi; t++)
        if (counts[t] > 0)
            memset((void*) (uintptr_t) dst[t], 0, (size_t) counts[t] * sizeof(float));
    if (hi <= lo)
        return;
    for (r = 0; r < p; r++) {
        const float* v = values + r * k;
        const uint32_t* ix = indices + r * k;
        row = lo;
        for (m = 0; m < k; m++) {
            int64_t j = ix[m];
            if (j < offsets[row] || j >= offsets[row] + counts[row]) {
                /* ascending rows usually just move on to the next tensors */
                if (j >= offsets[row] && row + 1 < hi && j < offsets[row + 1] + counts[row + 1] && j >= offsets[row + 1])
                    row = row + 1;
                else
                    row = gf_sp_find_row(offsets, counts, lo, hi, j);
            }
            float* d = (float*) (uintptr_t) dst[row];
            d[j - offsets[row]] += v[m];
        }
    }
    if (divisor != 1.0)
        for (t = lo; t < hi; t++) {
            float* d = (float*) (uintptr_t) dst[t];
            for (i = 0; i < counts[t]; i++)
                d[i] = d[i] / fdiv;
        }
}

static void gf_sp_decompress_array(const float* values, const uint32_t* indices, int64_t p, int64_t k,
                                   float* out, int64_t n, double divisor)
{
    int64_t i, r, m;
    float fdiv = (float) divisor;
    memset(out, 0, (size_t) n * sizeof(float));
    for (r = 0; r < p; r++) {
        const float* v = values + r * k;
        const uint32_t* ix = indices + r * k;
        for (m = 0; m < k; m++)
            out[ix[m]] += v[m];
    }
    if (divisor != 1.0)
        for (i = 0; i < n; i++)
            out[i] = out[i] / fdiv;
}

#endif
