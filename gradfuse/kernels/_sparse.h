/*
 * Top-k and random-k sparsification kernels (see docs/compressors.md ("Sparse compressors")).
 *
 * Everything here is integer selection logic plus one float32 add per element
 * (c = g + e) and float32 adds/divides on decompress, so the scalar and AVX2 paths
 * give identical bits by construction: the AVX2 code only speeds up the element-wise
 * add and the candidate scan, it never changes an order.
 *
 * Every tensor (row) of a table selects its own k (ks[row - lo]); indices are bucket
 * positions, so the payload of a bucket is its tensors' selections one after another,
 * ascending.
 *
 * Top-k selection of a tensor ("the k largest keys, ties to the lower index, indices
 * ascending", key = bits(c) & 0x7fffffff: |c| as uint32, NaN patterns above +inf) is a
 * radix select on the 32-bit keys, O(n), with no n-sized scratch. Tensors of at most
 * GF_SP_SMALL elements cut the key at the exponent (bits 30..23: a 256-bin level 1),
 * then bits 22..15, 14..7, 6..0, with the levels after the first on the candidates
 * (elements at or above the level-1 bin of the k-th largest key) only. Larger ones cut
 * the key in three digits, bits 31..21, 20..10, 9..0: level 1, a histogram of the top
 * digit (fused into the pass that produces c), gives the bin B1 holding the k-th
 * largest key; then either (few
 * candidates: the usual case) one scan collects the (index, raw) of every element with
 * top digit >= B1, in ascending index order, and levels 2 and 3 and the output run on
 * those candidates only; or (many candidates, e.g. an all-zero tensor) levels 2, 3 and
 * the output are each a pass over the tensor. Both give the threshold key T with
 * count(key > T) < k <= count(key >= T); the output is every element with key > T plus
 * the first k - count(key > T) with key == T.
 *
 * Random-k draws k_t positions of tensor t in O(k_t), stratified: stratum m of the
 * tensor is [floor(m n / k), floor((m + 1) n / k)), and one position is drawn uniformly
 * in each from splitmix64 (integer arithmetic only, so every device draws the same).
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

/* tests only: 0 automatic; 1 forces the large-tensor path without candidate buffers
   (levels over the source) for every tensor; 2 the large-tensor path with candidates for
   every tensor (no small-tensor path); 3 the small-tensor path for every tensor that
   fits it (n <= GF_SP_SMALL) */
static int gf_sp_test_mode = 0;

#define GF_SP_B1 2048                   /* level-1 bins: key >> 21 */
#define GF_SP_BLK 2048                  /* block of the fused c pass */
#define GF_SP_SMALL 16384               /* tensors up to this size: the small-tensor select */
#define GF_SP_GOLDEN 0x9e3779b97f4a7c15ULL

static inline uint32_t gf_sp_fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline uint64_t gf_sp_splitmix64_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* ------------------------------------------------------------------------------ */
/* key streams: one tensor's raw words (contiguous: c in e_out, or the gradient)    */

typedef struct {
    uint32_t mask;              /* key = raw & mask */
    int64_t n;                  /* elements of the tensor */
    int64_t base;               /* bucket position of its first element */
    const uint32_t* arr;
} gf_sp_stream;

typedef struct {
    int64_t j;                  /* next position inside the tensor */
} gf_sp_iter;

static void gf_sp_iter_init(const gf_sp_stream* s, gf_sp_iter* it)
{
    (void) s;
    it->j = 0;
}

