/*
 * Scaled 2-bit quantization (the default 2-bit format, docs/compressors.md "2-bit: layout")
 * with error feedback. Called from _twobit.pxi with validated arguments only. The
 * absolute-threshold (MXNet) 2-bit kernels are in _quant.h.
 *
 * Per tensor, blocks of B elements (B a multiple of 32; a tensor's last block may be
 * short), for c = g + e:
 *   s = mean |c| of the block       (32 lane partial sums: lane k takes the elements with
 *                                     (j - start) % 32 == k in increasing j from 0.0f, then
 *                                     the shfl_down tree 16, 8, 4, 2, 1, then / (float)count:
 *                                     the 1-bit scale's order)
 *   t = s * factor                   (one float32 multiply)
 *   +  if c > 0 and c >= t;  -  if c < 0 and c <= -t;  else 0
 *   v = (sum of |c| over the selected, same lane/tree order) / (float)nsel, 0 when nsel = 0
 *   decoded +v, -v, 0; residual e = c - q.
 * Codes: tensor i's ceil(n_i/16) uint32 words, its element k in bits 2(k%16), 2(k%16)+1
 * of its word k/16 (0b01 +, 0b10 -, 0b00 zero; padding 0); values: tensor i's ceil(n_i/B)
 * floats after the previous tensors'. Decompress-sum: ((v0 + v1) + ...) then the divide
 * of gf_q_divide. No FMA (-ffp-contract=off). The GPU twin is cuda/twobit.cu.
 */
#ifndef GRADFUSE_TWOBIT_H
#define GRADFUSE_TWOBIT_H

#include "_quant.h"

/* Lane/tree total of |c| over c[0..npad) (npad a multiple of 32), the selected elements
 * only unless all != 0 (selected: c > 0 && c >= t, or c < 0 && c <= -t); *nsel counts them. */
static float gf_tbb_total(const float* c, int64_t npad, float t, int all, int64_t* nsel)
{
    float lane[32];
    int64_t ns = 0;
    float nt = -t;
    for (int k = 0; k < 32; k++) lane[k] = 0.0f;
    if (all) {
        for (int64_t i = 0; i < npad; i += 32)
            for (int k = 0; k < 32; k++) lane[k] = lane[k] + fabsf(c[i + k]);
    } else {
        for (int64_t i = 0; i < npad; i += 32)
            for (int k = 0; k < 32; k++) {
                float x = c[i + k];
                int sel = (x > 0.0f && x >= t) || (x < 0.0f && x <= nt);
                ns += sel;
                lane[k] = lane[k] + (sel ? fabsf(x) : 0.0f);
            }
    }
    for (int off = 16; off >= 1; off >>= 1)
        for (int k = 0; k < off; k++) lane[k] = lane[k] + lane[k + off];
    if (nsel) *nsel = ns;
    return lane[0];
}

/* Codes of one staged block c[0..cnt) into words w[0..ceil(cnt/16)), residual into e (or
 * NULL), with threshold t and value v. */
static void gf_tbb_emit(const float* c, int64_t cnt, float t, float v, uint32_t* w, float* e)
{
    float nt = -t, nv = -v;
    for (int64_t i = 0; i < cnt; i += 16) {
        int64_t m = cnt - i < 16 ? cnt - i : 16;
        uint32_t word = 0;
        for (int64_t k = 0; k < m; k++) {
            float x = c[i + k];
            uint32_t pos = x > 0.0f && x >= t, neg = x < 0.0f && x <= nt;
            word |= (pos | (neg << 1)) << (2 * k);
            if (e) e[i + k] = x - (pos ? v : (neg ? nv : 0.0f));
        }
        w[i >> 4] = word;
    }
}

#if GF_Q_HAVE_AVX2
/* gf_tbb_total(c, npad, t, 0, nsel) on AVX2: the 32 lanes are 4 vectors of 8, the tree is
 * gf_ob_scale_avx2's (docs/compressors.md); unselected lanes add +0.0f, as the scalar's. */
