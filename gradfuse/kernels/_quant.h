/*
 * 1-bit (sign + per-block mean |c| scale) and 2-bit (MXNet threshold) quantization
 * with error feedback. Called from _quant.pxi with validated arguments only.
 *
 * Bit-exactness: every float32 operation is done in the same order and with the same
 * operands on the scalar and the AVX2 paths (and must be on the future CUDA port):
 *   - 1-bit scale: 32 lane partial sums (lane k takes elements with (j-start)%32 == k,
 *     increasing j, from 0.0f), then the shfl_down tree 16, 8, 4, 2, 1
 *     (lane[i] = lane[i] + lane[i+off]), then total / (float)count.
 *   - 1-bit blocks restart at every tensor of the table (a tensor's last block may be
 *     short); each tensor's sign bits start on a new 32-bit word and its scales follow
 *     the previous tensor's (docs/compressors.md, "1-bit: layout").
 *   - decompress-sum: ((v0 + v1) + v2) + ... starting from v0, then / (float)divisor
 *     unless divisor == 1.
 * No FMA (the build uses -ffp-contract=off; no fma intrinsics here).
 * NaN payload bits are not part of the contract (compilers may swap the operands of a
 * commutative add); only "is NaN" is.
 */
#ifndef GRADFUSE_QUANT_H
#define GRADFUSE_QUANT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "_simd.h"

#if GF_X86 && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GF_Q_HAVE_AVX2 1
#define GF_Q_AVX2 __attribute__((target("avx2")))
#else
#define GF_Q_HAVE_AVX2 0
#endif

/* ---------------------------------------------------------------- streamed output */

/* The fused AVX2 decode-and-sum (gf_q_decode_sum_avx2, _dsum.h) writes tensors of at
 * least this many bytes, when 16-byte aligned, with non-temporal stores: a decoded
 * tensor is written whole and not read by its decoder (but for a short last word), so
 * its lines need not be read for ownership first, and 100 MB of output do not evict the
 * cache. Smaller tensors stay in the cache for whoever reads them next. Only the stores
 * differ: the same bits.
 * Settable (gradfuse._core.set_stream_bytes) so that the tests and the A/B measurement
 * run both. */
#define GF_Q_STREAM_BYTES_DEFAULT (256 * 1024)
static int64_t gf_q_stream_bytes = GF_Q_STREAM_BYTES_DEFAULT;

/* Whether a decoder streams the m floats at d. */
static int gf_q_streams(const float* d, int64_t m)
{
    return GF_Q_HAVE_AVX2 && m * (int64_t)sizeof(float) >= gf_q_stream_bytes && ((uintptr_t)d & 15) == 0;
}

#if GF_Q_HAVE_AVX2
/* d[0..8) = v: two 16-byte non-temporal stores (d 16-byte aligned) when nt, else plain. */
GF_Q_AVX2 static inline void gf_q_put8(float* d, __m256 v, int nt)
{
    if (nt) {
        _mm_stream_ps(d, _mm256_castps256_ps128(v));
        _mm_stream_ps(d + 4, _mm256_extractf128_ps(v, 1));
    } else {
        _mm256_storeu_ps(d, v);
    }
}
#endif

/* Orders a call's non-temporal stores before whatever hands its outputs on. */
static void gf_q_stream_fence(int streamed)
{
#if GF_Q_HAVE_AVX2
    if (streamed) _mm_sfence();
#else
    (void)streamed;
#endif
}

/* Plain copy loop: glibc's memcpy was 3-4x slower than this for the 2-16 KB
 * staging copies on the test machine. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
static void gf_q_copy(float* __restrict d, const float* __restrict s, int64_t m)
{
    for (int64_t k = 0; k < m; k++) d[k] = s[k];
}

/* d = s + e elementwise (an exact per-element float32 add on either path). */
static void gf_q_add_scalar(float* __restrict d, const float* __restrict s,
                            const float* __restrict e, int64_t m)
{
    for (int64_t k = 0; k < m; k++) d[k] = s[k] + e[k];
}

