// 1-bit compression (sign + per-block mean |c| scale) with fused error feedback, and
// decompress-and-accumulate. GPU twin of gradfuse/_quant.h; the format and the math
// are frozen in docs/compressors.md and must come out bit for bit the same.
//
// NVRTC-compatible: no host headers, own fixed-width types. Float arithmetic uses the
// _rn intrinsics only (__fadd_rn, __fsub_rn, __fdiv_rn, __fmul_rn), which are never
// contracted into an FMA; compile with --fmad=false anyway.
//
// Layout (docs/compressors.md): blocks restart at every tensor of a table (a tensor's last
// block may be short), tensor i's bits start at word wstart[i] and its scales at bstart[i]
// (both prefix sums over the rows lo..hi-1, made by the host: gradfuse/gpu/onebit.py), so
// no block spans two tensors and every block starts on a word.
//
// Compress geometry: ONE WARP PER 1-BIT BLOCK (B elements, B a multiple of 32), 8 warps
// per CTA (blockDim 256), grid ceil(nblocks / 8). A table kernel's warp finds its tensor
// by a binary search of bstart. That makes the canonical order the
// natural one: lane k of the warp sums |c_j| for j = start + k, start + k + 32, ... in
// increasing j (each load instruction of the warp reads 32 consecutive floats), then the
// __shfl_down_sync tree 16, 8, 4, 2, 1 gives lane 0 the total, s = total / count. The
// sign word of elements start + 32i .. start + 32i + 31 is one __ballot_sync (lane k ->
// bit k). Up to GF_OB_REGS values per lane (B <= 32 * GF_OB_REGS) stay in registers
// between the scale and the emit pass (one read of g and e_in); larger blocks read
// them a second time (same bits, more traffic).
//
// A tensor's last, short block behaves as if zero padded: lanes past the count add
// nothing (adding +0.0f changes no lane sum), their ballot bits are 0, and words past
// ceil(count/32) do not exist.


#define GF_OB_REGS 32

__device__ __forceinline__ float gf_abs(float x)
{
    return __uint_as_float(__float_as_uint(x) & 0x7fffffffu);   // fabsf: clear the sign bit
}

__device__ __forceinline__ int gf_nonfinite(float x)
{
    return (__float_as_uint(x) & 0x7fffffffu) >= 0x7f800000u;
}

// ------------------------------------------------------------------ compress

// Where 1-bit block g lies: its first element x (the tensor's memory), its bucket position
// epos (for the residuals), its element count and its first payload word.
struct gf_ob_block {
    const float* x;
    gf_i64 epos, count, wpos;
};

// One contiguous array: blocks of B from element 0.
struct gf_ob_array {
    const float* x;
    gf_i64 n;
    __device__ __forceinline__ gf_ob_block at(gf_i64 g, gf_i64 block) const
    {
        gf_ob_block r;
        r.epos = g * block;
        r.x = x + r.epos;
        r.count = n - r.epos < block ? n - r.epos : block;
        r.wpos = r.epos >> 5;
        return r;
    }
};

// Rows lo..hi-1 of a table (dense offsets); bstart/wstart: R + 1 prefix sums (R = hi - lo)
// of the rows' ceil(count/B) blocks and ceil(count/32) words.
struct gf_ob_table {
    const gf_i64* ptrs;
    const gf_i64* offsets;
    const gf_i64* counts;
    const gf_i64* bstart;
    const gf_i64* wstart;
    gf_i64 lo, hi;
    __device__ __forceinline__ gf_ob_block at(gf_i64 g, gf_i64 block) const
    {
        // last i with bstart[i] <= g: empty rows share bstart with the next row, so this
        // is the row that holds block g (g < bstart[R])
        gf_i64 a = 0, b = hi - lo - 1;
        while (a < b) {
            gf_i64 m = a + ((b - a + 1) >> 1);
            if (bstart[m] <= g) a = m; else b = m - 1;
        }
        const gf_i64 row = lo + a, k0 = (g - bstart[a]) * block;
        gf_ob_block r;
        r.x = (const float*)ptrs[row] + k0;
        r.epos = offsets[row] + k0;
        r.count = counts[row] - k0 < block ? counts[row] - k0 : block;
        r.wpos = wstart[a] + (k0 >> 5);
        return r;
    }
};

// c of element k of a block: x[k] + e_in[epos + k] (float32 add), or x[k]
__device__ __forceinline__ float gf_ob_c(const gf_ob_block& bl, const float* e_in, gf_i64 k)
{
    float g = bl.x[k];
    return e_in ? __fadd_rn(g, e_in[bl.epos + k]) : g;
}

