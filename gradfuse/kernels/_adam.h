/* The Adam correction (docs/compressors.md, "The Adam correction"): the moment update in
 * the frozen preconditioner's units, fused with error feedback and 1-bit compression; the
 * step after the exchange; plain Adam on the averaged gradient (warm-up, uncompressed
 * tensors).
 *
 * tests/ref_adam.py is the numpy twin, cuda/adam.cu the GPU twin. float32, no FMA (the
 * build uses -ffp-contract=off, and no fma intrinsic is used); every AVX2 path computes
 * each element with the scalar path's operations in the scalar path's order, so the bits
 * are the same (IEEE products, sums, square roots and quotients are correctly rounded):
 *
 *   moment  x[j] = b1 * m[j] + (c1 * g[j]) * r[j]          c1*g; *r; b1*m; the sum
 *   step    s[j] = (a * m[j]) / (b * sqrt(v[j]) + eps)     a*m; sqrt; b*sqrt; + eps; the quotient
 *   plain   m[j] = b1 * m[j] + c1 * g[j];  v[j] = b2 * v[j] + c2 * (g[j] * g[j]);  out[j] = s[j]
 *   apply   mask[j] != 0: m[j] = mb[j], out[j] = a * mb[j];  else m[j] = 0, out[j] = 0
 *
 * r is the frozen preconditioner 1 / (b sqrt(v_T) + eps) (0 where v_T is 0), m after the
 * freeze the moment in its units; mb is the exchanged moment, read from the outputs, which
 * then receive the step. The 1-bit kernel stages c = x + e (no residual: c = x) per block and
 * runs 1-bit's own scale and emit functions (_quant.h), so its bits are the moment
 * kernel's followed by gf_onebit_compress on x. Tables: row i holds counts[i] floats at
 * src[i]; m, r, v, x, mask and the residuals are indexed by bucket position offsets[i] + k.
 *
 * gf_adam_plain also returns, when sums != NULL, sums[0] += |v_new * f_new - v_old * f_old|
 * and sums[1] += v_new * f_new in double (the freeze rule's relative change of the
 * bias-corrected v); these sums are not part of the bit contract (the AVX2 path adds in
 * another order).
 */
#ifndef GF_ADAM_H
#define GF_ADAM_H

#include <stdint.h>
#include <math.h>
#include "_quant.h"

/* ---------------------------------------------------------------- moment */

static void gf_adam_moment_scalar(float* __restrict x, const float* __restrict g, const float* __restrict m,
                                  const float* __restrict r, int64_t c, float b1, float c1)
{
    for (int64_t k = 0; k < c; k++) {
        float q = c1 * g[k];
        q = q * r[k];
        float p = b1 * m[k];
        x[k] = p + q;
    }
}

#if GF_Q_HAVE_AVX2
GF_Q_AVX2 static inline __m256 gf_adam_moment8(__m256 vb, __m256 vc, const float* g, const float* m, const float* r)
{
    __m256 q = _mm256_mul_ps(_mm256_mul_ps(vc, _mm256_loadu_ps(g)), _mm256_loadu_ps(r));
    return _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(m)), q);
}

GF_Q_AVX2 static void gf_adam_moment_avx2(float* __restrict x, const float* __restrict g, const float* __restrict m,
                                          const float* __restrict r, int64_t c, float b1, float c1)
{
    const __m256 vb = _mm256_set1_ps(b1), vc = _mm256_set1_ps(c1);
    int64_t k = 0;
    for (; k + 8 <= c; k += 8)
        _mm256_storeu_ps(x + k, gf_adam_moment8(vb, vc, g + k, m + k, r + k));
    gf_adam_moment_scalar(x + k, g + k, m + k, r + k, c - k, b1, c1);
}
#endif