/* Next block: *p <- its raw words, *j0 <- bucket position of the first; returns its length (0: end). */
static int64_t gf_sp_next(const gf_sp_stream* s, gf_sp_iter* it, const uint32_t** p, int64_t* j0)
{
    int64_t len;
    if (it->j >= s->n)
        return 0;
    len = s->n - it->j;
    if (len > (int64_t) 1 << 20)
        len = (int64_t) 1 << 20;
    *p = s->arr + it->j;
    *j0 = s->base + it->j;
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
/* candidate scan: (idx, raw) of every element with key >> sh >= B1, ascending      */
/* (sh: 21, the large-tensor top digit, or 23, the small-tensor one).               */
/* The branch-free scalar loop stores one slot past the last candidate.             */

static int64_t gf_sp_scan_scalar(const uint32_t* raw, int64_t len, int64_t j0, uint32_t mask,
                                 uint32_t B1, uint32_t* cidx, uint32_t* craw, int sh)
{
    int64_t i, m = 0;
    for (i = 0; i < len; i++) {
        cidx[m] = (uint32_t) (j0 + i);
        craw[m] = raw[i];
        m += ((raw[i] & mask) >> sh) >= B1;
    }
    return m;
}

#if GF_SP_HAVE_AVX2
__attribute__((target("avx2")))
static int64_t gf_sp_scan_avx2(const uint32_t* raw, int64_t len, int64_t j0, uint32_t mask,
                               uint32_t B1, uint32_t* cidx, uint32_t* craw, int sh)
{
    int64_t i = 0, m = 0;
    /* key >> sh >= B1 <=> (signed) key >> sh > B1 - 1: both sides are in -1..2047 */
    const __m256i vm = _mm256_set1_epi32((int) mask);
    const __m256i vb = _mm256_set1_epi32((int) B1 - 1);
    const __m128i vs = _mm_cvtsi32_si128(sh);
    for (; i + 32 <= len; i += 32) {
        __m256i k0 = _mm256_srl_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + i)), vm), vs);
        __m256i k1 = _mm256_srl_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + i + 8)), vm), vs);
        __m256i k2 = _mm256_srl_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + i + 16)), vm), vs);
        __m256i k3 = _mm256_srl_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + i + 24)), vm), vs);
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
    return m + gf_sp_scan_scalar(raw + i, len - i, j0 + i, mask, B1, cidx + m, craw + m, sh);
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

/* Scratch of the large-tensor select, allocated once per kernel call. */
typedef struct {
    uint32_t h1[4 * GF_SP_B1];          /* level 1, 4 interleaved copies */
    uint32_t h4[4 * GF_SP_HS];          /* levels 2 and 3 */
    gf_sp_iter it;
    uint32_t cidx[GF_SP_SMALL + 1], craw[GF_SP_SMALL + 1];   /* the small select's candidates */
} gf_sp_scratch;

/*
 * Select the k largest keys of the stream (ties to the lower index) into oidx[0..k-1]
 * (bucket positions, ascending), and their raw words into oraw (if not NULL).
 * hist1: the folded level-1 histogram. 0 < k < n. Returns 0 (the candidate buffers fall
 * back on the scratch-free path when they cannot be allocated).
 */
