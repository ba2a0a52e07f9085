// Shared prelude of every cuda/*.cu file. gradfuse.gpu.source() puts it in front of a
// kernel file before NVRTC (or nvcc, or the CPU emulator) compiles it, so each file is
// still one self-contained translation unit. NVRTC-compatible: no host headers.
// What it holds: the fixed-width types, the sources (one array, a table cursor), and what
// the 1-bit and scaled 2-bit kernels share (their blocked layout, the decode-and-sum).

typedef unsigned char gf_u8;
typedef unsigned short gf_u16;
typedef unsigned int gf_u32;
typedef long long gf_i64;
typedef unsigned long long gf_u64;

#define GF_FULL 0xffffffffu

// ------------------------------------------------------------------ sources

// One contiguous float32 array.
struct gf_src_array {
    const float* x;
    __device__ __forceinline__ float get(gf_i64 j) { return x[j]; }
};

// Rows lo..hi-1 of the plan's table, dense element offsets starting at 0 (checked by the
// caller). Each thread keeps its own cursor [rbeg, rend) and re-searches (binary search
// over the rows) only when j leaves it; j only grows per thread.
struct gf_src_table {
    const gf_i64* ptrs;
    const gf_i64* offsets;
    const gf_i64* counts;
    gf_i64 lo, hi;
    gf_i64 rbeg, rend;
    const float* base;

    __device__ __forceinline__ void init(const gf_i64* p, const gf_i64* o, const gf_i64* c,
                                         gf_i64 l, gf_i64 h)
    {
        ptrs = p; offsets = o; counts = c; lo = l; hi = h; rbeg = 0; rend = 0; base = 0;
    }

    __device__ __forceinline__ void seek(gf_i64 j)
    {
        // last row r in [lo, hi) with offsets[r] <= j: dense offsets make it the row that
        // holds j (empty rows share their offset with the next row, so they are skipped)
        gf_i64 a = lo, b = hi - 1;
        while (a < b) {
            gf_i64 m = a + ((b - a + 1) >> 1);
            if (offsets[m] <= j) a = m; else b = m - 1;
        }
        rbeg = offsets[a];
        rend = rbeg + counts[a];
        base = (const float*)ptrs[a];
    }

    __device__ __forceinline__ float get(gf_i64 j)
    {
        if (j >= rend || j < rbeg) seek(j);
        return base[j - rbeg];
    }
};

// ------------------------------------------------------------------ blocked 1-bit and 2-bit payloads

// The 1-bit (onebit.cu) and scaled 2-bit (twobit.cu, second half) formats share a layout,
// with the code width BITS (bits per code, 1 or 2) as its parameter: blocks of B elements
// (B a multiple of 32) restart at every tensor, a tensor's last block may be short; tensor
// i's codes start on a new uint32 word, PER_WORD = 32 / BITS codes to a word (element k in
// bits BITS * (k % PER_WORD) .. of its word k / PER_WORD), and its block floats (1-bit
// scales, 2-bit values) follow the previous tensors'. A table's tensors start at the prefix
// sums wstart (words) and bstart (blocks) that gradfuse/gpu/launch.py makes from the counts.
// Here: where a compress warp's block lies, and the decode-and-sum kernels' bodies; each
// format's own math (its compress body, its decoder) stays in its file.

template <int BITS>
struct gf_q_width {
    static_assert(BITS == 1 || BITS == 2, "codes of 1 or 2 bits");
    enum { PER_WORD = 32 / BITS, SHIFT = BITS == 1 ? 5 : 4 };   // codes per word, its log2
};

__device__ __forceinline__ float gf_abs(float x)
{
    return __uint_as_float(__float_as_uint(x) & 0x7fffffffu);   // fabsf: clear the sign bit
}

__device__ __forceinline__ int gf_nonfinite(float x)
{
    return (__float_as_uint(x) & 0x7fffffffu) >= 0x7f800000u;
}

// Where block g lies: its first element x (the tensor's memory), its bucket position epos
// (for the residuals), its element count and its first payload word.
struct gf_q_block {
    const float* x;
    gf_i64 epos, count, wpos;
};

// One contiguous array: blocks of B from element 0.
template <int BITS>
struct gf_q_array {
    const float* x;
    gf_i64 n;
    __device__ __forceinline__ gf_q_block at(gf_i64 g, gf_i64 block) const
    {
        gf_q_block r;
        r.epos = g * block;
        r.x = x + r.epos;
        r.count = n - r.epos < block ? n - r.epos : block;
        r.wpos = r.epos >> gf_q_width<BITS>::SHIFT;
        return r;
    }
};

