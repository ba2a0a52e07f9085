/* DGC's momentum correction: the velocity update and momentum factor masking.
 *
 * Math (docs/compressors.md, "Momentum correction"); tests/ref_momentum.py is the numpy twin
 * and cuda/momentum.cu the GPU twin. float32, no FMA (the build uses -ffp-contract=off):
 *
 *   u_out[j] = m * u_in[j] + g[j]           two roundings: the product, then the sum
 *   out[j]   = u_out[j]                     (heavy ball, nesterov == 0), or
 *   out[j]   = nesterov * u_out[j] + g[j]   (Nesterov's look-ahead with momentum nesterov)
 *
 * m is the velocity's decay: the momentum, times the pending velocity scale (a learning
 * rate change); the look-ahead uses the momentum itself.
 *
 *   mask: c = e_in[j] + x[j]; if (e_out[j] == 0 && c != 0) u[j] = 0
 *
 * g is read through a pointer table (row i: count[i] floats at src[i], bucket positions
 * offsets[i] ..); out, when given, through a second table with the same offsets and
 * counts. Every element is read before it is written, so out may be the gradients
 * themselves (an in-place bucket) and u_out may be u_in. One elementwise loop: any
 * vectorisation the compiler does gives the same bits (IEEE products and sums).
 */
#ifndef GF_MOMENTUM_H
#define GF_MOMENTUM_H

#include <stdint.h>

static void gf_momentum_update(const int64_t* src, const int64_t* offsets, const int64_t* counts,
                               int64_t lo, int64_t hi, const float* u_in, float* u_out, float m,
                               const int64_t* out, float nesterov)
{
    for (int64_t i = lo; i < hi; i++) {
        int64_t c = counts[i];
        if (c <= 0) continue;
        const float* g = (const float*)(uintptr_t)src[i];
        const float* ui = u_in + offsets[i];
        float* uo = u_out + offsets[i];
        float* o = out ? (float*)(uintptr_t)out[i] : 0;
        if (!o) {
            for (int64_t k = 0; k < c; k++) {
                float gk = g[k];
                float p = m * ui[k];
                uo[k] = p + gk;
            }
        } else if (nesterov == 0.0f) {
            for (int64_t k = 0; k < c; k++) {
                float gk = g[k];
                float p = m * ui[k];
                float u = p + gk;
                uo[k] = u;
                o[k] = u;
            }
        } else {
            for (int64_t k = 0; k < c; k++) {
                float gk = g[k];
                float p = m * ui[k];
                float u = p + gk;
                float q = nesterov * u;
                uo[k] = u;
                o[k] = q + gk;
            }
        }
    }
}

/* Zero u where the compressor sent a non-zero value: it cleared that element's residual. */
static int64_t gf_momentum_mask(const float* e_in, const float* x, const float* e_out, float* u, int64_t n)
{
    int64_t masked = 0;
    for (int64_t j = 0; j < n; j++) {
        float c = e_in[j] + x[j];
        if (e_out[j] == 0.0f && c != 0.0f) {
            u[j] = 0.0f;
            masked++;
        }
    }
    return masked;
}

#endif
