/*
 * Top-k and random-k sparsification kernels (see docs/compressors_sparse.md).
 *
 * Everything here is integer selection logic plus one float32 add per element
 * (c = g + e) and one float32 add/divide per selected element on decompress, so the
 * scalar and AVX2 paths give identical bits by construction: the AVX2 paths only
 * speed up the element-wise add and the candidate scan, never change an order.
 *
 * Selection ("the k largest keys, ties to the lower index, indices ascending") is a
 * two-level radix select on 32-bit keys, O(n):
 *   top-k:    key = bits(c) & 0x7fffffff      (|c| as uint32: same order as |c|,
 *                                               NaN patterns above +inf)
 *   random-k: key = ~h, h = splitmix64(seed + i) >> 32   (largest ~h == smallest h)
 * Level 1: histogram of key >> 16 (fused into the pass that produces c or h) gives the
 * bin B that holds the k-th largest key. Candidate pass: the indices whose key >> 16
 * >= B, in ascending order. Level 2: histogram of the low 16 bits of the candidates in
 * bin B gives the threshold key T with count(key > T) < k <= count(key >= T). Output:
 * the candidates with key > T, plus the first (k - count(key > T)) with key == T.
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

#define GF_SP_BINS 65536

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
/* candidate scan: cand <- every j with ((raw[j] & mask) >> 16) >= B, ascending.   */
/* cand must hold one slot more than the number of candidates.                      */

static int64_t gf_sp_scan_scalar(const uint32_t* raw, uint32_t mask, int64_t n,
                                 uint32_t B, uint32_t* cand)
{
    int64_t j, m = 0;
    for (j = 0; j < n; j++) {
        cand[m] = (uint32_t) j;
        m += ((raw[j] & mask) >> 16) >= B;
    }
    return m;
}

#if GF_SP_HAVE_AVX2
__attribute__((target("avx2")))
static int64_t gf_sp_scan_avx2(const uint32_t* raw, uint32_t mask, int64_t n,
                               uint32_t B, uint32_t* cand)
{
    int64_t j = 0, m = 0;
    /* unsigned (key >> 16) >= B  <=>  (key >> 16) > B - 1 as signed, since both
       sides fit in 17 bits; B == 0 selects everything. */
    const __m256i vm = _mm256_set1_epi32((int) mask);
    const __m256i vb = _mm256_set1_epi32((int) B - 1);
    for (; j + 32 <= n; j += 32) {
        __m256i k0 = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + j)), vm), 16);
        __m256i k1 = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + j + 8)), vm), 16);
        __m256i k2 = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + j + 16)), vm), 16);
        __m256i k3 = _mm256_srli_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i*) (raw + j + 24)), vm), 16);
        uint32_t b0 = (uint32_t) _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k0, vb)));
        uint32_t b1 = (uint32_t) _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k1, vb)));
        uint32_t b2 = (uint32_t) _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k2, vb)));
        uint32_t b3 = (uint32_t) _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k3, vb)));
        uint32_t bits = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
        while (bits) {
            cand[m++] = (uint32_t) (j + __builtin_ctz(bits));
            bits &= bits - 1;
        }
    }
    for (; j < n; j++) {
        cand[m] = (uint32_t) j;
        m += ((raw[j] & mask) >> 16) >= B;
    }
    return m;
}
#endif

/*
 * Select the k largest (raw[j] & mask), ties to the lower index, into out[0..k-1]
 * ascending. hist: the level-1 histogram of (raw[j] & mask) >> 16 over all n (it is
 * clobbered). 0 <= k <= n. Returns 0, or -1 when out of memory.
 */
