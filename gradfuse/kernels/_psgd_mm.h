/* PowerSGD's small-rank products without BLAS, batched over a bucket's matrices, for
 * ranks r <= GF_PSGD_MM_MAX_RANK (8): P = M Q, Q = M^T P and A = P Q^T.
 *
 * They run on the caller's thread only (no thread pool that spins beside the training
 * framework's threads, as a multi-threaded BLAS does), and they are memory-bound: one pass
 * over the matrix each. Float32 sums, as a GEMM's; tests/ref_powersgd.py has the numpy
 * twins (to tolerance against float64 products), the job falls back to BLAS above rank 8.
 *
 * The table `mats` has 6 int64 per matrix: (w, n, m, r, p, q): M (n x m, row-major) at
 * W + w, P (n x r) at P + p, Q (m x r) at Q + q, and the approximation A at A + w.
 *
 * Summation orders (fixed, so the AVX2 kernels and the portable ones give the same bits;
 * no FMA: -ffp-contract=off, and AVX2 multiplies and adds apart):
 *   P[k][c] = sum_j M[k][j] Q[j][c]: 8 lanes, lane l adds j = l, l + 8, ... (full groups of
 *     8) in order, the last m % 8 products go to lanes 0.. in order; then lanes
 *     l += l + 4 (l < 4), l += l + 2 (l < 2), lane 0 += lane 1.
 *   Q[j][c] = sum_k M[k][j] P[k][c]: in row order k = 0, 1, ..., n - 1.
 *   A[k][j] = sum_c P[k][c] Q[j][c]: in column order c = 0, ..., r - 1 (r = 1: one
 *     product, the same bits as any GEMM's).
 * Each needs a scratch of r m floats (Q transposed, or Q^T's running sums); the functions
 * return -1 when it cannot be allocated, else 0.
 */
#ifndef GF_PSGD_MM_H
#define GF_PSGD_MM_H

#include <stdint.h>
#include <stdlib.h>
#include "_simd.h"

#define GF_PSGD_MM_MAX_RANK 8
#define GF_MM_L 8

#if GF_X86 && (defined(__GNUC__) || defined(__clang__))
#define GF_MM_HAVE_AVX2 1
#define GF_MM_AVX2 __attribute__((target("avx2")))
#else
#define GF_MM_HAVE_AVX2 0
#endif

#define GF_MM_INLINE static inline __attribute__((always_inline))

/* qt[c * m + j] = q[j * r + c] */
static void gf_mm_transpose(const float* q, int64_t m, int R, float* qt)
{
    for (int64_t j = 0; j < m; j++)
        for (int c = 0; c < R; c++) qt[c * m + j] = q[j * R + c];
}

/* ------------------------------------------------------------------ P = M Q */

GF_MM_INLINE void gf_mm_mq_body(const float* M, int64_t n, int64_t m, const float* qt, float* P, const int R)
{
    const int64_t full = m - m % GF_MM_L;
    for (int64_t k = 0; k < n; k++) {
        const float* row = M + k * m;
        float acc[GF_PSGD_MM_MAX_RANK][GF_MM_L];
        for (int c = 0; c < R; c++)
            for (int l = 0; l < GF_MM_L; l++) acc[c][l] = 0.0f;
        for (int64_t j = 0; j < full; j += GF_MM_L)
            for (int c = 0; c < R; c++) {
                const float* qc = qt + c * m + j;
                for (int l = 0; l < GF_MM_L; l++) acc[c][l] += row[j + l] * qc[l];
            }
        for (int64_t j = full; j < m; j++)
            for (int c = 0; c < R; c++) acc[c][j - full] += row[j] * qt[c * m + j];
        for (int c = 0; c < R; c++) {
            float* a = acc[c];
            for (int l = 0; l < 4; l++) a[l] += a[l + 4];
            for (int l = 0; l < 2; l++) a[l] += a[l + 2];
            P[k * R + c] = a[0] + a[1];
        }
    }
}

/* ------------------------------------------------------------------ Q = M^T P */

/* Columns full..m of four rows' update of s = M^T P (the scalar tail of both bodies below:
 * each row added in turn, as the vector part does). */
GF_MM_INLINE void gf_mm_mtp_tail4(const float* r0, const float* r1, const float* r2, const float* r3,
                                  const float* p, float* s, int64_t full, int64_t m, const int R)
{
    for (int64_t j = full; j < m; j++)
        for (int c = 0; c < R; c++) {
            float v = s[c * m + j];
            v += r0[j] * p[c];
            v += r1[j] * p[R + c];
            v += r2[j] * p[2 * R + c];
            v += r3[j] * p[3 * R + c];
            s[c * m + j] = v;
        }
}