#if GF_Q_HAVE_AVX2
GF_Q_AVX2 static void gf_q_add_avx2(float* __restrict d, const float* __restrict s,
                                    const float* __restrict e, int64_t m)
{
    int64_t k = 0;
    for (; k + 16 <= m; k += 16) {
        __m256 a = _mm256_add_ps(_mm256_loadu_ps(s + k), _mm256_loadu_ps(e + k));
        __m256 b = _mm256_add_ps(_mm256_loadu_ps(s + k + 8), _mm256_loadu_ps(e + k + 8));
        _mm256_storeu_ps(d + k, a);
        _mm256_storeu_ps(d + k + 8, b);
    }
    for (; k < m; k++) d[k] = s[k] + e[k];
}
#endif

/* ---------------------------------------------------------------- table cursor */

/* Walks the rows lo..hi-1 of a (ptr, count) table in bucket order. Offsets are
 * dense (checked in Python), so the bucket position is implicit. */
typedef struct {
    const int64_t* ptrs;
    const int64_t* counts;
    int64_t row, hi, pos;   /* current row, end row, element position inside row */
} gf_qcur;

static void gf_qcur_init(gf_qcur* c, const int64_t* ptrs, const int64_t* counts,
                         int64_t lo, int64_t hi)
{
    c->ptrs = ptrs; c->counts = counts; c->row = lo; c->hi = hi; c->pos = 0;
}

/* stage[0..m) = src[next m elements] (+ e[0..m) when e != NULL). */
static void gf_q_gather(gf_qcur* cur, float* stage, int64_t m, const float* e)
{
    int64_t done = 0;
    while (done < m) {
        int64_t avail = cur->counts[cur->row] - cur->pos;
        if (avail <= 0) { cur->row++; cur->pos = 0; continue; }
        int64_t take = m - done < avail ? m - done : avail;
        const float* s = (const float*)(uintptr_t)cur->ptrs[cur->row] + cur->pos;
        float* d = stage + done;
        if (e) {
#if GF_Q_HAVE_AVX2
            if (gf_use_avx2) gf_q_add_avx2(d, s, e + done, take);
            else
#endif
            gf_q_add_scalar(d, s, e + done, take);
        } else {
            gf_q_copy(d, s, take);
        }
        done += take;
        cur->pos += take;
    }
}

/* dst[next m elements] = stage[0..m). */
static void gf_q_scatter(gf_qcur* cur, const float* stage, int64_t m)
{
    int64_t done = 0;
    while (done < m) {
        int64_t avail = cur->counts[cur->row] - cur->pos;
        if (avail <= 0) { cur->row++; cur->pos = 0; continue; }
        int64_t take = m - done < avail ? m - done : avail;
        float* d = (float*)(uintptr_t)cur->ptrs[cur->row] + cur->pos;
        gf_q_copy(d, stage + done, take);
        done += take;
        cur->pos += take;
    }
}

static float* gf_q_alloc(int64_t nfloats)
{
    return (float*)malloc((size_t)(nfloats > 0 ? nfloats : 1) * sizeof(float));
}

/* ---------------------------------------------------------------- the divide */

/* gf_q_divide as a mode: 0 nothing (divisor 1), 1 multiply by *f (the exact reciprocal
 * of a power of two), 2 divide by *f. For a power of two whose reciprocal is exact,
 * x * (1/f) is the same correctly rounded real number as x / f, so the same bits (zeros,
 * subnormals, inf and NaN included), and much cheaper. */
static int gf_q_divmode(double divisor, float* f)
{
    if (divisor == 1.0) return 0;
    float fd = (float)divisor;
    int ex;
    float m = frexpf(fd, &ex);
    float r = 1.0f / fd;
    if ((m == 0.5f || m == -0.5f) && r != 0.0f && fabsf(r) < INFINITY && r * fd == 1.0f) {
        *f = r;
        return 1;
    }
    *f = fd;
    return 2;
}