/* x (bucket positions) = b1 * m + (c1 * g) * r over table rows lo..hi-1. */
static void gf_adam_moment(const int64_t* src, const int64_t* offsets, const int64_t* counts,
                           int64_t lo, int64_t hi, const float* m, const float* r, float b1, float c1, float* x)
{
    for (int64_t i = lo; i < hi; i++) {
        int64_t c = counts[i];
        if (c <= 0) continue;
        const float* g = (const float*)(uintptr_t)src[i];
        int64_t o = offsets[i];
#if GF_Q_HAVE_AVX2
        if (gf_use_avx2) { gf_adam_moment_avx2(x + o, g, m + o, r + o, c, b1, c1); continue; }
#endif
        gf_adam_moment_scalar(x + o, g, m + o, r + o, c, b1, c1);
    }
}

/* ---------------------------------------------------------------- moment + 1-bit */

/* stage[0..cnt) = (b1 * m + (c1 * g) * r) + e (e NULL: without the residual). */
static void gf_adam_stage_scalar(float* __restrict st, const float* __restrict g, const float* __restrict m,
                                 const float* __restrict r, const float* __restrict e, int64_t cnt, float b1, float c1)
{
    for (int64_t k = 0; k < cnt; k++) {
        float q = c1 * g[k];
        q = q * r[k];
        float p = b1 * m[k];
        float x = p + q;
        st[k] = e ? x + e[k] : x;
    }
}

#if GF_Q_HAVE_AVX2
GF_Q_AVX2 static void gf_adam_stage_avx2(float* __restrict st, const float* __restrict g, const float* __restrict m,
                                         const float* __restrict r, const float* __restrict e, int64_t cnt,
                                         float b1, float c1)
{
    const __m256 vb = _mm256_set1_ps(b1), vc = _mm256_set1_ps(c1);
    int64_t k = 0;
    for (; k + 8 <= cnt; k += 8) {
        __m256 x = gf_adam_moment8(vb, vc, g + k, m + k, r + k);
        if (e) x = _mm256_add_ps(x, _mm256_loadu_ps(e + k));
        _mm256_storeu_ps(st + k, x);
    }
    gf_adam_stage_scalar(st + k, g + k, m + k, r + k, e ? e + k : NULL, cnt - k, b1, c1);
}
#endif

/* gf_onebit_compress (its format, blocks and residual) of c = (b1 * m + (c1 * g) * r) + e_in:
 * one pass over g, m, r and the residual. e_in/e_out NULL: no error feedback. Returns the
 * number of non-finite scales, or -1 on allocation failure. */
static int64_t gf_adam_onebit_compress(const int64_t* ptrs, const int64_t* counts, int64_t lo, int64_t hi,
                                       int64_t n, const float* m, const float* r, float b1, float c1,
                                       const float* e_in, float* e_out, int64_t block,
                                       uint32_t* bits, float* scales)
{
    if (n <= 0) return 0;
    int64_t bsz = block < n ? block : ((n + 31) & ~(int64_t)31);
    float* stage = gf_q_alloc(bsz);
    if (!stage) return -1;
    int64_t bad = 0, pos = 0, w = 0, b = 0;
    int avx = GF_Q_HAVE_AVX2 && gf_use_avx2;
    for (int64_t row = lo; row < hi; row++) {
        int64_t mrow = counts[row];
        if (mrow <= 0) continue;
        const float* g = (const float*)(uintptr_t)ptrs[row];
        for (int64_t k = 0; k < mrow; k += block, b++) {
            int64_t cnt = mrow - k < block ? mrow - k : block;
            int64_t npad = (cnt + 31) & ~(int64_t)31;
            const float* e = e_in ? e_in + pos + k : NULL;
#if GF_Q_HAVE_AVX2
            if (avx) gf_adam_stage_avx2(stage, g + k, m + pos + k, r + pos + k, e, cnt, b1, c1);
            else
#endif
            gf_adam_stage_scalar(stage, g + k, m + pos + k, r + pos + k, e, cnt, b1, c1);
            for (int64_t q = cnt; q < npad; q++) stage[q] = 0.0f;
            uint32_t* wb = bits + w + (k >> 5);
            float* eo = e_out ? e_out + pos + k : NULL;
            float s;
#if GF_Q_HAVE_AVX2
            if (avx) {
                s = gf_ob_scale_avx2(stage, npad, cnt);
                gf_ob_emit_avx2(stage, cnt, s, wb, eo);
            } else
#endif
            {
                s = gf_ob_scale_scalar(stage, npad, cnt);
                gf_ob_emit_scalar(stage, cnt, s, wb, eo);
            }
            scales[b] = s;
            if (!(fabsf(s) < INFINITY)) bad++;
        }
        w += (mrow + 31) >> 5;
        pos += mrow;
    }
    free(stage);
    return bad;
}