/* s[c * m + j] (zeroed by the caller) += sum over rows k in order of M[k][j] P[k][c];
 * four rows at a time, each added in turn (the same order as one row at a time), eight
 * columns j at a time for every c (the rows' values loaded once for all r sums). */
GF_MM_INLINE void gf_mm_mtp_body(const float* M, int64_t n, int64_t m, const float* P, float* s, const int R)
{
    const int64_t full = m - m % GF_MM_L;
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        const float *r0 = M + k * m, *r1 = r0 + m, *r2 = r1 + m, *r3 = r2 + m;
        const float* p = P + k * R;
        for (int64_t j = 0; j < full; j += GF_MM_L)
            for (int c = 0; c < R; c++) {
                const float p0 = p[c], p1 = p[R + c], p2 = p[2 * R + c], p3 = p[3 * R + c];
                float* sc = s + c * m + j;
                for (int l = 0; l < GF_MM_L; l++) {
                    float v = sc[l];
                    v += r0[j + l] * p0;
                    v += r1[j + l] * p1;
                    v += r2[j + l] * p2;
                    v += r3[j + l] * p3;
                    sc[l] = v;
                }
            }
        gf_mm_mtp_tail4(r0, r1, r2, r3, p, s, full, m, R);
    }
    for (; k < n; k++) {
        const float* r0 = M + k * m;
        for (int c = 0; c < R; c++) {
            const float p0 = P[k * R + c];
            float* sc = s + c * m;
            for (int64_t j = 0; j < m; j++) sc[j] += r0[j] * p0;
        }
    }
}

/* ------------------------------------------------------------------ A = P Q^T */

GF_MM_INLINE void gf_mm_pqt_body(const float* P, int64_t n, int64_t m, const float* qt, float* A, const int R)
{
    for (int64_t k = 0; k < n; k++) {
        float* a = A + k * m;
        const float* p = P + k * R;
        const float p0 = p[0];
        for (int64_t j = 0; j < m; j++) a[j] = p0 * qt[j];
        for (int c = 1; c < R; c++) {
            const float pc = p[c];
            const float* qc = qt + c * m;
            for (int64_t j = 0; j < m; j++) a[j] += pc * qc[j];
        }
    }
}

/* One dispatcher per product and instruction set: R a constant in each case, so the
 * accumulators stay in registers. */
#define GF_MM_DISPATCH(body, R, ...) \
    switch (R) { \
    case 1: body(__VA_ARGS__, 1); break; case 2: body(__VA_ARGS__, 2); break; \
    case 3: body(__VA_ARGS__, 3); break; case 4: body(__VA_ARGS__, 4); break; \
    case 5: body(__VA_ARGS__, 5); break; case 6: body(__VA_ARGS__, 6); break; \
    case 7: body(__VA_ARGS__, 7); break; default: body(__VA_ARGS__, 8); break; }

static void gf_mm_mq_base(const float* M, int64_t n, int64_t m, const float* qt, float* P, int R)
{ GF_MM_DISPATCH(gf_mm_mq_body, R, M, n, m, qt, P) }
static void gf_mm_mtp_base(const float* M, int64_t n, int64_t m, const float* P, float* s, int R)
{ GF_MM_DISPATCH(gf_mm_mtp_body, R, M, n, m, P, s) }
static void gf_mm_pqt_base(const float* P, int64_t n, int64_t m, const float* qt, float* A, int R)
{ GF_MM_DISPATCH(gf_mm_pqt_body, R, P, n, m, qt, A) }

#if GF_MM_HAVE_AVX2
#include <immintrin.h>

/* The same sums as the bodies above, lane for lane, eight floats to a register. */
GF_MM_AVX2 GF_MM_INLINE void gf_mm_mq_body_avx2(const float* M, int64_t n, int64_t m, const float* qt, float* P,
                                                const int R)
{
    const int64_t full = m - m % GF_MM_L;
    for (int64_t k = 0; k < n; k++) {
        const float* row = M + k * m;
        __m256 acc[GF_PSGD_MM_MAX_RANK];
        for (int c = 0; c < R; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < full; j += GF_MM_L) {
            const __m256 x = _mm256_loadu_ps(row + j);
            for (int c = 0; c < R; c++)
                acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(x, _mm256_loadu_ps(qt + c * m + j)));
        }
        for (int c = 0; c < R; c++) {
            float a[GF_MM_L];
            _mm256_storeu_ps(a, acc[c]);
            for (int64_t j = full; j < m; j++) a[j - full] += row[j] * qt[c * m + j];
            for (int l = 0; l < 4; l++) a[l] += a[l + 4];
            for (int l = 0; l < 2; l++) a[l] += a[l + 2];
            P[k * R + c] = a[0] + a[1];
        }
    }
}