/* acc[k] = acc[k] / (float)divisor in the mode and operand of gf_q_divmode. */
static void gf_q_divide_by(float* acc, int64_t cnt, int mode, float f)
{
    if (mode == 1) {
        for (int64_t k = 0; k < cnt; k++) acc[k] = acc[k] * f;
    } else if (mode == 2) {
        for (int64_t k = 0; k < cnt; k++) acc[k] = acc[k] / f;
    }
}

/* acc[k] = acc[k] / (float)divisor; nothing when divisor == 1.0 (gf_q_divmode). */
static void gf_q_divide(float* acc, int64_t cnt, double divisor)
{
    float f = 1.0f;
    int mode = gf_q_divmode(divisor, &f);
    gf_q_divide_by(acc, cnt, mode, f);
}

#if GF_Q_HAVE_AVX2
#define GF_Q_INLINE __attribute__((always_inline)) inline

/* A rank's decoding constants for one block, in the form its width's AVX2 decoder wants
 * (gf_ob_rank8, gf_tbb_rank8); a decoder may leave y unused. */
typedef struct {
    __m256 x, y;
} gf_q_rank8;
#endif

/* ================================================================ 1-bit */

/* Scale of one staged block: c[0..npad) with npad a multiple of 32 and
 * c[count..npad) == 0. */
static float gf_ob_scale_scalar(const float* c, int64_t npad, int64_t count)
{
    float lane[32];
    for (int k = 0; k < 32; k++) lane[k] = 0.0f;
    for (int64_t i = 0; i < npad; i += 32)
        for (int k = 0; k < 32; k++) lane[k] = lane[k] + fabsf(c[i + k]);
    for (int off = 16; off >= 1; off >>= 1)
        for (int k = 0; k < off; k++) lane[k] = lane[k] + lane[k + off];
    return lane[0] / (float)count;
}

/* Bits and residual of one staged block; words at bits[0..), residual at e (or NULL). */
static void gf_ob_emit_scalar(const float* c, int64_t count, float s,
                              uint32_t* bits, float* e)
{
    float ns = -s;
    for (int64_t i = 0; i < count; i += 32) {
        int64_t m = count - i < 32 ? count - i : 32;
        uint32_t w = 0;
        for (int64_t k = 0; k < m; k++) w |= (uint32_t)(c[i + k] >= 0.0f) << k;
        bits[i >> 5] = w;
    }
    if (e)
        for (int64_t k = 0; k < count; k++) {
            float x = c[k];
            e[k] = x - (x >= 0.0f ? s : ns);
        }
}

#if GF_Q_HAVE_AVX2
GF_Q_AVX2 static float gf_ob_scale_avx2(const float* c, int64_t npad, int64_t count)
{
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < npad; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_and_ps(_mm256_loadu_ps(c + i), absm));
        a1 = _mm256_add_ps(a1, _mm256_and_ps(_mm256_loadu_ps(c + i + 8), absm));
        a2 = _mm256_add_ps(a2, _mm256_and_ps(_mm256_loadu_ps(c + i + 16), absm));
        a3 = _mm256_add_ps(a3, _mm256_and_ps(_mm256_loadu_ps(c + i + 24), absm));
    }
    a0 = _mm256_add_ps(a0, a2);                 /* off 16: lanes 0..15 += 16..31 */
    a1 = _mm256_add_ps(a1, a3);
    a0 = _mm256_add_ps(a0, a1);                 /* off 8 */
    __m128 l = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1)); /* 4 */
    l = _mm_add_ps(l, _mm_movehl_ps(l, l));     /* off 2: [0]+=[2], [1]+=[3] */
    l = _mm_add_ss(l, _mm_shuffle_ps(l, l, 1)); /* off 1: [0]+=[1] */
    return _mm_cvtss_f32(l) / (float)count;
}