// Rows lo..hi-1 of a table (dense offsets); bstart/wstart: R + 1 prefix sums (R = hi - lo)
// of the rows' ceil(count/B) blocks and ceil(count/PER_WORD) words.
template <int BITS>
struct gf_q_table {
    const gf_i64* ptrs;
    const gf_i64* offsets;
    const gf_i64* counts;
    const gf_i64* bstart;
    const gf_i64* wstart;
    gf_i64 lo, hi;
    __device__ __forceinline__ gf_q_block at(gf_i64 g, gf_i64 block) const
    {
        // last i with bstart[i] <= g: empty rows share bstart with the next row, so this
        // is the row that holds block g (g < bstart[R])
        gf_i64 a = 0, b = hi - lo - 1;
        while (a < b) {
            gf_i64 m = a + ((b - a + 1) >> 1);
            if (bstart[m] <= g) a = m; else b = m - 1;
        }
        const gf_i64 row = lo + a, k0 = (g - bstart[a]) * block;
        gf_q_block r;
        r.x = (const float*)ptrs[row] + k0;
        r.epos = offsets[row] + k0;
        r.count = counts[row] - k0 < block ? counts[row] - k0 : block;
        r.wpos = wstart[a] + (k0 >> gf_q_width<BITS>::SHIFT);
        return r;
    }
};

// c of element k of a block: x[k] + e_in[epos + k] (float32 add), or x[k]
__device__ __forceinline__ float gf_q_c(const gf_q_block& bl, const float* e_in, gf_i64 k)
{
    float g = bl.x[k];
    return e_in ? __fadd_rn(g, e_in[bl.epos + k]) : g;
}

// c = g + e of element k of block bl (e_in NULL: g): 1-bit's value with error feedback.
struct gf_q_feedback {
    const float* e_in;
    __device__ __forceinline__ float operator()(const gf_q_block& bl, gf_i64 k) const { return gf_q_c(bl, e_in, k); }
};

#define GF_OB_REGS 32

// The 1-bit compress body (cuda/onebit.cu's geometry and order, documented there): one warp
// per block; val(bl, k) is the value c of element k of block bl (gf_q_feedback: g + e; the
// Adam correction's moment in cuda/adam.cu), read once per element, or twice for blocks
// larger than 32 * GF_OB_REGS (the same bits: val is a pure function of memory it does
// not write before the emit pass).
template <class Src, class Val>
__device__ __forceinline__ void gf_onebit_compress_body(const Src& src, gf_i64 nblocks, const Val& val,
                                                        float* e_out, gf_i64 block,
                                                        gf_u32* bits, float* scales, gf_u64* bad)
{
    const int lane = threadIdx.x & 31;
    const gf_i64 b = (gf_i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= nblocks) return;                       // whole warp leaves together
    const gf_q_block bl = src.at(b, block);
    const gf_i64 count = bl.count;
    const gf_i64 nw = (count + 31) >> 5;            // words of this block
    const bool regs = nw <= GF_OB_REGS;
    float r[GF_OB_REGS];

    // 1) lane partial sums, canonical order: lane k, elements start + k + 32 i, i ascending
    float acc = 0.0f;
    if (regs) {
#pragma unroll
        for (int i = 0; i < GF_OB_REGS; i++) {
            r[i] = 0.0f;
            if (i < nw) {
                gf_i64 k = (gf_i64)i * 32 + lane;
                if (k < count) {
                    r[i] = val(bl, k);
                    acc = __fadd_rn(acc, gf_abs(r[i]));
                }
            }
        }
    } else {
        for (gf_i64 i = 0; i < nw; i++) {
            gf_i64 k = i * 32 + lane;
            if (k < count) acc = __fadd_rn(acc, gf_abs(val(bl, k)));
        }
    }
    // 2) tree 16, 8, 4, 2, 1: lane[i] = lane[i] + lane[i + off]
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
        acc = __fadd_rn(acc, __shfl_down_sync(GF_FULL, acc, off));
    // 3) s = total / (float)count, broadcast from lane 0
    float s = __fdiv_rn(__shfl_sync(GF_FULL, acc, 0), (float)count);
    float ns = -s;

    // 4) sign words (ballot: lane k -> bit k; lanes past count vote 0) and residuals
    gf_u32* wb = bits + bl.wpos;
    float* eo = e_out ? e_out + bl.epos : 0;
    if (regs) {
#pragma unroll
        for (int i = 0; i < GF_OB_REGS; i++) {
            if (i < nw) {
                gf_i64 k = (gf_i64)i * 32 + lane;
                bool in = k < count;
                float x = r[i];
                bool pos = in && x >= 0.0f;         // -0 -> 1, NaN -> 0
                gf_u32 w = __ballot_sync(GF_FULL, pos);
                if (lane == 0) wb[i] = w;
                if (eo && in) eo[k] = __fsub_rn(x, pos ? s : ns);
            }
        }
    } else {
        for (gf_i64 i = 0; i < nw; i++) {
            gf_i64 k = i * 32 + lane;
            bool in = k < count;
            float x = in ? val(bl, k) : 0.0f;
            bool pos = in && x >= 0.0f;
            gf_u32 w = __ballot_sync(GF_FULL, pos);
            if (lane == 0) wb[i] = w;
            if (eo && in) eo[k] = __fsub_rn(x, pos ? s : ns);
        }
    }
    if (lane == 0) {
        scales[b] = s;
        if (gf_nonfinite(s)) atomicAdd(bad, 1ull);
    }
}