GF_MM_AVX2 GF_MM_INLINE void gf_mm_mtp_body_avx2(const float* M, int64_t n, int64_t m, const float* P, float* s,
                                                 const int R)
{
    const int64_t full = m - m % GF_MM_L;
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        const float *r0 = M + k * m, *r1 = r0 + m, *r2 = r1 + m, *r3 = r2 + m;
        const float* p = P + k * R;
        __m256 p0[GF_PSGD_MM_MAX_RANK], p1[GF_PSGD_MM_MAX_RANK], p2[GF_PSGD_MM_MAX_RANK], p3[GF_PSGD_MM_MAX_RANK];
        for (int c = 0; c < R; c++) {
            p0[c] = _mm256_set1_ps(p[c]); p1[c] = _mm256_set1_ps(p[R + c]);
            p2[c] = _mm256_set1_ps(p[2 * R + c]); p3[c] = _mm256_set1_ps(p[3 * R + c]);
        }
        for (int64_t j = 0; j < full; j += GF_MM_L) {
            const __m256 x0 = _mm256_loadu_ps(r0 + j), x1 = _mm256_loadu_ps(r1 + j);
            const __m256 x2 = _mm256_loadu_ps(r2 + j), x3 = _mm256_loadu_ps(r3 + j);
            for (int c = 0; c < R; c++) {
                float* sc = s + c * m + j;
                __m256 v = _mm256_loadu_ps(sc);
                v = _mm256_add_ps(v, _mm256_mul_ps(x0, p0[c]));
                v = _mm256_add_ps(v, _mm256_mul_ps(x1, p1[c]));
                v = _mm256_add_ps(v, _mm256_mul_ps(x2, p2[c]));
                v = _mm256_add_ps(v, _mm256_mul_ps(x3, p3[c]));
                _mm256_storeu_ps(sc, v);
            }
        }
        gf_mm_mtp_tail4(r0, r1, r2, r3, p, s, full, m, R);
    }
    for (; k < n; k++) {
        const float* r0 = M + k * m;
        for (int c = 0; c < R; c++) {
            const float pc = P[k * R + c];
            const __m256 pv = _mm256_set1_ps(pc);
            float* sc = s + c * m;
            int64_t j = 0;
            for (; j < full; j += GF_MM_L)
                _mm256_storeu_ps(sc + j, _mm256_add_ps(_mm256_loadu_ps(sc + j),
                                                       _mm256_mul_ps(_mm256_loadu_ps(r0 + j), pv)));
            for (; j < m; j++) sc[j] += r0[j] * pc;
        }
    }
}

GF_MM_AVX2 GF_MM_INLINE void gf_mm_pqt_body_avx2(const float* P, int64_t n, int64_t m, const float* qt, float* A,
                                                 const int R)
{
    const int64_t full = m - m % GF_MM_L;
    for (int64_t k = 0; k < n; k++) {
        float* a = A + k * m;
        const float* p = P + k * R;
        __m256 pv[GF_PSGD_MM_MAX_RANK];
        for (int c = 0; c < R; c++) pv[c] = _mm256_set1_ps(p[c]);
        int64_t j = 0;
        for (; j < full; j += GF_MM_L) {
            __m256 v = _mm256_mul_ps(pv[0], _mm256_loadu_ps(qt + j));
            for (int c = 1; c < R; c++) v = _mm256_add_ps(v, _mm256_mul_ps(pv[c], _mm256_loadu_ps(qt + c * m + j)));
            _mm256_storeu_ps(a + j, v);
        }
        for (; j < m; j++) {
            float v = p[0] * qt[j];
            for (int c = 1; c < R; c++) v += p[c] * qt[c * m + j];
            a[j] = v;
        }
    }
}

GF_MM_AVX2 static void gf_mm_mq_avx2(const float* M, int64_t n, int64_t m, const float* qt, float* P, int R)
{ GF_MM_DISPATCH(gf_mm_mq_body_avx2, R, M, n, m, qt, P) }
GF_MM_AVX2 static void gf_mm_mtp_avx2(const float* M, int64_t n, int64_t m, const float* P, float* s, int R)
{ GF_MM_DISPATCH(gf_mm_mtp_body_avx2, R, M, n, m, P, s) }
GF_MM_AVX2 static void gf_mm_pqt_avx2(const float* P, int64_t n, int64_t m, const float* qt, float* A, int R)
{ GF_MM_DISPATCH(gf_mm_pqt_body_avx2, R, P, n, m, qt, A) }
#define GF_MM_CALL(name, ...) do { if (gf_use_avx2) name##_avx2(__VA_ARGS__); else name##_base(__VA_ARGS__); } while (0)
#else
#define GF_MM_CALL(name, ...) name##_base(__VA_ARGS__)
#endif