GF_Q_AVX2 static float gf_tbb_selsum_avx2(const float* c, int64_t npad, float t, int64_t* nsel)
{
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 z = _mm256_setzero_ps(), vt = _mm256_set1_ps(t), vn = _mm256_set1_ps(-t);
    __m256 a[4] = {z, z, z, z};
    int64_t ns = 0;
    for (int64_t i = 0; i < npad; i += 32)
        for (int q = 0; q < 4; q++) {
            __m256 x = _mm256_loadu_ps(c + i + 8 * q);
            __m256 pos = _mm256_and_ps(_mm256_cmp_ps(x, z, _CMP_GT_OQ), _mm256_cmp_ps(x, vt, _CMP_GE_OQ));
            __m256 neg = _mm256_and_ps(_mm256_cmp_ps(x, z, _CMP_LT_OQ), _mm256_cmp_ps(x, vn, _CMP_LE_OQ));
            __m256 sel = _mm256_or_ps(pos, neg);
            ns += __builtin_popcount((unsigned)_mm256_movemask_ps(sel));
            a[q] = _mm256_add_ps(a[q], _mm256_and_ps(sel, _mm256_and_ps(x, absm)));
        }
    __m256 a0 = _mm256_add_ps(a[0], a[2]);        /* off 16 */
    __m256 a1 = _mm256_add_ps(a[1], a[3]);
    a0 = _mm256_add_ps(a0, a1);                   /* off 8 */
    __m128 l = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1)); /* 4 */
    l = _mm_add_ps(l, _mm_movehl_ps(l, l));       /* off 2 */
    l = _mm_add_ss(l, _mm_shuffle_ps(l, l, 1));   /* off 1 */
    *nsel = ns;
    return _mm_cvtss_f32(l);
}

/* gf_tbb_emit on AVX2; c is zero padded to a multiple of 32 (padding is never selected). */
GF_Q_AVX2 static void gf_tbb_emit_avx2(const float* c, int64_t cnt, float t, float v, uint32_t* w, float* e)
{
    const __m256 z = _mm256_setzero_ps(), vt = _mm256_set1_ps(t), vnt = _mm256_set1_ps(-t);
    const __m256 vv = _mm256_set1_ps(v), vnv = _mm256_set1_ps(-v);
    for (int64_t i = 0; i < cnt; i += 16) {
        uint32_t pm = 0, nm = 0;
        for (int q = 0; q < 2; q++) {
            int64_t o = i + 8 * q;
            __m256 x = _mm256_loadu_ps(c + o);
            __m256 pos = _mm256_and_ps(_mm256_cmp_ps(x, z, _CMP_GT_OQ), _mm256_cmp_ps(x, vt, _CMP_GE_OQ));
            __m256 neg = _mm256_and_ps(_mm256_cmp_ps(x, z, _CMP_LT_OQ), _mm256_cmp_ps(x, vnt, _CMP_LE_OQ));
            pm |= (uint32_t)gf_tb_spread[_mm256_movemask_ps(pos)] << (16 * q);
            nm |= (uint32_t)gf_tb_spread[_mm256_movemask_ps(neg)] << (16 * q);
            if (e && o < cnt) {
                __m256 qv = _mm256_or_ps(_mm256_and_ps(pos, vv), _mm256_and_ps(neg, vnv));
                __m256 r = _mm256_sub_ps(x, qv);
                if (o + 8 <= cnt) {
                    _mm256_storeu_ps(e + o, r);
                } else {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, r);
                    memcpy(e + o, tmp, (size_t)(cnt - o) * sizeof(float));
                }
            }
        }
        /* element k of the 16: pos bit at 2k, neg bit at 2k+1 */
        w[i >> 4] = pm | (nm << 1);          /* element k: + at bit 2k, - at bit 2k + 1 */
    }
}
#endif

/* One pass over rows lo..hi-1 of the table, blocks per tensor. e_in/e_out NULL: no error
 * feedback (else indexed by bucket position; may be the same array). Returns the number
 * of blocks whose mean |c| is not finite, or -1 on allocation failure. */