GF_Q_AVX2 static void gf_ob_emit_avx2(const float* c, int64_t count, float s,
                                      uint32_t* bits, float* e)
{
    const __m256 z = _mm256_setzero_ps();
    const __m256 vs = _mm256_set1_ps(s), vn = _mm256_set1_ps(-s);
    for (int64_t i = 0; i < count; i += 32) {
        int64_t m = count - i < 32 ? count - i : 32;
        uint32_t w = 0;
        for (int q = 0; q < 4; q++) {
            __m256 x = _mm256_loadu_ps(c + i + 8 * q);
            __m256 ge = _mm256_cmp_ps(x, z, _CMP_GE_OQ);   /* -0 -> true, NaN -> false */
            w |= (uint32_t)_mm256_movemask_ps(ge) << (8 * q);
            if (e) {
                __m256 r = _mm256_sub_ps(x, _mm256_blendv_ps(vn, vs, ge));
                int64_t o = i + 8 * q;
                if (o + 8 <= count) {
                    _mm256_storeu_ps(e + o, r);
                } else if (o < count) {
                    float t[8];
                    _mm256_storeu_ps(t, r);
                    memcpy(e + o, t, (size_t)(count - o) * sizeof(float));
                }
            }
        }
        if (m < 32) w &= (1u << m) - 1u;
        bits[i >> 5] = w;
    }
}
#endif

/* One fused pass over the bucket, tensor by tensor: blocks restart at every tensor
 * (a tensor's last block may be short), each tensor's words start at w, its scales at b.
 * e_in/e_out NULL: no error feedback (else indexed by bucket position).
 * Returns the number of non-finite scales, or -1 on allocation failure. */
static int64_t gf_onebit_compress(const int64_t* ptrs, const int64_t* counts,
                                  int64_t lo, int64_t hi, int64_t n,
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
        int64_t m = counts[row];
        if (m <= 0) continue;
        const float* g = (const float*)(uintptr_t)ptrs[row];
        for (int64_t k = 0; k < m; k += block, b++) {
            int64_t cnt = m - k < block ? m - k : block;
            int64_t npad = (cnt + 31) & ~(int64_t)31;
            const float* c = g + k;
            if (e_in || npad != cnt) {       /* stage c = g + e, zero padded to npad */
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
                c = stage;
            }
            uint32_t* wb = bits + w + (k >> 5);
            float* eo = e_out ? e_out + pos + k : NULL;
            float s;
#if GF_Q_HAVE_AVX2
            if (avx) {
                s = gf_ob_scale_avx2(c, npad, cnt);
                gf_ob_emit_avx2(c, cnt, s, wb, eo);
            } else
#endif
            {
                s = gf_ob_scale_scalar(c, npad, cnt);
                gf_ob_emit_scalar(c, cnt, s, wb, eo);
            }
            scales[b] = s;
            if (!(fabsf(s) < INFINITY)) bad++;
        }
        w += (m + 31) >> 5;
        pos += m;
    }
    free(stage);
    return bad;
}

/* The 1-bit decoder (gf_q_block_decompress_sum in _dsum.h is the driver): bit 1 -> +s,
 * 0 -> -s. acc[0..cnt) (=|+=) the decoded values of one block of one rank, words at
 * bits[0..). first: assign. */
static void gf_ob_decode_scalar(const uint32_t* bits, float s, int64_t cnt,
                                float* acc, int first)
{
    float ns = -s;
    for (int64_t i = 0; i < cnt; i += 32) {
        int64_t m = cnt - i < 32 ? cnt - i : 32;
        uint32_t w = bits[i >> 5];
        float* a = acc + i;
        if (first)
            for (int64_t k = 0; k < m; k++) a[k] = (w >> k) & 1u ? s : ns;
        else
            for (int64_t k = 0; k < m; k++) a[k] = a[k] + ((w >> k) & 1u ? s : ns);
    }
}

#if GF_Q_HAVE_AVX2
/* The 1-bit decoder on AVX2: a rank's constants are +s and -s (gf_ob_rank8); elements
 * 8q..8q+7 of word w each pick one of them by their bit (gf_ob_dec8: lane i tests bit i
 * of the word's byte q). */