// Divisor modes, chosen on the host (gradfuse/gpu/launch.py, divisor_mode) as _quant.h's
// gf_q_divmode chooses: 0: divisor == 1.0, nothing; 1: x / f; 2: x * f, f then the exact
// reciprocal of a power-of-two divisor (the same correctly rounded result).
__device__ __forceinline__ float gf_apply_div(float x, int mode, float f)
{
    if (mode == 1) return __fdiv_rn(x, f);
    if (mode == 2) return __fmul_rn(x, f);
    return x;
}

// Decode-and-sum, one thread per element. Dec is the format's decoder: Dec::BITS bits per
// code, Dec::value(c, v) the value of code c (the element's word shifted right to its code;
// the higher bits are not cleared) in a block whose float is v.

// Decoded sum of one element (the code at bit sh of word w, block float b of every row;
// row r = rank r, its words at r * wstride, its floats at r * vstride): ((v_0 + v_1) + ...)
// from v_0, then divided.
template <class Dec>
__device__ __forceinline__ float gf_q_sum(const gf_u32* words, gf_i64 wstride, const float* vals,
                                          gf_i64 vstride, gf_i64 p, gf_i64 w, gf_u32 sh, gf_i64 b,
                                          int mode, float f)
{
    float acc = 0.0f;
    for (gf_i64 r = 0; r < p; r++) {
        float x = Dec::value(words[r * wstride + w] >> sh, vals[r * vstride + b]);
        acc = r == 0 ? x : __fadd_rn(acc, x);
    }
    return gf_apply_div(acc, mode, f);
}

// One array of n elements, grid-stride: element j at word j / PER_WORD, block j / block.
template <class Dec>
__device__ __forceinline__ void gf_q_dsum_array(const gf_u32* words, gf_i64 wstride, const float* vals,
                                                gf_i64 vstride, gf_i64 p, gf_i64 block, float* out,
                                                gf_i64 n, int mode, float f)
{
    typedef gf_q_width<Dec::BITS> W;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 j = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        out[j] = gf_q_sum<Dec>(words, wstride, vals, vstride, p, j >> W::SHIFT,
                               (gf_u32)(j & (W::PER_WORD - 1)) * Dec::BITS, j / block, mode, f);
}

// Table rows on blockIdx.y (strided by gridDim.y), the row's elements on blockIdx.x:
// element k of row i at word wstart[i - lo] + k / PER_WORD, block bstart[i - lo] + k / block.
template <class Dec>
__device__ __forceinline__ void gf_q_dsum_table(const gf_u32* words, gf_i64 wstride, const float* vals,
                                                gf_i64 vstride, gf_i64 p, gf_i64 block,
                                                const gf_i64* ptrs, const gf_i64* counts,
                                                gf_i64 lo, gf_i64 hi, const gf_i64* bstart,
                                                const gf_i64* wstart, int mode, float f)
{
    typedef gf_q_width<Dec::BITS> W;
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 m = counts[i], w0 = wstart[i - lo], b0 = bstart[i - lo];
        float* d = (float*)ptrs[i];
        for (gf_i64 k = tid; k < m; k += stride)
            d[k] = gf_q_sum<Dec>(words, wstride, vals, vstride, p, w0 + (k >> W::SHIFT),
                                 (gf_u32)(k & (W::PER_WORD - 1)) * Dec::BITS, b0 + k / block, mode, f);
    }
}
