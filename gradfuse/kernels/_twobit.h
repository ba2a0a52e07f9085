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

/* acc[0..cnt) (=|+=) the decoded values of one block of one rank (codes 1 -> +v, 2 -> -v,
 * 0 and 3 -> +0). first: assign. */
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
/* One block of p payloads summed and divided in registers (rank r's words at codes +
 * r * cstride, its value vals[r * vstride]): the same operations in the same order as the
 * scalar decode per rank then gf_q_divide, one write of d. A word (16 elements) per step;
 * MODE, NT and P2 (p == 2) are constants in each instance (gf_tbb_decode_sum_avx2). */
GF_Q_AVX2 static GF_Q_INLINE void gf_tbb_dsum_body(const uint32_t* codes, int64_t cstride, const float* vals,
                                                  int64_t vstride, int64_t p, int64_t cnt, float* d,
                                                  const int mode, float f, const int nt, const int p2)
{
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256 vf = _mm256_set1_ps(f);
    const float v0 = vals[0], v1 = p2 ? vals[vstride] : 0.0f;
    const __m256 tab0 = _mm256_setr_ps(0.0f, v0, -v0, 0.0f, 0.0f, v0, -v0, 0.0f);
    const __m256 tab1 = _mm256_setr_ps(0.0f, v1, -v1, 0.0f, 0.0f, v1, -v1, 0.0f);
    int64_t k = 0;
    for (; k + 16 <= cnt; k += 16) {
        const uint32_t w0 = codes[k >> 4], w1 = p2 ? codes[cstride + (k >> 4)] : 0u;
        for (int q = 0; q < 2; q++) {
            __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)((w0 >> (16 * q)) & 0xffffu)), sh);
            __m256 acc = _mm256_permutevar_ps(tab0, idx);
            if (p2) {
                idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)((w1 >> (16 * q)) & 0xffffu)), sh);
                acc = _mm256_add_ps(acc, _mm256_permutevar_ps(tab1, idx));
            } else {
                for (int64_t r = 1; r < p; r++) {
                    float v = vals[r * vstride];
                    const __m256 tab = _mm256_setr_ps(0.0f, v, -v, 0.0f, 0.0f, v, -v, 0.0f);
                    uint32_t bits16 = (codes[r * cstride + (k >> 4)] >> (16 * q)) & 0xffffu;
                    idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)bits16), sh);
                    acc = _mm256_add_ps(acc, _mm256_permutevar_ps(tab, idx));
                }
            }
            gf_q_put8(d + k + 8 * q, gf_q_div8(acc, mode, vf), nt);
        }
    }
    for (; k < cnt; k++) {                    /* the block's last word, when short */
        float a = 0.0f;
        for (int64_t r = 0; r < p; r++) {
            float v = vals[r * vstride];
            const float t4[4] = {0.0f, v, -v, 0.0f};
            float x = t4[(codes[r * cstride + (k >> 4)] >> (2 * (k & 15))) & 3u];
            a = r ? a + x : x;
        }
        d[k] = gf_q_divone(a, mode, f);
    }
}

GF_Q_AVX2 static void gf_tbb_decode_sum_avx2(const uint32_t* codes, int64_t cstride, const float* vals,
                                             int64_t vstride, int64_t p, int64_t cnt, float* d,
                                             int mode, float f, int nt)
{
#define GF_TBB_DSUM(M, N, P2) gf_tbb_dsum_body(codes, cstride, vals, vstride, p, cnt, d, M, f, N, P2)
    GF_Q_DSUM_DISPATCH(GF_TBB_DSUM, p, mode, nt);
#undef GF_TBB_DSUM
}
#endif

/* codes: p rows of `cstride` words, values: p rows of `vstride` floats, in the layout of
 * gf_twobit_block_compress for the same table counts. Returns 0. */
static int gf_twobit_block_decompress_sum(const uint32_t* codes, int64_t cstride,
                                          const float* values, int64_t vstride, int64_t p,
                                          int64_t block, const int64_t* ptrs, const int64_t* counts,
                                          int64_t lo, int64_t hi, int64_t n, double divisor)
{
    if (n <= 0) return 0;
    int avx = GF_Q_HAVE_AVX2 && gf_use_avx2, streamed = 0;
    float f = 1.0f;
    int mode = gf_q_divmode(divisor, &f);
    int64_t w = 0, b = 0;
    for (int64_t row = lo; row < hi; row++) {
        int64_t m = counts[row];
        if (m <= 0) continue;
        float* d = (float*)(uintptr_t)ptrs[row];
#if GF_Q_HAVE_AVX2
        if (avx) {                 /* every rank's block summed in registers, one write (_quant.h) */
            int nt = gf_q_streams(d, m);
            streamed |= nt;
            for (int64_t k = 0; k < m; k += block, b++) {
                int64_t cnt = m - k < block ? m - k : block;
                gf_tbb_decode_sum_avx2(codes + w + (k >> 4), cstride, values + b, vstride, p, cnt, d + k,
                                       mode, f, nt);
            }
            w += (m + 15) >> 4;
            continue;
        }
#endif
        for (int64_t k = 0; k < m; k += block, b++) {
            int64_t cnt = m - k < block ? m - k : block;
            for (int64_t r = 0; r < p; r++) {
                const uint32_t* wr = codes + r * cstride + w + (k >> 4);
                float v = values[r * vstride + b];
                gf_tbb_decode_scalar(wr, v, cnt, d + k, r == 0);
            }
            gf_q_divide(d + k, cnt, divisor);
        }
        w += (m + 15) >> 4;
    }
    (void)avx;
    gf_q_stream_fence(streamed);
    return 0;
}

#endif