GF_Q_AVX2 static GF_Q_INLINE gf_q_rank8 gf_ob_rank8(float s)
{
    gf_q_rank8 t;
    t.x = _mm256_set1_ps(s);
    t.y = _mm256_set1_ps(-s);
    return t;
}

GF_Q_AVX2 static GF_Q_INLINE __m256 gf_ob_dec8(gf_q_rank8 t, uint32_t w, int q)
{
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i m = _mm256_and_si256(_mm256_set1_epi32((int)((w >> (8 * q)) & 0xffu)), sel);
    return _mm256_blendv_ps(t.y, t.x, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, sel)));
}
#endif

/* ================================================================ 2-bit */

#define GF_TB_CHUNK 4096   /* elements per staging chunk, a multiple of 8 */

/* lut: 8 bits -> 16 bits with bit i moved to bit 2i */
static uint16_t gf_tb_spread[256];
static int gf_tb_spread_ready = 0;

static void gf_tb_init_spread(void)
{
    if (gf_tb_spread_ready) return;
    for (int v = 0; v < 256; v++) {
        uint16_t r = 0;
        for (int i = 0; i < 8; i++) if (v >> i & 1) r |= (uint16_t)(1u << (2 * i));
        gf_tb_spread[v] = r;
    }
    gf_tb_spread_ready = 1;
}

/* Encode stage[0..npad) (npad multiple of 8, zero padded) into codes[0..npad/4),
 * overwrite stage with the residual. Returns the non-finite count. */
static int64_t gf_tb_encode_scalar(float* c, int64_t npad, float t, uint8_t* codes)
{
    float nt = -t;
    int64_t bad = 0;
    for (int64_t i = 0; i < npad; i += 4) {
        uint32_t byte = 0;
        for (int k = 0; k < 4; k++) {
            float x = c[i + k];
            byte |= ((uint32_t)(x >= t) | ((uint32_t)(x <= nt) << 1)) << (2 * k);
        }
        codes[i >> 2] = (uint8_t)byte;
    }
    int32_t nb = 0;   /* npad <= GF_TB_CHUNK */
    for (int64_t k = 0; k < npad; k++) {
        float x = c[k];
        nb += !(fabsf(x) < INFINITY);
        float q = x >= t ? t : 0.0f;   /* t > 0: at most one of the two holds */
        q = x <= nt ? nt : q;
        c[k] = x - q;
    }
    return bad + nb;
}

#if GF_Q_HAVE_AVX2
GF_Q_AVX2 static int64_t gf_tb_encode_avx2(float* c, int64_t npad, float t, uint8_t* codes)
{
    const __m256 vt = _mm256_set1_ps(t), vn = _mm256_set1_ps(-t);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(INFINITY);
    __m256i badv = _mm256_setzero_si256();
    for (int64_t i = 0; i < npad; i += 8) {
        __m256 x = _mm256_loadu_ps(c + i);
        __m256 ge = _mm256_cmp_ps(x, vt, _CMP_GE_OQ);
        __m256 le = _mm256_cmp_ps(x, vn, _CMP_LE_OQ);
        __m256 q = _mm256_or_ps(_mm256_and_ps(ge, vt), _mm256_and_ps(le, vn));
        _mm256_storeu_ps(c + i, _mm256_sub_ps(x, q));
        __m256 nf = _mm256_cmp_ps(_mm256_and_ps(x, absm), inf, _CMP_NLT_UQ);
        badv = _mm256_sub_epi32(badv, _mm256_castps_si256(nf));
        uint16_t w = (uint16_t)(gf_tb_spread[_mm256_movemask_ps(ge)]
                                | (gf_tb_spread[_mm256_movemask_ps(le)] << 1));
        codes[(i >> 2)] = (uint8_t)(w & 0xff);
        codes[(i >> 2) + 1] = (uint8_t)(w >> 8);
    }
    int32_t tmp[8];
    _mm256_storeu_si256((__m256i*)tmp, badv);
    int64_t bad = 0;
    for (int k = 0; k < 8; k++) bad += tmp[k];
    return bad;
}
#endif