static int gf_sp_select(const uint32_t* raw, uint32_t mask, int64_t n, int64_t k,
                        uint32_t* hist, uint32_t* out)
{
    int64_t j, m, cum, ncand, need;
    uint32_t B, L, T, key;
    int64_t b;
    uint32_t* cand;

    if (k <= 0)
        return 0;
    if (k >= n) {
        for (j = 0; j < n; j++)
            out[j] = (uint32_t) j;
        return 0;
    }
    /* level 1: the bin B of the k-th largest key; cum = count(key >> 16 > B) */
    cum = 0;
    B = 0;
    for (b = GF_SP_BINS - 1; b >= 0; b--) {
        if (cum + (int64_t) hist[b] >= k) { B = (uint32_t) b; break; }
        cum += hist[b];
    }
    ncand = cum + (int64_t) hist[B];
    /* + 1: the branch-free scan stores one slot past the last candidate */
    cand = (uint32_t*) malloc((size_t) (ncand + 1) * sizeof(uint32_t));
    if (cand == NULL)
        return -1;
#if GF_SP_HAVE_AVX2
    if (gf_use_avx2)
        m = gf_sp_scan_avx2(raw, mask, n, B, cand);
    else
#endif
        m = gf_sp_scan_scalar(raw, mask, n, B, cand);
    (void) m;   /* == ncand */
    /* level 2: low 16 bits of the keys in bin B */
    memset(hist, 0, GF_SP_BINS * sizeof(uint32_t));
    for (j = 0; j < ncand; j++) {
        key = raw[cand[j]] & mask;
        if ((key >> 16) == B)
            hist[key & 0xffff]++;
    }
    L = 0;
    for (b = GF_SP_BINS - 1; b >= 0; b--) {
        if (cum + (int64_t) hist[b] >= k) { L = (uint32_t) b; break; }
        cum += hist[b];
    }
    T = (B << 16) | L;
    need = k - cum;     /* how many keys == T to take, lowest indices first */
    m = 0;
    for (j = 0; j < ncand; j++) {
        key = raw[cand[j]] & mask;
        if (key > T) {
            out[m++] = cand[j];
        } else if (key == T && need > 0) {
            out[m++] = cand[j];
            need--;
        }
    }
    free(cand);
    return 0;
}

/* ------------------------------------------------------------------------------ */
/* pass 1 of top-k: c = g + e over a table, level-1 histogram, non-finite count     */

static inline void gf_sp_c_run_scalar(const float* g, const float* e, float* c,
                                      int64_t cnt, uint32_t* hist, int64_t* nonfinite)
{
    int64_t i, bad = 0;
    uint32_t key;
    for (i = 0; i < cnt; i++) {
        float v = e ? g[i] + e[i] : g[i];
        c[i] = v;
        key = gf_sp_fbits(v) & 0x7fffffffu;
        hist[key >> 16]++;
        bad += key >= 0x7f800000u;
    }
    *nonfinite += bad;
}

#if GF_SP_HAVE_AVX2
__attribute__((target("avx2")))
static void gf_sp_c_run_avx2(const float* g, const float* e, float* c,
                             int64_t cnt, uint32_t* hist, int64_t* nonfinite)
{
    int64_t i = 0, bad = 0;
    uint32_t key;
    const __m256i vabs = _mm256_set1_epi32(0x7fffffff);
    const __m256i vinf = _mm256_set1_epi32(0x7f7fffff);
    __m256i vbad = _mm256_setzero_si256();
    uint32_t keys[8];
    int t;
    for (; i + 8 <= cnt; i += 8) {
        __m256 v = _mm256_loadu_ps(g + i);
        if (e)
            v = _mm256_add_ps(v, _mm256_loadu_ps(e + i));
        _mm256_storeu_ps(c + i, v);
        __m256i kv = _mm256_and_si256(_mm256_castps_si256(v), vabs);
        vbad = _mm256_sub_epi32(vbad, _mm256_cmpgt_epi32(kv, vinf));
        _mm256_storeu_si256((__m256i*) keys, _mm256_srli_epi32(kv, 16));
        for (t = 0; t < 8; t++)
            hist[keys[t]]++;
    }
    _mm256_storeu_si256((__m256i*) keys, vbad);
    for (t = 0; t < 8; t++)
        bad += keys[t];
    for (; i < cnt; i++) {
        float v = e ? g[i] + e[i] : g[i];
        c[i] = v;
        key = gf_sp_fbits(v) & 0x7fffffffu;
        hist[key >> 16]++;
        bad += key >= 0x7f800000u;
    }
    *nonfinite += bad;
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
    uint32_t* hist;
    float* c;
    float* scratch = NULL;
    int64_t t, m, nonfinite = 0;
    int rc;

    hist = (uint32_t*) calloc(GF_SP_BINS, sizeof(uint32_t));
    if (hist == NULL)
        return -1;
    if (e_out) {
        c = e_out;
    } else {
        scratch = (float*) malloc((size_t) (n > 0 ? n : 1) * sizeof(float));
        if (scratch == NULL) { free(hist); return -1; }
        c = scratch;
    }
    for (t = lo; t < hi; t++) {
        const float* g = (const float*) (uintptr_t) src[t];
        int64_t off = offsets[t], cnt = counts[t];
        if (cnt <= 0)
            continue;
#if GF_SP_HAVE_AVX2
        if (gf_use_avx2)
            gf_sp_c_run_avx2(g, e_in ? e_in + off : NULL, c + off, cnt, hist, &nonfinite);
        else
#endif
            gf_sp_c_run_scalar(g, e_in ? e_in + off : NULL, c + off, cnt, hist, &nonfinite);
    }
    rc = gf_sp_select((const uint32_t*) c, 0x7fffffffu, n, k, hist, indices);
    if (rc == 0) {
        for (m = 0; m < k; m++)
            values[m] = c[indices[m]];
        if (e_out)
            for (m = 0; m < k; m++)
                e_out[indices[m]] = 0.0f;
    }
    free(hist);
    free(scratch);
    return rc < 0 ? -1 : nonfinite;
}

