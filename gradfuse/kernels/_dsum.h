/*
 * Decode-and-sum of the blocked 1-bit (_quant.h) and scaled 2-bit (_twobit.h) payloads:
 * one driver for both, with the code width (bits per code, 1 or 2) as its parameter.
 * Called from _quant.pxi with validated arguments only.
 *
 * Both layouts are per tensor: tensor i's codes fill ceil(n_i / (32 / bits)) uint32 words
 * (element k in bits bits*(k % cpw) .. of its word k / cpw, cpw = 32 / bits codes per
 * word) after the previous tensors' words, and its blocks of B elements (the last may be
 * short) each have one float (the 1-bit scale, the 2-bit value) after the previous
 * tensors'. Every block starts on a word and never spans two tensors, so each is decoded
 * straight into its tensor.
 *
 * What the widths share is here: the tensor and block loop, the choice of non-temporal
 * stores, the AVX2 block loop and its dispatch on constants, the divide. What differs is
 * the decoder, each in its width's header: a block of one rank decoded into floats
 * (gf_ob_decode_scalar, gf_tbb_decode_scalar) and, on AVX2, a rank's constants and eight
 * elements of a word decoded in a register (gf_ob_rank8 / gf_ob_dec8, gf_tbb_rank8 /
 * gf_tbb_dec8). The AVX2 loop takes the width as a constant in each instance, so the
 * width's decoder is inlined into it.
 *
 * Bits: dst[j] = ((v_0 + v_1) + ...) + v_{p-1} starting from v_0, in float32, then the
 * divide of gf_q_divmode, on either path.
 */
#ifndef GRADFUSE_DSUM_H
#define GRADFUSE_DSUM_H

#include "_quant.h"
#include "_twobit.h"

/* acc[0..cnt) (=|+=) one block of one rank decoded by the width's scalar decoder. */
static inline void gf_q_decode_scalar(int bits, const uint32_t* w, float v, int64_t cnt,
                                      float* acc, int first)
{
    if (bits == 1)
        gf_ob_decode_scalar(w, v, cnt, acc, first);
    else
        gf_tbb_decode_scalar(w, v, cnt, acc, first);
}

#if GF_Q_HAVE_AVX2
GF_Q_AVX2 static GF_Q_INLINE __m256 gf_q_div8(__m256 x, int mode, __m256 f)
{
    return mode == 1 ? _mm256_mul_ps(x, f) : mode == 2 ? _mm256_div_ps(x, f) : x;
}

/* The width's AVX2 decoder: a rank's constants, and elements 8q..8q+7 of word w. */
GF_Q_AVX2 static GF_Q_INLINE gf_q_rank8 gf_q_rank8_of(const int bits, float v)
{
    return bits == 1 ? gf_ob_rank8(v) : gf_tbb_rank8(v);
}

GF_Q_AVX2 static GF_Q_INLINE __m256 gf_q_dec8(const int bits, gf_q_rank8 t, uint32_t w, int q)
{
    return bits == 1 ? gf_ob_dec8(t, w, q) : gf_tbb_dec8(t, w, q);
}

/* One block of p payloads summed and divided in registers (rank r's words at words +
 * r * wstride, its float vals[r * vstride]): the same operations in the same order as the
 * scalar decode per rank then the divide, one write of d. A word (32 / bits elements, in
 * vectors of 8) per step, rank after rank: a rank's constants and word are read once per
 * word, not once per vector. The block's last word, when short, goes through the scalar
 * decoder (the same operations again). BITS, MODE, NT and P2 (p == 2) are constants in
 * each instance (gf_q_dsum_width). */
GF_Q_AVX2 static GF_Q_INLINE void gf_q_dsum_body(const int bits, const uint32_t* words, int64_t wstride,
                                                const float* vals, int64_t vstride, int64_t p,
                                                int64_t cnt, float* d, const int mode, float f,
                                                const int nt, const int p2)
{
    const int lg = bits == 1 ? 5 : 4;         /* log2 of the codes per word */
    const int nv = (1 << lg) / 8;             /* vectors per word */
    const int64_t nfull = cnt >> lg;          /* whole words */
    const __m256 vf = _mm256_set1_ps(f);
    const gf_q_rank8 t0 = gf_q_rank8_of(bits, vals[0]);
    const gf_q_rank8 t1 = gf_q_rank8_of(bits, p2 ? vals[vstride] : 0.0f);
    for (int64_t i = 0; i < nfull; i++) {
        __m256 acc[4];                        /* nv <= 4 */
        const uint32_t w0 = words[i];
        for (int q = 0; q < nv; q++) acc[q] = gf_q_dec8(bits, t0, w0, q);
        if (p2) {
            const uint32_t w1 = words[wstride + i];
            for (int q = 0; q < nv; q++) acc[q] = _mm256_add_ps(acc[q], gf_q_dec8(bits, t1, w1, q));
        } else {
            for (int64_t r = 1; r < p; r++) {
                const gf_q_rank8 t = gf_q_rank8_of(bits, vals[r * vstride]);
                const uint32_t w = words[r * wstride + i];
                for (int q = 0; q < nv; q++) acc[q] = _mm256_add_ps(acc[q], gf_q_dec8(bits, t, w, q));
            }
        }
        float* di = d + (i << lg);
        for (int q = 0; q < nv; q++) gf_q_put8(di + 8 * q, gf_q_div8(acc[q], mode, vf), nt);
    }
    const int64_t k = nfull << lg;
    if (k < cnt) {
        for (int64_t r = 0; r < p; r++)
            gf_q_decode_scalar(bits, words + r * wstride + nfull, vals[r * vstride], cnt - k, d + k, r == 0);
        gf_q_divide_by(d + k, cnt - k, mode, f);
    }
}