static int64_t gf_twobit_compress(const int64_t* ptrs, const int64_t* counts,
                                  int64_t lo, int64_t hi, int64_t n,
                                  const float* e_in, float* e_out, float t, uint8_t* codes)
{
    if (n <= 0) return 0;
    gf_tb_init_spread();
    float* stage = gf_q_alloc(GF_TB_CHUNK);
    uint8_t cbuf[GF_TB_CHUNK / 4];
    if (!stage) return -1;
    gf_qcur cur;
    gf_qcur_init(&cur, ptrs, counts, lo, hi);
    int avx = GF_Q_HAVE_AVX2 && gf_use_avx2;
    int64_t bad = 0;
    for (int64_t start = 0; start < n; start += GF_TB_CHUNK) {
        int64_t cnt = n - start < GF_TB_CHUNK ? n - start : GF_TB_CHUNK;
        int64_t npad = (cnt + 7) & ~(int64_t)7;
        gf_q_gather(&cur, stage, cnt, e_in ? e_in + start : NULL);
        for (int64_t k = cnt; k < npad; k++) stage[k] = 0.0f;
#if GF_Q_HAVE_AVX2
        if (avx) bad += gf_tb_encode_avx2(stage, npad, t, cbuf);
        else
#endif
        bad += gf_tb_encode_scalar(stage, npad, t, cbuf);
        int64_t nbytes = (cnt + 3) >> 2;
        uint8_t* cd = codes + (start >> 2);
        for (int64_t k = 0; k < nbytes; k++) cd[k] = cbuf[k];
        if (e_out) gf_q_copy(e_out + start, stage, cnt);
    }
    free(stage);
    return bad;
}

/* codes: p rows of `stride` bytes. */
static int gf_twobit_decompress_sum(const uint8_t* codes, int64_t stride, int64_t p, float t,
                                    const int64_t* ptrs, const int64_t* counts,
                                    int64_t lo, int64_t hi, int64_t n, double divisor)
{
    if (n <= 0) return 0;
    float* acc = gf_q_alloc(GF_TB_CHUNK);
    float* lut = gf_q_alloc(256 * 4);
    if (!acc || !lut) { free(acc); free(lut); return -1; }
    const float val[4] = {0.0f, t, -t, 0.0f};
    for (int v = 0; v < 256; v++)
        for (int k = 0; k < 4; k++) lut[4 * v + k] = val[(v >> (2 * k)) & 3];
    gf_qcur cur;
    gf_qcur_init(&cur, ptrs, counts, lo, hi);
    for (int64_t start = 0; start < n; start += GF_TB_CHUNK) {
        int64_t cnt = n - start < GF_TB_CHUNK ? n - start : GF_TB_CHUNK;
        int64_t nb = (cnt + 3) >> 2;   /* acc has room: GF_TB_CHUNK is a multiple of 4 */
        for (int64_t r = 0; r < p; r++) {
            const uint8_t* cr = codes + r * stride + (start >> 2);
            if (r == 0) {
                for (int64_t i = 0; i < nb; i++) memcpy(acc + 4 * i, lut + 4 * cr[i], 16);
            } else {
                for (int64_t i = 0; i < nb; i++) {
                    const float* l = lut + 4 * cr[i];
                    float* a = acc + 4 * i;
                    a[0] = a[0] + l[0]; a[1] = a[1] + l[1];
                    a[2] = a[2] + l[2]; a[3] = a[3] + l[3];
                }
            }
        }
        gf_q_divide(acc, cnt, divisor);
        gf_q_scatter(&cur, acc, cnt);   /* the last chunk's acc may hold padding: cnt only */
    }
    free(acc);
    free(lut);
    return 0;
}

#endif
