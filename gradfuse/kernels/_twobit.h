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
    for (int64_t row = lo; row < hi; row++) {
        int64_t m = counts[row];
        if (m <= 0) continue;
        const float* g = (const float*)(uintptr_t)ptrs[row];
        for (int64_t k = 0; k < m; k += block, b++) {
            int64_t cnt = m - k < block ? m - k : block;
            int64_t npad = (cnt + 31) & ~(int64_t)31;
            if (e_in) {
#if GF_Q_HAVE_AVX2
                if (gf_use_avx2) gf_q_add_avx2(stage, g + k, e_in + pos + k, cnt);
                else
#endif
                gf_q_add_scalar(stage, g + k, e_in + pos + k, cnt);
            } else {
                gf_q_copy(stage, g + k, cnt);
            }
            for (int64_t q = cnt; q < npad; q++) stage[q] = 0.0f;
            float s = gf_tbb_total(stage, npad, 0.0f, 1, NULL) / (float)cnt;
            float t = s * factor;
            int64_t nsel = 0;
            float tot = gf_tbb_total(stage, npad, t, 0, &nsel);
            float v = nsel ? tot / (float)nsel : 0.0f;
            gf_tbb_emit(stage, cnt, t, v, codes + w + (k >> 4), e_out ? e_out + pos + k : NULL);
            values[b] = v;
            if (!(fabsf(s) < INFINITY)) bad++;
        }
        w += (m + 15) >> 4;
        pos += m;
    }
    free(stage);
    return bad;
}

/* codes: p rows of `cstride` words, values: p rows of `vstride` floats, in the layout of
 * gf_twobit_block_compress for the same table counts. Returns 0. */
static int gf_twobit_block_decompress_sum(const uint32_t* codes, int64_t cstride,
                                          const float* values, int64_t vstride, int64_t p,
                                          int64_t block, const int64_t* ptrs, const int64_t* counts,
                                          int64_t lo, int64_t hi, int64_t n, double divisor)
{
    if (n <= 0) return 0;
    int64_t w = 0, b = 0;
    for (int64_t row = lo; row < hi; row++) {
        int64_t m = counts[row];
        if (m <= 0) continue;
        float* d = (float*)(uintptr_t)ptrs[row];
        for (int64_t k = 0; k < m; k += block, b++) {
            int64_t cnt = m - k < block ? m - k : block;
            for (int64_t r = 0; r < p; r++) {
                const uint32_t* wr = codes + r * cstride + w + (k >> 4);
                float v = values[r * vstride + b], nv = -v;
                float* a = d + k;
                for (int64_t j = 0; j < cnt; j++) {
                    uint32_t code = (wr[j >> 4] >> (2 * (j & 15))) & 3u;
                    float x = code == 1u ? v : (code == 2u ? nv : 0.0f);
                    a[j] = r == 0 ? x : a[j] + x;
                }
            }
            gf_q_divide(d + k, cnt, divisor);
        }
        w += (m + 15) >> 4;
    }
    return 0;
}

#endif