/* gf_q_dsum_body with constant arguments where it pays (p == 2: every division mode,
 * streamed or not), else with the run-time mode. */
GF_Q_AVX2 static GF_Q_INLINE void gf_q_dsum_width(const int bits, const uint32_t* words, int64_t wstride,
                                                 const float* vals, int64_t vstride, int64_t p,
                                                 int64_t cnt, float* d, int mode, float f, int nt)
{
#define GF_Q_DSUM(M, N, P2) gf_q_dsum_body(bits, words, wstride, vals, vstride, p, cnt, d, M, f, N, P2)
    if (p == 2) {
        if (mode == 1) { if (nt) GF_Q_DSUM(1, 1, 1); else GF_Q_DSUM(1, 0, 1); }
        else if (mode == 0) { if (nt) GF_Q_DSUM(0, 1, 1); else GF_Q_DSUM(0, 0, 1); }
        else { if (nt) GF_Q_DSUM(2, 1, 1); else GF_Q_DSUM(2, 0, 1); }
    } else {
        if (nt) GF_Q_DSUM(mode, 1, 0); else GF_Q_DSUM(mode, 0, 0);
    }
#undef GF_Q_DSUM
}

/* One block through the AVX2 loop of its width (1 or 2 bits per code). */
GF_Q_AVX2 static void gf_q_decode_sum_avx2(int bits, const uint32_t* words, int64_t wstride,
                                           const float* vals, int64_t vstride, int64_t p,
                                           int64_t cnt, float* d, int mode, float f, int nt)
{
    if (bits == 1)
        gf_q_dsum_width(1, words, wstride, vals, vstride, p, cnt, d, mode, f, nt);
    else
        gf_q_dsum_width(2, words, wstride, vals, vstride, p, cnt, d, mode, f, nt);
}
#endif

/* The driver. words: p rows of `wstride` uint32 words of `bits`-bit codes, vals: p rows
 * of `vstride` floats (row r = rank r), in the layout above for the table's counts; the
 * sum / divisor goes into rows lo..hi-1 of the (ptrs, counts) table. */
static void gf_q_block_decompress_sum(int bits, const uint32_t* words, int64_t wstride,
                                      const float* vals, int64_t vstride, int64_t p, int64_t block,
                                      const int64_t* ptrs, const int64_t* counts,
                                      int64_t lo, int64_t hi, int64_t n, double divisor)
{
    if (n <= 0) return;
    const int lg = bits == 1 ? 5 : 4;         /* log2 of the codes per word */
    int avx = GF_Q_HAVE_AVX2 && gf_use_avx2, streamed = 0;
    float f = 1.0f;
    int mode = gf_q_divmode(divisor, &f);
    int64_t w = 0, b = 0;
    for (int64_t row = lo; row < hi; row++) {
        int64_t m = counts[row];
        if (m <= 0) continue;
        float* d = (float*)(uintptr_t)ptrs[row];
#if GF_Q_HAVE_AVX2
        if (avx) {                 /* every rank's block summed in registers, one write */
            int nt = gf_q_streams(d, m);
            streamed |= nt;
            for (int64_t k = 0; k < m; k += block, b++) {
                int64_t cnt = m - k < block ? m - k : block;
                gf_q_decode_sum_avx2(bits, words + w + (k >> lg), wstride, vals + b, vstride, p, cnt, d + k,
                                     mode, f, nt);
            }
            w += (m + (1 << lg) - 1) >> lg;
            continue;
        }
#endif
        for (int64_t k = 0; k < m; k += block, b++) {
            int64_t cnt = m - k < block ? m - k : block;
            for (int64_t r = 0; r < p; r++)
                gf_q_decode_scalar(bits, words + r * wstride + w + (k >> lg), vals[r * vstride + b], cnt,
                                   d + k, r == 0);
            gf_q_divide_by(d + k, cnt, mode, f);
        }
        w += (m + (1 << lg) - 1) >> lg;
    }
    (void)avx;
    gf_q_stream_fence(streamed);
}

#endif
