/* PowerSGD's kernels: Gram-Schmidt over a batch of matrices, the gather of a bucket's
 * matrices with the residual added, and the scatter of the approximation with the new
 * residual.
 *
 * Math (docs/compressors.md, "PowerSGD"); tests/ref_powersgd.py is the numpy twin and
 * cuda/powersgd.cu the GPU twin. No FMA (the build uses -ffp-contract=off).
 *
 * Orthogonalization (gf_psgd_orthogonalize): matrix b is rows[b] x cols[b] float32,
 * row-major at base + offsets[b] (element (k, j) at k * cols + j). For each column i in
 * order: its squared norm s, then every later column j loses its projection on it:
 *
 *   s = dot(i, i);  if s == 0: the column stays zero (and nothing is projected);
 *   else d = sqrt(s) + eps; x[k][i] = (float)(x[k][i] / d)
 *   for j > i: t = dot(i, j); x[k][j] = (float)(x[k][j] - t * x[k][i])   (double, one rounding)
 *
 * dot(i, j) is a double sum in a fixed order, the GPU warp's: 32 lanes, lane l adds the
 * products of rows l, l + 32, l + 64, ... in row order (each product of two float32 is
 * exact in double), then a butterfly: for h = 16, 8, 4, 2, 1, lane l adds lane l ^ h's
 * sum (a + b == b + a, so every lane holds the same bits); the result is lane 0's.
 *
 * Gather (gf_psgd_gather): rows lo..hi-1 of a float32 table (src[i]: counts[i] floats);
 * route[i - lo] >= 0 sends row i to W at that offset, with the residual e (same offsets,
 * may be NULL) added, one rounding; route < 0 sends it to U at offset -1 - route.
 * Returns the number of non-finite values written.
 *
 * Scatter (gf_psgd_scatter): row i with route >= 0 receives A (the approximation) and,
 * when e_out is not NULL, e_out = W - A (one rounding); route < 0 receives U / divisor
 * (float32 division; a plain copy when divisor is 1).
 */
#ifndef GF_POWERSGD_H
#define GF_POWERSGD_H

#include <math.h>
#include <stdint.h>

#define GF_PSGD_LANES 32

static double gf_psgd_dot(const float* x, int64_t rows, int64_t cols, int64_t a, int64_t b)
{
    double lane[GF_PSGD_LANES];
    for (int l = 0; l < GF_PSGD_LANES; l++) lane[l] = 0.0;
    int64_t k = 0;
    for (; k + GF_PSGD_LANES <= rows; k += GF_PSGD_LANES)
        for (int l = 0; l < GF_PSGD_LANES; l++) {
            const float* r = x + (k + l) * cols;
            lane[l] += (double)r[a] * (double)r[b];
        }
    for (int l = 0; k + l < rows; l++) {
        const float* r = x + (k + l) * cols;
        lane[l] += (double)r[a] * (double)r[b];
    }
    for (int h = GF_PSGD_LANES / 2; h >= 1; h /= 2) {
        double nxt[GF_PSGD_LANES];
        for (int l = 0; l < GF_PSGD_LANES; l++) nxt[l] = lane[l] + lane[l ^ h];
        for (int l = 0; l < GF_PSGD_LANES; l++) lane[l] = nxt[l];
    }
    return lane[0];
}

static void gf_psgd_orthogonalize(float* base, const int64_t* offsets, const int64_t* rows, const int64_t* cols,
                                  int64_t count, double eps)
{
    for (int64_t b = 0; b < count; b++) {
        float* x = base + offsets[b];
        int64_t n = rows[b], r = cols[b];
        for (int64_t i = 0; i < r; i++) {
            double s = gf_psgd_dot(x, n, r, i, i);
            if (s == 0.0) continue;          /* a zero column stays zero on every rank */
            double d = sqrt(s) + eps;
            for (int64_t k = 0; k < n; k++) x[k * r + i] = (float)((double)x[k * r + i] / d);
            for (int64_t j = i + 1; j < r; j++) {
                double t = gf_psgd_dot(x, n, r, i, j);
                for (int64_t k = 0; k < n; k++) {
                    double p = t * (double)x[k * r + i];
                    x[k * r + j] = (float)((double)x[k * r + j] - p);
                }
            }
        }
    }
}

static int64_t gf_psgd_gather(const int64_t* src, const int64_t* counts, const int64_t* route, int64_t lo,
                              int64_t hi, const float* e, float* W, float* U)
{
    int64_t bad = 0;
    for (int64_t i = lo; i < hi; i++) {
        int64_t c = counts[i], to = route[i - lo];
        if (c <= 0) continue;
        const float* g = (const float*)(uintptr_t)src[i];
        if (to >= 0) {
            float* w = W + to;
            if (e) {
                const float* ei = e + to;
                for (int64_t k = 0; k < c; k++) { float v = g[k] + ei[k]; w[k] = v; bad += !isfinite(v); }
            } else {
                for (int64_t k = 0; k < c; k++) { float v = g[k]; w[k] = v; bad += !isfinite(v); }
            }
        } else {
            float* u = U + (-1 - to);
            for (int64_t k = 0; k < c; k++) { float v = g[k]; u[k] = v; bad += !isfinite(v); }
        }
    }
    return bad;
}

static void gf_psgd_scatter(const int64_t* dst, const int64_t* counts, const int64_t* route, int64_t lo,
                            int64_t hi, const float* A, const float* W, float* e_out, const float* U,
                            float divisor)
{
    for (int64_t i = lo; i < hi; i++) {
        int64_t c = counts[i], to = route[i - lo];
        if (c <= 0) continue;
        float* o = (float*)(uintptr_t)dst[i];
        if (to >= 0) {
            const float* a = A + to;
            if (e_out) {
                const float* w = W + to;
                float* eo = e_out + to;
                for (int64_t k = 0; k < c; k++) { float v = a[k]; eo[k] = w[k] - v; o[k] = v; }
            } else {
                for (int64_t k = 0; k < c; k++) o[k] = a[k];
            }
        } else {
            const float* u = U + (-1 - to);
            if (divisor == 1.0f) for (int64_t k = 0; k < c; k++) o[k] = u[k];
            else for (int64_t k = 0; k < c; k++) o[k] = u[k] / divisor;
        }
    }
}

#endif