/* kind 0: P = M Q, 1: Q = M^T P, 2: A = P Q^T, for each of the `count` matrices of `mats`
 * (every r in 1..GF_PSGD_MM_MAX_RANK, checked by the caller). */
static int gf_psgd_products(int kind, const int64_t* mats, int64_t count, const float* W, float* P, float* Q,
                            float* A)
{
    int64_t need = 1;
    for (int64_t b = 0; b < count; b++) {
        const int64_t* t = mats + 6 * b;
        if (t[2] * t[3] > need) need = t[2] * t[3];
    }
    float* s = (float*)malloc((size_t)need * sizeof(float));
    if (!s) return -1;
    for (int64_t b = 0; b < count; b++) {
        const int64_t* t = mats + 6 * b;
        const int64_t w = t[0], n = t[1], m = t[2], po = t[4], qo = t[5];
        const int R = (int)t[3];
        if (n <= 0 || m <= 0 || R <= 0) continue;
        if (kind == 0) {
            gf_mm_transpose(Q + qo, m, R, s);
            GF_MM_CALL(gf_mm_mq, W + w, n, m, s, P + po, R);
        } else if (kind == 1) {
            for (int64_t i = 0; i < m * R; i++) s[i] = 0.0f;
            GF_MM_CALL(gf_mm_mtp, W + w, n, m, P + po, s, R);
            float* q = Q + qo;
            for (int64_t j = 0; j < m; j++)
                for (int c = 0; c < R; c++) q[j * R + c] = s[c * m + j];
        } else {
            gf_mm_transpose(Q + qo, m, R, s);
            GF_MM_CALL(gf_mm_pqt, P + po, n, m, s, A + w, R);
        }
    }
    free(s);
    return 0;
}

/* The decode with the last product fused in (the bits of psgd_products "A" followed by
 * gf_psgd_scatter, without the approximation array in between): row i of the table with
 * route >= 0 is matrix mrow[i - lo] of `mats`, and receives A = P Q^T, a block of rows at
 * a time, then e_out = W - A for that block (while it is in cache); route < 0 receives U /
 * divisor (a copy when divisor is 1). Returns -1 when the scratch (r m floats) cannot be
 * allocated, else 0. */
static int gf_psgd_scatter_approx(const int64_t* dst, const int64_t* counts, const int64_t* route,
                                  const int64_t* mrow, int64_t lo, int64_t hi, const int64_t* mats,
                                  const float* P, const float* Q, const float* W, float* e_out, const float* U,
                                  float divisor)
{
    int64_t need = 1;
    for (int64_t i = lo; i < hi; i++) {
        if (route[i - lo] < 0 || counts[i] <= 0) continue;
        const int64_t* t = mats + 6 * mrow[i - lo];
        if (t[2] * t[3] > need) need = t[2] * t[3];
    }
    float* s = (float*)malloc((size_t)need * sizeof(float));
    if (!s) return -1;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t c = counts[i], to = route[i - lo];
        if (c <= 0) continue;
        float* o = (float*)(uintptr_t)dst[i];
        if (to < 0) {
            const float* u = U + (-1 - to);
            if (divisor == 1.0f) for (int64_t k = 0; k < c; k++) o[k] = u[k];
            else for (int64_t k = 0; k < c; k++) o[k] = u[k] / divisor;
            continue;
        }
        const int64_t* t = mats + 6 * mrow[i - lo];
        const int64_t n = t[1], m = t[2], po = t[4], qo = t[5];
        const int R = (int)t[3];
        gf_mm_transpose(Q + qo, m, R, s);
        const int64_t block = m >= 8192 ? 1 : 8192 / m;       /* rows of about 32 KB */
        for (int64_t k0 = 0; k0 < n; k0 += block) {
            const int64_t kb = n - k0 < block ? n - k0 : block;
            float* ob = o + k0 * m;
            GF_MM_CALL(gf_mm_pqt, P + po + k0 * R, kb, m, s, ob, R);
            if (e_out) {
                const float* w = W + to + k0 * m;
                float* eo = e_out + to + k0 * m;
                for (int64_t k = 0; k < kb * m; k++) eo[k] = w[k] - ob[k];
            }
        }
    }
    free(s);
    return 0;
}

#endif