template <class Src>
__device__ __forceinline__ void gf_onebit_compress_body(const Src& src, gf_i64 nblocks, const float* e_in,
                                                        float* e_out, gf_i64 block,
                                                        gf_u32* bits, float* scales, gf_u64* bad)
{
    const int lane = threadIdx.x & 31;
    const gf_i64 b = (gf_i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= nblocks) return;                       // whole warp leaves together
    const gf_ob_block bl = src.at(b, block);
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
                    r[i] = gf_ob_c(bl, e_in, k);
                    acc = __fadd_rn(acc, gf_abs(r[i]));
                }
            }
        }
    } else {
        for (gf_i64 i = 0; i < nw; i++) {
            gf_i64 k = i * 32 + lane;
            if (k < count) acc = __fadd_rn(acc, gf_abs(gf_ob_c(bl, e_in, k)));
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
            float x = in ? gf_ob_c(bl, e_in, k) : 0.0f;
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

// e_in/e_out: both NULL (no error feedback) or both n long; they may be the same array
// (in place: each element's e_in is read by the lane that later writes its e_out, before
// writing it). bad: one u64, incremented once per block whose scale is NaN or +-inf.
extern "C" __global__ void gf_onebit_compress_array(const float* x, gf_i64 n, const float* e_in,
                                                    float* e_out, gf_i64 block, gf_u32* bits,
                                                    float* scales, gf_u64* bad)
{
    gf_ob_array src;
    src.x = x;
    src.n = n;
    gf_onebit_compress_body(src, (n + block - 1) / block, e_in, e_out, block, bits, scales, bad);
}

extern "C" __global__ void gf_onebit_compress_table(const gf_i64* ptrs, const gf_i64* offsets,
                                                    const gf_i64* counts, gf_i64 lo, gf_i64 hi,
                                                    const gf_i64* bstart, const gf_i64* wstart,
                                                    gf_i64 nblocks, const float* e_in, float* e_out,
                                                    gf_i64 block, gf_u32* bits, float* scales,
                                                    gf_u64* bad)
{
    gf_ob_table src;
    src.ptrs = ptrs; src.offsets = offsets; src.counts = counts;
    src.bstart = bstart; src.wstart = wstart; src.lo = lo; src.hi = hi;
    gf_onebit_compress_body(src, nblocks, e_in, e_out, block, bits, scales, bad);
}

// ------------------------------------------------------------------ decompress-sum

// Divisor modes, chosen on the host exactly as _quant.h's gf_q_divide does:
// 0: divisor == 1.0, nothing; 1: x / f; 2: x * r (f a power of two with an exact
// reciprocal r: the same correctly rounded result, and the CPU's choice).
__device__ __forceinline__ float gf_apply_div(float x, int mode, float f)
{
    if (mode == 1) return __fdiv_rn(x, f);
    if (mode == 2) return __fmul_rn(x, f);         // f holds the reciprocal here
    return x;
}

// Decoded sum of one element (bit sh of word w, scale b of every row): ((v_0 + v_1) + ...)
// from v_0, then divided.
__device__ __forceinline__ float gf_onebit_sum(const gf_u32* bits, gf_i64 wstride,
                                               const float* scales, gf_i64 sstride, gf_i64 p,
                                               gf_i64 w, gf_u32 sh, gf_i64 b, int mode, float f)
{
    float acc = 0.0f;
    for (gf_i64 r = 0; r < p; r++) {
        float s = scales[r * sstride + b];
        float v = (bits[r * wstride + w] >> sh) & 1u ? s : -s;
        acc = r == 0 ? v : __fadd_rn(acc, v);
    }
    return gf_apply_div(acc, mode, f);
}

// bits: p rows of wstride words, scales: p rows of sstride floats (row r = rank r); one
// array: element j in bit j % 32 of word j / 32, scale j / block.
extern "C" __global__ void gf_onebit_decompress_sum_array(const gf_u32* bits, gf_i64 wstride,
                                                          const float* scales, gf_i64 sstride,
                                                          gf_i64 p, gf_i64 block, float* out,
                                                          gf_i64 n, int mode, float f)
{
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 j = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        out[j] = gf_onebit_sum(bits, wstride, scales, sstride, p, j >> 5, (gf_u32)(j & 31), j / block,
                               mode, f);
}

// Table rows on blockIdx.y (strided by gridDim.y), the row's elements on blockIdx.x: element
// k of row i in bit k % 32 of word wstart[i - lo] + k / 32, scale bstart[i - lo] + k / block.
extern "C" __global__ void gf_onebit_decompress_sum_table(const gf_u32* bits, gf_i64 wstride,
                                                          const float* scales, gf_i64 sstride,
                                                          gf_i64 p, gf_i64 block,
                                                          const gf_i64* ptrs, const gf_i64* counts,
                                                          gf_i64 lo, gf_i64 hi, const gf_i64* bstart,
                                                          const gf_i64* wstart, int mode, float f)
{
    gf_i64 tid = (gf_i64)blockIdx.x * blockDim.x + threadIdx.x;
    gf_i64 stride = (gf_i64)gridDim.x * blockDim.x;
    for (gf_i64 i = lo + blockIdx.y; i < hi; i += gridDim.y) {
        gf_i64 m = counts[i], w0 = wstart[i - lo], b0 = bstart[i - lo];
        float* d = (float*)ptrs[i];
        for (gf_i64 k = tid; k < m; k += stride)
            d[k] = gf_onebit_sum(bits, wstride, scales, sstride, p, w0 + (k >> 5), (gf_u32)(k & 31),
                                 b0 + k / block, mode, f);
    }
}