/* ---------------------------------------------------------------- the step */

static inline float gf_adam_step1(float mk, float vk, float a, float b, float eps)
{
    float num = a * mk;
    float r = sqrtf(vk);
    float d = b * r;
    d = d + eps;
    return num / d;
}

static void gf_adam_apply_scalar(float* __restrict o, float* __restrict m, const uint8_t* __restrict mask, int64_t c,
                                 float a)
{
    for (int64_t k = 0; k < c; k++) {
        float mb = o[k];
        if (mask && !mask[k]) {
            m[k] = 0.0f;
            o[k] = 0.0f;
        } else {
            m[k] = mb;
            o[k] = a * mb;
        }
    }
}

#if GF_Q_HAVE_AVX2
GF_Q_AVX2 static inline __m256 gf_adam_step8(__m256 mk, __m256 vk, __m256 va, __m256 vb, __m256 ve)
{
    __m256 num = _mm256_mul_ps(va, mk);
    __m256 d = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_sqrt_ps(vk)), ve);
    return _mm256_div_ps(num, d);
}

/* lanes whose mask byte is not 0, as an all-ones float mask */
GF_Q_AVX2 static inline __m256 gf_adam_keep8(const uint8_t* mask)
{
    __m128i bytes = _mm_loadl_epi64((const __m128i*)mask);
    __m256i w = _mm256_cvtepu8_epi32(bytes);
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpeq_epi32(w, _mm256_setzero_si256()),
                                                _mm256_set1_epi32(-1)));
}

GF_Q_AVX2 static void gf_adam_apply_avx2(float* __restrict o, float* __restrict m, const uint8_t* __restrict mask,
                                         int64_t c, float a)
{
    const __m256 va = _mm256_set1_ps(a);
    int64_t k = 0;
    for (; k + 8 <= c; k += 8) {
        __m256 mb = _mm256_loadu_ps(o + k);
        __m256 s = _mm256_mul_ps(va, mb);
        if (mask) {
            __m256 keep = gf_adam_keep8(mask + k);
            mb = _mm256_and_ps(mb, keep);
            s = _mm256_and_ps(s, keep);
        }
        _mm256_storeu_ps(m + k, mb);
        _mm256_storeu_ps(o + k, s);
    }
    gf_adam_apply_scalar(o + k, m + k, mask ? mask + k : NULL, c - k, a);
}
#endif

/* Over table rows lo..hi-1 of the outputs (which hold the exchanged moment): the moment
 * into m, the step a * moment into the outputs; mask NULL: every element kept. */
static void gf_adam_apply(const int64_t* dst, const int64_t* offsets, const int64_t* counts, int64_t lo, int64_t hi,
                          float* m, const uint8_t* mask, float a)
{
    for (int64_t i = lo; i < hi; i++) {
        int64_t c = counts[i];
        if (c <= 0) continue;
        float* o = (float*)(uintptr_t)dst[i];
        int64_t off = offsets[i];
        const uint8_t* mk = mask ? mask + off : NULL;
#if GF_Q_HAVE_AVX2
        if (gf_use_avx2) { gf_adam_apply_avx2(o, m + off, mk, c, a); continue; }
#endif
        gf_adam_apply_scalar(o, m + off, mk, c, a);
    }
}

/* ---------------------------------------------------------------- plain Adam */

typedef struct {
    float b1, c1, b2, c2, a, b, eps;
    double f_new, f_old;     /* the bias corrections 1 / (1 - b2^t) of the new and the old v */
} gf_adam_coef;