static int gf_sp_select(const gf_sp_stream* s, int64_t k, const uint32_t* hist1,
                        uint32_t* oidx, uint32_t* oraw, gf_sp_scratch* sc)
{
    static const int shifts[2] = {10, 0}, widths[2] = {11, 10};
    int64_t cum = 0, ncand, m, need, len, j0;
    uint32_t prefix;
    uint32_t *cidx = NULL, *craw = NULL, *h4 = sc->h4;
    const uint32_t* p;
    gf_sp_iter* it = &sc->it;
    int lv;

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
        gf_sp_iter_init(s, it);
        while ((len = gf_sp_next(s, it, &p, &j0)) > 0) {
#if GF_SP_HAVE_AVX2
            if (gf_use_avx2)
                m += gf_sp_scan_avx2(p, len, j0, s->mask, prefix, cidx + m, craw + m, 21);
            else
#endif
                m += gf_sp_scan_scalar(p, len, j0, s->mask, prefix, cidx + m, craw + m, 21);
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
    return 0;
}

/*
 * The same for a small tensor (n <= GF_SP_SMALL): the digits are the exponent (bits
 * 30..23: the key's bit 31 is 0), then bits 22..15, 14..7 and 6..0. Level 1 is a
 * 256-bin histogram (4 interleaved copies) over the tensor; one scan collects the
 * candidates (exponent >= the bin of the k-th largest key) into the scratch, and the
 * other levels and the output run on those only. The same T and the same output as the
 * large-tensor select (any digits give them).
 */
static void gf_sp_select_small(const gf_sp_stream* s, int64_t k, uint32_t* oidx, uint32_t* oraw,
                               gf_sp_scratch* sc)
{
    static const int shifts[3] = {15, 7, 0}, widths[3] = {8, 8, 7};
    uint32_t h[4 * 256];
    uint32_t hl[257];                   /* bin 256: keys whose higher digits differ */
    const uint32_t* raw = s->arr;
    const uint32_t mask = s->mask;
    int64_t i, m, cum = 0, need;
    uint32_t prefix;
    int lv;
    memset(h, 0, sizeof(h));
    for (i = 0; i + 4 <= s->n; i += 4) {
        h[(raw[i] & mask) >> 23]++;
        h[256 + ((raw[i + 1] & mask) >> 23)]++;
        h[512 + ((raw[i + 2] & mask) >> 23)]++;
        h[768 + ((raw[i + 3] & mask) >> 23)]++;
    }
    for (; i < s->n; i++)
        h[(raw[i] & mask) >> 23]++;
    for (i = 0; i < 256; i++)
        h[i] += h[256 + i] + h[512 + i] + h[768 + i];
    prefix = gf_sp_find_bin(h, 256, &cum, k);
#if GF_SP_HAVE_AVX2
    if (gf_use_avx2)
        m = gf_sp_scan_avx2(raw, s->n, s->base, mask, prefix, sc->cidx, sc->craw, 23);
    else
#endif
        m = gf_sp_scan_scalar(raw, s->n, s->base, mask, prefix, sc->cidx, sc->craw, 23);
    for (lv = 0; lv < 3; lv++) {
        const int shift = shifts[lv], top = shift + widths[lv];
        const uint32_t dmask = ((uint32_t) 1 << widths[lv]) - 1;
        memset(hl, 0, sizeof(hl));
        for (i = 0; i < m; i++) {
            uint32_t key = sc->craw[i] & mask;
            uint32_t sel = (uint32_t) 0 - (uint32_t) ((key >> top) == prefix);
            hl[(((key >> shift) & dmask) & sel) | (256u & ~sel)]++;
        }
        prefix = (prefix << widths[lv]) | gf_sp_find_bin(hl, (int64_t) 1 << widths[lv], &cum, k);
    }
    need = k - cum;
    gf_sp_emit(sc->craw, sc->cidx, m, 0, mask, prefix, &need, k, oidx, oraw);
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
static void gf_sp_take_all(const gf_sp_stream* s, uint32_t* oidx, uint32_t* oraw)
{
    int64_t i;
    for (i = 0; i < s->n; i++) {
        oidx[i] = (uint32_t) (s->base + i);
        if (oraw)
            oraw[i] = s->arr[i];
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

/* c = g + e into c; returns the non-finite count (tensors that need no level-1 histogram) */
static int64_t gf_sp_c_plain_scalar(const float* g, const float* e, float* c, int64_t cnt)
{
    int64_t i, bad = 0;
    for (i = 0; i < cnt; i++) {
        c[i] = g[i] + e[i];
        bad += (gf_sp_fbits(c[i]) & 0x7fffffffu) >= 0x7f800000u;
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
        if (h4) {
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
    }
    _mm256_storeu_si256((__m256i*) tmp, vbad);
    for (t = 0; t < 8; t++)
        bad += tmp[t];
    if (h4)
        return bad + gf_sp_c_run_scalar(g + i, e + i, c + i, cnt - i, h4);
    return bad + gf_sp_c_plain_scalar(g + i, e + i, c + i, cnt - i);
}
#endif

/* c = g + e into c (and the level-1 histogram into h4 when not NULL); the non-finite count */
static int64_t gf_sp_c_pass(const float* g, const float* e, float* c, int64_t cnt, uint32_t* h4)
{
#if GF_SP_HAVE_AVX2
    if (gf_use_avx2)
        return gf_sp_c_run_avx2(g, e, c, cnt, h4);
#endif
    return h4 ? gf_sp_c_run_scalar(g, e, c, cnt, h4) : gf_sp_c_plain_scalar(g, e, c, cnt);
}

/*
 * Top-k over a table, k_t = ks[t - lo] of every tensor t (0 <= k_t <= counts[t]).
 * e_in/e_out: both NULL or both n long (may be equal). values, indices: sum of ks long;
 * tensor after tensor, bucket positions. Returns the number of non-finite c, or -1 when
 * out of memory.
 */
static int64_t gf_sp_topk(const int64_t* src, const int64_t* offsets, const int64_t* counts,
                          int64_t lo, int64_t hi, int64_t n,
                          const float* e_in, float* e_out, const int64_t* ks,
                          float* values, uint32_t* indices)
{
    gf_sp_scratch* sc = NULL;
    gf_sp_stream s;
    int64_t t, m, out = 0, nonfinite = 0;
    (void) n;
    for (t = lo; t < hi; t++) {
        const float* g = (const float*) (uintptr_t) src[t];
        int64_t off = offsets[t], cnt = counts[t], k = ks[t - lo];
        int small, hist;
        uint32_t* h1 = NULL;
        if (cnt <= 0)
            continue;
        small = cnt <= GF_SP_SMALL && (gf_sp_test_mode == 3 || gf_sp_test_mode == 0);
        hist = !small && k > 0 && k < cnt;          /* the large select needs level 1 */
        if (k > 0 && k < cnt && sc == NULL && (sc = (gf_sp_scratch*) malloc(sizeof(gf_sp_scratch))) == NULL)
            return -1;
        if (hist) {
            h1 = sc->h1;
            memset(h1, 0, sizeof(sc->h1));
        }
        s.mask = 0x7fffffffu;
        s.n = cnt;
        s.base = off;
        if (e_out) {
            /* c = g + e into e_out, fused with the level-1 histogram */
            nonfinite += gf_sp_c_pass(g, e_in + off, e_out + off, cnt, h1);
            if (h1)
                gf_sp_hist1_fold(h1);
            s.arr = (const uint32_t*) (e_out + off);
        } else {
            s.arr = (const uint32_t*) g;
            if (h1)
                nonfinite += gf_sp_hist1_stream(&s, h1, 1, &sc->it);
            else
                nonfinite += gf_sp_count_nonfinite(s.arr, cnt);
        }
        if (k >= cnt)
            gf_sp_take_all(&s, indices + out, (uint32_t*) values + out);
        else if (k > 0 && small)
            gf_sp_select_small(&s, k, indices + out, (uint32_t*) values + out, sc);
        else if (k > 0)
            gf_sp_select(&s, k, h1, indices + out, (uint32_t*) values + out, sc);
        if (e_out)
            for (m = out; m < out + k; m++)
                e_out[indices[m]] = 0.0f;
        out += k;
    }
    free(sc);
    return nonfinite;
}

/* ------------------------------------------------------------------------------ */
/* random-k                                                                         */

/*
 * out <- the random-k positions of `rows` tensors (counts[0..rows), ks[0..rows), dense
 * bucket positions), tensor after tensor, ascending. The t-th non-empty tensor (t = 0, 1,
 * ...; empty tensors draw nothing and are not counted) draws from its own seed
 * s_t = splitmix64_mix(seed + (t + 1) * golden); stratum m (0 <= m < k) of a tensor of n
 * elements is [a, b) = [floor(m n / k), floor((m + 1) n / k)), and its position is
 * a + ((h * (b - a)) >> 32) with h = splitmix64_mix(s_t + (m + 1) * golden) >> 32.
 * O(k) per tensor; n < 2^32, so every product fits in 64 bits.
 */
static void gf_sp_randomk_draw(uint64_t seed, const int64_t* counts, const int64_t* ks, int64_t rows,
                               uint32_t* out)
{
    int64_t r, pos = 0;
    uint64_t m, t = 0;                  /* t: the index among the non-empty tensors */
    for (r = 0; r < rows; r++) {
        uint64_t n = (uint64_t) counts[r], k = (uint64_t) ks[r];
        if (n == 0)
            continue;
        if (k > 0) {
            uint64_t st = gf_sp_splitmix64_mix(seed + (t + 1) * GF_SP_GOLDEN);
            uint64_t a = 0, b;           /* stratum m's start is stratum m - 1's end: one division each */
            for (m = 0; m < k; m++) {
                uint64_t h = gf_sp_splitmix64_mix(st + (m + 1) * GF_SP_GOLDEN) >> 32;
                b = (m + 1) * n / k;
                out[m] = (uint32_t) ((uint64_t) pos + a + ((h * (b - a)) >> 32));
                a = b;
            }
            out += k;
        }
        pos += counts[r];
        t++;
    }
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

/* Whether the non-empty rows lo..hi-1 have ascending, disjoint ranges (a fusion plan's
 * tables do). */
static int gf_sp_tables_ascending(const int64_t* offsets, const int64_t* counts, int64_t lo, int64_t hi)
{
    int64_t t, end = 0;
    for (t = lo; t < hi; t++) {
        if (counts[t] <= 0)
            continue;
        if (offsets[t] < end)
            return 0;
        end = offsets[t] + counts[t];
    }
    return 1;
}

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

/* Whether every row of indices equals row 0 and row 0 is strictly ascending (random-k:
 * every rank drew the same positions; the sparse allreduce's single row). */
static int gf_sp_shared_ascending(const uint32_t* indices, int64_t p, int64_t k)
{
    int64_t r, m;
    for (m = 1; m < k; m++)
        if (indices[m] <= indices[m - 1])
            return 0;
    for (r = 1; r < p; r++)
        if (memcmp(indices, indices + r * k, (size_t) k * sizeof(uint32_t)) != 0)
            return 0;
    return 1;
}

/* the shared-positions sum of payload position m: ((0.0f + v[0][m]) + v[1][m]) + ..., / fdiv
 * (row r of the values at values + r * vs) */
static inline float gf_sp_shared_sum(const float* values, int64_t p, int64_t vs, int64_t m, int div, float fdiv)
{
    float acc = 0.0f;
    int64_t r;
    for (r = 0; r < p; r++)
        acc += values[r * vs + m];
    return div ? acc / fdiv : acc;
}

/* tensors of at least this many bytes are written with non-temporal stores (AVX2 path):
 * no read for ownership of lines that are overwritten whole, and no eviction of the
 * cache for 100 MB of output; smaller ones stay in the cache for whoever reads them next */
#define GF_SP_NT_BYTES (256 * 1024)
#define GF_SP_NT_CHUNK 1024            /* floats staged in L1 per chunk (4 KiB) */

#if GF_SP_HAVE_AVX2
/*
 * d[0..cnt) = z, except d[indices[m] - off] = the shared sum of m for the indices of
 * this tensor (from *pm on, ascending, all below off + cnt); *pm advanced past them.
 * The head up to a 64-byte boundary and the tail are plain stores; in between, chunks
 * are built in an L1 buffer and streamed out whole lines at a time (_mm256_stream_ps).
 * The same values as the plain loop: only the stores differ.
 */
__attribute__((target("avx2")))
static void gf_sp_fill_scatter_nt(float* d, int64_t cnt, int64_t off, float z, const float* values, int64_t vs,
                                  const uint32_t* indices, int64_t p, int64_t k, int64_t* pm, int div, float fdiv)
{
    float buf[GF_SP_NT_CHUNK] __attribute__((aligned(64)));
    const __m256 vz = _mm256_set1_ps(z);
    int64_t m = *pm, i, pos, len, head = 0;
    uintptr_t a = (uintptr_t) d;
    if (a & 3) {
        head = cnt;                     /* not float-aligned: no streaming at all */
    } else {
        head = (int64_t) (((64 - (a & 63)) & 63) >> 2);
        if (head > cnt)
            head = cnt;
    }
    for (i = 0; i < head; i++)
        d[i] = z;
    for (; m < k && (int64_t) indices[m] < off + head; m++)
        d[indices[m] - off] = gf_sp_shared_sum(values, p, vs, m, div, fdiv);
    for (pos = head; pos < cnt; pos += len) {
        int64_t full;
        len = cnt - pos < GF_SP_NT_CHUNK ? cnt - pos : GF_SP_NT_CHUNK;
        for (i = 0; i < len; i += 8)
            _mm256_store_ps(buf + i, vz);
        for (; m < k && (int64_t) indices[m] < off + pos + len; m++)
            buf[indices[m] - off - pos] = gf_sp_shared_sum(values, p, vs, m, div, fdiv);
        full = len & ~(int64_t) 15;     /* whole 64-byte lines */
        for (i = 0; i < full; i += 16) {
            _mm256_stream_ps(d + pos + i, _mm256_load_ps(buf + i));
            _mm256_stream_ps(d + pos + i + 8, _mm256_load_ps(buf + i + 8));
        }
        for (; i < len; i++)
            d[pos + i] = buf[i];
    }
    _mm_sfence();
    *pm = m;
}
#endif

/*
 * The same sums when every row holds the same strictly ascending positions: position
 * indices[m] gets ((0.0f + values[0][m]) + values[1][m]) + ... / fdiv, every other
 * element 0.0f / fdiv (0.0f when divisor == 1), which is what the general path's
 * clear, adds and divide pass give there, bit for bit; one write of the tensors instead
 * of a clear and a read-modify-write of them all (non-temporal for large tensors on the
 * AVX2 path: gf_sp_fill_scatter_nt).
 */
static void gf_sp_decompress_shared(const float* values, int64_t vs, const uint32_t* indices, int64_t p, int64_t k,
                                    const int64_t* dst, const int64_t* offsets, const int64_t* counts,
                                    int64_t lo, int64_t hi, double divisor)
{
    int64_t t, i, m = 0;
    int div = divisor != 1.0;
    float fdiv = (float) divisor;
    float z = div ? 0.0f / fdiv : 0.0f;
    uint32_t zb;
    memcpy(&zb, &z, 4);
    for (t = lo; t < hi; t++) {
        float* d = (float*) (uintptr_t) dst[t];
        int64_t off = offsets[t], cnt = counts[t];
        if (cnt <= 0)
            continue;
        /* the indices are ascending and the rows' ranges ascending and disjoint */
        while (m < k && (int64_t) indices[m] < off)
            m++;
#if GF_SP_HAVE_AVX2
        if (gf_use_avx2 && cnt * (int64_t) sizeof(float) >= GF_SP_NT_BYTES) {
            gf_sp_fill_scatter_nt(d, cnt, off, z, values, vs, indices, p, k, &m, div, fdiv);
            continue;
        }
#endif
        if (zb == 0)
            memset(d, 0, (size_t) cnt * sizeof(float));
        else
            for (i = 0; i < cnt; i++)
                d[i] = z;
        for (; m < k && (int64_t) indices[m] < off + cnt; m++)
            d[indices[m] - off] = gf_sp_shared_sum(values, p, vs, m, div, fdiv);
    }
}

static void gf_sp_decompress_table(const float* values, const uint32_t* indices, int64_t p, int64_t k,
                                   const int64_t* dst, const int64_t* offsets, const int64_t* counts,
                                   int64_t lo, int64_t hi, double divisor)
{
    int64_t t, i, r, m, row;
    float fdiv = (float) divisor;
    if (p > 0 && k > 0 && gf_sp_tables_ascending(offsets, counts, lo, hi)
            && gf_sp_shared_ascending(indices, p, k)) {
        gf_sp_decompress_shared(values, k, indices, p, k, dst, offsets, counts, lo, hi, divisor);
        return;
    }
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