/* ------------------------------------------------------------------------------ */
/* random-k                                                                         */

/* keys[i] = ~h_i for i in [i0, i1) and their level-1 histogram */
static void gf_sp_rk_keys_scalar(uint64_t seed, int64_t i0, int64_t i1, uint32_t* keys, uint32_t* hist)
{
    int64_t i;
    for (i = i0; i < i1; i++) {
        uint32_t key = ~gf_sp_rk_hash(seed, (uint64_t) i);
        keys[i] = key;
        hist[key >> 16]++;
    }
}

#if GF_SP_HAVE_AVX2
/* 64x64 -> low 64 bit multiply by a constant, from 32-bit products (AVX2 has no vpmullq) */
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
static void gf_sp_rk_keys_avx2(uint64_t seed, int64_t i0, int64_t i1, uint32_t* keys, uint32_t* hist)
{
    int64_t i = i0;
    uint32_t tmp[8];
    int t;
    const __m256i step = _mm256_set1_epi64x(8);
    __m256i z0 = _mm256_add_epi64(_mm256_set1_epi64x((long long) (seed + (uint64_t) i0 + 0x9e3779b97f4a7c15ULL)),
                                  _mm256_setr_epi64x(0, 1, 2, 3));
    __m256i z1 = _mm256_add_epi64(z0, _mm256_set1_epi64x(4));
    const __m256i ones = _mm256_set1_epi32(-1);
    const __m256i perm = _mm256_setr_epi32(1, 3, 5, 7, 0, 2, 4, 6);
    for (; i + 8 <= i1; i += 8) {
        __m256i a = z0, b = z1;
        a = gf_sp_mul64c(_mm256_xor_si256(a, _mm256_srli_epi64(a, 30)), 0xbf58476d1ce4e5b9ULL);
        b = gf_sp_mul64c(_mm256_xor_si256(b, _mm256_srli_epi64(b, 30)), 0xbf58476d1ce4e5b9ULL);
        a = gf_sp_mul64c(_mm256_xor_si256(a, _mm256_srli_epi64(a, 27)), 0x94d049bb133111ebULL);
        b = gf_sp_mul64c(_mm256_xor_si256(b, _mm256_srli_epi64(b, 27)), 0x94d049bb133111ebULL);
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 31));
        b = _mm256_xor_si256(b, _mm256_srli_epi64(b, 31));
        /* high halves of the 4+4 lanes, in order */
        __m256i ha = _mm256_permutevar8x32_epi32(a, perm);   /* lanes 0..3 = high words */
        __m256i hb = _mm256_permutevar8x32_epi32(b, perm);
        __m256i h = _mm256_permute2x128_si256(ha, hb, 0x20);
        h = _mm256_xor_si256(h, ones);
        _mm256_storeu_si256((__m256i*) (keys + i), h);
        _mm256_storeu_si256((__m256i*) tmp, _mm256_srli_epi32(h, 16));
        for (t = 0; t < 8; t++)
            hist[tmp[t]]++;
        z0 = _mm256_add_epi64(z0, step);
        z1 = _mm256_add_epi64(z1, step);
    }
    gf_sp_rk_keys_scalar(seed, i, i1, keys, hist);
}
#endif

/* out[0..k-1] <- the random-k indices (ascending). Returns 0 or -1 (out of memory). */
static int gf_sp_randomk_indices(uint64_t seed, int64_t n, int64_t k, uint32_t* out)
{
    uint32_t *hist, *keys;
    int rc;
    int64_t j;
    if (k <= 0)
        return 0;
    if (k >= n) {
        for (j = 0; j < n; j++)
            out[j] = (uint32_t) j;
        return 0;
    }
    hist = (uint32_t*) calloc(GF_SP_BINS, sizeof(uint32_t));
    keys = (uint32_t*) malloc((size_t) n * sizeof(uint32_t));
    if (hist == NULL || keys == NULL) {
        free(hist);
        free(keys);
        return -1;
    }
#if GF_SP_HAVE_AVX2
    if (gf_use_avx2)
        gf_sp_rk_keys_avx2(seed, 0, n, keys, hist);
    else
#endif
        gf_sp_rk_keys_scalar(seed, 0, n, keys, hist);
    rc = gf_sp_select(keys, 0xffffffffu, n, k, hist, out);
    free(hist);
    free(keys);
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