static int64_t gf_twobit_block_compress(const int64_t* ptrs, const int64_t* counts,
                                        int64_t lo, int64_t hi, int64_t n,
                                        const float* e_in, float* e_out, int64_t block,
                                        float factor, uint32_t* codes, float* values)
{
    if (n <= 0) return 0;
    int64_t bsz = block < n ? block : ((n + 31) & ~(int64_t)31);
    float* stage = gf_q_alloc(bsz);
    if (!stage) return -1;
    int64_t bad = 0, pos = 0, w = 0, b = 0;
    int avx = GF_Q_HAVE_AVX2 && gf_use_avx2;
    for (int64_t row = lo; row < hi; row++) {
        int64_t m = counts[row];
        if (m <= 0) continue;
        const float* g = (const float*)(uintptr_t)ptrs[row];
        for (int64_t k = 0; k < m; k += block, b++) {
            int64_t cnt = m - k < block ? m - k : block;
            int64_t npad = (cnt + 31) & ~(int64_t)31;
            if (e_in) {
#if GF_Q_HAVE_AVX2
                if (avx) gf_q_add_avx2(stage, g + k, e_in + pos + k, cnt);
                else
#endif
                gf_q_add_scalar(stage, g + k, e_in + pos + k, cnt);
            } else {
                gf_q_copy(stage, g + k, cnt);
            }
            for (int64_t q = cnt; q < npad; q++) stage[q] = 0.0f;
            float s, t, tot, v;
            int64_t nsel = 0;
            uint32_t* wb = codes + w + (k >> 4);
            float* eo = e_out ? e_out + pos + k : NULL;
#if GF_Q_HAVE_AVX2
            if (avx) {
                s = gf_ob_scale_avx2(stage, npad, cnt);      /* 1-bit's scale, the same order */
                t = s * factor;
                tot = gf_tbb_selsum_avx2(stage, npad, t, &nsel);
                v = nsel ? tot / (float)nsel : 0.0f;
                gf_tbb_emit_avx2(stage, cnt, t, v, wb, eo);
            } else
#endif
            {
                s = gf_tbb_total(stage, npad, 0.0f, 1, NULL) / (float)cnt;
                t = s * factor;
                tot = gf_tbb_total(stage, npad, t, 0, &nsel);
                v = nsel ? tot / (float)nsel : 0.0f;
                gf_tbb_emit(stage, cnt, t, v, wb, eo);
            }
            values[b] = v;
            if (!(fabsf(s) < INFINITY)) bad++;
        }
        w += (m + 15) >> 4;
        pos += m;
    }
    free(stage);
    return bad;
}

/* The 2-bit decoder (gf_q_block_decompress_sum in _dsum.h is the driver): code 1 -> +v,
 * 2 -> -v, 0 and 3 -> +0. acc[0..cnt) (=|+=) the decoded values of one block of one rank,
 * words at wr[0..). first: assign. */
static void gf_tbb_decode_scalar(const uint32_t* wr, float v, int64_t cnt, float* acc, int first)
{
    const float tab[4] = {0.0f, v, -v, 0.0f};
    for (int64_t i = 0; i < cnt; i += 16) {
        int64_t m = cnt - i < 16 ? cnt - i : 16;
        uint32_t word = wr[i >> 4];
        float* a = acc + i;
        if (first)
            for (int64_t k = 0; k < m; k++) a[k] = tab[(word >> (2 * k)) & 3u];
        else
            for (int64_t k = 0; k < m; k++) a[k] = a[k] + tab[(word >> (2 * k)) & 3u];
    }
}

#if GF_Q_HAVE_AVX2
/* The 2-bit decoder on AVX2: a rank's constant is its code table {0, v, -v, 0} in both
 * 128-bit halves (gf_tbb_rank8); elements 8q..8q+7 of word w look their codes up in it
 * (gf_tbb_dec8: lane i shifts the word's half q right by 2i, permutevar reads the low two
 * bits). */
GF_Q_AVX2 static GF_Q_INLINE gf_q_rank8 gf_tbb_rank8(float v)
{
    gf_q_rank8 t;
    t.x = _mm256_setr_ps(0.0f, v, -v, 0.0f, 0.0f, v, -v, 0.0f);
    t.y = t.x;
    return t;
}

GF_Q_AVX2 static GF_Q_INLINE __m256 gf_tbb_dec8(gf_q_rank8 t, uint32_t w, int q)
{
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)((w >> (16 * q)) & 0xffffu)), sh);
    return _mm256_permutevar_ps(t.x, idx);
}
#endif

#endif