static void gf_adam_plain_scalar(float* __restrict o, float* __restrict m, float* __restrict v, int64_t c,
                                 const gf_adam_coef* k8, double* sums)
{
    double dsum = 0.0, vsum = 0.0;
    for (int64_t k = 0; k < c; k++) {
        float g = o[k];
        float p = k8->b1 * m[k];
        float q = k8->c1 * g;
        float mk = p + q;
        float vo = v[k];
        float r = k8->b2 * vo;
        float gg = g * g;
        float s = k8->c2 * gg;
        float vk = r + s;
        m[k] = mk;
        v[k] = vk;
        o[k] = gf_adam_step1(mk, vk, k8->a, k8->b, k8->eps);
        if (sums) {
            double hn = (double)vk * k8->f_new;
            dsum += fabs(hn - (double)vo * k8->f_old);
            vsum += hn;
        }
    }
    if (sums) { sums[0] += dsum; sums[1] += vsum; }
}

#if GF_Q_HAVE_AVX2
GF_Q_AVX2 static void gf_adam_plain_avx2(float* __restrict o, float* __restrict m, float* __restrict v, int64_t c,
                                         const gf_adam_coef* k8, double* sums)
{
    const __m256 b1 = _mm256_set1_ps(k8->b1), c1 = _mm256_set1_ps(k8->c1);
    const __m256 b2 = _mm256_set1_ps(k8->b2), c2 = _mm256_set1_ps(k8->c2);
    const __m256 va = _mm256_set1_ps(k8->a), vb = _mm256_set1_ps(k8->b), ve = _mm256_set1_ps(k8->eps);
    const __m256d fn = _mm256_set1_pd(k8->f_new), fo = _mm256_set1_pd(k8->f_old);
    const __m256d absd = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    __m256d dacc = _mm256_setzero_pd(), vacc = _mm256_setzero_pd();
    int64_t k = 0;
    for (; k + 8 <= c; k += 8) {
        __m256 g = _mm256_loadu_ps(o + k);
        __m256 mk = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(m + k)), _mm256_mul_ps(c1, g));
        __m256 vo = _mm256_loadu_ps(v + k);
        __m256 vk = _mm256_add_ps(_mm256_mul_ps(b2, vo), _mm256_mul_ps(c2, _mm256_mul_ps(g, g)));
        _mm256_storeu_ps(m + k, mk);
        _mm256_storeu_ps(v + k, vk);
        _mm256_storeu_ps(o + k, gf_adam_step8(mk, vk, va, vb, ve));
        if (sums) {
            for (int h = 0; h < 2; h++) {
                __m128 nv = h ? _mm256_extractf128_ps(vk, 1) : _mm256_castps256_ps128(vk);
                __m128 ov = h ? _mm256_extractf128_ps(vo, 1) : _mm256_castps256_ps128(vo);
                __m256d hn = _mm256_mul_pd(_mm256_cvtps_pd(nv), fn);
                __m256d d = _mm256_sub_pd(hn, _mm256_mul_pd(_mm256_cvtps_pd(ov), fo));
                dacc = _mm256_add_pd(dacc, _mm256_and_pd(d, absd));
                vacc = _mm256_add_pd(vacc, hn);
            }
        }
    }
    if (sums) {
        double t[4], u[4];
        _mm256_storeu_pd(t, dacc);
        _mm256_storeu_pd(u, vacc);
        sums[0] += (t[0] + t[1]) + (t[2] + t[3]);
        sums[1] += (u[0] + u[1]) + (u[2] + u[3]);
    }
    gf_adam_plain_scalar(o + k, m + k, v + k, c - k, k8, sums);
}
#endif

/* Plain Adam over table rows lo..hi-1 of the outputs, which hold the averaged gradient
 * and receive the step; m and v updated in place. */
static void gf_adam_plain(const int64_t* dst, const int64_t* offsets, const int64_t* counts, int64_t lo, int64_t hi,
                          float* m, float* v, const gf_adam_coef* k8, double* sums)
{
    for (int64_t i = lo; i < hi; i++) {
        int64_t c = counts[i];
        if (c <= 0) continue;
        float* o = (float*)(uintptr_t)dst[i];
        int64_t off = offsets[i];
#if GF_Q_HAVE_AVX2
        if (gf_use_avx2) { gf_adam_plain_avx2(o, m + off, v + off, c, k8, sums); continue; }
#endif
        gf_adam_plain_scalar(o, m + off, v + off, c, k8, sums);
    }
}

#endif
